"""Property checks of the balancing core against independent exact references (seeded, many random cases).

Allocators and exact splits: every plan sums to the global batch and respects the bounds; the makespan of the
shortest-step split equals an independent optimum (exhaustive enumeration for tiny cases, the greedy
"next sample to the rank that finishes it first" heap for moderate ones, bisection on the makespan with per-rank
capacities for large ones); LBB's split has the smallest spread (exhaustive); infeasible inputs raise a
``ValueError`` naming the argument with a HINT. Partition: every sample once per epoch (padding exactly as
documented), the same number of steps on every rank, planned batch sizes per step, mid-epoch plan changes,
determinism by seed.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
import torch

from hetero_plugins.balancing.allocators import (
    Bounds,
    equal_finish_continuous,
    equal_finish_time,
    get_allocator,
)
from hetero_plugins.balancing.cliffs import CliffMemory
from hetero_plugins.balancing.lines import TimeModelLines, TimeModelParams, curve_times
from hetero_plugins.balancing.partition import (
    epoch_layout,
    epoch_shards,
    resplit_unprocessed,
    segment_layout,
    segment_shards,
    split_remainder,
    unprocessed_indices,
)
from hetero_plugins.balancing.sampler import HeteroBatchSampler
from hetero_plugins.balancing.splits import min_makespan_split, min_spread_split

# ----------------------------------------------------------------------------------------------- references


def _times(a, s, b, knee=None, beyond=None):
    return curve_times(np.asarray(a, float), np.asarray(s, float), np.asarray(b, float), knee, beyond)


def _ref_exhaustive(a, s, B, lo, hi, knee=None, beyond=None):
    """(best makespan, best spread among all plans, makespan of the min-spread plans) by enumeration."""
    n = len(a)
    best_mk, best_sp = np.inf, (np.inf, np.inf)
    for head in itertools.product(*[range(int(lo[i]), int(hi[i]) + 1) for i in range(n - 1)]):
        last = B - sum(head)
        if not lo[-1] <= last <= hi[-1]:
            continue
        t = _times(a, s, list(head) + [last], knee, beyond)
        mk = float(t.max())
        best_mk = min(best_mk, mk)
        best_sp = min(best_sp, (float(t.max() - t.min()), mk))
    return best_mk, best_sp


def _ref_greedy(a, s, B, lo, hi, knee=None, beyond=None):
    """Optimal makespan by the greedy heap: each further sample to the rank whose time with it is smallest."""
    b = [int(x) for x in lo]
    t_of = lambda i, k: float(_times([a[i]], [s[i]], [k], None if knee is None else [knee[i]],  # noqa: E731
                                     None if beyond is None else [beyond[i]])[0])
    heap = [(t_of(i, b[i] + 1), i) for i in range(len(a)) if b[i] < hi[i]]
    heapq.heapify(heap)
    for _ in range(B - sum(b)):
        _, i = heapq.heappop(heap)
        b[i] += 1
        if b[i] < hi[i]:
            heapq.heappush(heap, (t_of(i, b[i] + 1), i))
    return float(_times(a, s, b, knee, beyond).max())


def _capacity(a, s, lo, hi, T):
    """Per rank, the largest batch in [lo, hi] whose float time a + s*k is <= T (lo - 1 where none)."""
    with np.errstate(over="ignore", invalid="ignore"):
        k = np.floor((T - a) / s)
    k = np.clip(np.nan_to_num(k, nan=lo - 1, posinf=hi, neginf=lo - 1), lo - 1, hi)
    for _ in range(64):  # fix the rounding of the division against the float expression itself
        up = (k < hi) & (a + s * (k + 1) <= T)
        down = (k >= lo) & (a + s * k > T)
        if not up.any() and not down.any():
            break
        k = k + up - down
    return k


def _ref_bisect(a, s, B, lo, hi):
    """Smallest float T at which every rank fits its minimum and the capacities add up to B."""
    a, s, lo, hi = (np.asarray(x, float) for x in (a, s, lo, hi))
    feasible = lambda T: bool(np.all(a + s * lo <= T) and _capacity(a, s, lo, hi, T).sum() >= B)  # noqa: E731
    low, high = float(np.max(a + s * lo)), float(np.max(a + s * hi))
    if feasible(low):
        return low
    while np.nextafter(low, np.inf) < high:
        mid = 0.5 * (low + high)
        if mid <= low or mid >= high:
            mid = float(np.nextafter(low, np.inf))
        if feasible(mid):
            high = mid
        else:
            low = mid
    return high


def _random_lines(rng, n, integer_knees=False):
    kind = rng.integers(6)
    if kind == 0:  # huge speed ratios
        s = 10.0 ** rng.uniform(-6, -2, n)
    elif kind == 1:  # ties
        s = np.full(n, 10.0 ** rng.uniform(-5, -2))
    elif kind == 2:  # a few distinct speeds, exact ratios
        s = rng.choice([1e-3, 2e-3, 4e-3, 1e-7 * 3], n)
    else:
        s = rng.uniform(1e-4, 1e-2, n)
    a = np.zeros(n) if rng.random() < 0.3 else rng.uniform(0, 0.2, n) * (rng.random(n) < 0.8)
    if rng.random() < 0.1:
        a = np.full(n, 0.05)
    return a, s


def _random_bounds(rng, n, B=None):
    lo = rng.integers(1, 4, n) if rng.random() < 0.5 else np.ones(n, dtype=int)
    if rng.random() < 0.5:
        hi = lo + rng.integers(0, 40, n)
    else:
        hi = np.full(n, 2**31 - 1)
    return lo.astype(int), hi.astype(int)


def _check_plan(plan, B, lo, hi):
    plan = np.asarray(plan)
    assert plan.dtype.kind == "i" or all(isinstance(x, int) for x in plan.tolist())
    assert int(plan.sum()) == B, (plan, B)
    assert np.all(plan >= lo) and np.all(plan <= hi), (plan, lo, hi)


def _close(x, y):
    assert abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1e-300), (x, y)


# ----------------------------------------------------------------------------------------------- allocators


def _tiny_case(rng, min_ranks: int):
    """``min_ranks``-3 ranks with random lines, bounds of width 0-7 and a global batch they admit: small enough
    to enumerate every split."""
    n = int(rng.integers(min_ranks, 4))
    a, s = _random_lines(rng, n)
    lo = rng.integers(1, 3, n)
    hi = lo + rng.integers(0, 8, n)
    return n, a, s, lo, hi, int(rng.integers(lo.sum(), hi.sum() + 1))


def test_min_makespan_exhaustive_tiny():
    rng = np.random.default_rng(1)
    for _ in range(600):
        n, a, s, lo, hi, B = _tiny_case(rng, 1)
        plan = min_makespan_split(a, s, B, lo, hi)
        _check_plan(plan, B, lo, hi)
        mk, (sp, sp_mk) = _ref_exhaustive(a, s, B, lo, hi)
        _close(float(_times(a, s, plan).max()), mk)
        spread = min_spread_split(a, s, B, lo, hi)
        _check_plan(spread, B, lo, hi)
        t = _times(a, s, spread)
        _close(float(t.max() - t.min()) + 1.0, sp + 1.0)  # spreads compared on the scale of a second
        _close(float(t.max()), sp_mk)


def test_min_makespan_greedy_moderate():
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(1, 65))
        a, s = _random_lines(rng, n)
        lo, hi = _random_bounds(rng, n)
        top = int(min(hi.sum(), lo.sum() + 600))
        B = int(rng.integers(lo.sum(), top + 1))
        plan = min_makespan_split(a, s, B, lo, hi)
        _check_plan(plan, B, lo, hi)
        _close(float(_times(a, s, plan).max()), _ref_greedy(a, s, B, lo, hi))


def test_min_makespan_bisection_large():
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(1, 65))
        a, s = _random_lines(rng, n)
        lo, hi = _random_bounds(rng, n)
        if rng.random() < 0.5:
            hi = lo + rng.integers(0, 100_000, n)
        B = int(rng.integers(lo.sum(), min(hi.sum(), lo.sum() + 10**7) + 1))
        plan = min_makespan_split(a, s, B, lo, hi)
        _check_plan(plan, B, lo, hi)
        _close(float(_times(a, s, plan).max()), _ref_bisect(a, s, B, lo, hi))


def test_allocators_sum_bounds_and_optimality():
    rng = np.random.default_rng(4)
    names = ["static", "proportional", "equal_finish", "lbb"]
    for case in range(400):
        n = int(rng.integers(1, 65))
        a, s = _random_lines(rng, n)
        lo, hi = _random_bounds(rng, n)
        B = int(rng.integers(lo.sum(), min(hi.sum(), lo.sum() + [50, 5000, 10**6][case % 3]) + 1))
        bounds = Bounds(tuple(lo.tolist()), tuple(hi.tolist()))
        as_lines = case % 2 == 0
        models = (TimeModelLines(a, s, np.ones(n, dtype=bool)) if as_lines
                  else [TimeModelParams(float(x), float(y)) for x, y in zip(a, s)])
        plans = {}
        for name in names:
            plan = get_allocator(name).allocate(models, B, bounds)
            assert all(type(x) is int for x in plan), (name, plan)
            _check_plan(plan, B, lo, hi)
            plans[name] = plan
        ref = _ref_bisect(a, s, B, lo, hi) if B - lo.sum() > 2000 else _ref_greedy(a, s, B, lo, hi)
        _close(float(_times(a, s, plans["equal_finish"]).max()), ref)
        # static: the most even split in the bounds; proportional: shortest step for b_i / v_i at the mean batch
        _close(float(np.max(plans["static"])), _ref_bisect(np.zeros(n), np.ones(n), B, lo, hi))
        per = np.maximum((a + s * (B / n)) / (B / n), 1e-15)
        _close(float(np.max(per * plans["proportional"])), _ref_bisect(np.zeros(n), per, B, lo, hi))


def test_lbb_min_spread_exhaustive_tiny():
    rng = np.random.default_rng(5)
    for _ in range(300):
        n, a, s, lo, hi, B = _tiny_case(rng, 2)
        bounds = Bounds(tuple(int(x) for x in lo), tuple(int(x) for x in hi))
        plan = get_allocator("lbb").allocate([TimeModelParams(float(x), float(y)) for x, y in zip(a, s)], B, bounds)
        _check_plan(plan, B, lo, hi)
        _, (sp, sp_mk) = _ref_exhaustive(a, s, B, lo, hi)
        t = _times(a, s, plan)
        _close(float(t.max() - t.min()) + 1.0, sp + 1.0)


def test_knee_split_exhaustive_and_greedy():
    rng = np.random.default_rng(6)
    for case in range(500):
        n = int(rng.integers(1, 4 if case % 2 == 0 else 17))
        a, s = _random_lines(rng, n)
        lo = rng.integers(1, 3, n)
        hi = lo + rng.integers(0, 8 if case % 2 == 0 else 60, n)
        knee = np.where(rng.random(n) < 0.7, rng.integers(0, 12, n).astype(float), np.inf)
        if case % 3 == 0:  # a knee between two batch sizes
            knee = knee + rng.uniform(0, 1, n)
        # past the knee: steeper (memory cliff) or, for a saturation plateau's line, the proportional slope
        beyond = s * rng.uniform(1.0, 20.0, n)
        B = int(rng.integers(lo.sum(), hi.sum() + 1))
        plan = min_makespan_split(a, s, B, lo, hi, knee, beyond)
        _check_plan(plan, B, lo, hi)
        mk = (_ref_exhaustive(a, s, B, lo, hi, knee, beyond)[0] if case % 2 == 0
              else _ref_greedy(a, s, B, lo, hi, knee, beyond))
        _close(float(_times(a, s, plan, knee, beyond).max()), mk)
        if case % 4 == 1:  # the allocator reads the knees of the lines it is handed
            lines = TimeModelLines(a, s, np.ones(n, dtype=bool), knee, beyond)
            p2 = get_allocator("equal_finish").allocate(lines, B, Bounds(tuple(map(int, lo)), tuple(map(int, hi))))
            _close(float(_times(a, s, p2, knee, beyond).max()), mk)


def test_knee_between_batch_sizes_regression():
    """A non-integer knee: the split once bent the curve at the knee's floor, with the second line through the
    first there, so it priced rank 0's 2nd sample 11 s where ``curve_times`` (the planner's prediction) says
    6.5 s, and chose [1, 8] (8 s) over [2, 7] (7 s)."""
    knee, beyond = [1.5, np.inf], [10.0, 1.0]
    plan = min_makespan_split([0.0, 0.0], [1.0, 1.0], 9, [1, 1], [9, 9], knee, beyond)
    assert plan.tolist() == [2, 7]
    assert curve_times([0.0, 0.0], [1.0, 1.0], plan, knee, beyond).max() == 7.0


def test_extreme_scales_bisection():
    """Slopes over 19 decades (float ties within a rank), negative intercepts, minimum 0, batches up to 1e9."""
    rng = np.random.default_rng(12)
    for case in range(400):
        n = int(rng.integers(1, 65))
        if case % 2 == 0:
            s = 10.0 ** rng.uniform(-16, 3, n)
            a = rng.uniform(-1, 1, n) * 10.0 ** rng.uniform(-6, 3, n)
        else:
            s, a = rng.choice([1e-3, 1e-7], n), rng.choice([0.0, 1.0, 1e-9], n)
        lo = rng.integers(0, 5, n)
        hi = np.where(rng.random(n) < 0.5, lo + rng.integers(0, 10**6, n), 2**31 - 1)
        B = int(rng.integers(lo.sum(), min(hi.sum(), lo.sum() + 10**9) + 1))
        plan = min_makespan_split(a, s, B, lo, hi)
        _check_plan(plan, B, lo, hi)
        _close(float(_times(a, s, plan).max()), _ref_bisect(a, s, B, lo, hi))


def _ref_min_spread(a, s, B, lo, hi):
    """(smallest spread, shortest makespan among those) over every pair of candidate times [L, U]."""
    T = [a[i] + s[i] * np.arange(lo[i], hi[i] + 1) for i in range(len(a))]
    mk = _ref_greedy(a, s, B, lo, hi)
    best = (np.inf, np.inf)
    for L in np.unique(np.concatenate(T)):
        first = [int(np.searchsorted(t, L, side="left")) for t in T]
        if any(f >= len(t) for f, t in zip(first, T)) or sum(lo) + sum(first) > B:
            continue
        U = max(max(t[f] for f, t in zip(first, T)), mk)
        if sum(lo) + sum(int(np.searchsorted(t, U, side="right")) - 1 for t in T) >= B:
            best = min(best, (U - L, U))
    return best


def test_min_spread_moderate_pairs():
    rng = np.random.default_rng(13)
    for case in range(250):
        n = int(rng.integers(1, 7))
        a, s = _random_lines(rng, n)
        if case % 3 == 0:
            s, a = 10.0 ** rng.uniform(-9, 2, n), rng.uniform(-1, 1, n) * 10.0 ** rng.uniform(-6, 2, n)
        lo = rng.integers(0, 4, n)
        hi = lo + rng.integers(0, 40, n)
        B = int(rng.integers(lo.sum(), hi.sum() + 1))
        plan = min_spread_split(a, s, B, lo, hi)
        _check_plan(plan, B, lo, hi)
        t = _times(a, s, plan)
        sp, U = _ref_min_spread(a, s, B, lo, hi)
        scale = max(abs(U), 1e-300)
        assert abs(float(t.max() - t.min()) - sp) <= 1e-12 * scale and abs(float(t.max()) - U) <= 1e-12 * scale


def test_cliff_knees_keep_the_curve_convex_and_exact():
    rng = np.random.default_rng(14)
    for case in range(200):
        n = int(rng.integers(1, 9))
        a, s = rng.uniform(0, 0.05, n), rng.uniform(1e-3, 5e-3, n)
        mem = CliffMemory(n, epochs=int(rng.integers(1, 4)))
        cliff = rng.integers(20, 120, n).astype(float)
        for _e in range(int(rng.integers(1, 6))):
            for _ in range(int(rng.integers(1, 4))):
                b = rng.integers(10, 150, n).astype(float)
                tt = curve_times(a, s, b, cliff, s * rng.uniform(2, 6, n)) * rng.uniform(0.97, 1.03, n)
                mem.record(np.repeat(b[:, None], 8, 1), np.repeat(tt[:, None], 8, 1) * rng.uniform(0.99, 1.01, (n, 8)))
            mem.end_epoch()
        plan = rng.integers(10, 150, n)
        k0 = np.where(rng.random(n) < 0.5, rng.integers(5, 200, n).astype(float), np.inf)
        c0 = np.where(np.isfinite(k0), s * rng.uniform(1, 3, n), 1.0)
        k, c = mem.knees(a, s, plan, k0, c0)
        moved = (k != k0) | (c != c0)
        own = np.where(np.isfinite(k0) & (plan >= k0), c0, s)
        assert np.all(~moved | ((k == np.minimum(plan, k0)) & (c >= own)))
        assert np.all(np.isfinite(c) & (c > 0))
        if n <= 3:  # the split on the learned knees is the exact optimum of that curve
            lo, hi = np.ones(n, dtype=int), np.full(n, 12)
            B = int(rng.integers(n, 12 * n + 1))
            kk = np.minimum(k, 11.0) if case % 2 else k
            split = min_makespan_split(a, s, B, lo, hi, kk, c)
            _close(float(_times(a, s, split, kk, c).max()), _ref_exhaustive(a, s, B, lo, hi, kk, c)[0])


def test_equal_finish_time_continuous_optimum():
    rng = np.random.default_rng(7)
    for _ in range(2000):
        n = int(rng.integers(1, 65))
        a, s = _random_lines(rng, n)
        if rng.random() < 0.3:
            a = a + rng.uniform(0, 2.0, n) * (rng.random(n) < 0.2)  # data-bound ranks
        m = float(rng.integers(1, 4))
        B = int(rng.integers(n * m, 10**6))
        got = equal_finish_time(a, s, B, m)
        # independent: smallest T with T >= a_i + s_i m for every i and sum_i (T - a_i) / s_i >= B
        ref = max(float(np.max(a + s * m)), float((B + np.sum(a / s)) / np.sum(1 / s)))
        assert abs(got - ref) <= 1e-9 * ref
        cont = np.asarray(equal_finish_continuous([TimeModelParams(float(x), float(y)) for x, y in zip(a, s)], B,
                                                  Bounds.uniform(n, int(m))))
        assert abs(cont.sum() - B) <= 1e-6 * B and np.all(cont >= m - 1e-9)
        t = a + s * cont
        assert abs(t.max() - ref) <= 1e-9 * ref


def test_infeasible_inputs_raise_named_value_errors():
    rng = np.random.default_rng(8)
    for _ in range(200):
        n = int(rng.integers(1, 65))
        a, s = _random_lines(rng, n)
        lo, hi = _random_bounds(rng, n)
        hi = np.minimum(hi, lo + 50)
        bounds = Bounds(tuple(lo.tolist()), tuple(hi.tolist()))
        models = [TimeModelParams(float(x), float(y)) for x, y in zip(a, s)]
        for B in (int(lo.sum()) - 1, int(hi.sum()) + 1):
            if B < 1:
                continue
            for name in ("static", "proportional", "equal_finish", "lbb"):
                with pytest.raises(ValueError, match=r"`global_batch`.*HINT"):
                    get_allocator(name).allocate(models, B, bounds)
            with pytest.raises(ValueError, match=r"`global_batch`.*HINT"):
                min_makespan_split(a, s, B, lo, hi)
    with pytest.raises(ValueError, match=r"`max_batch\[1\]`.*HINT"):
        Bounds((1, 5), (4, 4))
    with pytest.raises(ValueError, match=r"`min_batch\[0\]`.*HINT"):
        Bounds((0, 1), (4, 4))
    with pytest.raises(ValueError, match=r"`global_batch`.*HINT"):
        get_allocator("equal_finish").allocate([None], 0, Bounds.uniform(1))
    with pytest.raises(ValueError, match=r"`slope`.*HINT"):
        min_makespan_split([0.0], [0.0], 4, [1], [8])


# ----------------------------------------------------------------------------------------------- partition


def _ddp_padded(n, padding, epoch, seed, shuffle):
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    return order + [order[i % n] for i in range(padding)]


def _random_plan(rng, world):
    if rng.random() < 0.3:
        return [int(rng.integers(1, 9))] * world
    return [int(x) for x in rng.integers(1, 40, world)]


def test_epoch_shards_cover_every_sample_as_documented():
    rng = np.random.default_rng(9)
    for case in range(1500):
        world = int(rng.integers(1, 17))
        plan = _random_plan(rng, world)
        B = sum(plan)
        n = int(rng.integers(1, 6 * B + 3 * world + 2))
        drop_last, shuffle, locality = bool(rng.random() < 0.4), bool(rng.random() < 0.6), bool(case % 3 == 2)
        pad = bool(rng.random() < 0.8)
        seed, epoch = int(rng.integers(100)), int(rng.integers(5))
        if drop_last and (n + ((-n) % world if pad else 0)) // B == 0:
            with pytest.raises(ValueError, match="drop_last"):
                epoch_shards(n, plan, epoch, seed, shuffle, drop_last, locality, pad)
            continue
        layout = epoch_layout(n, plan, drop_last, pad)
        shards = epoch_shards(n, plan, epoch, seed, shuffle, drop_last, locality, pad)
        again = epoch_shards(n, plan, epoch, seed, shuffle, drop_last, locality, pad)
        assert all(np.array_equal(x, y) for x, y in zip(shards, again))  # deterministic
        # the same number of steps on every rank, each step of the planned size
        sizes = [len(x) for x in shards]
        assert sizes == layout.shard_sizes()
        for r in range(world):
            assert sum(layout.step_counts(k)[r] for k in range(layout.steps)) == sizes[r]
            assert all(layout.step_counts(k)[r] == plan[r] for k in range(layout.full_steps))
            if layout.last_counts:
                assert 1 <= layout.last_counts[r] <= plan[r]
        total = sum(sizes)
        assert total == (layout.full_steps * B if drop_last else n + layout.padding)
        allidx = np.concatenate(shards)
        assert np.all((allidx >= 0) & (allidx < n))
        counts = np.bincount(allidx, minlength=n)
        if not drop_last:
            assert np.all(counts >= 1)  # every sample at least once; the extra ones are the padding
            assert total - n == layout.padding
            assert layout.padding < world or (layout.last_counts and sum(layout.last_counts) == world)
        if not locality:
            order = _ddp_padded(n, layout.padding, epoch, seed, shuffle)
            expect = [[] for _ in range(world)]
            for k in range(layout.steps):
                c = layout.step_counts(k)
                start = k * B
                for r in range(world):
                    expect[r] += order[start + sum(c[:r]) : start + sum(c[: r + 1])]
            assert [x.tolist() for x in shards] == expect
        if locality:
            if drop_last:  # no copies unless a global batch needs padding
                if layout.full_steps * B <= n:
                    assert counts.max() <= 1
            elif layout.padding == 0:
                assert np.all(counts == 1)
        elif layout.padding == 0 or drop_last and layout.full_steps * B <= n:
            assert counts.max() <= 1


def test_split_remainder_bounds():
    rng = np.random.default_rng(10)
    for _ in range(3000):
        world = int(rng.integers(1, 33))
        plan = _random_plan(rng, world)
        rem = int(rng.integers(world, sum(plan) + 1)) if rng.random() < 0.9 else int(rng.integers(world, 5 * sum(plan)))
        out = split_remainder(rem, plan)
        assert sum(out) == rem and all(x >= 1 for x in out)
        if rem <= sum(plan):
            assert all(x <= b for x, b in zip(out, plan))
        # largest remainder within the bounds: no single sample moved from one rank to another (both staying in
        # their bounds) brings both closer to their proportional shares
        exact = np.array([rem * b / sum(plan) for b in plan])
        cap = np.array(plan if rem <= sum(plan) else [rem] * world)
        dev = np.array(out) - exact
        give = np.array(out) > 1
        take = np.array(out) < cap
        if give.any() and take.any():
            assert dev[give].max() <= dev[take].min() + 1 + 1e-9, (rem, plan, out)


def test_batch_sampler_mid_epoch_plan_changes():
    rng = np.random.default_rng(11)
    for _ in range(300):
        world = int(rng.integers(1, 9))
        plan = _random_plan(rng, world)
        B = sum(plan)
        n = int(rng.integers(B, 8 * B + world))
        drop_last, shuffle = bool(rng.random() < 0.4), bool(rng.random() < 0.5)
        seed = int(rng.integers(50))
        samplers = [HeteroBatchSampler(n, plan, r, shuffle=shuffle, seed=seed, drop_last=drop_last)
                    for r in range(world)]
        steps = len(samplers[0])
        changes = []
        for _c in range(int(rng.integers(0, 3))):
            k = int(rng.integers(0, steps + 1))
            new = [int(x) for x in rng.multinomial(B - world, np.ones(world) / world) + 1]
            changes.append((k, new))
            for smp in samplers:
                smp.set_plan(new, from_step=k)
        batches = [list(smp) for smp in samplers]
        assert all(len(b) == steps == len(smp) for b, smp in zip(batches, samplers))
        layout = samplers[0].sampler.layout
        used = []
        for k in range(steps):
            counts = samplers[0].step_counts(k)
            cur = plan
            for start, p in changes:
                if start <= k:
                    cur = p
            if k < layout.full_steps:
                assert tuple(counts) == tuple(cur)
            for r in range(world):
                assert len(batches[r][k]) == counts[r]
                assert batches[r][k] == samplers[(r + 1) % world].batch_indices(k, r)
                used += batches[r][k]
        # the union over steps is the epoch's order, whatever the plans: each sample once (+ documented padding)
        order = _ddp_padded(n, layout.padding, 0, seed, shuffle)
        assert used == order[: len(used)]
        assert len(used) == (layout.full_steps * B if drop_last else n + layout.padding)


def test_resume_and_elastic_resplit_cover_the_rest_once():
    rng = np.random.default_rng(15)
    for _ in range(400):
        world = int(rng.integers(1, 9))
        plan = _random_plan(rng, world)
        B = sum(plan)
        n = int(rng.integers(1, 6 * B + 2 * world))
        drop_last, shuffle = bool(rng.random() < 0.3), bool(rng.random() < 0.5)
        try:
            layout = segment_layout(n, plan, None, drop_last)
        except ValueError:
            continue
        shards = segment_shards(n, plan, None, epoch=1, seed=3, shuffle=shuffle, drop_last=drop_last)
        k = int(rng.integers(0, layout.steps + 1))
        done = set()
        for r in range(world):
            done.update(shards[r][: sum(layout.step_counts(j)[r] for j in range(k))].tolist())
        rest = unprocessed_indices(shards, layout, k)
        assert len(set(rest.tolist())) == len(rest)
        assert set(rest.tolist()) == set(np.concatenate(shards).tolist()) - done
        new_plan = _random_plan(rng, int(rng.integers(1, 9)))
        new = resplit_unprocessed(shards, layout, k, new_plan)
        both = np.concatenate(new)
        assert set(both.tolist()) == set(rest.tolist())  # every unprocessed sample, nothing else
        if len(rest):
            new_layout = segment_layout(len(rest), new_plan, rest, False)
            assert len(both) - len(rest) == new_layout.padding  # padding only as a short last step borrows it
            assert [len(x) for x in new] == new_layout.shard_sizes()
            assert all(min(new_layout.step_counts(j)) >= 1 for j in range(new_layout.steps))
        # a sampler restored at step k yields exactly the steps the uninterrupted one had left
        kw = dict(shuffle=shuffle, seed=2, drop_last=drop_last)
        full = [list(HeteroBatchSampler(n, plan, r, **kw)) for r in range(world)]
        kk = int(rng.integers(0, len(full[0]) + 1))
        state = HeteroBatchSampler(n, plan, 0, **kw).state_dict(steps_done=kk)
        for r in range(world):
            restored = HeteroBatchSampler(n, plan, r, **kw)
            restored.load_state_dict(state)
            assert list(restored) == full[r][kk:]
