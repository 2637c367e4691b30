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


def test_epoch_statistics_match_the_metrics_functions():
    from hetero_plugins.metrics import idle_fraction, straggler_level

    rng = np.random.default_rng(4)
    rec = fake_epoch([40, 30, 20, 38], [1, 0.8, 0.5, 1.1], steps=7, rng=rng)
    rec[2, 3, 0] = 0  # a rank without a batch at step 3: that step is left out
    e = BalancePlanner(4, 128).end_epoch(0, rec, epoch_time=1.0)
    steps = [k for k in range(7) if k != 3]
    t = rec[:, steps, 1]
    assert e["straggler_level"] == pytest.approx(np.median([straggler_level(t[:, k]) for k in range(6)]))
    assert e["idle_fraction"] == pytest.approx(np.median([idle_fraction(t[:, k]) for k in range(6)]))
    assert e["compute_time"] == pytest.approx(np.median(t, axis=1).tolist())
    assert e["throughput"] == pytest.approx((rec[:, steps, 0].sum(1) / t.sum(1)).tolist())


def test_models_are_views_and_a_new_list_is_copied_in():
    from hetero_plugins.balancing.time_model import LinearTimeModel

    p = BalancePlanner(3, 96)
    p.end_epoch(0, fake_epoch(p.plan, [1.0, 0.5, 0.25]))
    before = [m.params() for m in p.models]
    keep = list(p.models)
    p.models = [keep[2], LinearTimeModel(half_life=keep[0].half_life), keep[0]]  # re-ordered ranks, one new
    assert [m.params() for m in p.models] == [before[2], None, before[0]]
    assert p.model_params()[0] == before[2] and not p.model_params().known[1]
    with pytest.raises(ValueError, match="3 time models"):
        p.models = keep[:2]


def test_a_deep_copy_learns_on_its_own_and_its_models_follow_it():
    """A copied planner (rollouts, simulator forks) reads its models from its own bank: what it observes shows in
    ``models`` and in its checkpoint, and nothing reaches the original."""
    import copy

    p = BalancePlanner(3, 96)
    p.end_epoch(0, fake_epoch(p.plan, [1.0, 0.5, 0.25]))
    before = p.state_dict()
    q = copy.deepcopy(p)
    twin = BalancePlanner(3, 96)
    twin.load_state_dict(before)
    for planner in (q, twin):
        planner.end_epoch(1, fake_epoch(planner.plan, [0.25, 0.5, 1.0]))
    assert [m.params() for m in q.models] == list(q.model_params()) == list(twin.model_params())
    assert [s["observations"] for s in q.state_dict()["models"]] == [
        s["observations"] for s in twin.state_dict()["models"]] != [s["observations"] for s in before["models"]]
    assert p.state_dict()["models"] == before["models"]


def data_epochs(planner, data, epochs=4, steps=10, rng=None):
    """Two equally fast ranks; rank r waits ``data[r]`` seconds for each batch. Returns the step times."""
    times = []
    for epoch in range(epochs):
        rec = fake_epoch(planner.plan, [1.0, 1.0], steps=steps, rng=rng)
        rec[:, :, 2] = np.asarray(data, dtype=np.float64)[:, None]
        times.append(float(np.max(rec[:, :, 1] + rec[:, :, 2], axis=0).mean()))
        planner.end_epoch(epoch, rec, epoch_time=times[-1] * steps)
    return times


def test_a_rank_that_waits_for_data_gets_fewer_samples():
    # A step ends when the slowest rank has loaded its batch and computed on it: rank 1 waits 40 ms for each
    # batch, so with equal compute speeds the shortest step gives it 20 samples fewer (1 ms per sample).
    p = BalancePlanner(2, 128)
    times = data_epochs(p, [0.0, 0.04], rng=np.random.default_rng(0))
    assert p.plan[0] - p.plan[1] == pytest.approx(40, abs=3), p.plan
    assert p.data_time == pytest.approx([0.0, 0.04])
    assert times[-1] < 0.93 * times[0]  # 0.106 s -> ~0.086 s
    lines = p.decision_lines()
    assert lines.intercept[1] - lines.intercept[0] == pytest.approx(0.04, rel=0.05)
    assert p.model_params().intercept[1] < 0.01  # the fitted line stays compute-only (true: 2 ms)
    # Without counting it, the split is on compute alone: equal.
    q = BalancePlanner(2, 128, count_data_time=False)
    data_epochs(q, [0.0, 0.04], rng=np.random.default_rng(0))
    assert abs(q.plan[0] - q.plan[1]) <= 2, q.plan


def test_data_time_is_checkpointed_seeded_and_checked():
    p = BalancePlanner(2, 128)
    data_epochs(p, [0.0, 0.04], epochs=2)
    q = BalancePlanner(2, 128)
    q.load_state_dict(p.state_dict())
    assert q.data_time == pytest.approx(p.data_time) and q.plan == p.plan
    q.seed_model(1, (0.002, 0.001), data_time=0.0)  # relocated where its input waits no longer
    assert q.data_time == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match=r"`data_time` must hold 2 .*HINT"):
        q.data_time = [0.1]
    with pytest.raises(ValueError, match="data_time"):
        q.seed_model(0, (0.002, 0.001), data_time=-1.0)


def test_a_rank_that_never_reported_is_skipped_not_a_crash():
    """NaN rows (a rank with no records, ragged step counts padded) leave the metrics of the steps every rank
    reported and the plan; the samples count what was reported."""
    p = BalancePlanner(2, 64)
    rec = fake_epoch([32, 32], [1.0, 0.5])
    rec[1, 3:] = np.nan
    entry = p.end_epoch(0, rec, epoch_time=1.0)
    assert entry["samples"] == 32 * 10 + 32 * 3
    assert entry["straggler_level"] > 0.3 and np.isfinite(entry["idle_fraction"])
    assert sum(entry["next_batch_sizes"]) == 64 and entry["next_batch_sizes"][0] > 32


def test_bad_memory_caps_are_refused_by_name_and_change_nothing():
    p = BalancePlanner(2, 64)
    rec = fake_epoch([32, 32], [1.0, 0.5])
    assert p.end_epoch(0, rec, memory_caps=[np.int64(40), None])["next_batch_sizes"] == [40, 24]  # NumPy ints
    for caps, match in (([40.0, None], r"`memory_caps\[0\]` must be an int, got 40.0"),
                        ([10, 10], r"`memory_caps`=\[10, 10\] hold 20 samples, fewer than the global batch 64"),
                        ([5], r"`memory_caps` has 1 entries for 2 ranks")):
        with pytest.raises(ValueError, match=match):
            p.end_epoch(1, rec, memory_caps=caps)
        assert p.memory_caps == [40, None] and len(p.history) == 1
    assert sum(p.end_epoch(1, rec)["next_batch_sizes"]) == 64  # the planner goes on with the caps it had


def test_an_initial_plan_above_the_largest_batch_is_refused():
    with pytest.raises(ValueError, match=r"`initial_plan`=\[60, 4\] .* between 1 and 40"):
        BalancePlanner(2, 64, max_batch_size=40, initial_plan=[60, 4])
    assert BalancePlanner(2, 64, max_batch_size=40, initial_plan=[40, 24]).plan == [40, 24]


def test_a_relocated_rank_gets_its_share_at_once_and_is_damped_again_once_measured():
    """A rank seeded on a new device (a relocation) is re-split to what its predicted line is worth, past the
    ``max_change_factor`` its old place's batch would allow: the move's predicted gain assumed that re-split (a
    five-rank validation cluster kept a rank moved to a free fast slot at 16 of 1280 samples and lost the restart
    cost: 0.98x no relocation). Once measured it is damped again."""

    def rec(plan, per_sample):
        r = np.zeros((2, 6, 3))
        r[:, :, 0] = np.asarray(plan)[:, None]
        r[:, :, 1] = (np.asarray(plan) * np.asarray(per_sample))[:, None]
        return r

    p = BalancePlanner(2, 256, warmup_steps=0)
    p.end_epoch(0, rec([128, 128], [0.001, 0.032]))
    p.end_epoch(1, rec(p.plan, [0.001, 0.032]))
    slow = list(p.plan)
    assert slow[1] <= 10  # 32x slower: a few samples
    p.seed_model(1, (0.0, 0.001), batch_size=256)  # moved to a device as fast as rank 0's
    p.replan()
    assert p.plan == [128, 128], (slow, p.plan)  # not 8x its old batch at most
    p.end_epoch(2, rec([128, 128], [0.001, 0.001]))
    p.end_epoch(3, rec([128, 128], [0.001, 0.064]))  # measured there, then 64x slower: damped to 8x down at most
    assert p.plan[1] == 16, p.plan


def test_bad_ranks_steps_backlogs_and_shares_are_refused_by_name():
    from hetero_plugins.balancing.allocators import Bounds, largest_remainder, reroute_backlog
    from hetero_plugins.balancing.time_model import TimeModelBank

    p = BalancePlanner(2, 16)
    rec = np.array([[[8, 0.01, 0]] * 4, [[8, 0.02, 0]] * 4], dtype=np.float64)
    with pytest.raises(ValueError, match="`rank`=5 is not a rank"):
        p.seed_model(5, (0.0, 0.001))
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="observed_steps"):
            p.end_epoch(0, rec, observed_steps=bad)
    assert p.history == []  # refused before anything was learned
    with pytest.raises(ValueError, match="backlog"):
        p.plan_with_backlog([3.0])
    bank = TimeModelBank(2)
    for bad in ([-1], [2], [0.5]):  # -1 once updated the last rank; 0.5 once forgot rank 0
        with pytest.raises(ValueError, match="`rows`"):
            bank.observe(np.array([8.0]), np.array([0.01]), rows=bad)
        with pytest.raises(ValueError, match="`rows`"):
            bank.forget_levels(bad)
    with pytest.raises(ValueError, match="shares"):  # an infinite share once looped for ever
        largest_remainder([np.inf, 1.0], 4, Bounds.uniform(2))
    assert reroute_backlog([8, 8], [0, 0], Bounds.uniform(2), 16) == [8, 8]
