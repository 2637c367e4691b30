"""A 2-rank CPU job for tests/test_relocation_torchrun.py and tests/test_relocation_review_regressions.py (run
under torchrun, or plainly).

Rank 1 starts on a slow ``t4`` (emulated at 0.4x); the cluster description offers an idle ``v100`` at
accelerator index 0. This script plays the cluster manager: after a relocation restart it describes the
placement the spec asks for. ``--die-saving`` makes rank 0 die while the first attempt saves the relocation
checkpoint (a node lost mid-relocation). Each rank of each attempt writes ``attempt{n}_rank{r}.json``.
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
FIRST = {"ranks": [{"device": "v100", "corunner": None}, {"device": "t4", "corunner": None}],
         "free_slots": [{"device": "v100", "corunner": None, "index": 0}]}


def placement(out: str) -> dict[str, Any]:
    spec = resume_spec(out)
    if spec is None:
        return FIRST
    return {"ranks": [{"device": r["device"], "corunner": r["corunner"]} for r in spec["ranks"]],
            "free_slots": [{"device": "t4", "corunner": None}]}


def resume_spec(out: str) -> dict[str, Any] | None:
    try:
        spec = read_relocation_spec(os.path.join(out, "hetero_restart.json"))
    except ValueError:
        return None
    return spec if spec is not None and spec.get("checkpoint") and len(spec["ranks"]) == 2 else None


class DiesSaving(DigitsMLP):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os._exit(3)  # the node is lost while the relocation checkpoint is being written


class Record(pl.Callback):
    def __init__(self, out: str, resumed: str | None) -> None:
        self.out, self.resumed, self.epochs = out, resumed, []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs.append(trainer.current_epoch)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "plain")
        with open(os.path.join(self.out, f"attempt{attempt}_rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"resumed": self.resumed, "epochs": self.epochs, "final_epoch": trainer.current_epoch,
                       "relocated_slot": getattr(trainer.strategy, "relocated_slot", "missing"),
                       "plan_history": trainer.strategy.plan_history}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--die-saving", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(0)
    resumed = resume_checkpoint(os.path.join(args.out, "hetero_restart.json"))
    speeds = [SPEED[r["device"]] for r in placement(args.out)["ranks"]]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2,
        strategy=HeteroDDPStrategy(policy="dqn", cluster=lambda epoch: placement(args.out),
                                   relocation=Relocator(restart_cost=0.05)),
        callbacks=[HeterogeneityEmulator(speeds, cost_per_sample=0.004), Record(args.out, resumed)],
        max_epochs=args.epochs, limit_train_batches=10, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=args.out,
    )
    model = DiesSaving(batch_size=16) if args.die_saving else DigitsMLP(batch_size=16)
    trainer.fit(model, ckpt_path=resumed)


if __name__ == "__main__":
    main()
