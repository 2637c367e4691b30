"""Unit tests of the pseudo-synchronous corrector/exchange and of local SGD averaging (ranks simulated in-process)."""

from __future__ import annotations

import doctest
import math
import re
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import hetero_plugins.aggregation.local_sgd as local_sgd_mod
import hetero_plugins.aggregation.pseudo_sync as pseudo_sync_mod
from hetero_plugins.aggregation.local_sgd import LocalSGDSchedule, weighted_average_
from hetero_plugins.aggregation.pseudo_sync import CompletedHandle, DelayedExchange, PseudoSyncCorrector


class SimWorld:
    """In-process stand-in for R ranks: a collective keyed by (name, call index) sums the ranks' tensors in rank
    order once all have contributed; ranks run in threads so blocking waits behave as in a real job."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._cond = threading.Condition()
        self._slots: dict[Any, dict[int, torch.Tensor]] = defaultdict(dict)
        self.calls: dict[Any, int] = defaultdict(int)

    def contribute(self, key: Any, rank: int, t: torch.Tensor) -> None:
        with self._cond:
            self._slots[key][rank] = t.detach().clone()
            self._cond.notify_all()

    def result(self, key: Any) -> torch.Tensor:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self._slots[key]) == self.ranks, timeout=20), key
            parts = self._slots[key]
            out = parts[0].clone()
            for r in range(1, self.ranks):
                out += parts[r]
            return out

    def allreduce(self, rank: int, name: str = "ar") -> Callable[[torch.Tensor], torch.Tensor]:
        counter = [0]

        def fn(t: torch.Tensor) -> torch.Tensor:
            key = (name, counter[0])
            counter[0] += 1
            self.contribute(key, rank, t)
            return self.result(key)

        return fn

    def launch(self, rank: int, name: str = "async") -> Callable[[torch.Tensor], CompletedHandle]:
        counter = [0]
        world = self

        class _Handle:
            def __init__(self, key: Any) -> None:
                self.key = key

            def wait(self) -> torch.Tensor:
                return world.result(self.key)

        def fn(t: torch.Tensor) -> Any:
            key = (name, counter[0])
            counter[0] += 1
            self.contribute(key, rank, t)
            return _Handle(key)

        return fn

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        with ThreadPoolExecutor(self.ranks) as ex:
            return list(ex.map(fn, range(self.ranks)))


# ---------------------------------------------------------------------------------------------- pseudo-sync


def test_min_confidence_one_returns_previous_reduced_gradient_exactly():
    R, steps = 3, 5
    g = torch.Generator().manual_seed(0)
    local = [[torch.randn(7, generator=g) for _ in range(R)] for _ in range(steps)]
    world = SimWorld(R)

    def rank(r: int) -> list[Any]:
        ex, corr = DelayedExchange(world.launch(r)), PseudoSyncCorrector(min_confidence=1.0)
        out = []
        for k in range(steps):
            prev = ex.exchange(local[k][r] / R)
            out.append(None if prev is None else corr.combine(prev))
            assert corr.confidence == 1.0
        out.append(corr.combine(ex.flush()))
        return out

    results = world.run(rank)
    for r in range(R):
        assert results[r][0] is None
        for k in range(steps):
            expected = local[k][0] / R + local[k][1] / R + local[k][2] / R
            assert torch.equal(results[r][k + 1], expected)
            assert torch.equal(results[r][k + 1], results[0][k + 1])


def test_confidence_follows_cosine_and_is_clipped():
    c = PseudoSyncCorrector(smoothing=0.9, min_confidence=0.5)
    assert c.confidence == 1.0
    c.combine(torch.tensor([1.0, 0.0]))
    assert c.confidence == 1.0  # first call
    c.combine(torch.tensor([0.8, 0.6]))  # cos = 0.8
    assert c.confidence == pytest.approx(0.8, abs=1e-6)
    c.combine(torch.tensor([0.8, -0.6]))  # cos(prev, new) = 0.64 - 0.36 = 0.28 -> clipped to 0.5
    assert c.confidence == pytest.approx(0.5)
    c.combine(torch.tensor([-0.8, 0.6]))  # cos = -1 -> 0.5
    assert c.confidence == pytest.approx(0.5)
    c.combine(torch.tensor([-1.6, 1.2]))  # same direction, twice the norm: cos = 1
    assert c.confidence == pytest.approx(1.0, abs=1e-6)
    c.combine(torch.zeros(2))  # undefined cosine counts as no agreement
    assert c.confidence == pytest.approx(0.5)

    c0 = PseudoSyncCorrector(min_confidence=0.0)
    c0.combine(torch.tensor([1.0, 1.0]))
    c0.combine(torch.tensor([-1.0, -1.0]))
    assert c0.confidence == 0.0


def test_smoothing_recursion_matches_hand_computation():
    beta, amin = 0.7, 0.2
    g = torch.Generator().manual_seed(1)
    base = 2.0 * torch.randn(6, generator=g, dtype=torch.float64)
    grads = [base + 0.8 * torch.randn(6, generator=g, dtype=torch.float64) for _ in range(6)]
    c = PseudoSyncCorrector(smoothing=beta, min_confidence=amin)
    s, prev, confidences = None, None, []
    for G in grads:
        out = c.combine(G)
        if s is None:
            s, a = G.clone(), 1.0
        else:
            s = beta * s + (1 - beta) * G
            cos = float(G @ prev / (G.norm() * prev.norm()))
            a = min(1.0, max(amin, cos))
        prev = G.clone()
        confidences.append(a)
        assert torch.allclose(out, a * G + (1 - a) * s, atol=1e-12, rtol=0)
        assert c.confidence == pytest.approx(a, abs=1e-12)
    assert len(set(confidences)) > 2  # the sequence exercised several confidences


def test_non_finite_gradient_passes_through_and_keeps_state():
    c = PseudoSyncCorrector(smoothing=0.5, min_confidence=0.0)
    c.combine(torch.tensor([1.0, 0.0]))
    before = c.state_dict()
    bad = torch.tensor([float("inf"), 1.0])
    out = c.combine(bad)
    assert torch.equal(out, bad)
    after = c.state_dict()
    assert torch.equal(after["smoothed"], before["smoothed"]) and torch.equal(after["previous"], before["previous"])
    assert c.confidence == 1.0
    assert torch.allclose(c.combine(torch.tensor([0.0, 1.0])), torch.tensor([0.5, 0.5]))


def test_corrector_state_round_trip():
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(5, generator=g) for _ in range(5)]
    a = PseudoSyncCorrector(smoothing=0.8, min_confidence=0.3)
    for G in grads[:3]:
        a.combine(G)
    b = PseudoSyncCorrector(smoothing=0.8, min_confidence=0.3)
    b.load_state_dict(a.state_dict())
    assert b.calls == 3 and b.confidence == pytest.approx(a.confidence)
    for G in grads[3:]:
        assert torch.equal(a.combine(G), b.combine(G))
    fresh = PseudoSyncCorrector()
    fresh.load_state_dict(PseudoSyncCorrector().state_dict())
    assert torch.equal(fresh.combine(grads[0]), grads[0])


def test_delayed_exchange_returns_previous_step_and_flush_returns_last():
    R, steps = 4, 4
    world = SimWorld(R)

    def rank(r: int) -> list[Any]:
        ex = DelayedExchange(world.launch(r))
        out = [ex.exchange(torch.full((3,), float(10 * k + r))) for k in range(steps)]
        assert ex.pending and ex.launched == steps
        out.append(ex.flush())
        assert not ex.pending and ex.flush() is None
        return out

    for out in world.run(rank):
        assert out[0] is None
        for k in range(steps):  # the reduce of step k comes back at call k + 1 (flush for the last)
            assert torch.equal(out[k + 1], torch.full((3,), float(sum(10 * k + r for r in range(R)))))


def test_delayed_exchange_first_step_sync():
    ex = DelayedExchange(lambda t: CompletedHandle(t * 2), first_step_sync=True)
    g0 = ex.exchange(torch.tensor([1.0]))
    assert torch.equal(g0, torch.tensor([2.0]))  # waited at once
    g0[0] = -1.0  # the caller may modify what it got: the kept copy is unaffected
    assert torch.equal(ex.exchange(torch.tensor([3.0])), torch.tensor([2.0]))  # still the newest available
    assert torch.equal(ex.exchange(torch.tensor([5.0])), torch.tensor([6.0]))
    assert torch.equal(ex.flush(), torch.tensor([10.0]))
    assert torch.equal(ex.exchange(torch.tensor([7.0])), torch.tensor([14.0]))  # after a flush: sync again


def test_delayed_exchange_first_step_sync_over_simulated_ranks():
    R = 3
    world = SimWorld(R)

    def rank(r: int) -> list[torch.Tensor]:
        ex = DelayedExchange(world.launch(r), first_step_sync=True)
        return [ex.exchange(torch.tensor([float(k + r)])) for k in range(3)] + [ex.flush()]

    for out in world.run(rank):
        assert [float(t) for t in out] == [3.0, 3.0, 6.0, 9.0]


# ---------------------------------------------------------------------------------------------- local SGD


def _rank_tensors(r: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + r)
    return [
        torch.randn(3, 4, generator=g, dtype=dtype),
        torch.randn(5, generator=g, dtype=dtype),
        torch.randn((), generator=g, dtype=dtype),
        torch.tensor(10 + r),  # e.g. BatchNorm's num_batches_tracked: skipped
    ]


def test_weighted_average_matches_float64_reference_for_uneven_counts():
    R, counts = 4, [3, 0, 7, 1]
    world = SimWorld(R)
    originals = [_rank_tensors(r) for r in range(R)]
    bases = [[t.clone() * 0.5 for t in originals[0]] for _ in range(R)]  # same base on every rank

    def rank(r: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
        ts = [t.clone() for t in originals[r]]
        return ts, weighted_average_(ts, counts[r], world.allreduce(r), base=bases[r])

    results = world.run(rank)
    N = sum(counts)
    for j in range(3):
        ref = sum(counts[r] * originals[r][j] for r in range(R)) / N
        for r in range(R):
            assert (results[r][0][j] - ref).abs().max() <= 1e-12
            assert results[r][0][j].dtype == torch.float64
    for r in range(R):
        assert int(results[r][0][3]) == 10 + r  # integer buffer untouched
        stats = results[r][1]
        assert stats["total_samples"] == N and stats["ranks"] == 3
        assert stats["bytes"] == (12 + 5 + 1 + 3) * 8
    # norm-test statistics: sum_m (n_m / n_bar) ||d_m||^2 and ||d_bar||^2, whose combination is the weighted spread
    active = [r for r in range(R) if counts[r] > 0]
    n_bar = N / len(active)
    deltas = [torch.cat([(originals[r][j] - bases[0][j]).reshape(-1) for j in range(3)]) for r in active]
    d_bar = sum(counts[r] * d for r, d in zip(active, deltas)) / N
    sq_sum = sum(counts[r] / n_bar * float(d @ d) for r, d in zip(active, deltas))
    spread = sum(counts[r] / n_bar * float((d - d_bar) @ (d - d_bar)) for r, d in zip(active, deltas))
    stats = results[0][1]
    assert stats["sq_norm_sum"] == pytest.approx(sq_sum, rel=1e-12)
    assert stats["mean_sq_norm"] == pytest.approx(float(d_bar @ d_bar), rel=1e-12)
    assert stats["sq_norm_sum"] - 3 * stats["mean_sq_norm"] == pytest.approx(spread, rel=1e-9)


def test_weighted_average_with_no_samples_leaves_tensors_unchanged():
    R = 3
    world = SimWorld(R)
    originals = [_rank_tensors(r) for r in range(R)]

    def rank(r: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
        ts = [t.clone() for t in originals[r]]
        return ts, weighted_average_(ts, 0, world.allreduce(r))

    for r, (ts, stats) in enumerate(world.run(rank)):
        assert all(torch.equal(a, b) for a, b in zip(ts, originals[r]))
        assert stats["total_samples"] == 0 and stats["ranks"] == 0 and stats["bytes"] == 21 * 8


def test_weighted_average_buffer_dtype_and_single_allreduce():
    calls: list[torch.Tensor] = []

    def allreduce(b: torch.Tensor) -> torch.Tensor:
        calls.append(b.clone())
        return b * 2  # two identical ranks

    ts = _rank_tensors(0, dtype=torch.float32)
    before = [t.clone() for t in ts]
    stats = weighted_average_(ts, 4, allreduce)
    assert len(calls) == 1 and calls[0].dtype == torch.float32 and stats["bytes"] == 21 * 4
    assert stats["total_samples"] == 8 and stats["ranks"] == 2
    assert all(torch.allclose(a, b) for a, b in zip(ts, before))
    assert ts[0].dtype == torch.float32
    stats = weighted_average_(_rank_tensors(0, dtype=torch.float16), 4, allreduce)
    assert calls[-1].dtype == torch.float32  # half parameters are accumulated in at least float32
    stats = weighted_average_(ts, 4, allreduce, dtype=torch.float64)
    assert calls[-1].dtype == torch.float64 and stats["bytes"] == 21 * 8


def test_schedule_averages_every_h_steps_and_counts_rounds():
    s = LocalSGDSchedule(local_steps=3)
    flags = [s.step_done(8 + k % 2) for k in range(3)]
    assert flags == [False, False, True] and s.samples_since_average == 25
    s.averaged()
    assert s.communication_rounds == 1 and s.samples_since_average == 0 and s.steps_since_average == 0
    for _ in range(4):
        for k in range(3):
            if s.step_done(8):
                s.averaged()
    assert s.communication_rounds == 5
    assert s.suggest_global_batch(64, sq_norm_sum=1e6, mean_sq_norm=1e-6, ranks=4) == 64  # adaptive=False
    h1 = LocalSGDSchedule(local_steps=1)
    assert all(h1.step_done(1) for _ in range(3))


def _norm_test_stats(sigma2: float, ranks: int, per_rank: int, seed: int) -> dict[str, Any]:
    """Deltas d_m = mu + noise with per-sample variance sigma2 per coordinate, each averaging `per_rank` samples."""
    dim = 2000
    mu = torch.full((dim,), 0.1, dtype=torch.float64)
    world = SimWorld(ranks)

    def rank(r: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed * 1000 + r)
        d = mu + math.sqrt(sigma2 / per_rank) * torch.randn(dim, generator=g, dtype=torch.float64)
        return weighted_average_([d], per_rank, world.allreduce(r), base=[torch.zeros(dim, dtype=torch.float64)])

    return world.run(rank)[0]


def test_norm_test_grows_batch_when_variance_dominates_only():
    M, b, eta = 8, 64, 0.8
    s = LocalSGDSchedule(local_steps=1, adaptive=True, tolerance=eta)
    current = M * b
    # high variance: V = 100 * 2000 per sample; E||d_bar||^2 = 20 + V / N -> expected global ~ V / (eta^2 E||d_bar||^2)
    stats = _norm_test_stats(100.0, M, b, seed=1)
    V, N = 100.0 * 2000, M * b
    expected = V / (eta**2 * (20 + V / N))
    new = s.suggest_global_batch(current, stats["sq_norm_sum"], stats["mean_sq_norm"], M)
    assert new > current and new % M == 0
    assert new == pytest.approx(expected, rel=0.1)
    assert s.last_test["sigma2"] == pytest.approx(V, rel=0.05)  # the per-sample variance is recovered
    exact_b = stats["total_samples"] / stats["ranks"]
    assert new == s.suggest_global_batch(current, stats["sq_norm_sum"], stats["mean_sq_norm"], M, exact_b)
    # low variance: the test is satisfied, the batch stays
    low = _norm_test_stats(0.1, M, b, seed=2)
    assert s.suggest_global_batch(current, low["sq_norm_sum"], low["mean_sq_norm"], M) == current


def test_norm_test_is_monotone_capped_and_degenerate_safe():
    M = 8
    s = LocalSGDSchedule(local_steps=1, adaptive=True, tolerance=0.8, max_global_batch=2000)
    batch, seen = M * 64, []
    for k, sigma2 in enumerate([100.0, 0.1, 100.0, 0.01, 100.0, 100.0, 100.0, 0.1]):
        st = _norm_test_stats(sigma2, M, batch // M, seed=10 + k)  # each rank's delta averages its batch
        batch = s.suggest_global_batch(batch, st["sq_norm_sum"], st["mean_sq_norm"], M)
        seen.append(batch)
    assert seen == sorted(seen) and seen[0] > M * 64 and seen[1] == seen[0] and seen[-1] == 2000
    assert s.suggest_global_batch(64, 5.0, 0.0, 4) == 64  # zero mean delta: no information
    assert s.suggest_global_batch(64, 5.0, 1.0, 1) == 64  # one rank: no variance estimate
    assert s.suggest_global_batch(64, 1e300, 1e-300, 4) == 2000  # overflow goes to the cap


def test_schedule_state_round_trip():
    s = LocalSGDSchedule(local_steps=2, adaptive=True, max_global_batch=512)
    s.step_done(8), s.step_done(8), s.averaged(), s.step_done(5)
    s.suggest_global_batch(64, 4.0, 0.5, 4)
    t = LocalSGDSchedule(local_steps=2, adaptive=True, max_global_batch=512)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    assert t.step_done(5) and t.samples_since_average == 10 and t.communication_rounds == 1


# ---------------------------------------------------------------------------------------------- errors, docs


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: PseudoSyncCorrector(smoothing=1.0), "smoothing"),
        (lambda: PseudoSyncCorrector(smoothing=-0.1), "smoothing"),
        (lambda: PseudoSyncCorrector(min_confidence=1.5), "min_confidence"),
        (lambda: PseudoSyncCorrector(min_confidence="high"), "min_confidence"),
        (lambda: PseudoSyncCorrector().combine(torch.zeros(2, 2)), "reduced"),
        (lambda: PseudoSyncCorrector().combine(torch.zeros(2, dtype=torch.long)), "reduced"),
        (lambda: _two_calls(torch.zeros(2), torch.zeros(3)), "reduced"),
        (lambda: PseudoSyncCorrector().load_state_dict({}), "state"),
        (lambda: DelayedExchange(5), "launch"),
        (lambda: DelayedExchange(CompletedHandle, first_step_sync=1), "first_step_sync"),
        (lambda: LocalSGDSchedule(local_steps=0), "local_steps"),
        (lambda: LocalSGDSchedule(local_steps=2.5), "local_steps"),
        (lambda: LocalSGDSchedule(adaptive="yes"), "adaptive"),
        (lambda: LocalSGDSchedule(tolerance=0.0), "tolerance"),
        (lambda: LocalSGDSchedule(max_global_batch=0), "max_global_batch"),
        (lambda: LocalSGDSchedule().step_done(-1), "samples"),
        (lambda: LocalSGDSchedule().suggest_global_batch(0, 1.0, 1.0, 2), "current_global_batch"),
        (lambda: LocalSGDSchedule().suggest_global_batch(8, -1.0, 1.0, 2), "sq_norm_sum"),
        (lambda: LocalSGDSchedule().suggest_global_batch(8, 1.0, float("nan"), 2), "mean_sq_norm"),
        (lambda: LocalSGDSchedule().suggest_global_batch(8, 1.0, 1.0, 0), "ranks"),
        (lambda: LocalSGDSchedule().suggest_global_batch(8, 1.0, 1.0, 2, 0.0), "samples_per_rank"),
        (lambda: LocalSGDSchedule().load_state_dict({"steps_since_average": 0}), "state"),
        (lambda: weighted_average_([torch.zeros(2)], -1, lambda b: b), "samples"),
        (lambda: weighted_average_([torch.zeros(2)], 1, None), "allreduce"),
        (lambda: weighted_average_([torch.zeros(2)], 1, lambda b: b[:1]), "allreduce"),
        (lambda: weighted_average_([torch.zeros(2)], 1, lambda b: b, base=[]), "base"),
        (lambda: weighted_average_([torch.zeros(2)], 1, lambda b: b, base=[torch.zeros(3)]), "base[0]"),
        (lambda: weighted_average_([torch.zeros(2)], 1, lambda b: b, dtype=torch.int64), "dtype"),
        (lambda: weighted_average_([torch.zeros(2, dtype=torch.cfloat)], 1, lambda b: b), "tensors[0]"),
        (lambda: weighted_average_([[1.0]], 1, lambda b: b), "tensors[0]"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(make, name):
    with pytest.raises(ValueError, match=re.escape(f"`{name}`")):
        make()


def _two_calls(a: torch.Tensor, b: torch.Tensor) -> None:
    c = PseudoSyncCorrector(min_confidence=0.0)
    c.combine(a)
    c.combine(b)


@pytest.mark.parametrize("module", [pseudo_sync_mod, local_sgd_mod])
def test_docstring_examples(module):
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
