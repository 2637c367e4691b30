"""An announced co-runner change starts the changed rank's line afresh (``BalancePlanner(regime_reset=True)``)."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_plugins.balancing.coordinator import PlanCoordinator
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.time_bank import TimeModelBank
from hetero_plugins.scheduler.policy import AutoAllocator, DQNAllocator
from tests.test_balancing_options import ScriptedComm


class _Table:
    """A slowdown table standing in for the NCF: the co-runner "video" doubles a rank's step time."""

    def predict(self, workload: str, device: str, corunner: str | None) -> float:
        return {None: 1.0, "video": 2.0}[corunner]


def _records(batches: list[list[int]], slopes: list[float], kappa: float = 10.0) -> np.ndarray:
    """Exact step times ``(b + kappa) * slope`` (a fixed cost of ``kappa`` samples), no data time."""
    b = np.asarray(batches, dtype=np.float64)
    rec = np.zeros(b.shape + (3,))
    rec[:, :, 0] = b
    rec[:, :, 1] = (b + kappa) * np.asarray(slopes)[:, None]
    return rec


@pytest.mark.parametrize("cls", [DQNAllocator, AutoAllocator])
def test_an_announced_change_is_learned_from_its_first_steps(cls):
    """Two equal ranks; a co-runner that doubles rank 1's time arrives, announced, at an epoch boundary, and the
    next epoch has two steps (fewer than the change test needs). With the reset, rank 1's line after that epoch
    is the new regime's exactly (its fixed cost kept) and the corrected plan stays; without it the two steps
    are held back as a possible outlier, the line is the old one and the plan falls back to the equal split."""
    truth_after = (0.02, 0.002)
    for reset in (True, False):
        alloc = cls(interference=_Table(), hedge=0.0)
        p = BalancePlanner(2, 128, allocator=alloc, warmup_steps=0, regime_reset=reset)
        p.end_epoch(0, _records([[48, 48, 80, 80, 48, 48, 80, 80]] * 2, [1e-3, 1e-3]))
        assert p.plan == [64, 64]
        alloc.set_context(devices=["a", "a"], corunners=[None, None], next_corunners=[None, "video"])
        p.replan()
        assert p.plan == [88, 40]  # (88 + 10) * 1e-3 = 0.098 s, (40 + 10) * 2e-3 = 0.1 s
        assert alloc.changed_ranks == [1]
        assert p.state_dict()["regime_reset"] == ([1] if reset else [])
        p.end_epoch(1, _records([[88, 88], [40, 40]], [1e-3, 2e-3]))
        lines = p.model_params()
        if reset:
            assert lines.intercept[1] == pytest.approx(truth_after[0], rel=1e-9)
            assert lines.slope[1] == pytest.approx(truth_after[1], rel=1e-9)
            assert p.plan == [88, 40]
        else:
            assert lines.slope[1] == pytest.approx(1e-3, rel=1e-9)  # the old regime's line, unchanged
            assert p.plan == [64, 64]
    # A checkpoint taken between the announcement and the next steps keeps the pending reset.
    fresh = BalancePlanner(2, 128, allocator=cls(interference=_Table(), hedge=0.0), warmup_steps=0)
    fresh.end_epoch(0, _records([[48, 48, 80, 80, 48, 48, 80, 80]] * 2, [1e-3, 1e-3]))
    alloc = fresh.allocator
    alloc.set_context(devices=["a", "a"], corunners=[None, None], next_corunners=[None, "video"])
    fresh.replan()
    resumed = BalancePlanner(2, 128, allocator=cls(interference=_Table(), hedge=0.0), warmup_steps=0)
    resumed.load_state_dict(fresh.state_dict())
    resumed.end_epoch(1, _records([[88, 88], [40, 40]], [1e-3, 2e-3]))
    assert resumed.model_params().slope[1] == pytest.approx(truth_after[1], rel=1e-9)


def test_forget_levels_keeps_the_fixed_cost_and_checks_its_rows():
    bank = TimeModelBank(2, half_life=6.0)
    b = np.array([[48.0, 80.0] * 4] * 2)
    bank.observe(b, (b + 10.0) * 1e-3)
    bank.forget_levels([1])
    assert bool(bank.lines().known[0]) and not bool(bank.lines().known[1])
    bank.observe(np.array([[48.0], [40.0]]), np.array([[0.058], [0.1]]))
    assert bank.lines().intercept[1] == pytest.approx(0.02, rel=1e-9)
    bank.forget_levels([])  # nothing to forget
    with pytest.raises(ValueError, match="rows"):
        bank.forget_levels([2])


def test_a_pending_reset_follows_renumbered_ranks_and_can_be_turned_off():
    def announced(reset: bool) -> BalancePlanner:
        alloc = DQNAllocator(interference=_Table(), hedge=0.0)
        p = BalancePlanner(3, 96, allocator=alloc, warmup_steps=0, regime_reset=reset)
        p.end_epoch(0, _records([[16, 48] * 4] * 3, [1e-3] * 3))
        alloc.set_context(devices=["a"] * 3, corunners=[None] * 3, next_corunners=[None, "video", None])
        p.replan()
        return p

    p = announced(True)
    assert p.state_dict()["regime_reset"] == [1]
    p.follow_ranks([1, 0, 2])
    assert p.state_dict()["regime_reset"] == [0]
    p.follow_ranks([-1, 2, 0])  # rank 0 is new, rank 2 was rank 0
    assert p.state_dict()["regime_reset"] == [2]
    assert announced(False).state_dict()["regime_reset"] == []
    with pytest.raises(ValueError, match="regime_reset"):
        BalancePlanner(2, 8, regime_reset="yes")


class _Recording(ScriptedComm):
    """A :class:`ScriptedComm` whose rank 0 leaves each broadcast in ``root`` (shared with rank 1's comm)."""

    def broadcast_object(self, obj, name: str, root: int = 0):
        out = super().broadcast_object(obj, name, root)
        self.root[name] = out
        return out


def test_every_rank_takes_the_reset_that_only_rank_0_could_see():
    """Only rank 0's allocator holds the cluster context that announces rank 1's new co-runner, so only it finds
    ``changed_ranks``; rank 1 takes the pending reset with the plan (at a mid-epoch replan and at an epoch end), and
    both ranks' time models and predicted step times stay alike (so every rank's history is the same)."""
    batches = [[48, 48, 80, 80, 48, 48, 80, 80]] * 2
    coords, sent = [], {}
    for rank in (0, 1):
        alloc = DQNAllocator(interference=_Table(), hedge=0.0)
        comm = _Recording(rank=rank, world=2)
        comm.root = sent  # rank 0 writes its broadcasts, rank 1 reads them
        coords.append(PlanCoordinator(BalancePlanner(2, 128, allocator=alloc, warmup_steps=0), comm))
    coords[0].planner.allocator.set_context(devices=["a", "a"], corunners=[None, None],
                                            next_corunners=[None, "video"])

    def both(call):  # rank 0 first: rank 1 reads what it sent
        return [call(coords[rank], rank) for rank in (0, 1)]

    def epoch(epoch: int, rec: np.ndarray) -> list:
        for rank in (0, 1):  # each rank's peer contributes its header and records
            coords[rank].comm.others = {"hetero_plugins.header": [np.array([rec.shape[1], 0.5, -1.0])],
                                        "hetero_plugins.records": [rec[1 - rank]]}
        return both(lambda c, r: c.end_epoch(epoch, rec[r], elapsed=0.5))

    entries = epoch(0, _records(batches, [1e-3, 1e-3]))
    assert entries[0] == entries[1]
    assert coords[0].planner.allocator.changed_ranks == [1] and coords[1].planner.allocator.changed_ranks == []
    assert [c.planner.pending_reset for c in coords] == [[1], [1]]
    plans = both(lambda c, r: c.replan())  # mid-epoch, on what is known: the same pending reset is sent again
    assert plans[0] == plans[1] and [c.planner.pending_reset for c in coords] == [[1], [1]]
    entries = epoch(1, _records([[88, 88], [40, 40]], [1e-3, 2e-3]))
    assert entries[0] == entries[1]
    lines = [c.planner.model_params() for c in coords]
    assert lines[0].intercept[1] == pytest.approx(0.02, rel=1e-9) and lines[0].slope[1] == pytest.approx(0.002)
    np.testing.assert_array_equal(lines[0].intercept, lines[1].intercept)
    np.testing.assert_array_equal(lines[0].slope, lines[1].slope)
    assert coords[0].planner.predicted_step_time == coords[1].planner.predicted_step_time
    assert coords[0].planner.history == coords[1].planner.history
    # Rank 0's moves set the damping of both: either rank's checkpoint resumes the same run.
    assert coords[0].planner.state_dict() == coords[1].planner.state_dict()


def test_a_bad_pending_reset_names_the_argument():
    p = BalancePlanner(2, 8)
    p.pending_reset = [1, 1, 0]
    assert p.pending_reset == [0, 1]
    with pytest.raises(ValueError, match="pending_reset.*world_size 2"):
        p.pending_reset = [2]
    with pytest.raises(ValueError, match="pending_reset"):
        p.pending_reset = [-1]
