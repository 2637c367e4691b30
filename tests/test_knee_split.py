"""Pricing beyond the measured batch sizes: the exact split on lines that turn steeper past a knee
(``min_makespan_split(..., knee, beyond)``) and the planner's ``extrapolate="proportional"``."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from hetero_plugins.balancing.allocators import Bounds, min_makespan_split
from hetero_plugins.balancing.lines import TimeModelLines, curve_times
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.scheduler.policy import AutoAllocator, DQNAllocator


def _greedy(a, s, knee, beyond, total, lo, hi):
    """Reference: one sample at a time to the rank whose next sample finishes first (a heap over the curve's
    times, independent of the bisection)."""
    b = np.array(lo, dtype=np.int64)
    heap = [(float(curve_times(a[i], s[i], b[i] + 1, knee[i], beyond[i])), i) for i in range(len(a)) if b[i] < hi[i]]
    heapq.heapify(heap)
    for _ in range(total - int(b.sum())):
        _, i = heapq.heappop(heap)
        b[i] += 1
        if b[i] < hi[i]:
            heapq.heappush(heap, (float(curve_times(a[i], s[i], b[i] + 1, knee[i], beyond[i])), i))
    return b


@pytest.mark.parametrize("seed", range(8))
def test_the_knee_split_is_exact_against_a_greedy_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    a = rng.uniform(0.0, 0.1, n) * (rng.random(n) < 0.7)
    s = np.exp(rng.uniform(np.log(1e-5), np.log(1e-2), n))
    knee = np.where(rng.random(n) < 0.7, rng.integers(0, 80, n).astype(np.float64), np.inf)
    beyond = s * rng.uniform(1.0, 30.0, n)
    lo = rng.integers(1, 4, n)
    hi = lo + rng.integers(5, 200, n)
    total = int(rng.integers(lo.sum(), hi.sum() + 1))
    got = min_makespan_split(a, s, total, lo, hi, knee, beyond)
    want = _greedy(a, s, knee, beyond, total, lo, hi)
    assert got.sum() == total and np.all((got >= lo) & (got <= hi))
    t_got = curve_times(a, s, got, knee, beyond).max()
    t_want = curve_times(a, s, want, knee, beyond).max()
    assert t_got == pytest.approx(t_want, rel=1e-12, abs=1e-15)
    # and without knees (all inf) it is the plain split
    plain = min_makespan_split(a, s, total, lo, hi)
    assert np.array_equal(min_makespan_split(a, s, total, lo, hi, np.full(n, np.inf), s), plain)


def test_knee_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="knee"):
        min_makespan_split([0.0, 0.0], [1.0, 1.0], 4, [1, 1], [4, 4], knee=[1.0, 2.0], beyond=None)
    with pytest.raises(ValueError, match="beyond"):
        min_makespan_split([0.0, 0.0], [1.0, 1.0], 4, [1, 1], [4, 4], knee=[1.0, 2.0], beyond=[0.0, 1.0])
    with pytest.raises(ValueError, match="knee"):
        TimeModelLines(np.zeros(2), np.ones(2), np.ones(2, dtype=bool), knee=np.ones(2))


def _records(plan, step_time, steps=8):
    rec = np.zeros((len(plan), steps, 3))
    for r, b in enumerate(plan):
        rec[r, :, 0] = b
        rec[r, :, 1] = step_time[r](b)
    return rec


def _plateau(b):
    """Saturated up to 128 samples (as slow at 32 as at 128), then a memory cliff at 160."""
    return 0.002 + 0.0005 * max(b, 128) + 0.00001 * b + 0.0015 * max(0, b - 160)


def _slow(b):
    return 0.002 + 0.0012 * b


def test_a_plateau_rank_is_not_sent_past_its_cliff_on_a_flat_line() -> None:
    out = {}
    for mode in ("line", "proportional"):
        p = BalancePlanner(2, 256, extrapolate=mode, initial_plan=[32, 224], knee_factor=1.0)
        p.end_epoch(0, _records([32, 224], [_plateau, _slow]))
        p.plan = [48, 208]
        p.end_epoch(1, _records([48, 208], [_plateau, _slow]))
        out[mode] = list(p.plan)
        lines = p.decision_lines()
        if mode == "proportional":
            assert lines.knee[0] == 48 and lines.beyond[0] == pytest.approx(_plateau(48) / 48, rel=1e-6)
        else:
            assert lines.knee is None
    assert out["line"][0] > 160  # the flat line sends rank 0 past its cliff in one re-plan
    assert 48 < out["proportional"][0] < 160  # priced in proportion beyond 48: it grows, short of the cliff
    assert sum(out["proportional"]) == 256
    # the planner's predicted step is the curve's: rank 0's share costs what the proportional model says
    t = p.predict_step_time(out["proportional"])
    assert t == pytest.approx(max(_plateau(48) * out["proportional"][0] / 48, _slow(out["proportional"][1])), rel=0.05)


def test_a_real_fixed_cost_is_reached_as_the_knee_moves_out() -> None:
    speed = [lambda b: 0.05 + 0.0001 * b, lambda b: 0.002 + 0.002 * b]
    plans = {}
    for mode in ("line", "proportional"):
        p = BalancePlanner(2, 512, extrapolate=mode)
        p.end_epoch(0, _records(p.plan, speed))
        p.plan = [200, 312]
        for e in range(1, 16):
            p.end_epoch(e, _records(p.plan, speed))
        plans[mode] = p.plan
    assert abs(plans["proportional"][0] - plans["line"][0]) <= 0.05 * plans["line"][0]


def test_the_learned_allocators_split_on_the_knee_scaled_by_their_corrections() -> None:
    lines = TimeModelLines(np.array([0.09, 0.0]), np.array([0.0001, 0.003]), np.ones(2, dtype=bool),
                           knee=np.array([100.0, np.inf]), beyond=np.array([0.001, 1.0]))
    bounds = Bounds.uniform(2, max_batch=1000)
    assert DQNAllocator().allocate(lines, 400, bounds) == [300, 100]
    assert AutoAllocator().allocate(lines, 400, bounds) == [300, 100]
    dqn = DQNAllocator(hedge=0.0)  # the point correction (the hedge: tests/test_hedge.py)
    dqn.split(lines, 400, bounds, np.array([2.0, 1.0]))  # rank 0 announced 2x slower: the whole curve doubles
    want = min_makespan_split([0.18, 0.0], [0.0002, 0.003], 400, [1, 1], [1000, 1000], [100.0, np.inf], [0.002, 1.0])
    assert dqn.split(lines, 400, bounds, np.array([2.0, 1.0])) == want.tolist()
    assert dqn.predict_makespan(lines, want.tolist()) == pytest.approx(
        float(curve_times([0.18, 0.0], [0.0002, 0.003], want, [100.0, np.inf], [0.002, 1.0]).max()))


@pytest.mark.parametrize("bad", ["linear", None, 1])
def test_a_bad_extrapolate_names_the_option(bad) -> None:
    with pytest.raises(ValueError, match="extrapolate"):
        BalancePlanner(2, 64, extrapolate=bad)


def test_the_knee_factor_trusts_the_line_that_far_past_the_measured_sizes() -> None:
    p = BalancePlanner(2, 256, initial_plan=[32, 224], knee_factor=2.0)
    p.end_epoch(0, _records([32, 224], [_plateau, _slow]))
    p.plan = [48, 208]
    p.end_epoch(1, _records([48, 208], [_plateau, _slow]))
    lines = p.decision_lines()
    assert lines.knee[0] == 96  # twice the largest batch measured
    assert lines.beyond[0] == pytest.approx(float(lines.intercept[0] + lines.slope[0] * 96) / 96)
    t = lines.times(np.array([96.0, 1.0]))[0]
    assert t == pytest.approx(float(lines.intercept[0] + lines.slope[0] * 96))  # the line up to the knee
    assert lines.times(np.array([192.0, 1.0]))[0] == pytest.approx(2 * t)  # in proportion beyond it
    with pytest.raises(ValueError, match="knee_factor"):
        BalancePlanner(2, 64, knee_factor=0.5)

