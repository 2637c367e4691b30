"""An ``IterableDataset`` (no ``len``) trains as under stock DDP, with HeteroDDPStrategy and with BatchBalancer
beside ``ddp_spawn`` (2 spawned gloo ranks on CPU): one warning, equal batches, and no plan reported as applied."""

from __future__ import annotations

import pytest

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

import hetero_plugins.strategies  # noqa: F401  (registers "hetero_ddp_spawn")
from hetero_plugins.callbacks import BatchBalancer, HeterogeneityEmulator
from tests.balancer_jobs import N, StepLogMLP, epoch_indices, step_logs
from tests.helpers.distributed import START_METHOD, rank_output
from tests.lightning_jobs import Report, read_reports

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", ["hetero_ddp_spawn", "ddp+BatchBalancer"])
def test_iterable_dataset_trains_like_stock_ddp_with_one_warning(tmp_path, capfd, strategy):
    pl.seed_everything(0)
    callbacks = [HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002), Report(str(tmp_path))]
    if strategy == "ddp+BatchBalancer":  # stock DDP, its ranks from the fork server
        callbacks.insert(0, BatchBalancer())
        strategy = DDPStrategy(start_method=START_METHOD)
    t = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, default_root_dir=str(tmp_path))
    with rank_output() as ranks:
        t.fit(StepLogMLP(str(tmp_path), loader="iterable", batch_size=16))
    assert (capfd.readouterr().err + ranks.text).count("per-rank batch sizes need a sized dataset") == 1
    logs = step_logs(str(tmp_path), 2)
    for epoch in range(2):
        # Each rank ran its own share of the iterable in batches of 16, as stock DDP does.
        assert sorted(epoch_indices(logs, epoch)) == list(range(N))
        for r in range(2):
            assert epoch_indices([logs[r]], epoch) == list(range(r, N, 2))
            assert {len(s["idx"]) for s in logs[r] if s["epoch"] == epoch} == {16}
    reports = read_reports(str(tmp_path), 2)
    hist = reports[0]["plan_history"]
    assert len(hist) == 2 and hist == reports[1]["plan_history"]
    for entry in hist:
        assert entry["plan_applied"] is False
        assert entry["batch_sizes"] == entry["next_batch_sizes"] == [16, 16]
    assert hist[1]["throughput"][0] > 2 * hist[1]["throughput"][1]  # the time models still see rank 1 is slow
    assert reports[0]["batch_plan"] == [16, 16]
    assert t.callback_metrics["hetero/plan_applied"].item() == 0.0
    assert t.callback_metrics["hetero/batch_size/rank_1"].item() == 16.0
