"""Plans that stay put under noise, and move by a bounded factor when the models are wrong."""

import copy

import numpy as np
import pytest

from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, load_scenario, oracle, simulate
from tests.test_exact_allocator import random_scenario

BUILTIN = ["paper_mix", "static_mix", "interference", "dynamic", "elastic"]


def constant_speeds(spec, noise=0.05, epochs=30):
    spec = copy.deepcopy(spec)
    spec.update(noise=noise, epochs=epochs, events=[])
    spec.pop("free_slots", None)
    return spec


def changes(plans, after=0):
    return [e for e in range(max(1, after), len(plans)) if plans[e] != plans[e - 1]]


@pytest.mark.parametrize("name", BUILTIN)
def test_a_converged_plan_stays_put_under_five_percent_noise(name):
    spec = constant_speeds(BUILTIN_SCENARIOS[name])
    for seed in range(2):
        plans = simulate(spec, "equal_finish", seed=seed)["plans"]
        assert changes(plans, after=6) == [], (seed, changes(plans))


def test_a_converged_plan_stays_put_on_random_clusters():
    rng = np.random.default_rng(21)
    for _ in range(10):
        sc = random_scenario(rng, events=False, noise=0.05, epochs=30, steps=20)
        plans = simulate(sc, "equal_finish")["plans"]
        assert changes(plans, after=12) == [], (sc, changes(plans))


def moves_are_bounded(plans, factor=8.0):
    for old, new in zip(plans, plans[1:]):
        if len(old) != len(new):
            continue  # a restart with another world size
        for b0, b1 in zip(old, new):
            assert abs(b1 - b0) <= 1 or b0 / factor <= b1 <= b0 * factor, (old, new)


@pytest.mark.parametrize("name", BUILTIN)
def test_every_re_plan_moves_a_batch_by_a_bounded_factor(name):
    for policy in ("equal_finish", "proportional", "lbb", "auto"):
        moves_are_bounded(simulate(BUILTIN_SCENARIOS[name], policy)["plans"])


def test_every_re_plan_moves_a_batch_by_a_bounded_factor_on_random_clusters():
    rng = np.random.default_rng(22)
    for _ in range(10):
        sc = random_scenario(rng, noise=0.05)
        for policy in ("equal_finish", "lbb"):
            moves_are_bounded(simulate(sc, policy)["plans"])


SWING = {
    "name": "swing", "global_batch": 384, "epochs": 10, "steps_per_epoch": 20, "noise": 0.05,
    "devices": {"fast": {"overhead": 0.005, "cost_per_sample": 0.0006, "memory_samples": 1024},
                "slow": {"overhead": 0.006, "cost_per_sample": 0.0012, "memory_samples": 1024}},
    "ranks": [{"device": "fast", "count": 2}, {"device": "slow", "count": 2}],
    "interference": {"video": {"fast": 1.3, "slow": 1.3}},
    # Co-runners arrive at the epoch boundary where the plan first changes.
    "events": [{"epoch": 1, "rank": 0, "corunner": "video"}, {"epoch": 1, "rank": 2, "corunner": "video"}],
}


@pytest.mark.parametrize("seed", range(3))
def test_a_slowdown_hidden_by_a_plan_change_costs_one_epoch_not_a_swinging_plan(seed):
    # Fitted through both regimes, the models once sent plans from 65 to 1 sample and back, epochs up to
    # 2.8x the oracle's. Now the first plan after the hidden change is a few percent off (the change cannot
    # be seen at one batch size), the change is found at the next, and the plan after that is right and stays.
    sc = load_scenario(SWING)
    out, best = simulate(sc, "equal_finish", seed=seed), oracle(sc, seed=seed)
    ratio = np.array(out["epoch_times"]) / np.array(best["epoch_times"])
    assert np.all(ratio[2:] < 1.1) and np.all(ratio[4:] < 1.05), ratio
    assert changes(out["plans"], after=5) == []


def fake_epoch(plan, seconds_per_sample, overhead=0.002, steps=20, rng=None, noise=0.0):
    rec = np.zeros((len(plan), steps, 3))
    for r, (b, c) in enumerate(zip(plan, seconds_per_sample)):
        rec[r, :, 0] = b
        rec[r, :, 1] = (overhead + c * b) * (1.0 if rng is None else np.exp(rng.normal(0, noise, steps)))
    return rec


def test_a_single_bad_fit_moves_a_batch_by_at_most_the_factor_then_moves_damp():
    p = BalancePlanner(2, 200)  # max_change_factor=8
    p.end_epoch(0, fake_epoch(p.plan, [0.001, 0.001]))
    assert p.plan == [100, 100]
    p.seed_model(1, (0.0, 1e-6))  # a wildly wrong line: rank 1 looks 1000x faster
    p.replan()
    assert p.plan == [13, 187]  # rank 0 at most 8x down
    p.seed_model(1, (0.0, 1.0))  # now wildly slow
    p.replan()
    assert p.plan == [104, 96]  # rank 0 at most 8x up; back the way it came, so the factor becomes sqrt(8)
    p.seed_model(1, (0.0, 1e-6))
    p.replan()
    assert p.plan == [37, 163]  # 104 / 2.83; reversed again: 8 ** (1 / 4) = 1.68
    p.seed_model(1, (0.0, 1.0))
    p.replan()
    assert p.plan == [62, 138]  # 37 * 1.68


def test_without_a_limit_a_bad_fit_moves_the_plan_to_an_extreme():
    p = BalancePlanner(2, 200, max_change_factor=None)
    p.end_epoch(0, fake_epoch(p.plan, [0.001, 0.001]))
    p.seed_model(1, (0.0, 1e-6))
    p.replan()
    assert p.plan[0] < 5


def test_the_noise_margin_keeps_a_converged_plan():
    speeds = [0.0005] * 4 + [0.001] * 4

    def changes_after_convergence(margin):
        moved = 0
        for seed in range(5):
            rng = np.random.default_rng(seed)
            p = BalancePlanner(8, 256, noise_margin=margin)
            for epoch in range(40):
                entry = p.end_epoch(epoch, fake_epoch(p.plan, speeds, rng=rng, noise=0.05))
                moved += epoch >= 4 and entry["plan_changed"]
        return moved

    assert changes_after_convergence(1.0) == 0
    assert changes_after_convergence(0.0) >= 5  # comparing point predictions, noise moves the plan again and again


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(max_change_factor=1.0), "max_change_factor"), (dict(max_change_factor=0.5), "max_change_factor"),
     (dict(noise_margin=-1.0), "noise_margin")],
)
def test_bad_damping_options_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BalancePlanner(2, 64, **kwargs)


def test_damping_state_survives_a_checkpoint():
    p = BalancePlanner(2, 200)
    p.end_epoch(0, fake_epoch(p.plan, [0.001, 0.001]))
    p.seed_model(1, (0.0, 1e-6))
    p.replan()
    p.seed_model(1, (0.0, 1.0))
    p.replan()
    q = BalancePlanner(2, 200)
    q.load_state_dict(p.state_dict())
    for planner in (p, q):
        planner.seed_model(1, (0.0, 1e-6))
        planner.replan()
    assert q.plan == p.plan
