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


def _wobbly(plan, slopes, wobble=0.1, steps=12):
    """Step records with a fixed cost of 10 samples and step noise alternating by +-``wobble``."""
    b = np.asarray(plan, dtype=np.float64)
    rec = np.zeros((2, steps, 3))
    rec[:, :, 0] = b[:, None]
    rec[:, :, 1] = ((b + 10) * np.asarray(slopes))[:, None] * np.array([1 - wobble, 1 + wobble] * (steps // 2))
    return rec


@pytest.mark.parametrize(("jump", "moves"), [(1.0, False), (1.12, False), (1.2, True)])
def test_a_rank_that_drifts_off_its_measured_level_is_not_held_by_the_noise_margin(jump, moves):
    """Two equal ranks measured under +-10% step noise at [64, 64]; then rank 1 runs ``jump`` slower at the same
    batch. 20% is beyond its noise (2.5 standard errors): its own margin is waived, and the 8% predicted gain of
    moving samples off it is taken (the margin on both ranks held it: the plan stayed while the rank grew slower).
    12% is within the noise: the margin holds, as it must under noise alone."""
    p = BalancePlanner(2, 128, warmup_steps=0)
    for epoch in range(3):
        p.end_epoch(epoch, _wobbly(p.plan, [1e-3, 1e-3]))
    entry = p.end_epoch(3, _wobbly(p.plan, [1e-3, 1e-3 * jump]))
    assert entry["plan_changed"] is moves
    assert p.state_dict()["drift"] == [0, int(moves)]
    if moves:
        assert entry["predicted_gain"] < 0.1 and p.plan[1] < 64
    resumed = BalancePlanner(2, 128, warmup_steps=0)
    resumed.load_state_dict(p.state_dict())
    assert resumed.state_dict()["drift"] == [0, int(moves)]  # a checkpoint between steps and decision keeps it
