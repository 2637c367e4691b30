"""HeteroDDPStrategy(policy="auto") on 2 spawned CPU ranks: the learned scheduler in a real Lightning run."""

from __future__ import annotations

import pytest

import lightning.pytorch as pl

from hetero_plugins.callbacks import HeterogeneityEmulator
from hetero_plugins.strategies import HeteroDDPStrategy
from tests.lightning_jobs import DigitsMLP, Report, read_reports

pytestmark = pytest.mark.distributed


def test_auto_allocator_rebalances_a_lightning_run(tmp_path):
    pl.seed_everything(0)
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=HeteroDDPStrategy(start_method="spawn", policy="auto"),
        callbacks=[HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002), Report(str(tmp_path))],
        max_epochs=3, limit_train_batches=20, limit_val_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    t.fit(DigitsMLP(batch_size=16))
    reports = read_reports(str(tmp_path), 2)
    hist = reports[0]["plan_history"]
    assert hist == reports[1]["plan_history"]  # every rank adopted the same plans
    assert hist[0]["batch_sizes"] == [16, 16]
    assert hist[1]["batch_sizes"][1] < 10 and sum(hist[1]["batch_sizes"]) == 32  # the slow rank's share dropped
    assert all(h["batch_sizes"][1] < 10 for h in hist[1:])
