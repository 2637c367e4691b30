"""How far a re-plan may move each rank's batch: LB-BSP's oscillation damping as per-rank state.

A re-plan moves a rank's batch by at most a factor (``max_change_factor``) up or down. A rank whose batch moves
back the way it came, by a quarter or more, has its factor square-rooted (in log terms, halved) until it moves
the same way twice: "once a part moves back the way it came, every part moves half as far" (Chen et al.,
LB-BSP, SoCC'18). A single bad fit then costs one epoch at most a factor off, not a plan swinging between
extremes. The state is one rank's factor and last move direction; one rank decides and every rank adopts it
(:class:`~hetero_plugins.balancing.coordinator.PlanCoordinator`), so checkpoints agree whichever rank saves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetero_plugins.balancing.allocators import Bounds

__all__ = ["MoveDamping"]


class MoveDamping:
    """Per-rank move limits of ``world_size`` ranks (``max_change_factor=None``: no limit).

    Example::

        >>> d = MoveDamping(2, 8.0)
        >>> b = d.bounds(Bounds((1, 1), (1024, 1024)), [64, 64])
        >>> b.min_batch, b.max_batch
        ((8, 8), (512, 512))
        >>> d.record([64, 64], [16, 112]); d.record([16, 112], [64, 64])  # rank 0 moved back the way it came
        >>> d.factor.round(2).tolist()
        [2.83, 2.83]
    """

    def __init__(self, world_size: int, max_change_factor: float | None) -> None:
        self.max_change_factor = max_change_factor
        self.top = math.inf if max_change_factor is None else float(max_change_factor)
        self.factor = np.full(world_size, self.top)
        self.last_move = np.zeros(world_size, dtype=np.int64)

    def bounds(self, bounds: Bounds, current: Sequence[int]) -> Bounds:
        """``bounds`` narrowed to within each rank's factor of the current plan (unchanged without a limit, or
        where the current plan lies outside ``bounds``: a new memory cap admits any plan within it)."""
        if self.max_change_factor is None:
            return bounds
        if not bounds.admits(current):
            return bounds
        cur = np.asarray(current, dtype=np.float64)
        lo, hi = np.asarray(bounds.min_batch), np.asarray(bounds.max_batch)
        t_lo = np.maximum(lo, np.minimum(cur - 1, np.ceil(cur / self.factor))).astype(np.int64)
        t_hi = np.minimum(hi, np.maximum(cur + 1, np.floor(cur * self.factor))).astype(np.int64)
        return Bounds(tuple(t_lo.tolist()), tuple(t_hi.tolist()))

    def record(self, old: Sequence[int], new: Sequence[int]) -> None:
        """Square-root the factor of ranks whose batch moved back the way it came (by a quarter or more, at least
        2 samples); restore it (squared, up to the limit) when a rank moves the same way twice."""
        if self.max_change_factor is None:
            return
        o, n = np.asarray(old, dtype=np.float64), np.asarray(new, dtype=np.float64)
        move = np.where(np.abs(n - o) >= np.maximum(2.0, 0.25 * o), np.sign(n - o), 0).astype(np.int64)
        back = (move != 0) & (move == -self.last_move)
        again = (move != 0) & (move == self.last_move)
        self.factor[back] = np.sqrt(self.factor[back])
        self.factor[again] = np.minimum(self.factor[again] ** 2, self.max_change_factor)
        self.last_move = np.where(move != 0, move, self.last_move)

    def release(self, rank: int) -> None:
        """Leave ``rank`` undamped until it is measured (a seeded model: its past was elsewhere)."""
        self.factor[rank], self.last_move[rank] = math.inf, 0

    def measured(self, ranks: np.ndarray) -> None:
        """Damp ``ranks`` (a boolean mask) again: they have been measured."""
        self.factor[ranks] = np.minimum(self.factor[ranks], self.top)

    def follow(self, new: np.ndarray, src: np.ndarray) -> None:
        """Rank i takes rank ``src[i]``'s state; ``new[i]``: a new rank, started afresh."""
        self.factor = np.where(new, self.top, self.factor[src])
        self.last_move = np.where(new, 0, self.last_move[src])

    def state_dict(self) -> dict[str, list[Any]]:
        return {"change_factor": self.factor.tolist(), "last_move": self.last_move.tolist()}

    def load_state_dict(self, state: Mapping[str, Sequence[Any]]) -> None:
        """Restore :meth:`state_dict` (one entry per rank in each list)."""
        factor = np.asarray(state["change_factor"], dtype=np.float64)
        move = np.asarray(state["last_move"], dtype=np.int64)
        n = len(self.factor)
        if factor.shape != (n,) or move.shape != (n,) or np.any(factor < 1) or not np.all(np.isin(move, (-1, 0, 1))):
            raise ValueError(f"damping state {dict(state)} must hold {n} change factors >= 1 and {n} last moves in "
                             "{-1, 0, 1}. HINT: pass a state_dict() of a planner with as many ranks.")
        self.factor, self.last_move = factor, move
