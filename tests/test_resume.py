"""Resuming HeteroDDPStrategy runs (2 spawned gloo ranks on CPU): from a mid-epoch checkpoint after a rank was
killed, every remaining sample of the epoch runs exactly once; on another world size the plan and the time
models are re-seeded instead of refused."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.sampler import HeteroBatchSampler
from hetero_plugins.balancing.time_model import LinearTimeModel
from hetero_plugins.callbacks._loaders import ResumableLoader
from hetero_plugins.callbacks import HeterogeneityEmulator
from hetero_plugins.strategies import HeteroDDPStrategy
from tests.balancer_jobs import N, KillRank, ModelProbe, StepLogMLP, epoch_indices, plan_at, step_logs
from tests.helpers.distributed import START_METHOD, rank_output
from tests.lightning_jobs import Report, read_reports


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("locality", [False, True])
def test_batch_sampler_resumes_at_its_first_step_not_done(locality):
    s = HeteroBatchSampler(100, [6, 2], rank=0, seed=3, locality=locality)
    s.set_epoch(4)
    if not locality:
        s.set_plan([5, 3], from_step=4)
    full = list(s)
    state = s.state_dict(steps_done=7)
    assert state["epoch"] == 4 and state["steps_done"] == 7
    fresh = HeteroBatchSampler(100, [4, 4], rank=0, seed=3, locality=locality)
    fresh.load_state_dict(state)
    assert fresh.start_step == 7 and len(fresh) == len(full)
    assert list(fresh) == full[7:]  # the plan and its change come back with the position
    assert list(fresh) == full  # the position is used once
    fresh.load_state_dict(state)
    fresh.set_epoch(5)  # an end-of-epoch checkpoint: the next epoch starts at its first step
    assert fresh.start_step == 0 and len(list(fresh)) == len(full)


def test_batch_sampler_state_of_another_world_size_warns_mid_epoch():
    state = HeteroBatchSampler(96, [16, 16], rank=0).state_dict(steps_done=1)
    s = HeteroBatchSampler(96, [16, 16, 16], rank=2)
    with pytest.warns(RuntimeWarning, match="saved position .* is for 2 ranks.*HINT"):
        s.load_state_dict(state)
    assert s.plan == (16, 16, 16) and len(list(s)) == 1  # 96 / 48 = 2 steps: the second one runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HeteroBatchSampler(96, [16, 16, 16], rank=0).load_state_dict(
            HeteroBatchSampler(96, [16, 16], rank=0).state_dict(steps_done=3))  # the epoch was over: no warning


@pytest.mark.parametrize("workers", [0, 2])
def test_resumable_loader_counts_what_it_delivered_not_what_workers_drew(workers):
    data = TensorDataset(torch.arange(64))
    loader = ResumableLoader(data, batch_sampler=HeteroBatchSampler(64, [4, 4], rank=1, seed=1), num_workers=workers)
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["steps_done"] == 3
    rest = [b[0].tolist() for b in it]
    again = ResumableLoader(data, batch_sampler=HeteroBatchSampler(64, [4, 4], rank=1, seed=1), num_workers=workers)
    again.load_state_dict(state)
    assert [b[0].tolist() for b in again] == rest and len(seen + rest) == 8


def test_planner_resized_state_reseeds_models_and_plan():
    p = BalancePlanner(3, 48)
    p.end_epoch(0, np.array([[[16, 0.016, 0]] * 6 + [[12, 0.013, 0]] * 6, [[16, 0.064, 0]] * 6 + [[12, 0.05, 0]] * 6,
                             [[16, 0.016, 0]] * 6 + [[12, 0.013, 0]] * 6]))
    state = p.state_dict()
    with pytest.raises(ValueError, match="world_size=3, global_batch=48.*HINT: .*resize=True"):
        BalancePlanner(2, 32).load_state_dict(state)
    smaller = BalancePlanner(2, 32)
    with pytest.warns(RuntimeWarning, match=r"checkpoint is for 3 ranks .* Ranks \[0, 1\] keep their time models; "):
        smaller.load_state_dict(state, resize=True)
    assert smaller.model_params() == p.model_params()[:2] and smaller.history == p.history
    assert smaller.plan[0] > 2 * smaller.plan[1] and sum(smaller.plan) == 32  # decided from the kept lines
    larger = BalancePlanner(4, 64)
    with pytest.warns(RuntimeWarning, match=r"ranks \[3\] start without one"):
        larger.load_state_dict(state, resize=True)
    assert larger.model_params()[:3] == p.model_params() and larger.model_params()[3] is None
    assert larger.plan == [16, 16, 16, 16]


def test_a_resized_resume_drops_memory_caps_that_cannot_hold_the_new_batch():
    # Four ranks capped at 10 hold 32 samples; two of them do not. The resize used to fail inside the re-plan,
    # after the models and history were overwritten, with an error blaming max_batch_size.
    p = BalancePlanner(4, 32)
    p.end_epoch(0, np.array([[[8, 0.01 * (r + 1), 0]] * 5 for r in range(4)]), memory_caps=[10] * 4)
    fits = BalancePlanner(2, 16)
    with pytest.warns(RuntimeWarning, match="keep their time models"):
        fits.load_state_dict(p.state_dict(), resize=True)
    assert fits.memory_caps == [10, 10] and sum(fits.plan) == 16 and max(fits.plan) <= 10
    small = BalancePlanner(2, 32)
    with pytest.warns(RuntimeWarning, match="memory caps cannot hold this global batch and were dropped"):
        small.load_state_dict(p.state_dict(), resize=True)
    assert small.memory_caps == [None, None] and sum(small.plan) == 32
    assert small.model_params() == p.model_params()[:2]


# ---------------------------------------------------------------------------------------------- real runs

def trainer(out, callbacks, devices=2, **kw):
    opts = dict(accelerator="cpu", devices=devices, max_epochs=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    opts.update(kw)
    return pl.Trainer(strategy=HeteroDDPStrategy(start_method=START_METHOD), callbacks=callbacks + [Report(str(out))],
                      default_root_dir=str(out), **opts)


@pytest.mark.distributed
def test_mid_epoch_resume_after_a_killed_rank_runs_every_remaining_sample_once(tmp_path):
    first, second, ckpt_dir = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    first.mkdir()
    second.mkdir()
    pl.seed_everything(0)
    # 15 steps an epoch; a checkpoint every 5 steps; rank 1 is killed (-9) after step 12 of epoch 1, so the last
    # checkpoint is mid-epoch, after step 9 of epoch 1 (global step 25).
    ckpt = ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=5, save_last=True)
    t = trainer(first, [HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002), ckpt, KillRank(1, 1, 12)],
                enable_checkpointing=True)
    with pytest.raises(Exception):
        t.fit(StepLogMLP(str(first), batch_size=16))
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=False)["global_step"] == 25

    t2 = trainer(second, [HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002)])
    t2.fit(StepLogMLP(str(second), batch_size=16), ckpt_path=str(ckpt_dir / "last.ckpt"))
    before, after = step_logs(str(first), 2), step_logs(str(second), 2)
    resumed = [s for s in after[0] if s["epoch"] == 1]
    assert [s["step"] for s in resumed] == list(range(10, 15))  # the resumed epoch starts at its first undone step
    # Every sample of epoch 1 ran exactly once: steps 0-9 before the checkpoint, 10-14 after the resume.
    done = epoch_indices(before, 1, range(10))
    assert sorted(done + epoch_indices(after, 1)) == list(range(N))
    # Lightning saved the balanced loader's position in the fit loop's state.
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert (state["epoch"], state["steps_done"]) == (1, 10)
    # The resumed steps are those the killed run would have run: steps 10-12 (13 on rank 0, which may start its
    # next step before rank 1 dies) ran before the kill, with the same global batches. A step's global batch (the
    # ranks' samples in rank order) is fixed by the epoch's order; its split between the ranks may differ, as a
    # plan change for a straggler made after the checkpoint is timed afresh in the resumed run.
    def global_batches(logs):
        steps = [{s["step"]: s["idx"] for s in logs[r] if s["epoch"] == 1 and s["step"] >= 10} for r in range(2)]
        return {k: steps[0][k] + steps[1][k] for k in sorted(set(steps[0]) & set(steps[1]))}

    lost, again = global_batches(before), global_batches(after)
    assert len(lost) >= 3 and {k: again[k] for k in lost} == lost
    # The epoch's record has its start plan and the plan changes made before the checkpoint; the steps of the
    # resumed run but its last, and those of the killed run up to the checkpoint, ran the planned batch on every rank;
    # epoch 1 started on epoch 0's decision.
    hist = read_reports(str(second), 2)[0]["plan_history"]
    assert len(hist) == 2 and hist[1]["batch_sizes"] == hist[0]["next_batch_sizes"] != [16, 16]
    assert all(h["plan_applied"] for h in hist)
    for logs in (before, after):
        for r in range(2):
            for s in logs[r]:
                if s["epoch"] == 1 and s["step"] < (10 if logs is before else 14):
                    assert len(s["idx"]) == plan_at(hist[1], s["step"])[r], (s["step"], r)


@pytest.mark.distributed
def test_resume_on_another_world_size_reseeds_plan_and_time_models(tmp_path):
    first, second, ckpt_dir = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    first.mkdir()
    second.mkdir()
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True)
    t = trainer(first, [HeterogeneityEmulator([1.0, 0.25], cost_per_sample=0.002), ckpt], max_epochs=1,
                enable_checkpointing=True)
    t.fit(StepLogMLP(str(first), batch_size=16))
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["callbacks"]["BatchBalancer"]["planner"]
    assert saved["world_size"] == 2

    # The same checkpoint on 3 ranks: no refusal; ranks 0 and 1 keep their lines, rank 2 starts without one.
    t3 = trainer(second, [HeterogeneityEmulator([1.0, 0.25, 1.0], cost_per_sample=0.002), ModelProbe(str(second))],
                 devices=3)
    with rank_output() as ranks:
        t3.fit(StepLogMLP(str(second), batch_size=16), ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert "BalancePlanner: the checkpoint is for 2 ranks and a global batch of 32; this run has 3 ranks" in ranks.text
    lines = []
    for s in saved["models"]:
        m = LinearTimeModel()
        m.load_state_dict(s)
        lines.append([m.params().intercept, m.params().slope])
    for r in range(3):
        probe = json.loads((second / f"probe_rank{r}.json").read_text())
        assert [x for line in probe["lines"][:2] for x in line] == pytest.approx([x for line in lines for x in line])
        assert probe["lines"][2] is None
        assert probe["plan"] == [16, 16, 16]  # equal until rank 2 is measured
    hist = read_reports(str(second), 3)[0]["plan_history"]
    assert hist[0] == saved["history"][0] and hist[1]["batch_sizes"] == [16, 16, 16]
    assert sum(hist[1]["next_batch_sizes"]) == 48 and hist[1]["next_batch_sizes"][1] < 16  # rank 1 is slow
    assert sorted(epoch_indices(step_logs(str(second), 3), 1)) == list(range(N))
