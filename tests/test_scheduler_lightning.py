"""HeteroDDPStrategy(policy="auto") on 2 spawned CPU ranks: the learned scheduler in a real Lightning run."""

from __future__ import annotations

import pytest

import lightning.pytorch as pl

from hetero_plugins.callbacks import HeterogeneityEmulator
from hetero_plugins.strategies import HeteroDDPStrategy
from tests.helpers.distributed import START_METHOD
from tests.lightning_jobs import DigitsMLP, Report, read_reports

pytestmark = pytest.mark.distributed


def test_auto_allocator_rebalances_a_lightning_run(tmp_path):
    pl.seed_everything(0)
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=HeteroDDPStrategy(start_method=START_METHOD, policy="auto"),
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


def test_cluster_context_reaches_the_learned_scheduler_and_relocation_writes_a_spec(tmp_path):
    """Stage 2 in a real Lightning run: the co-runner placed beside rank 1 for epoch 1 shrinks its share before
    any step measured it (equal emulated speeds), and the free v100 yields a restart spec on every rank's
    history."""
    import json

    from hetero_plugins.scheduler.relocation import Relocator
    from tests.lightning_jobs import video_arrives_on_rank_1

    pl.seed_everything(0)
    spec = tmp_path / "restart.json"
    t = pl.Trainer(
        accelerator="cpu", devices=2,
        # The default policy ("auto") applies the NCF to a first arrival while nothing contradicts it.
        strategy=HeteroDDPStrategy(start_method=START_METHOD, cluster=video_arrives_on_rank_1,
                                   relocation=Relocator(restart_cost=0.0), restart_spec=str(spec)),
        # 240 ms a step: this machine's few ms of timing jitter stay well inside auto's max_noise (8%), which
        # would otherwise (rightly) hold the NCF back.
        callbacks=[HeterogeneityEmulator([1.0, 1.0], cost_per_sample=0.015), Report(str(tmp_path))],
        max_epochs=2, limit_train_batches=12, limit_val_batches=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    t.fit(DigitsMLP(batch_size=16))
    reports = read_reports(str(tmp_path), 2)
    hist = reports[0]["plan_history"]
    assert hist == reports[1]["plan_history"]
    # The NCF predicts ~1.4x for training beside video on a v100: rank 1 gets about 32 / 2.4 = 13 samples.
    assert hist[0]["batch_sizes"] == [16, 16]
    assert 11 <= hist[0]["next_batch_sizes"][1] <= 14, hist[0]
    reloc = hist[0]["relocation"]
    assert reloc["moves"] == [[1, 0]] and reloc["predicted_gain"] > 0.05 and reloc["spec"] == str(spec)
    written = json.loads(spec.read_text())
    assert written["moves"] == [{"rank": 1, "to_free_slot": 0}] and written["epoch"] == 1
    moved = written["ranks"][1]
    assert {k: moved[k] for k in ("rank", "device", "corunner", "from")} == {
        "rank": 1, "device": "v100", "corunner": None, "from": "free_slots[0]"}
    assert moved["line"][1] > 0  # the predicted line of the slot it would run on


def test_a_bad_cluster_file_stops_every_rank_with_the_fix(tmp_path):
    bad = tmp_path / "cluster.json"
    bad.write_text('{"ranks": [{"device": "v100"}]}')  # one entry for two ranks
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy=HeteroDDPStrategy(start_method=START_METHOD, cluster=str(bad)),
        max_epochs=1, limit_train_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
    )
    # Every rank raises the same ValueError (none waits in a collective); the spawn launcher re-raises the
    # first one with its traceback.
    with pytest.raises(Exception, match=r"ValueError: .*cluster.json: cluster description field `ranks` is invalid"
                                        r".*one entry per rank \(2\)"):
        t.fit(DigitsMLP(batch_size=8))
