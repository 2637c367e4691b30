"""A torchrun job that relocates a rank by restarting: run with ``--max-restarts 1`` on 2 CPU ranks.

Rank 1 starts on a slow ``t4`` (emulated at 0.4x); the cluster description offers an idle ``v100``. At the end
of epoch 0 the balancer decides the move pays, saves a checkpoint, writes the restart spec and stops the
workers; torchrun starts them again, this script plays the cluster manager (it applies the spec to the
placement it describes and to the emulated speeds) and resumes from ``resume_checkpoint``. Each rank of the
final attempt writes ``attempt_rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402

from hetero_plugins.callbacks import HeterogeneityEmulator  # noqa: E402
from hetero_plugins.scheduler.relocation import Relocator  # noqa: E402
from hetero_plugins.scheduler.restart_spec import read_relocation_spec, resume_checkpoint  # noqa: E402
from hetero_plugins.strategies import HeteroDDPStrategy  # noqa: E402
from tests.lightning_jobs import DigitsMLP  # noqa: E402

SPEED = {"v100": 1.0, "t4": 0.4}


def placement(out: str) -> dict[str, Any]:
    """The cluster manager's view: the initial placement, or the one a relocation restart asked for."""
    spec = read_relocation_spec(os.path.join(out, "hetero_restart.json"))
    if spec is None or not spec.get("checkpoint"):
        return {"ranks": [{"device": "v100", "corunner": None}, {"device": "t4", "corunner": None}],
                "free_slots": [{"device": "v100", "corunner": None}]}
    return {"ranks": [{"device": r["device"], "corunner": r["corunner"]} for r in spec["ranks"]],
            "free_slots": [{"device": "t4", "corunner": None}]}  # the place rank 1 left


class Record(pl.Callback):
    def __init__(self, out: str, resumed: str | None) -> None:
        self.out, self.resumed, self.epochs = out, resumed, []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs.append(trainer.current_epoch)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with open(os.path.join(self.out, f"attempt_rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"), "resumed": self.resumed,
                       "epochs": self.epochs, "final_epoch": trainer.current_epoch,
                       "plan_history": trainer.strategy.plan_history}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pl.seed_everything(0)
    spec_path = os.path.join(args.out, "hetero_restart.json")
    resumed = resume_checkpoint(spec_path)
    speeds = [SPEED[r["device"]] for r in placement(args.out)["ranks"]]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2,
        strategy=HeteroDDPStrategy(policy="dqn", cluster=lambda epoch: placement(args.out),
                                   relocation=Relocator(restart_cost=0.05)),
        callbacks=[HeterogeneityEmulator(speeds, cost_per_sample=0.004), Record(args.out, resumed)],
        max_epochs=3, limit_train_batches=10, limit_val_batches=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=args.out,
    )
    trainer.fit(DigitsMLP(batch_size=16), ckpt_path=resumed)


if __name__ == "__main__":
    main()
