"""A real run with Lightning's loggers: the digits CNN on 2 CPU ranks (this process and the one Lightning starts
for rank 1, as a user's script runs; speeds 1 and 0.25) with HeteroDDPStrategy and LRAdapter, a TensorBoardLogger
and a CSVLogger writing into the same run folder, and Lightning's default checkpoint. Used by tests/test_loggers.py
and tests/test_report.py.

    python tests/scripts/logged_run.py OUT_DIR [EPOCHS]
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from hetero_plugins.apps.digits import DigitsCNN
from hetero_plugins.callbacks import HeterogeneityEmulator, LRAdapter
from hetero_plugins.strategies import HeteroDDPStrategy


def main() -> None:
    out = sys.argv[1]
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    warnings.filterwarnings("ignore")
    pl.seed_everything(0, verbose=False)
    loggers = [TensorBoardLogger(out, name="run", version=0), CSVLogger(out, name="run", version=0)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=HeteroDDPStrategy(), max_epochs=epochs,
        logger=loggers, log_every_n_steps=4, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=out,
        callbacks=[HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.001), LRAdapter()],
    )
    trainer.fit(DigitsCNN(batch_size=32))
    if trainer.is_global_zero:  # rank 1 shares this stdout: two prints could land on one line
        sys.stdout.write(json.dumps({"log_dir": os.path.join(out, "run", "version_0")}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
