import numpy as np
import pytest

from hetero_plugins.emulation import EmulationModel, RandomStalls, Stall
from hetero_plugins.metrics import idle_fraction, straggler_level
from hetero_plugins.telemetry import StepTimer, SystemMonitor, memory_cap


def test_metrics():
    assert straggler_level([2.0, 2.0]) == 0.0
    assert straggler_level([1.0, 3.0]) == pytest.approx(1.0)
    assert idle_fraction([1.0, 1.0]) == 0.0
    assert idle_fraction([4.0, 1.0]) == pytest.approx(0.375)
    with pytest.raises(ValueError, match="compute_times"):
        straggler_level([])


def test_emulation_speeds_schedule_and_stalls():
    m = EmulationModel([1, 0.5], 0.01, schedule={2: [0.5, 0.5], 4: {1: 1.0}}, stalls=[Stall(0, 1, 2, 3, 5.0)])
    assert m.delay(1, 0, 0, 10) == pytest.approx(0.2)
    assert m.speeds_at(3) == [0.5, 0.5] and m.speeds_at(4) == [0.5, 1.0]
    assert [m.stall_factor(0, 1, s) for s in range(6)] == [1, 1, 5, 5, 5, 1]
    r = RandomStalls(probability=1.0, min_steps=2, max_steps=2, slowdown=3.0, seed=1)
    assert sorted({r.factor(0, 0, s) for s in range(10)}) == [1.0, 3.0]
    assert r.factor(0, 0, 4) == RandomStalls(probability=1.0, min_steps=2, max_steps=2, slowdown=3.0, seed=1).factor(0, 0, 4)
    # speeds as NumPy gives them: an array, or NumPy scalars
    assert EmulationModel(np.array([1, 0.5]), 0.01).speeds == EmulationModel([np.int64(1), np.float32(0.5)], 0.01).speeds


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(speeds=[1, -1], cost_per_sample=0.1), r"speeds\[1\]"),
        (dict(speeds=[], cost_per_sample=0.1), "speeds"),
        (dict(speeds=[1], cost_per_sample=-1), "cost_per_sample"),
        (dict(speeds=[1], cost_per_sample=0.1, schedule={1: [1, 2]}), r"schedule\[1\]"),
        (dict(speeds=[1], cost_per_sample=0.1, schedule={1: {3: 1.0}}), "names rank 3"),
        (dict(speeds=[1], cost_per_sample=0.1, stalls=[Stall(2, 0)]), "names rank 2"),
    ],
)
def test_emulation_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmulationModel(**kwargs)


def test_step_timer_excludes_waiting_after_gradients_ready():
    clock = iter([0.0, 0.5, 2.0, 2.1, 2.2, 2.3]).__next__
    t = StepTimer(clock=clock)
    t.start_step(4)           # 0.0
    t.mark_gradients_ready()  # 0.5
    rec = t.end_step()        # 2.0 (the all-reduce waited 1.5 s for another rank)
    assert rec.compute_time == 0.5 and rec.batch_size == 4
    t.start_step(4)           # 2.1 -> data time 0.1
    t.mark_backward_end()     # 2.2, no hook fired
    rec = t.end_step()        # 2.3
    assert rec.data_time == pytest.approx(0.1) and rec.compute_time == pytest.approx(0.1)


def test_memory_cap_and_cpu_monitor():
    assert memory_cap(16, peak_bytes=5 * 2**30, baseline_bytes=2**30, total_bytes=40 * 2**30, headroom=0.9) == 140
    snap = SystemMonitor(gpu_index=0).read()  # no GPU here: CPU stats only, nothing raises
    assert "cpu_percent" in snap
