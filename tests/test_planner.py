import numpy as np
import pytest

from hetero_plugins.balancing.planner import BalancePlanner


def fake_epoch(plan, speeds, steps=10, cost=0.001, overhead=0.002, rng=None):
    rec = np.zeros((len(plan), steps, 3))
    for r, (b, s) in enumerate(zip(plan, speeds)):
        noise = 1.0 if rng is None else rng.uniform(0.97, 1.03, steps)
        rec[r, :, 0] = b
        rec[r, :, 1] = (overhead + cost * b / s) * noise
    return rec


def test_converges_to_speed_proportional_plan():
    rng = np.random.default_rng(0)
    speeds = [1, 1, 0.5, 0.25]
    p = BalancePlanner(4, 128)
    for epoch in range(4):
        p.end_epoch(epoch, fake_epoch(p.plan, speeds, rng=rng), epoch_time=1.0)
    assert sum(p.plan) == 128
    ideal = [128 * s / sum(speeds) for s in speeds]
    assert all(abs(b - i) <= 3 for b, i in zip(p.plan, ideal)), p.plan
    assert p.history[0]["straggler_level"] > 1.0 and p.history[-1]["straggler_level"] < 0.15


def test_damping_keeps_plan_for_small_gains():
    p = BalancePlanner(2, 64, min_gain=0.05)
    p.end_epoch(0, fake_epoch([32, 32], [1.0, 0.97]), epoch_time=1.0)
    assert p.plan == [32, 32]
    assert p.history[0]["plan_changed"] is False


def test_memory_caps_bound_the_plan():
    p = BalancePlanner(2, 64)
    p.end_epoch(0, fake_epoch([32, 32], [1.0, 0.25]), memory_caps=[40, None])
    assert p.plan == [40, 24]


def test_history_and_state_round_trip():
    p = BalancePlanner(2, 64)
    e = p.end_epoch(0, fake_epoch([32, 32], [1.0, 0.5]), epoch_time=2.0)
    assert set(e) >= {"epoch", "batch_sizes", "throughput", "straggler_level", "predicted_epoch_time",
                      "measured_epoch_time", "samples_per_s", "next_batch_sizes"}
    assert e["samples_per_s"] == pytest.approx(640 / 2.0)
    e1 = p.end_epoch(1, fake_epoch(p.plan, [1.0, 0.5]), epoch_time=1.5)
    assert e1["predicted_epoch_time"] == pytest.approx(max(np.median(fake_epoch(p.plan, [1.0, 0.5])[:, :, 1], axis=1)) * 10, rel=0.05)
    q = BalancePlanner(2, 64)
    q.load_state_dict(p.state_dict())
    assert q.plan == p.plan and q.history == p.history and q.model_params() == p.model_params()
    with pytest.raises(ValueError, match="world_size=2, global_batch=64"):
        BalancePlanner(3, 64).load_state_dict(p.state_dict())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=4, global_batch=3), "smaller than world size x minimum batch"),
        (dict(world_size=2, global_batch=64, min_batch_size=0), "min_batch_size"),
        (dict(world_size=2, global_batch=64, min_gain=2.0), "min_gain"),
        (dict(world_size=2, global_batch=64, allocator="magic"), "allocator"),
        (dict(world_size=2, global_batch=64, initial_plan=[10, 10]), "initial_plan"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BalancePlanner(**kwargs)
