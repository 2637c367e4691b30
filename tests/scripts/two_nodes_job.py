"""One "node" of a two-node HeteroDDPStrategy run on one host: ``devices=1, num_nodes=2``, gloo on CPU; rank 1
is emulated 4x slower. The launcher sets the environment by hand, as a cluster's job script would.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=... WORLD_SIZE=2 NODE_RANK=<0|1> LOCAL_RANK=0 \\
        python tests/scripts/two_nodes_job.py OUT_DIR
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl

import hetero_plugins.strategies  # noqa: F401  (registers "hetero_ddp")
from hetero_plugins.callbacks import HeterogeneityEmulator
from tests.balancer_jobs import StepLogMLP
from tests.lightning_jobs import Report


def main() -> None:
    out = sys.argv[1]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy="hetero_ddp", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=out,
        callbacks=[HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.005), Report(out)],
    )
    trainer.fit(StepLogMLP(out, batch_size=16))


if __name__ == "__main__":
    main()
