"""Allocators: split a fixed global batch into per-rank batch sizes from per-rank time models.

Every allocator implements ``allocate(models, global_batch, bounds) -> list[int]``; the result always sums
to exactly ``global_batch`` and respects each rank's ``[min, max]`` bounds. Integer plans are exact for each
allocator's objective (:func:`min_makespan_split`, :func:`min_spread_split`), not rounded continuous shares.
The global batch never changes, so the SGD update keeps its mathematics.

- ``static``: equal split, the stock behaviour of DDP and Horovod.
- ``proportional``: b_i proportional to measured throughput (DBS/DLB, Ye et al. 2020/2022; LB-BSP's
  b_i = B v_i / sum v_j, Chen et al. SoCC'18): the shortest-step integer split for times b_i / v_i.
- ``equal_finish``: for linear time models a_i + beta_i b_i, the integer split with the shortest predicted
  step (the exact integer version of a_i + beta_i b_i = T for all i, with bounds).
- ``lbb``: LBB's objective, min (max - min) of predicted times, solved exactly on a re-plan, with LBB's
  hysteresis: a current plan whose predicted straggler level is at most ``tolerance`` is kept, up to
  ``fine_threshold`` only +/-1 moves are made (Yao et al. 2024).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.balancing.splits import min_makespan_split, min_spread_split
from hetero_plugins.balancing.time_model import TimeModelLines, TimeModelParams

__all__ = [
    "ALLOCATORS",
    "Allocator",
    "Bounds",
    "EqualFinishAllocator",
    "equal_finish_time",
    "fitted_models",
    "knee_arrays",
    "LBBAllocator",
    "reroute_backlog",
    "ProportionalAllocator",
    "StaticAllocator",
    "get_allocator",
    "largest_remainder",
    "min_makespan_split",
    "min_spread_split",
    "predicted_times",
    "register_allocator",
]


@dataclass(frozen=True)
class Bounds:
    """Per-rank limits on the local batch size (inclusive).

    Args:
        min_batch: smallest local batch of each rank.
        max_batch: largest local batch of each rank (a memory cap goes here).
    """

    min_batch: tuple[int, ...]
    max_batch: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.min_batch) != len(self.max_batch) or not self.min_batch:
            raise ValueError(
                f"`min_batch` and `max_batch` must have one entry per rank, got {len(self.min_batch)} and "
                f"{len(self.max_batch)}."
            )
        ints = set(map(type, self.min_batch)) | set(map(type, self.max_batch)) == {int}
        if ints and min(self.min_batch) >= 1 and all(map(int.__ge__, self.max_batch, self.min_batch)):
            return  # the common case, checked without building a message per rank
        for r, (lo, hi) in enumerate(zip(self.min_batch, self.max_batch)):
            check_int(f"min_batch[{r}]", lo, minimum=1, hint="every rank needs at least one sample per step")
            check_int(f"max_batch[{r}]", hi, minimum=lo, hint=f"max_batch[{r}] must be >= min_batch[{r}]={lo}")

    @classmethod
    def uniform(cls, world_size: int, min_batch: int = 1, max_batch: int | None = None) -> Bounds:
        """The same bounds for every rank; ``max_batch=None`` means unbounded."""
        check_int("world_size", world_size, minimum=1)
        hi = max_batch if max_batch is not None else 2**31 - 1
        return cls((min_batch,) * world_size, (hi,) * world_size)

    @property
    def world_size(self) -> int:
        return len(self.min_batch)

    def admits(self, plan: Sequence[int]) -> bool:
        """Whether ``plan`` has one batch per rank, each within that rank's bounds."""
        return len(plan) == self.world_size and all(
            lo <= b <= hi for b, lo, hi in zip(plan, self.min_batch, self.max_batch))

    def check_feasible(self, global_batch: int) -> None:
        """Raise ``ValueError`` if no split of ``global_batch`` satisfies these bounds."""
        check_int("global_batch", global_batch, minimum=1)
        lo, hi = sum(self.min_batch), sum(self.max_batch)
        if global_batch < lo:
            raise ValueError(
                f"`global_batch`={global_batch} is smaller than world size x minimum batch = {lo} "
                f"(min_batch={list(self.min_batch)}). HINT: raise the per-rank batch size or lower `min_batch_size`."
            )
        if global_batch > hi:
            raise ValueError(
                f"`global_batch`={global_batch} exceeds the sum of per-rank maximum batches {hi} "
                f"(max_batch={list(self.max_batch)}). HINT: raise `max_batch_size` or lower the batch size."
            )


def predicted_times(models: Sequence[TimeModelParams], sizes: Sequence[int]) -> list[float]:
    """Each rank's predicted compute seconds for the given local batch sizes."""
    return [m.predict(b) for m, b in zip(models, sizes)]


def largest_remainder(shares: Sequence[float], total: int, bounds: Bounds) -> list[int]:
    """Round non-negative real ``shares`` to integers summing to ``total`` within ``bounds``.

    Floors every share (clamped to its bounds), then hands the missing units to the largest fractional parts
    (or takes surplus units from the smallest), never crossing a bound.

    Example::

        >>> largest_remainder([1.5, 1.5, 1.0], 4, Bounds.uniform(3))
        [2, 1, 1]
    """
    bounds.check_feasible(total)
    x = np.asarray(shares, dtype=np.float64)
    if x.shape != (bounds.world_size,) or not np.all(np.isfinite(x)):
        raise ValueError(f"`shares`={x.tolist()} must hold {bounds.world_size} finite numbers, one per rank. HINT: "
                         "pass each rank's real-valued share of the total.")
    x = np.clip(x, bounds.min_batch, bounds.max_batch)
    out = np.floor(x + 1e-9).astype(np.int64)
    out = np.clip(out, bounds.min_batch, bounds.max_batch)
    frac = x - out
    missing = total - int(out.sum())
    order = sorted(range(len(out)), key=lambda i: (-frac[i], i))
    while missing > 0:
        for i in order:
            if missing == 0:
                break
            if out[i] < bounds.max_batch[i]:
                out[i] += 1
                missing -= 1
    order = sorted(range(len(out)), key=lambda i: (frac[i], -i))
    while missing < 0:
        for i in order:
            if missing == 0:
                break
            if out[i] > bounds.min_batch[i]:
                out[i] -= 1
                missing += 1
    return [int(v) for v in out]


def reroute_backlog(plan: Sequence[int], backlog: Sequence[float], bounds: Bounds, total: int) -> list[int]:
    """``plan`` re-routed so that ranks with a ``backlog`` (extra samples of work per step) get fewer new samples.

    Each rank's new samples shrink by its backlog (down to its lower bound), and what it gives up goes to the ranks
    without backlog in proportion to their batches in ``plan``; the result still sums to ``total``.

    Example::

        >>> reroute_backlog([15, 10, 5], [0, 4, 0], Bounds.uniform(3), 30)
        [18, 6, 6]
    """
    extra = [max(0.0, float(c)) for c in backlog]
    plan = [int(b) for b in plan]
    if len(extra) != len(plan) or not all(math.isfinite(c) for c in extra):
        raise ValueError(f"`backlog`={list(backlog)} must hold one finite number per rank ({len(plan)}). HINT: pass "
                         "each rank's extra samples per step, 0 where it has none.")
    if not any(extra):
        return plan
    give = [min(c, b - lo) for c, b, lo in zip(extra, plan, bounds.min_batch)]
    weights = [b if c == 0 else 0.0 for b, c in zip(plan, extra)]
    if not any(weights) or sum(give) <= 0:
        return plan
    pool, total_w = sum(give), sum(weights)
    target = [b - g + pool * w / total_w for b, g, w in zip(plan, give, weights)]
    lo = tuple(min(b, lo) for b, lo in zip(plan, bounds.min_batch))
    return largest_remainder(target, total, Bounds(lo, bounds.max_batch))


def _line_arrays(models: Sequence[TimeModelParams | None]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(intercept, slope)`` arrays of fitted lines, or ``None`` when a rank has no usable line (no model, or a
    slope that is not finite and positive). A :class:`~hetero_plugins.balancing.time_model.TimeModelLines`
    (what the planner passes) is read without building one object per rank."""
    if isinstance(models, TimeModelLines):
        if not models.known.all():
            return None
        a, s = models.intercept, models.slope
    else:
        if any(m is None for m in models):
            return None
        a = np.fromiter((m.intercept for m in models), dtype=np.float64, count=len(models))  # type: ignore[union-attr]
        s = np.fromiter((m.slope for m in models), dtype=np.float64, count=len(models))  # type: ignore[union-attr]
    if not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(a))):
        return None
    return a, s


def knee_arrays(models: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(knee, beyond)`` of a :class:`~hetero_plugins.balancing.time_model.TimeModelLines` that has them (the
    planner's ``extrapolate="proportional"``), else ``(None, None)``: the lines hold at every batch size."""
    knee, beyond = getattr(models, "knee", None), getattr(models, "beyond", None)
    if knee is None or beyond is None:
        return None, None
    return np.asarray(knee, dtype=np.float64), np.asarray(beyond, dtype=np.float64)


def fitted_models(models: Sequence[TimeModelParams | None]) -> list[TimeModelParams] | None:
    """``models`` as a list when every rank has a usable fitted line (finite, positive slope), else ``None``
    (an allocator then keeps the current plan or splits equally)."""
    if any(m is None or not math.isfinite(m.slope) or m.slope <= 0 for m in models):
        return None
    return list(models)  # type: ignore[arg-type]


class Allocator(ABC):
    """Splits ``global_batch`` into per-rank local batches from per-rank time models.

    Two optional methods let an allocator that corrects the fitted lines (the learned ones, for announced
    co-runner changes) keep the planner on its corrections: ``predict_makespan(models, plan)`` (the planner's
    damping gate asks it instead of the fitted lines) and ``lines(models, world_size) -> (intercepts, slopes)``
    (the lines of its last decision, on which the planner places the samples it moves when it clips a plan).

    ``reads_knees = True`` says that it splits on the lines' knees where they have them
    (:attr:`~hetero_plugins.balancing.lines.TimeModelLines.knee`, the planner's ``extrapolate="proportional"``);
    for any other allocator the planner decides and gates on the plain lines.
    """

    name: str = "allocator"
    #: whether :meth:`allocate` splits on the lines' knees (``TimeModelLines.knee`` / ``beyond``)
    reads_knees: bool = False
    #: ranks whose speed the context of the last :meth:`allocate` says changes from the steps measured so far (an
    #: announced co-runner change); the planner forgets their measured levels (``BalancePlanner(regime_reset)``)
    changed_ranks: Sequence[int] = ()

    @abstractmethod
    def allocate(
        self,
        models: Sequence[TimeModelParams | None],
        global_batch: int,
        bounds: Bounds,
        current: Sequence[int] | None = None,
    ) -> list[int]:
        """Return per-rank batch sizes (global-rank order) that sum to ``global_batch``.

        ``models[i]`` is rank i's fitted time line or ``None`` where nothing is known yet (then the
        allocator keeps ``current``, or splits equally). ``current`` is the plan in force, for allocators
        with hysteresis.
        """

    def _equal(self, global_batch: int, bounds: Bounds) -> list[int]:
        return largest_remainder([global_batch / bounds.world_size] * bounds.world_size, global_batch, bounds)

    @staticmethod
    def _usable(current: Sequence[int] | None, global_batch: int, bounds: Bounds) -> bool:
        """Whether ``current`` is a plan that may be kept: one size per rank, summing to ``global_batch``, each
        within the rank's bounds (a cap lowered since, e.g. a memory limit, rules the old plan out)."""
        return current is not None and sum(current) == global_batch and bounds.admits(current)

    def _keep_or_equal(self, global_batch: int, bounds: Bounds, current: Sequence[int] | None) -> list[int]:
        if self._usable(current, global_batch, bounds):
            return list(current)  # type: ignore[arg-type]
        return self._equal(global_batch, bounds)


class StaticAllocator(Allocator):
    """Equal split (stock DDP/Horovod behaviour), respecting bounds."""

    name = "static"

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        n = bounds.world_size
        # The most even split within the bounds: the shortest step when every rank has the same time line.
        return min_makespan_split(np.zeros(n), np.ones(n), global_batch, bounds.min_batch, bounds.max_batch).tolist()


class ProportionalAllocator(Allocator):
    """b_i proportional to rank i's throughput at the current mean batch (DBS/DLB, LB-BSP)."""

    name = "proportional"

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        lines = _line_arrays(models)
        if lines is None:
            return self._keep_or_equal(global_batch, bounds, current)
        a, s = lines
        ref = global_batch / bounds.world_size
        per_sample = np.maximum((a + s * ref) / ref, 1e-15)  # 1 / speed: b_i proportional to speed
        return min_makespan_split(np.zeros_like(a), per_sample, global_batch, bounds.min_batch,
                                  bounds.max_batch).tolist()


def equal_finish_time(fixed: Sequence[float] | np.ndarray, slope: Sequence[float] | np.ndarray, global_batch: int,
                      min_batch: float = 1.0) -> float:
    """The continuous equal-finish step time: the shortest makespan of a real-valued split with every rank at
    ``min_batch`` samples or more.

    Where no rank is held at the floor it is ``(B + sum c_i / s_i) / sum 1 / s_i`` and every rank's time
    ``c_i + s_i b_i`` equals it (``c``: fixed seconds per step, data time included where it counts; ``s``: seconds
    per sample). A rank whose fixed cost alone exceeds that time is held at ``min_batch`` and the others share
    the rest, who then finish before it: the step lasts that rank's ``c_i + s_i * min_batch``. So the time is
    ``max(closed form, max_i c_i + s_i * min_batch)``, exactly. Placements are compared by it,
    so a rank that waits for its data longer than the others compute (a data-loading-bound place) costs its full
    wait: the unclamped formula gave it negative samples and priced it as if it helped.

    Example::

        >>> round(equal_finish_time([0.0, 0.0], [0.001, 0.003], 400), 9)  # 300 and 100 samples
        0.3
        >>> round(equal_finish_time([0.0, 0.5], [0.001, 0.001], 400), 4)  # rank 1 waits 0.5 s: held at 1 sample
        0.501
    """
    c = np.asarray(fixed, dtype=np.float64)
    s = np.asarray(slope, dtype=np.float64)
    # With no rank below its floor the closed form is the makespan; with one below, the others cover fewer
    # samples than there and finish before it, so the floor's rank sets the step: the max of the two, exactly.
    unclamped = (global_batch + np.sum(c / s)) / np.sum(1.0 / s)
    return float(max(unclamped, float(np.max(c + s * min_batch))))


def equal_finish_continuous(models: Sequence[TimeModelParams], global_batch: int, bounds: Bounds) -> list[float]:
    """Real-valued sizes with a_i + beta_i b_i = T on every unclamped rank and sum b_i = global_batch."""
    a = np.array([m.intercept for m in models])
    beta = np.array([m.slope for m in models])
    lo = np.asarray(bounds.min_batch, dtype=np.float64)
    hi = np.asarray(bounds.max_batch, dtype=np.float64)
    fixed = np.full(len(a), np.nan)
    x = lo.copy()
    for _ in range(len(a) + 1):
        free = np.isnan(fixed)
        if not free.any():
            break
        rest = global_batch - np.nansum(fixed)
        t = (rest + np.sum(a[free] / beta[free])) / np.sum(1.0 / beta[free])
        x = np.where(free, (t - a) / beta, fixed)
        below, above = free & (x < lo), free & (x > hi)
        if not below.any() and not above.any():
            break
        fixed[below], fixed[above] = lo[below], hi[above]
    return list(np.clip(x, lo, hi))


class EqualFinishAllocator(Allocator):
    """Equal finishing time for linear models: the integer split with the shortest predicted step
    (:func:`min_makespan_split`, exact; its continuous relaxation is :func:`equal_finish_continuous`)."""

    name = "equal_finish"
    reads_knees = True

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        lines = _line_arrays(models)
        if lines is None:
            return self._keep_or_equal(global_batch, bounds, current)
        knee, beyond = knee_arrays(models)
        return min_makespan_split(*lines, global_batch, bounds.min_batch, bounds.max_batch, knee, beyond).tolist()


class LBBAllocator(Allocator):
    """LBB: minimise max - min predicted time, with fine (+/-1) and coarse (re-solve) tuning and hysteresis.

    The coarse re-solve is exact (:func:`min_spread_split`: the smallest spread, among those the shortest
    step); where that would scan too many candidate times it starts from the shortest-step split and
    fine-tunes.

    Args:
        tolerance: keep the current plan while its predicted straggler level is at most this (LBB: 0.06).
        fine_threshold: up to this level, only move single samples from the slowest to the fastest rank.
    """

    name = "lbb"

    def __init__(self, tolerance: float = 0.06, fine_threshold: float = 0.15) -> None:
        self.tolerance = check_float("tolerance", tolerance, minimum=0.0)
        self.fine_threshold = check_float("fine_threshold", fine_threshold, minimum=self.tolerance)

    @staticmethod
    def _level(t: Sequence[float]) -> float:
        mean = sum(t) / len(t)
        return (max(t) - min(t)) / mean if mean > 0 else 0.0

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        lines = _line_arrays(models)
        if lines is None:
            return self._keep_or_equal(global_batch, bounds, current)
        fitted = [TimeModelParams(float(x), float(y)) for x, y in zip(*lines)]
        valid_current = self._usable(current, global_batch, bounds)
        if valid_current:
            level = self._level(predicted_times(fitted, current))  # type: ignore[arg-type]
            if level <= self.tolerance:
                return list(current)  # type: ignore[arg-type]
            start = list(current) if level <= self.fine_threshold else None  # type: ignore[arg-type]
        else:
            start = None
        if start is None:
            exact = min_spread_split(*lines, global_batch, bounds.min_batch, bounds.max_batch)
            if exact is not None:
                return exact.tolist()
            start = EqualFinishAllocator().allocate(models, global_batch, bounds)
        return self._fine_tune(fitted, start, bounds)

    @staticmethod
    def _score(t: Sequence[float]) -> tuple[float, int]:
        """What fine-tuning lowers: the spread, then how many ranks share the slowest or the fastest time
        (with two ranks tied slowest, no single move lowers the spread, but moving one is progress)."""
        top, low = max(t), min(t)
        return top - low, sum(x >= top - 1e-12 for x in t) + sum(x <= low + 1e-12 for x in t)

    def _fine_tune(self, models: list[TimeModelParams], sizes: list[int], bounds: Bounds) -> list[int]:
        sizes = list(sizes)
        for _ in range(4 * sum(sizes)):
            t = predicted_times(models, sizes)
            spread, ties = self._score(t)
            best: tuple[float, int, int, int] | None = None
            order = np.argsort(t, kind="stable")
            for slow in order[::-1][:2]:
                for fast in order[:2]:
                    if slow == fast or sizes[slow] <= bounds.min_batch[slow] or sizes[fast] >= bounds.max_batch[fast]:
                        continue
                    trial = list(sizes)
                    trial[slow] -= 1
                    trial[fast] += 1
                    s, k = self._score(predicted_times(models, trial))
                    better = s < spread - 1e-12 or (s <= spread + 1e-12 and k < ties)
                    if better and (best is None or (s, k) < best[:2]):
                        best = (s, k, int(slow), int(fast))
            if best is None:
                break
            sizes[best[2]] -= 1
            sizes[best[3]] += 1
        return sizes


ALLOCATORS: dict[str, type[Allocator]] = {
    "static": StaticAllocator,
    "proportional": ProportionalAllocator,
    "equal_finish": EqualFinishAllocator,
    "lbb": LBBAllocator,
}


def register_allocator(name: str, cls: type[Allocator], *, override: bool = False) -> None:
    """Make ``cls`` available by ``name`` to :func:`get_allocator` (and every ``allocator=`` option).

    The learned ``dqn`` / ``auto`` of :mod:`hetero_plugins.scheduler` register themselves this way when that
    package is imported (``import hetero_plugins`` does). Registering a name again with another class needs
    ``override=True``; registering the same class again does nothing.

    Example::

        >>> class Halves(StaticAllocator):
        ...     name = "halves"
        >>> register_allocator("halves", Halves)
        >>> get_allocator("halves").allocate([None, None], 8, Bounds.uniform(2))
        [4, 4]
        >>> del ALLOCATORS["halves"]
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty string, got {name!r}. HINT: e.g. register_allocator('mine', MyAllocator).")
    if not isinstance(cls, type) or not issubclass(cls, Allocator):
        raise ValueError(f"`cls`={cls!r} is not an Allocator subclass. HINT: subclass "
                         "hetero_plugins.balancing.allocators.Allocator and implement allocate().")
    known = ALLOCATORS.get(name)
    if known is not None and known is not cls and not override:
        raise ValueError(f"allocator {name!r} is already registered as {known.__module__}.{known.__qualname__}. "
                         "HINT: pick another name, or pass override=True to replace it.")
    ALLOCATORS[name] = cls


def get_allocator(name: str | Allocator) -> Allocator:
    """An allocator instance from its registered name (``static``, ``proportional``, ``equal_finish``, ``lbb``,
    the learned ``dqn`` / ``auto`` of :mod:`hetero_plugins.scheduler`, and any added by
    :func:`register_allocator`); an :class:`Allocator` instance passes through."""
    if isinstance(name, Allocator):
        return name
    if not isinstance(name, str) or name not in ALLOCATORS:
        raise ValueError(f"`allocator` must be one of {sorted(ALLOCATORS)}, got {name!r}. HINT: use one of these "
                         "names, pass an Allocator instance, or register a class with register_allocator(name, cls).")
    return ALLOCATORS[name]()
