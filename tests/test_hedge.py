"""Hedged co-runner corrections: the quantile that minimises the expected makespan, against a brute-force
reference, and the allocators' use of it."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from hetero_plugins.balancing.allocators import Bounds, min_makespan_split
from hetero_plugins.balancing.time_model import TimeModelParams as P
from hetero_plugins.scheduler.hedge import hedged_factors
from hetero_plugins.scheduler.policy import AutoAllocator, DQNAllocator

_N = NormalDist()


def _expected_makespan(b: float, total: float, f: float, s_i: float, s_rest: float, sigma: float) -> float:
    """E[max(X s_i b, s_rest (total - b))] for X = f exp(sigma Z), in closed form: c + E[(a X - c)+] (a call
    option's price under a log-normal, with a = s_i b and c = s_rest (total - b))."""
    a, c = s_i * b, s_rest * (total - b)
    if a <= 0 or c <= 0:
        return c + a * f * math.exp(sigma * sigma / 2.0)
    d = math.log(c / (a * f)) / sigma
    return c + a * f * math.exp(sigma * sigma / 2.0) * _N.cdf(sigma - d) - c * _N.cdf(-d)


@pytest.mark.parametrize("seed", range(8))
def test_hedged_split_is_near_the_brute_force_expected_makespan_optimum(seed):
    """One corrected rank against the rest of the cluster (one line): the split on the hedged factor is the
    expected makespan's minimum over every split (found on a grid of 0.01 samples, to 1e-6), where the split on
    the point correction loses up to 10% when the rank is small."""
    rng = np.random.default_rng(seed)
    total, spread = 1000.0, 0.25
    f, s_i, s_rest = float(np.exp(rng.uniform(-1.0, 1.0))), rng.uniform(0.5, 5.0), rng.uniform(0.01, 2.0)
    sigma = spread * abs(np.log(f))
    point = s_rest * total / (f * s_i + s_rest)  # both sides finish together on the point correction
    share = (1.0 / (f * s_i)) / (1.0 / (f * s_i) + 1.0 / s_rest)
    hedged = hedged_factors(np.array([f, 1.0]), np.array([share, 1.0 - share]), None, spread, max_z=8.0)[0]
    b_hedged = s_rest * total / (hedged * s_i + s_rest)
    grid = np.linspace(0.0, total, 100001)
    best = min(_expected_makespan(b, total, f, s_i, s_rest, sigma) for b in grid)
    e_point = _expected_makespan(point, total, f, s_i, s_rest, sigma)
    e_hedged = _expected_makespan(b_hedged, total, f, s_i, s_rest, sigma)
    assert e_hedged <= e_point + 1e-12
    assert e_hedged <= best * (1.0 + 1e-6)


def test_hedge_moves_each_group_by_its_share_and_never_past_a_speed_up():
    f = np.array([1.0, 2.0, 2.0, 0.5, 2.0])
    shares = np.array([0.1, 0.05, 0.05, 0.2, 0.6])
    alone = hedged_factors(f, shares, None, 0.3)
    assert alone[0] == 1.0  # no change, no hedge
    assert 2.0 < alone[1] == alone[2] and alone[4] < 2.0  # a rank with 60% of the work: below the median
    assert 0.5 < alone[3] < 1.0
    grouped = hedged_factors(f, shares, ["a", "g", "g", "b", "c"], 0.3)
    assert 2.0 < grouped[1] == grouped[2] < alone[1]  # erring together, the pair carries 10%: a lower quantile
    assert hedged_factors(np.array([0.2, 1.0]), np.array([1e-6, 1.0]), None, 5.0)[0] == 1.0  # capped at 1
    assert hedged_factors(f, np.full(5, 0.2), None, 0.0).tolist() == f.tolist()
    with pytest.raises(ValueError, match="spread"):
        hedged_factors(f, np.full(5, 0.2), None, -0.1)


class _Table:
    def predict(self, workload: str, device: str, corunner: str | None) -> float:
        return {None: 1.0, "video": 2.0}[corunner]


@pytest.mark.parametrize("cls", [DQNAllocator, AutoAllocator])
def test_allocators_plan_a_small_corrected_rank_at_the_hedged_quantile(cls):
    """Seven fast ranks and a slow one beside which a co-runner arrives (2x): with ``hedge`` the slow rank is
    planned on the hedged factor (fewer samples than the point correction gives), the split stays exact on the
    hedged lines and keeps the global batch; ``hedge=0`` is the point correction's split."""
    models = [P(0.002, 0.0005)] * 7 + [P(0.002, 0.004)]
    a, s = np.array([m.intercept for m in models]), np.array([m.slope for m in models])
    ctx = {"devices": ["v100"] * 7 + ["t4"], "corunners": [None] * 8, "next_corunners": [None] * 7 + ["video"]}
    bounds = Bounds.uniform(8)
    plans = {}
    for hedge in (0.0, 0.3):
        alloc = cls(interference=_Table(), hedge=hedge)
        alloc.set_context(**ctx)
        plans[hedge] = alloc.allocate(models, 1024, bounds)
        assert sum(plans[hedge]) == 1024
        f_used, _ = alloc.lines(models, 8)
        f_rank = f_used[7] / a[7]
        assert plans[hedge] == min_makespan_split(a * np.r_[np.ones(7), f_rank], s * np.r_[np.ones(7), f_rank], 1024,
                                                  bounds.min_batch, bounds.max_batch).tolist()
    f = np.r_[np.ones(7), 2.0]
    assert plans[0.0] == min_makespan_split(a * f, s * f, 1024, bounds.min_batch, bounds.max_batch).tolist()
    assert plans[0.3][7] < plans[0.0][7]
    with pytest.raises(ValueError, match="hedge"):
        cls(hedge=-1.0)
