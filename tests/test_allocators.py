import itertools

import numpy as np
import pytest

from hetero_plugins.balancing.allocators import (
    ALLOCATORS,
    Bounds,
    EqualFinishAllocator,
    LBBAllocator,
    get_allocator,
    largest_remainder,
    predicted_times,
)
from hetero_plugins.balancing.time_model import TimeModelParams


def random_models(rng, n):
    return [TimeModelParams(float(rng.uniform(0, 0.02)), float(rng.uniform(1e-4, 5e-3))) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
@pytest.mark.parametrize("seed", range(12))
def test_exact_sum_and_bounds(name, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    lo = [int(rng.integers(1, 4)) for _ in range(n)]
    hi = [int(v + rng.integers(0, 200)) for v in lo]
    bounds = Bounds(tuple(lo), tuple(hi))
    total = int(rng.integers(sum(lo), sum(hi) + 1))
    sizes = get_allocator(name).allocate(random_models(rng, n), total, bounds)
    assert sum(sizes) == total
    assert all(isinstance(b, int) for b in sizes)
    assert all(l <= b <= h for b, l, h in zip(sizes, lo, hi))


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
def test_a_current_plan_outside_the_bounds_is_not_kept(name):
    # A cap lowered since the plan was made (rank 0 may now take 3): keeping the plan, with or without models,
    # would hand rank 0 more than it may take.
    caps = Bounds((1, 1), (3, 10))
    for models in ([None, None], [TimeModelParams(0.0, 0.002), TimeModelParams(0.0, 0.005)]):
        sizes = get_allocator(name).allocate(models, 7, caps, current=[5, 2])
        assert sum(sizes) == 7 and sizes[0] <= 3, (models, sizes)
    assert get_allocator(name).allocate([None, None], 7, Bounds.uniform(2), current=[5, 2]) in ([5, 2], [4, 3])


@pytest.mark.parametrize("name", ["proportional", "equal_finish", "lbb"])
def test_monotone_in_speed(name):
    # Same fixed cost, per-sample cost growing with rank: a slower rank never gets more samples.
    models = [TimeModelParams(0.005, 0.001 * (1 + k)) for k in range(5)]
    sizes = get_allocator(name).allocate(models, 500, Bounds.uniform(5))
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] > sizes[-1]


def test_equal_finish_balances_predicted_times():
    models = [TimeModelParams(0.01, 0.001), TimeModelParams(0.01, 0.001), TimeModelParams(0.01, 0.002),
              TimeModelParams(0.01, 0.004)]
    sizes = EqualFinishAllocator().allocate(models, 512, Bounds.uniform(4))
    t = predicted_times(models, sizes)
    assert max(t) - min(t) <= 0.004 + 1e-12  # within one sample of the slowest per-sample cost
    # no integer plan has a smaller makespan (brute force over neighbours)
    best = max(t)
    for i, j in itertools.permutations(range(4), 2):
        trial = list(sizes)
        trial[i] -= 1
        trial[j] += 1
        assert max(predicted_times(models, trial)) >= best - 1e-12


def test_equal_finish_clamps_and_resolves():
    models = [TimeModelParams(0.0, 0.001)] * 3 + [TimeModelParams(0.0, 0.1)]
    sizes = EqualFinishAllocator().allocate(models, 100, Bounds((1, 1, 1, 5), (30, 200, 200, 200)))
    assert sizes[0] == 30 and sizes[3] == 5 and sum(sizes) == 100
    assert abs(sizes[1] - sizes[2]) <= 1


def test_static_is_equal_split():
    assert get_allocator("static").allocate([None, None, None], 10, Bounds.uniform(3)) == [4, 3, 3]


def test_unknown_models_keep_current_plan():
    assert get_allocator("equal_finish").allocate([None, None], 10, Bounds.uniform(2), current=[7, 3]) == [7, 3]


def test_lbb_hysteresis_and_fine_tuning():
    models = [TimeModelParams(0.0, 0.001), TimeModelParams(0.0, 0.001)]
    lbb = LBBAllocator(tolerance=0.06, fine_threshold=0.15)
    assert lbb.allocate(models, 100, Bounds.uniform(2), current=[51, 49]) == [51, 49]  # level 0.04: keep
    assert lbb.allocate(models, 100, Bounds.uniform(2), current=[54, 46]) == [50, 50]  # fine +/-1 moves
    slow = [TimeModelParams(0.0, 0.001), TimeModelParams(0.0, 0.003)]
    assert lbb.allocate(slow, 100, Bounds.uniform(2), current=[50, 50]) == [75, 25]  # coarse re-solve
    # Ranks tied slowest (identical lines: noise-free emulation, one seeded profile per device type): no single
    # move lowers the spread, but moving one of them is progress; fine-tuning reaches the exact re-solve's split.
    tied = [TimeModelParams(0.0, 0.001)] * 2 + [TimeModelParams(0.0, 0.0011)] * 2
    assert lbb.allocate(tied, 400, Bounds.uniform(4), current=[100] * 4) == [105, 105, 95, 95]
    assert lbb.allocate(tied, 400, Bounds.uniform(4)) == [105, 105, 95, 95]


def test_largest_remainder():
    assert largest_remainder([2.6, 2.4, 5.0], 10, Bounds.uniform(3)) == [3, 2, 5]
    assert sum(largest_remainder([0.3] * 7, 7, Bounds.uniform(7))) == 7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_batch=3, bounds=Bounds.uniform(4, min_batch=1)), "global_batch`=3 is smaller than world size"),
        (dict(global_batch=50, bounds=Bounds.uniform(2, max_batch=10)), "exceeds the sum of per-rank maximum"),
    ],
)
def test_infeasible_bounds_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_allocator("equal_finish").allocate([TimeModelParams(0, 1e-3)] * kwargs["bounds"].world_size, **kwargs)


def test_bad_allocator_and_bounds():
    with pytest.raises(ValueError, match="`allocator` must be one of"):
        get_allocator("fastest")
    with pytest.raises(ValueError, match=r"min_batch\[0\]"):
        Bounds((0,), (4,))
    with pytest.raises(ValueError, match=r"max_batch\[1\]"):
        Bounds((1, 5), (4, 4))


@pytest.mark.parametrize("module", ["hetero_plugins.balancing.allocators", "hetero_plugins.balancing.planner",
                                    "hetero_plugins.balancing.time_model", "hetero_plugins.balancing.time_bank",
                                    "hetero_plugins.balancing.splits", "hetero_plugins.balancing.lines"])
def test_docstring_examples(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(module)).failed == 0


def test_equal_finish_time_is_the_equal_finish_makespan():
    from hetero_plugins.balancing.allocators import equal_finish_continuous, equal_finish_time

    models = [TimeModelParams(0.01, 0.001), TimeModelParams(0.02, 0.004), TimeModelParams(0.0, 0.002)]
    sizes = equal_finish_continuous(models, 700, Bounds.uniform(3))
    t = equal_finish_time([m.intercept for m in models], [m.slope for m in models], 700)
    assert all(m.predict(b) == pytest.approx(t) for m, b in zip(models, sizes))


def test_equal_finish_time_holds_a_rank_slower_than_the_step_at_its_floor():
    """A rank whose fixed cost (a long wait for data) exceeds the others' equal-finish time keeps its minimum
    batch and bounds the step; the unclamped formula gave it negative samples and a shorter step than any split."""
    from hetero_plugins.balancing.allocators import equal_finish_continuous, equal_finish_time

    models = [TimeModelParams(0.0, 0.001), TimeModelParams(0.0, 0.002), TimeModelParams(0.4, 0.001)]
    bounds = Bounds.uniform(3, min_batch=1)
    sizes = equal_finish_continuous(models, 300, bounds)
    t = equal_finish_time([m.intercept for m in models], [m.slope for m in models], 300)
    assert sizes[2] == pytest.approx(1.0)
    assert t == pytest.approx(max(m.predict(b) for m, b in zip(models, sizes)))
    assert t == pytest.approx(0.401)
    # any real split with every rank at >= 1 sample takes at least as long
    rng = np.random.default_rng(0)
    for _ in range(200):
        b = 1 + rng.dirichlet(np.ones(3)) * 297
        assert max(m.predict(x) for m, x in zip(models, b)) >= t - 1e-12
    # and with no rank at its floor it is the closed form
    assert equal_finish_time([0.0, 0.0], [0.001, 0.003], 400) == pytest.approx(0.3)
