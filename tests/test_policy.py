"""The rebuilt "dqn" and "auto" allocators: exact split on NCF-corrected lines, and auto's safety gate."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hetero_plugins.balancing.allocators import Bounds, EqualFinishAllocator, min_makespan_split
from hetero_plugins.balancing.lines import TimeModelLines
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.time_model import TimeModelParams as P
from hetero_plugins.scheduler.interference import InterferenceCorrection
from hetero_plugins.scheduler.policy import AutoAllocator, DQNAllocator
from hetero_plugins.scheduler.relocation import Relocator
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, simulate


class TablePredictor:
    """A user's own slowdown predictor: a lookup table (anything with ``predict`` is accepted)."""

    def __init__(self, table: dict[tuple[str, str], float]) -> None:
        self.table = table

    def predict(self, workload: str, device: str, corunner: str | None) -> float:
        if corunner is None:
            return 1.0
        if (device, corunner) not in self.table:
            raise ValueError(f"unknown pair {(device, corunner)}")
        return self.table[(device, corunner)]


FAST, SLOW = P(0.005, 0.0005), P(0.006, 0.0012)
DEVICES = ["v100"] * 3 + ["t4"]


def _scaled(m: P, f: float) -> P:
    return P(m.intercept * f, m.slope * f)


def _arrival_then_departure(ncf_says: float, truth: float, defaults: bool = False
                            ) -> tuple[AutoAllocator, list[int], list[int]]:
    """Epoch 1: a video job arrives beside the t4 (NCF: ``ncf_says``); epoch 2 measures it (``truth``); the job
    leaves at epoch 3. Returns the allocator (trusting measured ratios, not unchecked predictions; ``defaults``:
    the default options), its plan for epoch 3 and equal_finish's on the same lines."""
    table = TablePredictor({("t4", "video"): ncf_says, ("v100", "video"): 1.4})
    auto = AutoAllocator(hedge=0.0, interference=table) if defaults else \
        AutoAllocator(hedge=0.0, interference=table, trust_unverified=False, measured_ratios=True)
    bounds = Bounds.uniform(4)
    models = [FAST] * 3 + [SLOW]
    first = auto.allocate(models, 256, bounds)
    auto.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 3 + ["video"])
    arrival = auto.allocate(models, 256, bounds, current=first)
    if not defaults:
        assert auto.last_choice == "equal_finish" and arrival == first  # never measured yet: not trusted
        assert auto.last_reason == "rank 3 (t4, None -> video) is unverified and trust_unverified=False"
    measured = [FAST] * 3 + [_scaled(SLOW, truth)]  # what the epoch beside the video job measured
    auto.set_context(devices=DEVICES, corunners=[None] * 3 + ["video"], next_corunners=[None] * 4)
    departure = auto.allocate(measured, 256, bounds, current=arrival)
    return auto, departure, EqualFinishAllocator().allocate(measured, 256, bounds)


def _exact(lines: list[P], factors: list[float]) -> list[int]:
    a, s = np.array([m.intercept for m in lines]), np.array([m.slope for m in lines])
    f = np.array(factors)
    return min_makespan_split(a * f, s * f, 256, [1] * 4, [256] * 4).tolist()


@pytest.mark.parametrize("ncf_says", [2.0, 1.25])
def test_auto_corrects_a_measured_change_by_the_measured_ratio_whatever_the_ncf_says(ncf_says):
    auto, plan, ef = _arrival_then_departure(ncf_says=ncf_says, truth=1.2)
    assert auto.measured_ratio("training", "t4", None, "video") == pytest.approx(1.2)
    # The departure was measured (in reverse) by the arrival: the t4 gets its speed back at once, by the
    # measured ratio, never by the NCF's (2.0 disagrees with it; 1.25 agrees within `agreement`).
    measured = [FAST] * 3 + [_scaled(SLOW, 1.2)]
    assert auto.last_choice == "ncf" and plan != ef and plan[3] > ef[3]
    assert plan == _exact(measured, [1.0, 1.0, 1.0, 1 / 1.2])
    assert auto.sources == {"measured": 1, "ncf": 0}
    assert auto.disagreements == (1 if ncf_says == 2.0 else 0)
    assert auto.choices == {"ncf": 1, "equal_finish": 1}
    # The video job returns to the t4 (measured before) and a first one arrives beside a v100 (never seen,
    # trust_unverified=False): only the t4 is corrected, by the measured 1.2; the v100 stays as equal_finish
    # sees it.
    lines = [FAST] * 3 + [SLOW]  # the epoch after the departure measured the t4 alone again
    auto.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=["video", None, None, "video"])
    mixed = auto.allocate(lines, 256, Bounds.uniform(4), current=plan)
    assert auto.last_choice == "ncf" and mixed == _exact(lines, [1.0, 1.0, 1.0, 1.2])
    # By default (measured_ratios=False) the measured ratio is kept but the NCF's word corrects the departure.
    default, plan, ef = _arrival_then_departure(ncf_says=ncf_says, truth=1.2, defaults=True)
    assert default.measured_ratio("training", "t4", None, "video") == pytest.approx(1.2)
    assert default.last_choice == "ncf" and default.sources == {"measured": 0, "ncf": 2}
    assert plan == _exact(measured, [1.0, 1.0, 1.0, 1 / ncf_says]) and default.disagreements == 0
    # The default (trust_unverified=True) corrects the first arrival on the NCF's word.
    trusting = AutoAllocator(hedge=0.0, interference=TablePredictor({("t4", "video"): 2.0}))
    trusting.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 3 + ["video"])
    told = trusting.allocate([FAST] * 3 + [SLOW], 256, Bounds.uniform(4))
    assert trusting.last_choice == "ncf" and told == _exact([FAST] * 3 + [SLOW], [1.0, 1.0, 1.0, 2.0])
    assert trusting.sources == {"measured": 0, "ncf": 1}


def test_auto_distrusts_an_ncf_with_a_bad_track_record_and_a_disagreeing_reference():
    table = TablePredictor({("t4", "video"): 2.0, ("t4", "etl"): 1.5})
    models = [FAST] * 3 + [SLOW]
    bounds = Bounds.uniform(4)
    for gate_split in (True, False):
        auto = AutoAllocator(hedge=0.0, interference=table, min_record=1, gate_split=gate_split)
        auto.ncf_errors.append(float(np.log(2.0 / 1.2)))  # one measured change, predicted 67% too slow
        auto.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 3 + ["etl"])
        plan = auto.allocate(models, 256, bounds)
        assert "NCF median error 67%" in auto.trusted()  # relocations are vetoed either way
        if gate_split:  # the split falls back too
            assert plan == EqualFinishAllocator().allocate(models, 256, bounds)
            assert "NCF median error 67%" in auto.last_reason
        else:  # the default: the announced change is still corrected by the NCF
            assert auto.last_choice == "ncf" and plan == _exact(models, [1.0, 1.0, 1.0, 1.5])
    noisy = AutoAllocator(hedge=0.0, interference=table, gate_split=True, max_noise=0.01)
    noisy._residuals.append(np.array([0.1, -0.1, 0.12]))  # the lines missed this epoch's times by ~10%
    noisy.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 3 + ["etl"])
    assert noisy.allocate(models, 256, bounds) == EqualFinishAllocator().allocate(models, 256, bounds)
    assert "residual spread" in noisy.last_reason and "residual spread" in noisy.trusted()
    ref = AutoAllocator(hedge=0.0, interference=TablePredictor({("t4", "etl"): 1.5}),
                        reference=TablePredictor({("t4", "etl"): 1.1}))
    ref.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 3 + ["etl"])
    ref.allocate(models, 256, Bounds.uniform(4))
    assert ref.last_choice == "equal_finish" and "reference predictor's 1.10" in ref.last_reason
    with pytest.raises(ValueError, match="`agreement`=2.0 must be in \\(0, 1\\].*HINT"):
        AutoAllocator(agreement=2.0)
    with pytest.raises(ValueError, match="`tolerance`=0.1 is no longer an option of AutoAllocator.*HINT: remove"):
        AutoAllocator(tolerance=0.1)
    with pytest.raises(ValueError, match="`reference`=3 is not a predictor.*HINT"):
        AutoAllocator(reference=3)
    with pytest.raises(ValueError, match="measured_ratios"):
        AutoAllocator(measured_ratios="yes")


@pytest.mark.parametrize("name", ["static_mix", "dynamic", "paper_mix"])
def test_auto_is_equal_finish_on_scenarios_without_corunners(name):
    spec = BUILTIN_SCENARIOS[name]
    assert not any("corunner" in ev for ev in spec.get("events", []))
    ef, auto = simulate(spec, "equal_finish"), simulate(spec, AutoAllocator())
    assert auto["plans"] == ef["plans"] and auto["epoch_times"] == ef["epoch_times"]


def _random_cluster(rng: np.random.Generator, max_world: int) -> tuple[Any, ...]:
    """A random cluster of v100s and t4s whose co-runners (a video job, an ETL job or none) change at a boundary:
    ``(n, devices, old, new, intercepts, slopes, min batches, max batches, global batch)``."""
    n = int(rng.integers(3, max_world))
    devices = list(rng.choice(["v100", "t4"], n))
    old = [None if c == "-" else c for c in rng.choice(["-", "video", "etl"], n)]
    new = [None if c == "-" else c for c in rng.choice(["-", "video", "etl"], n)]
    a, s = rng.uniform(0.0, 0.01, n), rng.uniform(2e-4, 3e-3, n)
    lo, hi = rng.integers(1, 4, n), rng.integers(64, 256, n)
    return n, devices, old, new, a, s, lo, hi, int(rng.integers(lo.sum(), hi.sum() + 1))


def test_dqn_split_is_the_exact_split_on_ncf_corrected_lines():
    rng = np.random.default_rng(3)
    table = {("v100", "video"): 1.4, ("t4", "video"): 1.9, ("v100", "etl"): 1.2, ("t4", "etl"): 1.3}
    for _ in range(20):
        n, devices, old, new, a, s, lo, hi, gb = _random_cluster(rng, 40)
        dqn = DQNAllocator(hedge=0.0, interference=TablePredictor(table))
        dqn.set_context(devices=devices, corunners=old, next_corunners=new)
        plan = dqn.allocate([P(x, y) for x, y in zip(a, s)], gb, Bounds(tuple(map(int, lo)), tuple(map(int, hi))))
        f = InterferenceCorrection(TablePredictor(table)).factors("training", devices, old, new)
        assert plan == min_makespan_split(a * f, s * f, gb, lo, hi).tolist()
        if np.any(f != 1.0):  # the damping gate sees the corrected lines
            assert dqn.predict_makespan([P(x, y) for x, y in zip(a, s)], plan) == pytest.approx(
                float(np.max((a + s * np.array(plan)) * f)))


def _with_data(a: np.ndarray, s: np.ndarray, data: np.ndarray) -> TimeModelLines:
    """Compute lines with each rank's wait for data added to its intercept, as the planner decides on them."""
    return TimeModelLines(a + data, s, np.ones(len(a), dtype=bool), data=data)


def test_corrections_scale_the_compute_and_leave_the_wait_for_data():
    """A co-runner slows a rank's compute, not its wait for data (the simulator's model, and the relocators'
    pricing): the corrected lines are ``(intercept - data) * f + data`` and ``slope * f``. Before, the whole
    intercept was scaled: a data-bound rank whose co-runner left was priced as if its data came faster too, and
    handed samples it could not run (a generated 5-rank cluster: 0.963x the best analytic allocator)."""
    rng = np.random.default_rng(5)
    table = {("v100", "video"): 1.4, ("t4", "video"): 1.9, ("v100", "etl"): 1.2, ("t4", "etl"): 2.3}
    for _ in range(20):
        n, devices, old, new, a, s, lo, hi, gb = _random_cluster(rng, 30)
        data = np.where(rng.random(n) < 0.4, rng.uniform(0.0, 0.2, n), 0.0)
        f = InterferenceCorrection(TablePredictor(table)).factors("training", devices, old, new)
        expected = min_makespan_split(a * f + data, s * f, gb, lo, hi).tolist()
        bounds = Bounds(tuple(map(int, lo)), tuple(map(int, hi)))
        for alloc in (DQNAllocator(hedge=0.0, interference=TablePredictor(table)),
                      AutoAllocator(hedge=0.0, interference=TablePredictor(table))):
            alloc.set_context(devices=devices, corunners=old, next_corunners=new)
            lines = _with_data(a, s, data)
            plan = alloc.allocate(lines, gb, bounds)
            assert plan == expected
            assert alloc.predict_makespan(lines, plan) == pytest.approx(float(np.max(a * f + data + s * f * plan)))
    # The planner hands its allocator the data it counts: a rank waiting 150 ms for each batch, whose co-runner
    # (2x) leaves, gains nothing from its compute running twice as fast, since the others finish first anyway.
    dqn = DQNAllocator(hedge=0.0, interference=TablePredictor({("t4", "etl"): 2.0}))
    planner = BalancePlanner(2, 128, allocator=dqn)
    batch = np.tile(np.repeat([32.0, 96.0], 10), 2).reshape(2, 20)  # both ranks measured at 32 and 96 samples
    compute = np.array([[1.0], [2.0]]) * (0.002 + 0.001 * batch)  # rank 1 beside the co-runner: 2x
    planner.observe(np.stack([batch, compute, np.array([[0.0], [0.15]]) + 0 * batch], axis=2))
    lines = planner.decision_lines()
    assert lines.data.tolist() == [0.0, 0.15] and lines.intercept[1] == pytest.approx(0.154)
    planner.allocator.set_context(devices=["v100", "t4"], corunners=[None, "etl"], next_corunners=[None, None])
    planner.allocator.allocate(lines, 128, Bounds.uniform(2))
    a_fixed, slope = planner.allocator.lines(lines, 2)
    assert a_fixed[1] == pytest.approx(0.152) and slope[1] == pytest.approx(0.001)  # not 0.077 and 0.001


def test_auto_measures_a_corunners_slowdown_on_the_compute_alone():
    """The slowdown a co-runner change is measured at (and the NCF scored by) is the ratio of the compute lines:
    the wait for data a rank's intercept holds would dilute it (a 2x slowdown of a rank waiting 50 ms a step
    for data was measured as 1.13x)."""
    table = TablePredictor({("t4", "video"): 2.0, ("v100", "video"): 1.4})
    auto = AutoAllocator(hedge=0.0, interference=table)
    a, s, data = np.array([0.005] * 3 + [0.006]), np.array([0.0005] * 3 + [0.0012]), np.array([0.0, 0, 0, 0.05])
    bounds = Bounds.uniform(4)
    plan = auto.allocate(_with_data(a, s, data), 256, bounds)
    auto.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 3 + ["video"])
    plan = auto.allocate(_with_data(a, s, data), 256, bounds, current=plan)
    f = np.array([1.0, 1.0, 1.0, 2.0])  # what the epoch beside the video job measured: the t4's compute 2x
    auto.set_context(devices=DEVICES, corunners=[None] * 3 + ["video"], next_corunners=[None] * 3 + ["video"])
    auto.allocate(_with_data(a * f, s * f, data), 256, bounds, current=plan)
    assert auto.measured_ratio("training", "t4", None, "video") == pytest.approx(2.0)
    assert auto.ncf_errors == [pytest.approx(0.0, abs=1e-12)]  # the NCF said 2.0: right


def test_guard_keeps_relocations_only_when_the_models_are_trusted():
    auto = AutoAllocator()
    guarded = auto.guard(Relocator(restart_cost=0.0), noise_margin=2.0)
    kw = dict(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, "video"],
              lines=[(0.005, 0.0005), (0.006, 0.0012)], free_slots=[{"device": "v100"}],
              global_batch=512, steps_per_epoch=20, epochs_left=5)
    small = dict(kw, next_corunners=[None, None], lines=[(0.005, 0.0005), (0.006, 0.00064)])
    assert guarded.propose(**small).moves == []  # 10% predicted, within 2 x max_noise before any residual
    assert "none measured yet" in guarded.last_reason
    models = [P(0.005, 0.0005), P(0.006, 0.0012)]
    for _ in range(2):  # two epoch boundaries; the lines predicted the epoch between them: residuals 0
        auto.set_context(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, None])
        auto.allocate(models, 512, Bounds.uniform(2))
    assert auto.noise() == 0.0
    assert guarded.propose(**small).moves == [(1, 0)] and guarded.kept == 1 and guarded.vetoed == 1
    auto.move_errors += [0.5, 0.6]  # the lines predicted for two moved ranks were 65% and 82% off
    assert guarded.propose(**kw).moves == [] and "2 moved ranks erred by 73%" in guarded.last_reason
    strict = AutoAllocator().guard(Relocator(restart_cost=0.0), min_gain=0.2)  # 12% is not worth the risk
    assert strict.propose(**small).moves == [] and strict.last_reason == "predicted gain 12.1% < min_gain 20%"
    # The defaults ask a 5% gain above one spread (8% before any residual) that pays one restart back.
    default = AutoAllocator().guard(Relocator(restart_cost=0.0))
    assert default.propose(**small).moves == [(1, 0)] and default.kept == 1
    tiny = dict(small, lines=[(0.005, 0.0005), (0.006, 0.00058)])  # 4% predicted
    assert Relocator(restart_cost=0.0, min_gain=0.0).propose(**tiny).moves == [(1, 0)]
    assert AutoAllocator().guard(Relocator(restart_cost=0.0, min_gain=0.0)).propose(**tiny).moves == []
    # A restart worth four epochs of the saving: a relocator counting five epochs moves; the guard, which
    # wants it paid back within three, does not.
    d = Relocator(restart_cost=0.0).propose(**small)
    cost = 4 * 20 * (d.current_step_time - d.step_time)
    far = Relocator(restart_cost=cost, horizon_epochs=5)
    assert far.propose(**small).moves == [(1, 0)]
    guarded_far = AutoAllocator().guard(far)
    assert guarded_far.propose(**small).moves == [] and "payback" in guarded_far.last_reason


def test_auto_learns_no_slowdown_from_a_rank_that_just_moved():
    """A relocated rank's line one boundary after its move is still its first epoch's fit at the new place: a
    co-runner arriving there is not learned as a measured slowdown (on a generated cluster one was measured as a
    2x speed-up, and the next rank that co-runner joined was given twice its batch), while the same arrival
    beside a rank that stayed put is."""
    auto = AutoAllocator(hedge=0.0, interference=TablePredictor({("t4", "video"): 1.5, ("v100", "video"): 1.4}))
    bounds = Bounds.uniform(4)
    models = [FAST] * 3 + [SLOW]
    plan = auto.allocate(models, 256, bounds)
    auto.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 4)
    plan = auto.allocate(models, 256, bounds, current=plan)
    auto.moved([3])  # rank 3 relocated at this boundary; the re-plan follows
    plan = auto.allocate(models, 256, bounds, current=plan)
    # next boundary (scores the move): a video job is announced beside rank 0 and beside the moved rank 3
    auto.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=["video", None, None, "video"])
    plan = auto.allocate(models, 256, bounds, current=plan)
    # the epoch beside the video jobs measured rank 0 1.4x slower, and rank 3's young line at half its old one
    measured = [_scaled(FAST, 1.4), FAST, FAST, _scaled(SLOW, 0.5)]
    auto.set_context(devices=DEVICES, corunners=["video", None, None, "video"],
                     next_corunners=["video", None, None, "video"])
    auto.allocate(measured, 256, bounds, current=plan)
    assert auto.measured_ratio("training", "v100", None, "video") == pytest.approx(1.4)
    assert auto.measured_ratio("training", "t4", None, "video") is None
    # without the move, the same measurement would have been learned
    still = AutoAllocator(hedge=0.0, interference=TablePredictor({("t4", "video"): 1.5, ("v100", "video"): 1.4}))
    p = still.allocate(models, 256, bounds)
    still.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=["video", None, None, "video"])
    p = still.allocate(models, 256, bounds, current=p)
    still.set_context(devices=DEVICES, corunners=["video", None, None, "video"],
                      next_corunners=["video", None, None, "video"])
    still.allocate(measured, 256, bounds, current=p)
    assert still.measured_ratio("training", "t4", None, "video") == pytest.approx(0.5)


def test_guard_vetoes_a_slot_whose_measured_slowdown_contradicts_the_ncf_only_with_measured_ratios():
    """With ``measured_ratios`` a slot's co-runner slowdown measured in this run (3x) outranks the NCF's (1.1x)
    and the move there is vetoed; by default the measured ratio is kept but the NCF prices the move."""
    table = TablePredictor({("v100", "video"): 1.1, ("t4", "video"): 1.1})
    kw = dict(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, None],
              lines=[(0.005, 0.0005), (0.006, 0.0030)], free_slots=[{"device": "v100", "corunner": "video"}],
              global_batch=512, steps_per_epoch=20, epochs_left=5, workload="training")
    assert Relocator(restart_cost=0.0, predictor=table).propose(**kw).moves == [(1, 0)]
    for measured_ratios in (True, False):
        auto = AutoAllocator(hedge=0.0, interference=table, measured_ratios=measured_ratios)
        auto.measured[("training", "v100", None, "video")] = [float(np.log(3.0))]
        guarded = auto.guard(Relocator(restart_cost=0.0, predictor=table))
        moves = guarded.propose(**kw).moves
        if measured_ratios:
            assert moves == [] and "NCF slowdown 1.10 disagrees with the measured 3.00" in guarded.last_reason
        else:
            assert moves == [(1, 0)] and guarded.kept == 1


def test_auto_corrects_a_change_the_ncf_cannot_predict_by_its_measured_ratio():
    """A co-runner the NCF does not know beside the t4: the arrival is left as equal_finish sees it (nothing to
    correct it by); once an epoch beside it was measured (1.2x), its departure is corrected by that ratio even
    with ``measured_ratios=False``, the only evidence there is."""
    auto = AutoAllocator(hedge=0.0, interference=TablePredictor({("v100", "video"): 1.4}))  # nothing for the t4
    bounds = Bounds.uniform(4)
    models = [FAST] * 3 + [SLOW]
    first = auto.allocate(models, 256, bounds)
    auto.set_context(devices=DEVICES, corunners=[None] * 4, next_corunners=[None] * 3 + ["video"])
    arrival = auto.allocate(models, 256, bounds, current=first)
    assert auto.last_choice == "equal_finish" and arrival == first
    measured = [FAST] * 3 + [_scaled(SLOW, 1.2)]
    auto.set_context(devices=DEVICES, corunners=[None] * 3 + ["video"], next_corunners=[None] * 4)
    departure = auto.allocate(measured, 256, bounds, current=arrival)
    assert auto.last_choice == "ncf" and auto.sources == {"measured": 1, "ncf": 0}
    assert departure == _exact(measured, [1.0, 1.0, 1.0, 1 / 1.2])


def test_a_change_whose_every_measurement_contradicts_the_ncf_is_corrected_by_them():
    """`contradicted` (default 4, here 3): the measured ratios replace the NCF's for a change once that many
    measurements of it (either way round) all lie beyond `agreement` of the NCF, on one side; scattered ones
    (noise) never do."""
    import math

    assert AutoAllocator().contradicted == 4
    auto = AutoAllocator(contradicted=3)
    key = ("training", "t4", None, "video")
    auto.measured[key] = [math.log(1.02), math.log(0.97)]
    assert auto.contradicting_ratio(*key, ncf=1.5) is None  # two measurements: not yet
    auto.measured[("training", "t4", "video", None)] = [math.log(1 / 1.05)]  # the departure, measured in reverse
    assert auto.contradicting_ratio(*key, ncf=1.5) == pytest.approx(1.02)
    assert auto.contradicting_ratio(*key, ncf=1.1) is None  # 1.05 lies within 15% of 1.1
    auto.measured[key] = [math.log(0.6), math.log(1.7), math.log(0.9)]  # scattered on both sides of 1.0
    assert auto.contradicting_ratio(*key, ncf=1.0) is None
    assert AutoAllocator(contradicted=0).contradicting_ratio(*key, ncf=5.0) is None
    with pytest.raises(ValueError, match="contradicted"):
        AutoAllocator(contradicted=-1)


def test_auto_stops_correcting_a_corunner_the_ncf_wrongly_believes_slows_a_device():
    """A `video` job arrives beside a v100 and a t4 every other epoch and truly slows nothing (the NCF predicts it
    does): once four measurements all contradict the NCF, `auto` splits as if nothing changed, closer to
    `equal_finish` than with the NCF's word alone (0.87x the best analytic allocator before, session 21's fuzzing)."""
    events = [{"epoch": e, "ranks": [0, 2], "corunner": "video" if e % 2 else None} for e in range(1, 12)]
    sc = {"name": "harmless_video", "workload": "training",
          "ranks": [{"device": "v100", "count": 2}, {"device": "t4", "count": 2}],
          "devices": {"v100": {"cost_per_sample": 0.001, "overhead": 0.01},
                      "t4": {"cost_per_sample": 0.003, "overhead": 0.01}},
          "global_batch": 800, "epochs": 12, "steps_per_epoch": 10, "noise": 0.02,
          "interference": {"video": 1.0}, "events": events}
    ef = simulate(sc, "equal_finish", seed=0)["steady_samples_per_s"]
    trusting, measuring = AutoAllocator(contradicted=0), AutoAllocator()
    t0 = simulate(sc, trusting, seed=0)["steady_samples_per_s"]
    t3 = simulate(sc, measuring, seed=0)["steady_samples_per_s"]
    assert trusting.contradictions == 0 and measuring.contradictions > 0
    assert t0 < 0.92 * ef and t3 > t0 * 1.04
