"""Change points at any batch size: a speed change that coincides with a plan change is found."""

import copy

import numpy as np
import pytest

from hetero_plugins.balancing.time_model import LinearTimeModel, TimeModelBank

# A rank's true line before a co-runner arrives (fixed 5 ms, 0.6 ms per sample), and 1.3x slower after.
A, S, SLOW = 0.005, 0.000599, 1.3


def true_time(b, factor=1.0):
    return factor * (A + S * b)


def solo_model(seed):
    """A model measured solo at 64 and 123 samples (20 steps each) under 5% noise, and that noise's source."""
    rng = np.random.default_rng(seed)
    noise = lambda: float(np.exp(rng.normal(0, 0.05)))  # noqa: E731
    m = LinearTimeModel()
    for b in (64, 123):
        for _ in range(20):
            m.observe(b, true_time(b) * noise())
    return m, noise


def max_rel_error(model, factor, sizes=(48, 64, 90, 123, 300, 512)):
    # From half the smallest batch seen to 4x the largest: below, a fixed cost of 5 ms learned under 5%
    # noise from batches of 64 and 123 is too uncertain for 10% (in any estimator).
    return max(abs(model.predict(b) / true_time(b, factor) - 1) for b in sizes)


@pytest.mark.parametrize("seed", range(10))
def test_a_slowdown_at_a_new_batch_size_converges_within_five_steps(seed):
    # Measured solo at the equal split and at b=123, then the plan moves the rank to b=90 at the same
    # boundary at which a co-runner makes it 1.3x slower. Fitting one line through both regimes predicted
    # t(300) = 0.09 s against a true 0.24 s.
    m, noise = solo_model(seed)
    assert max_rel_error(m, 1.0) < 0.1
    errors = []
    for _ in range(5):
        m.observe(90, true_time(90, SLOW) * noise())
        errors.append(max_rel_error(m, SLOW))
    assert m.change_points == 1
    assert errors[-1] < 0.10, errors
    assert m.predict(300) == pytest.approx(true_time(300, SLOW), rel=0.1)


def test_in_blocks_a_slowdown_at_a_new_batch_size_is_found_like_step_by_step():
    # The same case with whole epochs given at once (as a planner's epoch end does), for 50 ranks at once:
    # the block update finds the same changes as the step-by-step rule, and learns the new line as well.
    rng = np.random.default_rng(11)
    n = 50
    block, stepwise = TimeModelBank(n), TimeModelBank(n)
    for b, factor, steps in ((64, 1.0, 20), (123, 1.0, 20), (90, SLOW, 5)):
        t = true_time(b, factor) * np.exp(rng.normal(0, 0.05, (n, steps)))
        block.observe(np.full((n, steps), float(b)), t)
        for k in range(steps):
            stepwise.observe(np.full(n, float(b)), t[:, k])
    assert (block.change_points == stepwise.change_points).all() and block.change_points.mean() >= 0.9
    for line, ref, found in zip(block.lines(), stepwise.lines(), block.change_points):
        if found:
            assert max(abs(line.predict(b) / true_time(b, SLOW) - 1) for b in (48, 64, 90, 123, 300, 512)) < 0.10
            assert line.predict(300) == pytest.approx(ref.predict(300), rel=0.03)


def test_in_blocks_no_false_change_under_five_percent_noise_over_1000_steps():
    rng = np.random.default_rng(5)
    n = 100
    a, s = rng.uniform(0, 0.05, n), rng.uniform(1e-4, 2e-3, n)
    bank = TimeModelBank(n)
    for _ in range(50):  # epochs of 20 steps, each at a new batch size
        b = rng.integers(16, 512, n).astype(float)
        bank.observe(np.repeat(b[:, None], 20, axis=1), (a + s * b)[:, None] * np.exp(rng.normal(0, 0.05, (n, 20))))
    assert bank.change_points.sum() == 0


@pytest.mark.parametrize("seed", range(5))
def test_no_false_change_under_five_percent_noise_over_1000_steps(seed):
    # The plan moves the rank to a new batch size every 20 steps (as re-plans do); 5% log-normal noise.
    rng = np.random.default_rng(100 + seed)
    a, s = rng.uniform(0, 0.05), rng.uniform(1e-4, 2e-3)
    m = LinearTimeModel()
    b = 64
    for k in range(1000):
        if k % 20 == 0:
            b = int(rng.integers(16, 512))
        m.observe(b, (a + s * b) * float(np.exp(rng.normal(0, 0.05))))
    assert m.change_points == 0


def test_a_faster_regime_and_a_change_at_a_seen_size_are_found():
    m = LinearTimeModel()
    for b in (32, 64) * 10:
        m.observe(b, 0.01 + 0.001 * b)
    for _ in range(4):
        m.observe(64, (0.01 + 0.001 * 64) / 1.5)  # the co-runner left: faster
    assert m.change_points == 1
    assert m.predict(32) == pytest.approx((0.01 + 0.001 * 32) / 1.5, rel=0.02)  # the fixed-cost share is kept


def test_a_short_stall_is_neither_a_change_nor_learned_in_full():
    m = LinearTimeModel()
    for _ in range(20):
        m.observe(32, 0.05)
    for _ in range(3):  # one step short of a change
        m.observe(32, 0.5)
    m.observe(32, 0.05)
    assert m.change_points == 0
    assert m.predict(32) < 0.05 * 1.15 * 1.15  # each stalled step clipped to 15% above the prediction


def test_an_unknown_fixed_cost_is_not_a_change():
    # Only one batch size seen: at another size anything between the proportional and the constant
    # extrapolation is the same speed.
    m = LinearTimeModel()
    for _ in range(20):
        m.observe(128, 0.04 + 0.0002 * 128)
    for _ in range(8):
        m.observe(32, 0.04 + 0.0002 * 32)
    assert m.change_points == 0
    assert m.params().intercept == pytest.approx(0.04, rel=0.05)


def test_the_bank_learns_like_one_model_per_rank():
    rng = np.random.default_rng(7)
    n, steps = 5, 60
    b = np.repeat(rng.integers(8, 200, (n, steps // 10)), 10, axis=1).astype(float)
    factor = np.where(np.arange(steps) >= 30, rng.choice([1.0, 1.6, 0.6], n)[:, None], 1.0)
    t = (0.01 + 0.001 * b) * factor * np.exp(rng.normal(0, 0.03, (n, steps)))
    t[1, 7] = 2.0  # a stall
    bank, chunked = TimeModelBank(n), TimeModelBank(n)
    for k in range(steps):
        bank.observe(b[:, k], t[:, k])
    chunked.observe(b[:, :25], t[:, :25])
    chunked.observe(b[:, 25:], t[:, 25:])
    for r in range(n):
        single = LinearTimeModel()
        for k in range(steps):
            single.observe(b[r, k], t[r, k])
        assert bank.lines()[r] == single.params()
        assert bank.change_points[r] == chunked.change_points[r] == single.change_points
        # Blocks of steps hold the change test's interval for the block and refit every few steps after a plan
        # change (time_block): the same changes, and predictions within 1% of the step-by-step rule inside the
        # sizes run (5% at the ends, where the fitted fixed cost weighs most).
        for size, rel in ((8, 0.05), (64, 0.01), (200, 0.05)):
            assert chunked.lines()[r].predict(size) == pytest.approx(single.params().predict(size), rel=rel)


def test_a_block_of_steps_at_one_batch_size_is_the_step_by_step_rule():
    # Quiet steps at one batch size: the closed form of the block update gives the step-by-step levels and noise.
    rng = np.random.default_rng(3)
    n, steps = 64, 40
    b = np.repeat(rng.integers(8, 200, n)[:, None], steps, axis=1).astype(float)
    t = (0.01 + 0.001 * b) * np.exp(rng.normal(0, 0.01, (n, steps)))
    block, stepwise = TimeModelBank(n), TimeModelBank(n)
    block.observe(b, t)
    for k in range(steps):
        stepwise.observe(b[:, k], t[:, k])
    for name in ("_gb", "_gy", "_gw", "_var", "_nobs", "_np"):
        np.testing.assert_allclose(getattr(block, name), getattr(stepwise, name), rtol=1e-12, atol=1e-15)
    # A 1.5x slowdown of some ranks half-way through a block is a change for exactly those ranks, as step by step.
    slow = np.where(np.arange(steps) >= 20, np.where(np.arange(n) < 16, 1.5, 1.0)[:, None], 1.0)
    block.observe(b, t * slow)
    for k in range(steps):
        stepwise.observe(b[:, k], (t * slow)[:, k])
    assert (block.change_points == (np.arange(n) < 16)).all()
    assert (block.change_points == stepwise.change_points).all()
    np.testing.assert_allclose(block._gy.max(axis=1), stepwise._gy.max(axis=1), rtol=0.02)


def test_state_round_trip_keeps_held_back_steps_and_reads_the_old_format():
    m = LinearTimeModel()
    for b in (16, 32) * 6:
        m.observe(b, 0.01 + 0.002 * b)
    m.observe(32, 0.2)  # held back (a possible change)
    twin = LinearTimeModel()
    twin.load_state_dict(m.state_dict())
    assert twin.params() == m.params() and len(twin) == len(m)
    for _ in range(3):
        m.observe(32, 0.2)
        twin.observe(32, 0.2)
    assert twin.change_points == m.change_points == 1 and twin.params() == m.params()
    old = {"half_life": 6.0, "window": 512, "observations": [[16, 0.042], [32, 0.074]] * 4, "intercept_ratio": 0.135}
    legacy = LinearTimeModel()
    legacy.load_state_dict(old)
    assert legacy.predict(64) == pytest.approx(0.138, rel=0.01)


def test_a_checkpoint_taken_right_after_a_change_inside_the_fitted_sizes_resumes():
    # A change found between the sizes kappa was fitted on keeps kappa but drops its interval until the new
    # regime's first line; a checkpoint taken then (a Lightning resume did so under horovodrun) must load.
    m, noise = solo_model(0)
    for _ in range(8):
        m.observe(100, true_time(100, SLOW) * noise())
    state = m.state_dict()
    assert m.change_points == 1 and state["kappa"] is not None and state["kappa_interval"] is None
    twin = LinearTimeModel()
    twin.load_state_dict(state)
    assert twin.params() == m.params() and twin.change_points == 1
    for b in (100, 60, 100, 60):
        m.observe(b, true_time(b, SLOW))
        twin.observe(b, true_time(b, SLOW))
    assert twin.params() == m.params()


@pytest.mark.parametrize("seed", range(8))
def test_every_state_through_regime_changes_survives_a_checkpoint(seed):
    # Random batch sizes, 5% noise and a speed change now and then: after every step the state loads into a new
    # model that predicts alike and goes on alike (half of such runs once hit a state that did not load).
    rng = np.random.default_rng(seed)
    m, factor = LinearTimeModel(), 1.0
    for step in range(120):
        if rng.random() < 0.05:
            factor *= float(rng.choice([0.5, 0.8, 1.3, 2.0]))
        b = int(rng.choice([8, 16, 32, 64, 100, 128]))
        m.observe(b, factor * true_time(b) * float(np.exp(rng.normal(0, 0.05))))
        twin = LinearTimeModel()
        twin.load_state_dict(m.state_dict())
        assert twin.params() == m.params() and twin.change_points == m.change_points, step
    for b in (16, 128, 16, 128):
        m.observe(b, 1.5 * true_time(b))
        twin.observe(b, 1.5 * true_time(b))
    assert twin.params() == m.params() and twin.change_points == m.change_points


def test_copies_are_standalone():
    bank = TimeModelBank(2)
    bank.observe(np.array([[32.0] * 4, [64.0] * 4]), np.array([[0.03] * 4, [0.05] * 4]))
    from hetero_plugins.balancing.time_model import ModelList

    views = ModelList(bank)
    mine = copy.deepcopy(views[1])
    mine.observe(64, 5.0)
    line = bank.lines()[1]
    assert line.intercept == 0.0 and line.slope == pytest.approx(0.05 / 64, rel=1e-12)
    assert len(mine) == len(views[1]) + 1
    views[0] = mine  # assigning copies the model into the bank's row
    assert bank.lines()[0] == mine.params()
    with pytest.raises(ValueError, match="options"):
        views[0] = LinearTimeModel(change_steps=2)


def test_validation_names_the_option():
    with pytest.raises(ValueError, match="change_threshold"):
        LinearTimeModel(change_threshold=0)
    with pytest.raises(ValueError, match="batch_sizes` and `seconds`"):
        TimeModelBank(2).observe(np.ones((3, 2)), np.ones((3, 2)))


def test_a_short_epoch_that_deviates_throughout_counts_for_the_next_plan():
    # Epochs of three steps: a co-runner arriving at an epoch start leaves a run of three slow steps, one short
    # of a change; at the epoch end the planner takes it in instead of planning the next epoch on the old speed.
    from hetero_plugins.balancing.planner import BalancePlanner

    def epoch(plan, slow):
        rec = np.zeros((2, 3, 3))
        for r, b in enumerate(plan):
            rec[r, :, 0] = b
            rec[r, :, 1] = (0.005 + 0.001 * b) * (slow if r == 1 else 1.0)
        return rec

    p = BalancePlanner(2, 128, warmup_steps=0)
    for e in range(4):
        p.end_epoch(e, epoch(p.plan, 1.0))
    assert p.plan == [64, 64]
    p.end_epoch(4, epoch(p.plan, 1.9))
    assert p.models[1].change_points == 1
    assert p.plan[1] < 50  # 1.9x slower: about 44 of 128
    twenty = LinearTimeModel()
    for _ in range(20):
        twenty.observe(64, 0.069)
    bank = twenty._bank
    bank.observe(np.array([[64.0] * 20]), np.array([[0.069] * 17 + [0.2] * 3]))
    bank.settle()  # a run of three at the end of a 20-step epoch may be a stall: it stays held back
    assert twenty.change_points == 0 and twenty.predict(64) == pytest.approx(0.069)


@pytest.mark.parametrize("seed", range(5))
def test_a_line_fitted_across_a_slow_ramp_does_not_replace_the_fixed_cost(seed):
    # The fixed cost (5 ms, kappa ~ 8 samples) is learned at 64 and 123 samples. A ramping background load then
    # makes the rank slower step after step while the plan cuts its batch: the smaller batch is measured about
    # as slow as the larger one was a moment before. A line through those two levels says the step time
    # hardly depends on the batch (kappa in the thousands), and a planner trusting it stops cutting the rank's
    # batch while the rank slows further (seen in the simulator). That fit's precision is nil (its ends lie
    # within noise of each other): it must not replace the fixed cost learned before the ramp.
    m, noise = solo_model(seed)
    kappa_before = m.params().intercept / m.params().slope
    assert 0 < kappa_before < 40
    for _ in range(8):  # the ramp starts: 1.5x slower at 123 samples (a change point inside the fitted range)
        m.observe(123, true_time(123, 1.5) * noise())
    for _ in range(8):  # the plan cuts the batch to 100; the ramp has gone on to about 1.8x
        m.observe(100, true_time(123, 1.5) * 0.99 * noise())
    p = m.params()
    assert p.intercept / p.slope < 3 * max(kappa_before, 8.0)
    # so cutting the batch is still predicted to help
    assert m.predict(50) < 0.7 * m.predict(100)


def test_drift_is_judged_at_measured_batch_sizes_against_the_noise():
    """``TimeModelBank.drift``: a rank whose steps ran off the level measured at their batch size, beyond
    ``tolerance`` and 2.5 standard errors: +1 slower, -1 faster; steps at a size never measured are not judged."""
    rng = np.random.default_rng(3)
    bank = TimeModelBank(4)
    b = np.array([[32.0, 64.0] * 10] * 4)
    bank.observe(b, true_time(b) * np.exp(rng.normal(0, 0.05, b.shape)))
    at = np.full((4, 6), 64.0)
    at[2] = 48.0  # never measured: a line's extrapolation, not a drift
    t = true_time(at) * np.array([[1.0], [1.25], [1.25], [0.75]])
    assert bank.drift(at, t, tolerance=0.03).tolist() == [0, 1, 0, -1]
    assert bank.drift(at, true_time(at) * 1.04, tolerance=0.03).tolist() == [0, 0, 0, 0]  # within the noise
    assert bank.drift(at, true_time(at) * 1.25, tolerance=0.3).tolist() == [0, 0, 0, 0]  # within the tolerance
    t[1, :] = np.nan  # no step measured: not judged
    assert bank.drift(at, t, tolerance=0.03).tolist() == [0, 0, 0, -1]


def test_a_resume_between_an_epoch_and_its_re_plan_does_not_settle_a_short_stall_as_a_change():
    """A 3-step stall at the end of a 20-step epoch is held back, not a change (a run needs 4 steps, or all of a
    short epoch's steps). A checkpoint taken there and resumed, then re-planned without new steps (the Horovod
    sampler's resume path), must decide as the uninterrupted run does: the checkpoint keeps how many steps the
    last observation had, which is what tells a short epoch's run from a stall."""
    import json

    from hetero_plugins.balancing.planner import BalancePlanner

    rng = np.random.default_rng(0)
    live = BalancePlanner(2, 64)
    for epoch in range(3):
        b = np.array([[size] * 20 for size in live.plan], dtype=np.float64)
        t = (0.01 + b * np.array([[0.001], [0.004]])) * (1 + 0.02 * rng.standard_normal((2, 20)))
        if epoch == 2:
            t[1, -3:] *= 1.6  # a stall on rank 1
        live.end_epoch(epoch, np.stack([b, t, np.zeros_like(b)], axis=2))
    resumed = BalancePlanner(2, 64)
    resumed.load_state_dict(json.loads(json.dumps(live.state_dict())))
    assert resumed.replan()["next_batch_sizes"] == live.replan()["next_batch_sizes"]
    assert resumed.models[1].change_points == live.models[1].change_points == 0
    assert resumed.models[1].params() == live.models[1].params()
