"""The aggregation modes under HeteroDDPStrategy: real 2-rank gloo runs on CPU (spawned processes).

Each run records the sample indices every rank trained on, so "each sample exactly once per epoch" is
checked on what the ranks really processed, and the final weights are compared with a single process
replaying what the mode promises (float64, 1e-9).
"""

from __future__ import annotations

import os

import pytest
import torch

import lightning.pytorch as pl

import hetero_plugins.strategies  # noqa: F401
from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.apps.digits import digits_datasets
from hetero_plugins.callbacks import HeterogeneityEmulator
from hetero_plugins.emulation import Stall
from hetero_plugins.balancing.partition import ddp_order, epoch_layout
from hetero_plugins.strategies import HeteroDDPStrategy
from tests.helpers.distributed import START_METHOD
from tests.lightning_jobs import IndexedDigitsMLP, Report, read_reports

pytestmark = pytest.mark.distributed

BATCH = 16  # per rank at the start: global batch 32


def fit(tmp_path, aggregation, epochs=1, speeds=(1.0, 0.25), stalls=None, cost=0.002, accumulate=1, **kw):
    pl.seed_everything(0)
    model = IndexedDigitsMLP(batch_size=BATCH)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = HeteroDDPStrategy(start_method=START_METHOD, aggregation=aggregation, **kw)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, strategy=strategy,
        callbacks=[HeterogeneityEmulator(list(speeds), cost_per_sample=cost, stalls=stalls), Report(str(tmp_path))],
        default_root_dir=str(tmp_path), accumulate_grad_batches=accumulate,
    )
    trainer.fit(model)
    return model, initial, read_reports(str(tmp_path), 2), trainer


def step_unions(epochs: int) -> list[list[list[int]]]:
    """Every step's global batch of indices (plan-independent with the default layout)."""
    n = len(digits_datasets(dtype=torch.float64)[0])
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    out = []
    for epoch in range(epochs):
        layout = epoch_layout(n, [BATCH, BATCH])
        order = ddp_order(n, layout.padding, epoch, seed, True)
        out.append([order[k * 2 * BATCH : (k + 1) * 2 * BATCH].tolist() for k in range(layout.steps)])
    return out


def replay(initial: dict, epochs: int, delayed: bool = False) -> IndexedDigitsMLP:
    """One process stepping on each step's union; ``delayed``: each step applies the previous step's gradient
    (the first step applies none, the last gradient is applied once at the end)."""
    model = IndexedDigitsMLP(batch_size=BATCH)
    model.load_state_dict(initial)
    opt = model.configure_optimizers()
    train, _ = digits_datasets(dtype=torch.float64)
    pending = None
    params = list(model.parameters())
    for steps in step_unions(epochs):
        for idx in steps:
            x, y = train[idx]
            grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
            apply, pending = (pending, grads) if delayed else (grads, None)
            if apply is not None:
                for p, g in zip(params, apply):
                    p.grad = g.clone()
                opt.step()
    if delayed and pending is not None:
        for p, g in zip(params, pending):
            p.grad = g.clone()
        opt.step()
    return model


def assert_close(model, ref):
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(p, q, rtol=0, atol=1e-9), (name, (p - q).abs().max())


def assert_each_sample_once(reports, epochs):
    n = len(digits_datasets(dtype=torch.float64)[0])
    for e in range(epochs):
        seen = sorted(reports[0]["seen"][str(e)] + reports[1]["seen"][str(e)])
        assert seen == list(range(n)), f"epoch {e}: {len(seen)} processed, {len(set(seen))} distinct of {n}"


def rank_state(report):
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in report["state"].items()}


def test_wbsp_fast_rank_steals_and_the_update_equals_one_process_on_each_union(tmp_path):
    model, initial, reports, _ = fit(tmp_path, "wbsp", epochs=2, replan_every=None)
    assert reports[0]["stolen_samples"] > 2 * reports[1]["stolen_samples"]  # rank 1 is 4x slower
    assert_each_sample_once(reports, 2)
    assert_close(model, replay(initial, 2))
    # The step records count the samples each rank really processed: the slow rank's share shrinks.
    hist = reports[0]["plan_history"]
    assert hist[0]["next_batch_sizes"][1] < BATCH and sum(hist[0]["next_batch_sizes"]) == 2 * BATCH


def test_weighted_with_gradient_accumulation_and_mid_epoch_replans_equals_one_process(tmp_path):
    """Accumulating 2 micro-steps, the hook weights a window's summed gradient once by the rank's share: a
    mid-epoch plan change must start a window (it once started at step 5, inside window 4-5: 9e-3 off)."""
    model, initial, reports, _ = fit(tmp_path, "weighted", epochs=1, accumulate=2, replan_every=3)
    changes = reports[0]["plan_history"][0]["plan_changes"]
    assert changes and all(c["step"] % 2 == 0 for c in changes), changes
    assert_each_sample_once(reports, 1)
    ref = IndexedDigitsMLP(batch_size=BATCH)
    ref.load_state_dict(initial)
    opt, params = ref.configure_optimizers(), list(ref.parameters())
    train, _ = digits_datasets(dtype=torch.float64)
    steps = step_unions(1)[0]
    for w in range(0, len(steps), 2):  # Lightning scales each micro-step's loss by 1/2, the last one's too
        grads = [sum(gs) / 2 for gs in zip(*(torch.autograd.grad(
            torch.nn.functional.cross_entropy(ref(train[idx][0]), train[idx][1]), params) for idx in steps[w:w + 2]))]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    assert_close(model, ref)


def test_deadline_without_a_hit_equals_weighted(tmp_path):
    model, initial, reports, _ = fit(tmp_path, AggregationOptions("deadline", deadline_slack=1e6), epochs=1)
    assert reports[0]["carried_samples"] == 0 == reports[1]["carried_samples"]
    assert_each_sample_once(reports, 1)
    assert_close(model, replay(initial, 1))


def test_deadline_carries_a_stalled_ranks_samples_and_still_processes_each_once(tmp_path):
    stall = Stall(rank=1, epoch=0, start_step=6, num_steps=12, slowdown=10.0)
    model, initial, reports, trainer = fit(
        tmp_path, AggregationOptions("deadline", deadline_slack=0.2, micro_batches=4), epochs=2,
        speeds=(1.0, 1.0), stalls=[stall], replan_every=3,
    )
    assert reports[1]["carried_samples"] > 0  # the stalled rank stopped at deadlines
    assert_each_sample_once(reports, 2)
    # The plan routed new samples away from the stalled rank while it had a backlog.
    changes = reports[0]["plan_history"][0]["plan_changes"]
    assert any(c["batch_sizes"][1] < BATCH for c in changes), changes
    # Both ranks hold the same model, and it trained.
    for key, value in rank_state(reports[0]).items():
        assert torch.equal(value, rank_state(reports[1])[key]), key
    assert trainer.callback_metrics["val_acc"].item() > 0.85


def test_pseudo_sync_plain_delay_equals_one_step_delayed_sgd(tmp_path):
    model, initial, reports, _ = fit(tmp_path, AggregationOptions("pseudo_sync", min_confidence=1.0), epochs=1,
                                     replan_every=None)
    assert_each_sample_once(reports, 1)
    assert_close(model, replay(initial, 1, delayed=True))


def test_local_sgd_averages_every_h_steps_weighted_by_samples(tmp_path):
    h = 4
    model, initial, reports, _ = fit(tmp_path, AggregationOptions("local_sgd", local_steps=h), epochs=1,
                                     replan_every=None)
    assert_each_sample_once(reports, 1)
    steps = reports[0]["train_batches"]
    rounds = -(-steps // h)  # every H steps and once at the epoch's end
    assert reports[0]["communication_rounds"] == rounds
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert reports[0]["communication_bytes"] == pytest.approx(rounds * param_bytes, rel=0.01)
    for key, value in rank_state(reports[0]).items():  # averaged at the epoch's end: identical models
        assert torch.equal(value, rank_state(reports[1])[key]), key
    # Replay: two local models, each stepping on its own share, averaged by samples every H steps.
    train, _ = digits_datasets(dtype=torch.float64)
    plan = reports[0]["plan_history"][0]["batch_sizes"]
    locals_ = []
    for _ in range(2):
        m = IndexedDigitsMLP(batch_size=BATCH)
        m.load_state_dict(initial)
        locals_.append((m, m.configure_optimizers()))
    samples = [0, 0]
    unions = step_unions(1)[0]
    for k, idx in enumerate(unions):
        counts = plan if len(idx) == sum(plan) else _split_last(len(idx), plan)
        lo = 0
        for r, (m, opt) in enumerate(locals_):
            x, y = train[idx[lo : lo + counts[r]]]
            lo += counts[r]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            samples[r] += counts[r]
        if (k + 1) % h == 0 or k + 1 == len(unions):
            total = sum(samples)
            with torch.no_grad():
                for tensors in zip(*(m.parameters() for m, _ in locals_)):
                    avg = sum(t * (n / total) for t, n in zip(tensors, samples))
                    for t in tensors:
                        t.copy_(avg)
            samples = [0, 0]
    assert_close(model, locals_[0][0])


def _split_last(total: int, plan: list[int]) -> list[int]:
    from hetero_plugins.balancing.partition import split_remainder

    return list(split_remainder(total, plan))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(aggregation="fastest"), "aggregation"),
        (dict(aggregation="wbsp", locality=True), "locality"),
        (dict(aggregation=3), "aggregation"),
    ],
)
def test_bad_aggregation_arguments_fail_before_any_process_starts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HeteroDDPStrategy(**kwargs)


def test_option_of_another_mode_is_refused():
    with pytest.raises(ValueError, match="`deadline_slack` does not apply to aggregation='wbsp'"):
        AggregationOptions("wbsp", deadline_slack=0.5)


def test_gradient_accumulation_is_refused_by_explicit_modes(tmp_path):
    strategy = HeteroDDPStrategy(start_method=START_METHOD, aggregation="deadline")
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, num_sanity_val_steps=0, strategy=strategy,
                         accumulate_grad_batches=2, default_root_dir=str(tmp_path))
    with pytest.raises(Exception, match="accumulate_grad_batches"):
        trainer.fit(IndexedDigitsMLP(batch_size=BATCH))
