"""The planner's extrapolation limit: a rank goes beyond the batch sizes it has measured only as far as its fitted
line and the proportional model through its largest measured size agree (``extrapolation_tolerance``)."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.time_bank import TimeModelBank


def _records(plan, step_time, steps=8, rng=None, noise=0.0):
    """One epoch's records ``(ranks, steps, 3)``: rank r's step takes ``step_time[r](b)`` seconds."""
    rec = np.zeros((len(plan), steps, 3))
    for r, b in enumerate(plan):
        rec[r, :, 0] = b
        jitter = 1.0 if rng is None else np.exp(rng.normal(0.0, noise, steps))
        rec[r, :, 1] = step_time[r](b) * jitter
    return rec


def _brute_limit(intercept: float, slope: float, measured: float, tol: float) -> float:
    """The largest integer batch at which ``t(measured) * b / measured <= (1 + tol) * (intercept + slope * b)``,
    searched directly (inf if every size up to 10^6 qualifies)."""
    t_m = intercept + slope * measured
    b = np.arange(1, 1_000_001, dtype=np.float64)
    ok = t_m * b / measured <= (1 + tol) * (intercept + slope * b) * (1 + 1e-12)
    if ok.all():
        return np.inf
    return float(b[np.argmin(ok)] - 1) if ok[0] else 0.0


@pytest.mark.parametrize("seed", range(6))
def test_the_limit_is_where_the_two_models_part_by_the_tolerance(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 12
    bank = TimeModelBank(n)
    a = rng.uniform(0.0, 0.05, n) * (rng.random(n) < 0.8)
    s = np.exp(rng.uniform(np.log(1e-5), np.log(1e-3), n))
    lo = rng.integers(4, 64, n).astype(np.float64)
    hi = lo * rng.uniform(1.3, 3.0, n)
    sizes = np.stack([lo, hi] * 6, axis=1)
    bank.observe(sizes, a[:, None] + s[:, None] * sizes)
    lines = bank.lines()
    for tol in (0.25, 1.0, 3.0):
        got = bank.extrapolation_limits(tol)
        for i in range(n):
            want = _brute_limit(float(lines.intercept[i]), float(lines.slope[i]), float(hi[i]), tol)
            if np.isinf(want):
                assert np.isinf(got[i]) or got[i] >= 1e6, (i, tol, got[i])
            else:
                assert abs(got[i] - want) <= 1, (i, tol, got[i], want)
            assert got[i] >= hi[i] * 1.0 - 1  # never below what the rank has run at


def test_no_line_or_no_fixed_cost_sets_no_limit() -> None:
    bank = TimeModelBank(3)
    sizes = np.array([[16.0] * 8, [16.0, 32.0] * 4, [16.0, 32.0] * 4])
    times = np.array([[0.1] * 8, [0.016, 0.032] * 4, [0.1, 0.1008] * 4])  # one size; proportional; flat
    bank.observe(sizes, times)
    limit = bank.extrapolation_limits(1.0)
    assert np.isinf(limit[0]) and np.isinf(limit[1])
    assert limit[2] == pytest.approx(2 * 32, abs=1)  # a flat line: (1 + tol) times the largest size measured
    with pytest.raises(ValueError, match="tolerance"):
        bank.extrapolation_limits(-0.1)


def test_a_plateau_rank_grows_by_the_limit_not_by_the_change_factor() -> None:
    # rank 0 sits on a saturation plateau up to 128 samples (its line through 32 and 48 is nearly flat), then
    # costs 4x per sample past a memory cliff at 160; rank 1 is linear and slow
    def plateau(b):
        return 0.002 + 0.0005 * max(b, 128) + 0.00001 * b + 0.0015 * max(0, b - 160)

    def slow(b):
        return 0.002 + 0.004 * b

    speed = [plateau, slow]
    out = {}
    for tol in (None, 1.0):
        p = BalancePlanner(2, 256, extrapolation_tolerance=tol, initial_plan=[32, 224], extrapolate="line")
        p.end_epoch(0, _records([32, 224], speed))
        p.plan = [48, 208]
        p.end_epoch(1, _records([48, 208], speed))
        out[tol] = list(p.plan)
        limit = p._bank.extrapolation_limits(1.0)[0] if tol else None  # noqa: SLF001 - checked against the plan
        if tol:
            assert out[tol][0] <= max(limit, 48)
            assert limit == pytest.approx(96, abs=2)  # a flat line measured up to 48 may double
    assert out[None][0] > 160  # without a limit the flat line sends rank 0 past its cliff in one re-plan
    assert out[1.0][0] < 160
    assert sum(out[1.0]) == 256


def test_the_planner_converges_as_the_limit_moves_out() -> None:
    # a rank whose fixed cost is real (not a plateau): the limit slows the first re-plans, not the end point
    speed = [lambda b: 0.05 + 0.0001 * b, lambda b: 0.002 + 0.002 * b]
    plans = {}
    for tol in (None, 1.0):
        p = BalancePlanner(2, 512, extrapolation_tolerance=tol, extrapolate="line")
        p.end_epoch(0, _records(p.plan, speed))
        p.plan = [200, 312]
        for e in range(1, 12):
            p.end_epoch(e, _records(p.plan, speed))
        plans[tol] = p.plan
    assert abs(plans[1.0][0] - plans[None][0]) <= 0.05 * plans[None][0]


@pytest.mark.parametrize("bad", [-1.0, "1", float("nan")])
def test_a_bad_tolerance_names_the_option(bad) -> None:
    with pytest.raises(ValueError, match="extrapolation_tolerance"):
        BalancePlanner(2, 64, extrapolation_tolerance=bad)


def test_a_clipped_plan_places_its_samples_on_the_allocators_corrected_lines() -> None:
    from hetero_plugins.balancing.allocators import Bounds, EqualFinishAllocator, min_makespan_split

    class Corrected(EqualFinishAllocator):
        """Rank 2's co-runner is announced to triple its times: the allocator's own lines say so."""

        def lines(self, models, world_size):
            a, s = np.asarray(models.intercept, dtype=np.float64), np.asarray(models.slope, dtype=np.float64)
            f = np.array([1.0, 1.0, 3.0, 1.0])[:world_size]
            return a * f, s * f

    speed = [lambda b: 0.002 + 0.001 * b] * 4
    for allocator, scale in ((Corrected(), [1.0, 1.0, 3.0, 1.0]), ("equal_finish", [1.0] * 4)):
        p = BalancePlanner(4, 256, allocator=allocator, extrapolation_tolerance=None, extrapolate="line")
        p.end_epoch(0, _records(p.plan, speed))
        p.plan = [48, 48, 80, 80]
        p.end_epoch(1, _records(p.plan, speed))
        trust = Bounds((1, 1, 1, 1), (60, 60, 200, 200))
        got = p._damp([100, 100, 28, 28], trust)  # noqa: SLF001 - the clipping step itself
        lines = p.decision_lines()
        f = np.asarray(scale)
        want = min_makespan_split(lines.intercept * f, lines.slope * f, 256, [60, 60, 28, 28], [60, 60, 200, 200])
        assert got == want.tolist() and sum(got) == 256
        if allocator != "equal_finish":
            assert got[2] < got[3]  # the freed samples avoid the rank the allocator knows is slow
