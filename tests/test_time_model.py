import numpy as np
import pytest

from hetero_plugins.balancing.time_model import LinearTimeModel


def test_recovers_line_under_noise_and_stalls():
    rng = np.random.default_rng(0)
    m = LinearTimeModel(half_life=50)
    for k in range(200):
        b = [16, 24, 32][k % 3]
        t = (0.02 + 0.003 * b) * rng.uniform(0.95, 1.05)
        if k % 17 == 0:
            t *= 10  # a transient stall
        m.observe(b, t)
    p = m.params()
    assert p.intercept == pytest.approx(0.02, abs=0.006)
    assert p.slope == pytest.approx(0.003, rel=0.1)


def test_single_batch_size_is_proportional():
    m = LinearTimeModel()
    for _ in range(5):
        m.observe(32, 0.064)
    assert m.params().intercept == 0.0
    assert m.predict(64) == pytest.approx(0.128)


def test_forgetting_notices_slowdown_within_an_epoch():
    m = LinearTimeModel(half_life=6)
    for _ in range(40):
        m.observe(32, 0.032)
    for _ in range(10):  # the rank becomes 3x slower
        m.observe(32, 0.096)
    assert m.predict(32) == pytest.approx(0.096, rel=0.05)


def test_ignores_empty_steps_and_round_trips():
    m = LinearTimeModel()
    m.observe(0, 1.0)
    m.observe(8, float("nan"))
    assert m.params() is None and len(m) == 0
    m.observe(8, 0.1)
    m.observe(16, 0.18)
    m2 = LinearTimeModel()
    m2.load_state_dict(m.state_dict())
    assert m2.params() == m.params()


def test_validation():
    with pytest.raises(ValueError, match="half_life"):
        LinearTimeModel(half_life=0)


def test_change_point_adopts_a_new_speed_within_a_few_steps():
    m = LinearTimeModel()
    for _ in range(40):
        m.observe(32, 0.032)
    for k in range(4):  # the rank becomes 3x slower: declared after 4 consecutive slow steps
        m.observe(32, 0.096)
    assert m.change_points == 1 and m.predict(32) == pytest.approx(0.096, rel=0.01)
    for _ in range(4):  # and back
        m.observe(32, 0.032)
    assert m.change_points == 2 and m.predict(32) == pytest.approx(0.032, rel=0.01)


def test_isolated_stalls_and_noise_are_not_change_points():
    rng = np.random.default_rng(1)
    m = LinearTimeModel()
    for k in range(300):
        t = 0.05 * rng.uniform(0.9, 1.1) * (8.0 if k % 10 == 0 else 1.0)
        m.observe(32, t)
    assert m.change_points == 0 and m.predict(32) == pytest.approx(0.05, rel=0.06)


def test_a_new_batch_size_is_not_mistaken_for_a_speed_change():
    m = LinearTimeModel()
    for _ in range(20):
        m.observe(32, 0.05 + 0.001 * 32)  # a large fixed cost the model cannot see from one batch size
    for _ in range(8):
        m.observe(8, 0.05 + 0.001 * 8)  # far above the proportional extrapolation, but the same speed
    assert m.change_points == 0
    assert m.params().intercept == pytest.approx(0.05, rel=0.05)  # both sizes kept: the line is learned
