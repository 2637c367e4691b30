"""The integer allocators against independent brute-force solvers, and the simulator's oracle against policies."""

import copy
import itertools

import numpy as np
import pytest

from hetero_plugins.balancing.allocators import (
    ALLOCATORS,
    Bounds,
    LBBAllocator,
    get_allocator,
    min_makespan_split,
    min_spread_split,
)
from hetero_plugins.balancing.time_model import TimeModelLines, TimeModelParams
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, load_scenario, oracle, simulate


def dp_min_makespan(a, s, total, lo, hi):
    """Shortest makespan by dynamic programming over ranks: best[u] = the shortest makespan of the ranks so far
    with u samples among them (every batch of every rank tried)."""
    best = np.full(total + 1, np.inf)
    best[0] = -np.inf
    for ai, si, l, h in zip(a, s, lo, hi):
        new = np.full(total + 1, np.inf)
        for b in range(int(l), int(h) + 1):
            if b > total:
                break
            new[b:] = np.minimum(new[b:], np.maximum(ai + si * b, best[: total + 1 - b]))
        best = new
    return best[total]


def enumerate_plans(total, lo, hi):
    ranges = [range(l, min(h, total) + 1) for l, h in zip(lo, hi)]
    for head in itertools.product(*ranges[:-1]):
        last = total - sum(head)
        if lo[-1] <= last <= hi[-1]:
            yield (*head, last)


def makespan(a, s, plan):
    return float(np.max(np.asarray(a) + np.asarray(s) * np.asarray(plan, dtype=np.float64)))


def random_case(rng, n_max=6, b_max=60):
    n = int(rng.integers(1, n_max + 1))
    kind = rng.integers(3)
    if kind == 0:  # a few device types, as in a real cluster (many exact ties)
        types = [(rng.integers(0, 12) / 1000, rng.integers(1, 13) / 2000) for _ in range(int(rng.integers(1, 4)))]
        a, s = map(np.array, zip(*[types[int(rng.integers(len(types)))] for _ in range(n)]))
    elif kind == 1:
        a, s = rng.uniform(0, 0.02, n), rng.uniform(1e-4, 5e-3, n)
    else:  # very different speeds, fixed costs larger than whole steps of other ranks
        a, s = rng.uniform(0, 0.5, n) * (rng.random(n) < 0.5), np.exp(rng.uniform(np.log(1e-5), np.log(1e-1), n))
    lo = rng.integers(1, 4, n)
    hi = lo + rng.integers(0, b_max, n)
    if rng.random() < 0.2:
        hi[:] = 2**31 - 1  # unbounded ranks
    total = int(rng.integers(lo.sum(), min(hi.sum(), lo.sum() + b_max * n) + 1))
    return a.astype(float), s.astype(float), total, lo, hi


def test_min_makespan_matches_dynamic_programming_on_thousands_of_cases():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        a, s, total, lo, hi = random_case(rng)
        plan = min_makespan_split(a, s, total, lo, hi)
        assert plan.sum() == total and np.all(plan >= lo) and np.all(plan <= hi), (a, s, total, lo, hi, plan)
        assert makespan(a, s, plan) == dp_min_makespan(a, s, total, lo, np.minimum(hi, total)), (a, s, total, lo, hi)


def test_the_issue_line_set_is_solved_exactly_for_every_global_batch():
    # Six ranks of three types; the +/-1 rounding that stopped at the first tie was up to 13% slower here.
    a = np.array([5, 5, 6, 6, 10, 10]) / 1000
    s = np.array([0.5, 0.5, 1.2, 1.2, 6, 6]) / 1000
    models = [TimeModelParams(x, y) for x, y in zip(a, s)]
    for total in range(64, 1025, 7):
        bounds = Bounds.uniform(6)
        plan = get_allocator("equal_finish").allocate(models, total, bounds)
        assert makespan(a, s, plan) == dp_min_makespan(a, s, total, [1] * 6, [total] * 6), total


@pytest.mark.parametrize("name", ["static", "proportional", "equal_finish"])
def test_each_allocator_is_exact_for_its_own_lines(name):
    # static: every rank the same line; proportional: b_i / v_i with v_i the speed at the mean batch;
    # equal_finish: the fitted lines themselves.
    rng = np.random.default_rng(1)
    for _ in range(300):
        a, s, total, lo, hi = random_case(rng, n_max=5, b_max=40)
        models = [TimeModelParams(x, y) for x, y in zip(a, s)]
        plan = get_allocator(name).allocate(models, total, Bounds(tuple(map(int, lo)), tuple(map(int, hi))))
        if name == "static":
            ea, es = np.zeros(len(a)), np.ones(len(a))
        elif name == "proportional":
            ref = total / len(a)
            ea, es = np.zeros(len(a)), (a + s * ref) / ref
        else:
            ea, es = a, s
        assert makespan(ea, es, plan) == pytest.approx(dp_min_makespan(ea, es, total, lo, np.minimum(hi, total)),
                                                       rel=1e-12)


def test_min_spread_matches_enumeration():
    rng = np.random.default_rng(2)
    for _ in range(600):
        a, s, total, lo, hi = random_case(rng, n_max=4, b_max=12)
        hi = np.minimum(hi, total)
        plan = min_spread_split(a, s, total, lo, hi)
        assert plan is not None and plan.sum() == total and np.all(plan >= lo) and np.all(plan <= hi)
        best = min((float(np.ptp(a + s * np.array(p))), makespan(a, s, p)) for p in enumerate_plans(total, lo, hi))
        t = a + s * plan
        assert float(np.ptp(t)) == pytest.approx(best[0], abs=1e-12), (a, s, total, lo, hi, plan)
        assert makespan(a, s, plan) == pytest.approx(best[1], abs=1e-12)


def test_lbb_re_plans_exactly_and_keeps_its_hysteresis():
    rng = np.random.default_rng(3)
    for _ in range(200):
        a, s, total, lo, hi = random_case(rng, n_max=4, b_max=12)
        hi = np.minimum(hi, total)
        bounds = Bounds(tuple(map(int, lo)), tuple(map(int, hi)))
        plan = LBBAllocator().allocate([TimeModelParams(x, y) for x, y in zip(a, s)], total, bounds)
        best = min(float(np.ptp(a + s * np.array(p))) for p in enumerate_plans(total, lo, hi))
        assert float(np.ptp(a + s * np.array(plan))) == pytest.approx(best, abs=1e-12)
    same = [TimeModelParams(0.0, 0.001)] * 2
    assert LBBAllocator().allocate(same, 100, Bounds.uniform(2), current=[51, 49]) == [51, 49]


@pytest.mark.parametrize("name", sorted(set(ALLOCATORS) - {"dqn", "auto"}))
def test_array_lines_and_parameter_lists_give_the_same_plan(name):
    rng = np.random.default_rng(4)
    a, s = rng.uniform(0, 0.01, 50), rng.uniform(1e-4, 3e-3, 50)
    lines = TimeModelLines(a, s, np.ones(50, dtype=bool))
    listed = [TimeModelParams(float(x), float(y)) for x, y in zip(a, s)]
    bounds = Bounds.uniform(50, max_batch=300)
    assert get_allocator(name).allocate(lines, 4000, bounds) == get_allocator(name).allocate(listed, 4000, bounds)


def test_bad_lines_name_the_argument():
    with pytest.raises(ValueError, match="slope.*HINT"):
        min_makespan_split([0.0, 0.0], [0.001, 0.0], 10, [1, 1], [10, 10])
    with pytest.raises(ValueError, match="global_batch`=30 is outside.*HINT"):
        min_makespan_split([0.0, 0.0], [0.001, 0.002], 30, [1, 1], [10, 10])
    with pytest.raises(ValueError, match="one entry per rank"):
        min_makespan_split([0.0], [0.001, 0.002], 3, [1, 1], [10, 10])


def noise_free(spec):
    spec = copy.deepcopy(spec)
    spec["noise"] = 0.0
    return spec


def random_scenario(rng, events=True, noise=0.0, epochs=8, steps=6):
    """A random cluster in the scenario JSON schema, validated by load_scenario."""
    devices = {f"d{k}": {"overhead": float(rng.uniform(0.001, 0.02)), "cost_per_sample": float(rng.uniform(1e-4, 4e-3)),
                         "memory_samples": int(rng.integers(64, 1024))} for k in range(int(rng.integers(1, 4)))}
    names = sorted(devices)
    n = int(rng.integers(2, 9))
    ranks = [{"device": names[int(rng.integers(len(names)))], "corunner": None,
              "data": float(rng.choice([0.0, 0.0, rng.uniform(0, 0.01)]))} for _ in range(n)]
    cap = sum(devices[r["device"]]["memory_samples"] for r in ranks)
    spec = {"name": "random", "devices": devices, "ranks": ranks,
            "global_batch": int(rng.integers(n, min(cap, 64 * n) + 1)), "epochs": epochs, "steps_per_epoch": steps,
            "noise": noise, "seed": int(rng.integers(1000)),
            "interference": {"video": {d: float(rng.uniform(1.1, 2.0)) for d in names}}, "events": []}
    if events:
        for _ in range(int(rng.integers(0, 4))):
            e, r = int(rng.integers(1, epochs)), int(rng.integers(n))
            kind = rng.integers(3)
            if kind == 0:
                spec["events"].append({"epoch": e, "rank": r, "speed": float(rng.uniform(0.5, 2.5))})
            elif kind == 1:
                spec["events"].append({"epoch": e, "rank": r, "corunner": "video"})
            else:
                spec["events"].append({"epoch": e, "rank": r, "ramp": float(rng.uniform(1.2, 2.5)), "over": 3})
    return load_scenario(spec)


POLICIES = ["static", "proportional", "equal_finish", "lbb", "dqn", "auto"]


@pytest.mark.parametrize("name", ["paper_mix", "static_mix", "interference", "dynamic", "elastic"])
def test_the_oracle_bounds_every_policy_on_every_epoch(name):
    spec = noise_free(BUILTIN_SCENARIOS[name])
    best = oracle(spec)["epoch_times"]
    for policy in POLICIES:
        times = simulate(spec, policy)["epoch_times"]
        slower = [e for e, (t, o) in enumerate(zip(times, best)) if t < o * (1 - 1e-12)]
        assert not slower, (policy, [(e, times[e], best[e]) for e in slower])


def test_the_oracle_bounds_every_policy_on_random_scenarios():
    rng = np.random.default_rng(5)
    for _ in range(12):
        sc = random_scenario(rng)
        best = oracle(sc)["epoch_times"]
        for policy in ("proportional", "equal_finish", "lbb", "auto"):
            times = simulate(sc, policy)["epoch_times"]
            assert all(t >= o * (1 - 1e-12) for t, o in zip(times, best)), (sc, policy, times, best)
