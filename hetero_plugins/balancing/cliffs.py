"""Memory cliffs in a rank's step-time curve: what a line through its latest level cannot see.

A rank's compute time per step grows about linearly with its batch until its memory nearly fills; past that
point each further sample can cost several times as much (activation recomputation, allocator fragmentation,
host offload: the ``cliff`` of the simulator's device curves). The time model
(:mod:`hetero_plugins.balancing.time_model`) fits lines through the levels of its current regime, and a cliff
crossed by a plan change looks there like a speed change: the model restarts from the new level and forgets the
other side, so an exact split swings the rank across the cliff and back at every re-plan (a cluster of six
``mig``-class ranks, three of them waiting for data, a cliff at 85 of 100 samples: the ranks without a data
wait alternated between about 80 and 95 samples, 0.92x the plain proportional split).

:class:`CliffMemory` keeps, outside the time model's regimes, the median compute time of each rank at every
constant batch it ran in the last ``epochs`` epochs. Where one of those batches, above the rank's current one,
ran slower than the current curve predicts by more than ``tolerance``, the curve past the current batch is
priced along the steepest chord from the curve's time there to the measured one: a knee, on which the split
stays exact (:func:`~hetero_plugins.balancing.lines.curve_times`, ``min_makespan_split``). LBB fits the line
(Yao et al. 2024); this is the piece of the curve the line leaves out, learned from the run's own steps.

A speed change the time model finds at an unchanged batch (a co-runner, not a cliff) clears the rank's memory,
and so does a new time model (:meth:`CliffMemory.forget`: a rank moved or re-seeded).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.balancing.lines import curve_times

__all__ = ["CliffMemory", "row_medians"]


def row_medians(x: np.ndarray) -> np.ndarray:
    """``np.median(x, axis=1)`` through one sort (several times faster for many short rows)."""
    if x.shape[1] == 0 or np.isnan(x).any():
        return np.median(x, axis=1)
    s = np.sort(x, axis=1)
    m = x.shape[1]
    return 0.5 * (s[:, (m - 1) // 2] + s[:, m // 2])


class CliffMemory:
    """Each rank's recent ``(batch, median compute seconds)`` and the knees they imply (module docstring).

    Args:
        world_size: number of ranks.
        epochs: epochs a measurement is remembered for (0: off, no knee is ever added).
        tolerance: how much slower than the current curve predicts a measured batch must have run to count as
            past a cliff (0.1: 10%; step noise of a few percent moves a median over tens of steps far less).

    Example::

        >>> mem = CliffMemory(1)
        >>> mem.record(np.array([[96.0] * 10]), np.array([[0.33] * 10]))  # past a cliff at 85
        >>> mem.end_epoch()
        >>> mem.record(np.array([[80.0] * 10]), np.array([[0.224] * 10]))  # the line's side: 0.0042 + 0.00275 b
        >>> knee, beyond = mem.knees([0.0042], [0.00275], [80], [np.inf], [1.0])
        >>> int(knee[0]), round(float(beyond[0]), 4)  # (0.33 - 0.2242) / 16 seconds per sample past 80
        (80, 0.0066)
    """

    MAX_ENTRIES = 16  #: measurements kept at most (re-plans within epochs record one each)

    def __init__(self, world_size: int, epochs: int = 4, tolerance: float = 0.1, prefix: str = "") -> None:
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.epochs = check_int(f"{prefix}epochs", epochs, minimum=0,
                                hint="e.g. 4 (epochs a measurement counts), or 0 for off")
        self.tolerance = check_float(f"{prefix}tolerance", tolerance, minimum=0.0, strict_minimum=True,
                                     hint="e.g. 0.1 (a batch must have run 10% slower than the curve predicts)")
        self.steepest = 10.0  #: a chord steeper than this many times the curve's slope is no cliff
        self._epoch = 0
        self._tick = np.zeros(0, dtype=np.int64)  # epoch of each entry
        self._b = np.zeros((0, self.world_size))  # per entry and rank: the batch (nan: none recorded)
        self._t = np.zeros((0, self.world_size))  # its median compute seconds
        self._odd = np.zeros((0, self.world_size), dtype=bool)  # slower than a later run of as many samples or more

    def record(self, batch: Any, seconds: Any, changed: Any = None) -> None:
        """Remember the steps ``batch`` / ``seconds`` (shape ``(world_size, steps)``) of each rank whose valid steps
        all ran one batch size; ``changed``: ranks whose time model found a speed change in these steps (their
        memory is cleared where the batch is the one they last ran: not a cliff)."""
        b, t = np.asarray(batch, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
        if self.epochs == 0 or b.ndim != 2 or b.shape != t.shape or b.shape[0] != self.world_size:
            return
        ok = (b > 0) & np.isfinite(b) & np.isfinite(t) & (t > 0)
        any_ok = ok.any(axis=1)
        lo = np.where(ok, b, np.inf).min(axis=1)
        const = any_ok & (lo == np.where(ok, b, -np.inf).max(axis=1))
        size = np.where(const, lo, np.nan)
        if changed is not None and len(self._tick):
            last = self._last()
            same = np.asarray(changed, dtype=bool) & np.isfinite(last) & (np.abs(size - last) <= 0.05 * last)
            self._b[:, same] = np.nan
        if not const.any():
            return
        med = np.full(self.world_size, np.nan)
        rows = np.flatnonzero(const)
        med[rows] = row_medians(np.where(ok[rows], t[rows], np.nan)) if ok[rows].all() else \
            np.nanmedian(np.where(ok[rows], t[rows], np.nan), axis=1)
        with np.errstate(invalid="ignore"):  # an earlier run slower than this one of as many samples or more
            self._odd |= (self._b <= size[None]) & (self._t > med[None] * (1.0 + self.tolerance))
        self._tick = np.append(self._tick, self._epoch)[-self.MAX_ENTRIES:]
        self._b = np.vstack([self._b, size[None]])[-self.MAX_ENTRIES:]
        self._t = np.vstack([self._t, med[None]])[-self.MAX_ENTRIES:]
        self._odd = np.vstack([self._odd, np.zeros((1, self.world_size), dtype=bool)])[-self.MAX_ENTRIES:]

    def _last(self) -> np.ndarray:
        """Each rank's most recently recorded batch (nan: none)."""
        seen = np.isfinite(self._b)
        idx = np.where(seen.any(axis=0), len(self._b) - 1 - np.argmax(seen[::-1], axis=0), -1)
        return np.where(idx >= 0, self._b[np.maximum(idx, 0), np.arange(self.world_size)], np.nan)

    def end_epoch(self) -> None:
        """An epoch ended: measurements older than ``epochs`` epochs are dropped."""
        self._epoch += 1
        keep = self._tick >= self._epoch - self.epochs
        self._tick, self._b, self._t, self._odd = self._tick[keep], self._b[keep], self._t[keep], self._odd[keep]

    def forget(self, rank: int) -> None:
        """Drop what ``rank`` measured (its time model starts afresh: it moved, or was re-seeded)."""
        self._b[:, int(rank)] = np.nan

    def follow(self, old: Any) -> None:
        """Rank i takes what rank ``old[i]`` measured (-1: nothing; the ranks were renumbered)."""
        idx = np.asarray(old, dtype=np.int64)
        keep, src = idx[None] >= 0, np.maximum(idx, 0)
        self._b = np.where(keep, self._b[:, src], np.nan)
        self._t = np.where(keep, self._t[:, src], np.nan)
        self._odd = keep & self._odd[:, src]

    def knees(self, intercept: Any, slope: Any, plan: Any, knee: Any, beyond: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(knee, beyond)`` per rank for the curve ``intercept + slope b`` with the given ``knee`` / ``beyond``
        (:func:`~hetero_plugins.balancing.lines.curve_times`; compute seconds, no data wait): unchanged, except
        for ranks that ran a batch above their ``plan`` entry more than ``tolerance`` slower than that curve
        predicts, whose knee moves to the plan entry and whose seconds per sample past it become the steepest
        such chord (never below the curve's own slope there, so the curve stays convex). A batch that ran that
        much slower at or below the plan entry, or slower than a later run of as many samples or more, or along a
        chord more than ``steepest`` times the curve's slope, marks a slower past (a co-runner since gone): what
        the rank ran up to then is not read as a cliff."""
        a, s = np.asarray(intercept, dtype=np.float64), np.asarray(slope, dtype=np.float64)
        k, c = np.asarray(knee, dtype=np.float64), np.asarray(beyond, dtype=np.float64)
        p = np.asarray(plan, dtype=np.float64)
        if not len(self._tick):
            return k, c
        hb = np.where(np.isfinite(self._b), self._b, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            at = curve_times(a[None], s[None], hb, k[None], c[None])
            here = curve_times(a, s, p, k, c)
            slow = np.isfinite(self._b) & (self._t > at * (1.0 + self.tolerance)) & np.isfinite(at) & (s[None] > 0)
            own = np.where(np.isfinite(k) & (p >= k), c, s)  # the curve's slope just past the plan entry
            chords = (self._t - here[None]) / np.where(hb > p[None], hb - p[None], 1.0)
            # Slow at or below the plan, slower than a later run of as many samples or more, or steeper than any
            # cliff (``steepest`` times the curve's own slope): the rank was slower then (a co-runner since gone),
            # and nothing it ran up to that time is read as a cliff.
            era = np.arange(len(self._tick))[:, None]
            odd = slow & ((hb <= p[None]) | (chords > self.steepest * own[None]) | self._odd)
            stale = np.where(odd, era, -1).max(axis=0)
            past = slow & (hb > p[None]) & (era > stale[None])
            chord = np.where(past, chords, -np.inf).max(axis=0)
        hit = np.isfinite(chord) & np.isfinite(here)
        if not hit.any():
            return k, c
        return np.where(hit, np.minimum(p, k), k), np.where(hit, np.maximum(chord, own), c)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "tick": self._tick.tolist(), "batch": np.nan_to_num(self._b, nan=-1.0).tolist(),
                "seconds": np.nan_to_num(self._t, nan=-1.0).tolist(), "odd": self._odd.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same world size (another one: nothing is restored)."""
        b = np.asarray(state.get("batch", []), dtype=np.float64).reshape(-1, self.world_size) \
            if np.size(state.get("batch", [])) % self.world_size == 0 else None
        if b is None:
            return
        self._epoch = int(state.get("epoch", 0))
        self._tick = np.asarray(state.get("tick", []), dtype=np.int64)
        self._b = np.where(b > 0, b, np.nan)
        t = np.asarray(state.get("seconds", []), dtype=np.float64).reshape(-1, self.world_size)
        self._t = np.where(t > 0, t, np.nan)
        odd = np.asarray(state.get("odd", np.zeros(b.shape, dtype=bool)), dtype=bool).reshape(b.shape)
        self._odd = odd
