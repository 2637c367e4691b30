"""Allocators: split a fixed global batch into per-rank batch sizes from per-rank time models.

Every allocator implements ``allocate(models, global_batch, bounds) -> list[int]``; the result always sums
to exactly ``global_batch`` and respects each rank's ``[min, max]`` bounds (largest-remainder rounding, then
integer refinement). The global batch never changes, so the SGD update keeps its mathematics.

- ``static``: equal split, the stock behaviour of DDP and Horovod.
- ``proportional``: b_i proportional to measured throughput (DBS/DLB, Ye et al. 2020/2022; LB-BSP's
  b_i = B v_i / sum v_j, Chen et al. SoCC'18).
- ``equal_finish``: the closed form for linear time models, a_i + beta_i b_i = T for all i, with clamping
  to bounds and re-solving for the unclamped ranks, then a makespan-optimal integer rounding.
- ``lbb``: LBB's objective, min (max - min) of predicted times, reached by +/-1 fine-tuning from the
  equal-finish plan, with LBB's hysteresis: a current plan whose predicted straggler level is at most
  ``tolerance`` is kept, up to ``fine_threshold`` only +/-1 moves are made (Yao et al. 2024).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.balancing.time_model import TimeModelParams

__all__ = [
    "ALLOCATORS",
    "Allocator",
    "Bounds",
    "EqualFinishAllocator",
    "equal_finish_time",
    "fitted_models",
    "LBBAllocator",
    "ProportionalAllocator",
    "StaticAllocator",
    "get_allocator",
    "largest_remainder",
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
    x = np.clip(np.asarray(shares, dtype=np.float64), bounds.min_batch, bounds.max_batch)
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


def _clamped_proportional(weights: Sequence[float], total: int, bounds: Bounds) -> list[float]:
    """Continuous shares proportional to ``weights``, clamped to bounds, summing to ``total`` (water-filling)."""
    w = np.asarray(weights, dtype=np.float64)
    lo = np.asarray(bounds.min_batch, dtype=np.float64)
    hi = np.asarray(bounds.max_batch, dtype=np.float64)
    fixed = np.full(len(w), np.nan)
    for _ in range(len(w) + 1):
        free = np.isnan(fixed)
        rest = total - np.nansum(fixed)
        x = np.where(free, w / w[free].sum() * rest if free.any() else 0.0, fixed)
        below, above = free & (x < lo), free & (x > hi)
        if not below.any() and not above.any():
            return list(x)
        fixed[below], fixed[above] = lo[below], hi[above]
    return list(np.clip(x, lo, hi))


def _refine_makespan(models: Sequence[TimeModelParams], sizes: list[int], bounds: Bounds) -> list[int]:
    """+/-1 moves from the rank predicted slowest to the one where the extra sample costs least."""
    sizes = list(sizes)
    for _ in range(4 * sum(sizes)):
        t = predicted_times(models, sizes)
        slow = int(np.argmax(t))
        if sizes[slow] <= bounds.min_batch[slow]:
            break
        cand = [
            (models[j].predict(sizes[j] + 1), j)
            for j in range(len(sizes))
            if j != slow and sizes[j] < bounds.max_batch[j]
        ]
        if not cand:
            break
        t_new, j = min(cand)
        new_slow = models[slow].predict(sizes[slow] - 1)
        rest = max((t[k] for k in range(len(t)) if k not in (slow, j)), default=-math.inf)
        if max(t_new, new_slow, rest) < t[slow] - 1e-12:
            sizes[slow] -= 1
            sizes[j] += 1
        else:
            break
    return sizes


def fitted_models(models: Sequence[TimeModelParams | None]) -> list[TimeModelParams] | None:
    """``models`` as a list when every rank has a usable fitted line (finite, positive slope), else ``None``
    (an allocator then keeps the current plan or splits equally)."""
    if any(m is None or not math.isfinite(m.slope) or m.slope <= 0 for m in models):
        return None
    return list(models)  # type: ignore[arg-type]


class Allocator(ABC):
    """Splits ``global_batch`` into per-rank local batches from per-rank time models."""

    name: str = "allocator"

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

    def _keep_or_equal(self, global_batch: int, bounds: Bounds, current: Sequence[int] | None) -> list[int]:
        if current is not None and sum(current) == global_batch and len(current) == bounds.world_size:
            return list(current)
        return self._equal(global_batch, bounds)


class StaticAllocator(Allocator):
    """Equal split (stock DDP/Horovod behaviour), respecting bounds."""

    name = "static"

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        return self._equal(global_batch, bounds)


class ProportionalAllocator(Allocator):
    """b_i proportional to rank i's throughput at the current mean batch (DBS/DLB, LB-BSP)."""

    name = "proportional"

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        fitted = fitted_models(models)
        if fitted is None:
            return self._keep_or_equal(global_batch, bounds, current)
        ref = global_batch / bounds.world_size
        speed = [ref / max(m.predict(ref), 1e-12) for m in fitted]
        return largest_remainder(_clamped_proportional(speed, global_batch, bounds), global_batch, bounds)


def equal_finish_time(fixed: Sequence[float] | np.ndarray, slope: Sequence[float] | np.ndarray, global_batch: int) -> float:
    """The unclamped continuous equal-finish step time ``(B + sum c_i / s_i) / sum 1 / s_i``.

    Every rank's time ``c_i + s_i b_i`` equals it when the ``b_i`` sum to ``global_batch`` (``c``: fixed seconds
    per step, data time included where it counts; ``s``: seconds per sample). Placements are compared by it.

    Example::

        >>> round(equal_finish_time([0.0, 0.0], [0.001, 0.003], 400), 9)  # 300 and 100 samples
        0.3
    """
    c = np.asarray(fixed, dtype=np.float64)
    s = np.asarray(slope, dtype=np.float64)
    return float((global_batch + np.sum(c / s)) / np.sum(1.0 / s))


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
    """Closed-form equal finishing time for linear models, clamped and re-solved, makespan-optimal rounding."""

    name = "equal_finish"

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        fitted = fitted_models(models)
        if fitted is None:
            return self._keep_or_equal(global_batch, bounds, current)
        shares = equal_finish_continuous(fitted, global_batch, bounds)
        return _refine_makespan(fitted, largest_remainder(shares, global_batch, bounds), bounds)


class LBBAllocator(Allocator):
    """LBB: minimise max - min predicted time, with fine (+/-1) and coarse (re-solve) tuning and hysteresis.

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
        fitted = fitted_models(models)
        if fitted is None:
            return self._keep_or_equal(global_batch, bounds, current)
        valid_current = current is not None and sum(current) == global_batch and len(current) == bounds.world_size
        if valid_current:
            level = self._level(predicted_times(fitted, current))  # type: ignore[arg-type]
            if level <= self.tolerance:
                return list(current)  # type: ignore[arg-type]
            start = list(current) if level <= self.fine_threshold else None  # type: ignore[arg-type]
        else:
            start = None
        if start is None:
            start = EqualFinishAllocator().allocate(fitted, global_batch, bounds)
        return self._fine_tune(fitted, start, bounds)

    def _fine_tune(self, models: list[TimeModelParams], sizes: list[int], bounds: Bounds) -> list[int]:
        sizes = list(sizes)
        for _ in range(4 * sum(sizes)):
            t = predicted_times(models, sizes)
            spread = max(t) - min(t)
            best: tuple[float, int, int] | None = None
            order = np.argsort(t)
            for slow in order[::-1][:2]:
                for fast in order[:2]:
                    if slow == fast or sizes[slow] <= bounds.min_batch[slow] or sizes[fast] >= bounds.max_batch[fast]:
                        continue
                    trial = list(sizes)
                    trial[slow] -= 1
                    trial[fast] += 1
                    tt = predicted_times(models, trial)
                    s = max(tt) - min(tt)
                    if s < spread - 1e-12 and (best is None or s < best[0]):
                        best = (s, int(slow), int(fast))
            if best is None:
                break
            sizes[best[1]] -= 1
            sizes[best[2]] += 1
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
    if name not in ALLOCATORS:
        raise ValueError(f"`allocator` must be one of {sorted(ALLOCATORS)}, got {name!r}. HINT: use one of these "
                         "names, pass an Allocator instance, or register a class with register_allocator(name, cls).")
    return ALLOCATORS[name]()
