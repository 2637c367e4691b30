"""Pure placement and split helpers on linear time lines: the best set of places, the equal-finish split.

Both are used online (the :class:`~hetero_plugins.scheduler.relocation.Relocator`, the ``auto`` allocator's
guard) and by the simulator's oracle, so they live apart from either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetero_plugins.balancing.allocators import equal_finish_time

__all__ = ["best_placement", "equal_finish_plan"]


def best_placement(slots: Sequence[Mapping[str, Any]], n: int, global_batch: int) -> list[int]:
    """Indices of the ``n`` slots with the shortest equal-finish step time (true times, data included).

    Greedy on speed (``1/slope``, the exact optimum when fixed costs are negligible), then single swaps with
    the unchosen slots while the exact continuous equal-finish time
    (:func:`~hetero_plugins.balancing.allocators.equal_finish_time`, a rank held at one sample when its fixed
    cost alone outlasts the others) improves (``c``: fixed cost plus data time, ``s``: slope). Each slot is
    ``{"intercept", "slope", "data"}`` (plus
    ``"rank"``: a slot with a rank wins ties against a free one).

    Example::

        >>> slots = [{"intercept": 0.0, "slope": 0.004, "data": 0.0, "rank": 0},
        ...          {"intercept": 0.0, "slope": 0.001, "data": 0.0, "rank": 1},
        ...          {"intercept": 0.0, "slope": 0.002, "data": 0.0, "rank": None}]
        >>> best_placement(slots, 2, 300)
        [1, 2]
    """
    c = np.array([float(x["intercept"]) + float(x["data"]) for x in slots])
    sl = np.array([float(x["slope"]) for x in slots])
    order = sorted(range(len(slots)), key=lambda k: (sl[k], slots[k].get("rank") is None, k))
    chosen = order[:n]
    rest = order[n:]

    def t(ix: list[int]) -> float:
        return equal_finish_time(c[ix], sl[ix], global_batch)

    best = t(chosen)
    improved = bool(rest)
    while improved:
        improved = False
        for i in range(len(chosen)):
            for j in range(len(rest)):
                cand = chosen[:i] + [rest[j]] + chosen[i + 1:]
                v = t(cand)
                if v < best * (1 - 1e-9):
                    rest[j], chosen = chosen[i], cand
                    best, improved = v, True
    return sorted(chosen)


def equal_finish_plan(intercept: np.ndarray, slope: np.ndarray, global_batch: int, min_batch: np.ndarray,
                      max_batch: np.ndarray) -> np.ndarray:
    """Makespan-optimal integer split for linear times ``a_i + beta_i * b_i`` (vectorised, O(60 N)).

    The same objective as :class:`~hetero_plugins.balancing.allocators.EqualFinishAllocator` (closed-form equal finish
    plus makespan-optimal rounding), solved directly: bisection on the step time ``T`` for the smallest ``T``
    at which the samples every rank can finish by ``T``, ``clip(floor((T - a_i) / beta_i), lo_i, hi_i)``, cover
    the global batch; the few surplus samples (ties) leave the ranks that finish last. Ties may be broken
    differently from ``EqualFinishAllocator``; the predicted makespan is never larger.

    Example::

        >>> equal_finish_plan(np.zeros(2), np.array([0.001, 0.003]), 400, np.ones(2), np.full(2, 400)).tolist()
        [300, 100]
    """
    a = np.asarray(intercept, dtype=np.float64)
    beta = np.maximum(np.asarray(slope, dtype=np.float64), 1e-12)
    lo = np.asarray(min_batch, dtype=np.float64)
    hi = np.asarray(max_batch, dtype=np.float64)

    def count(t: float) -> np.ndarray:
        return np.clip(np.floor((t - a) / beta + 1e-9), lo, hi)

    t_lo, t_hi = 0.0, float(np.max(a + beta * hi))
    for _ in range(64):
        mid = 0.5 * (t_lo + t_hi)
        if count(mid).sum() >= global_batch:
            t_hi = mid
        else:
            t_lo = mid
        if t_hi - t_lo <= 1e-12 * max(t_hi, 1e-12):
            break
    b = count(t_hi)
    surplus = int(b.sum()) - int(global_batch)
    while surplus > 0:  # ties at the threshold: the ranks whose last sample finishes latest give one back
        t = a + beta * b
        t[b <= lo] = -np.inf
        k = min(surplus, int(np.isfinite(t).sum()))
        idx = np.argpartition(-t, k - 1)[:k]
        b[idx] -= 1
        surplus -= k
    return b.astype(np.int64)
