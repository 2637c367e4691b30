"""Run under ``horovodrun -np 2 --gloo``: ``HeteroHorovodStrategy(policy="dqn", cluster=...)`` on every rank.

From epoch 1 the cluster description places a video job beside rank 1 and offers an idle v100; both ranks
run at the same emulated speed. Rank 0's decision at the end of epoch 0 must already give rank 1 less work
(the NCF's predicted slowdown, before any step measured it), every rank must adopt the same decision record,
and the relocation must be written as a restart spec (horovodrun is not torchrun: nothing restarts).
Each rank writes ``rank{r}.json`` into argv[1].
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import horovod.torch as hvd
import torch

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from hetero_plugins.callbacks import HeterogeneityEmulator  # noqa: E402
from hetero_plugins.scheduler.relocation import Relocator  # noqa: E402
from hetero_plugins.strategies import HeteroHorovodStrategy  # noqa: E402
from tests.lightning_jobs import DigitsMLP, video_arrives_on_rank_1  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    spec = os.path.join(out_dir, "restart.json")
    trainer = pl.Trainer(
        strategy=HeteroHorovodStrategy(policy="dqn", cluster=video_arrives_on_rank_1,
                                       relocation=Relocator(restart_cost=0.0), restart_spec=spec),
        accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=12, limit_val_batches=1,
        callbacks=[HeterogeneityEmulator([1.0, 1.0], cost_per_sample=0.005)], logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        default_root_dir=out_dir,
    )
    trainer.fit(DigitsMLP(batch_size=16))
    with open(os.path.join(out_dir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"plan_history": trainer.strategy.plan_history}, f)


if __name__ == "__main__":
    main(sys.argv[1])
