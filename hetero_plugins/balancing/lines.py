"""The fitted step-time lines t(b) = a + s b: one rank's (:class:`TimeModelParams`) and every rank's at once
(:class:`TimeModelLines`, what the planner hands the allocators), optionally steeper beyond a knee
(:func:`curve_times`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

__all__ = ["TimeModelLines", "TimeModelParams", "curve_times", "data_seconds", "proportional_knees"]


def curve_times(intercept: Any, slope: Any, batch: Any, knee: Any = None, beyond: Any = None) -> np.ndarray:
    """Per-rank predicted seconds at ``batch``: ``a + s b`` up to ``knee``, and past it the line's time at the
    knee plus ``beyond`` seconds per further sample (``knee`` ``inf`` or ``None``: the line throughout).

    Written as a second line ``(a + s k - c k) + c b`` so that the exact split
    (:func:`~hetero_plugins.balancing.allocators.min_makespan_split`) evaluates the very same expression.

    Example::

        >>> curve_times([0.1], [0.001], [300], knee=[100], beyond=[0.002]).round(6).tolist()
        [0.6]
    """
    a = np.asarray(intercept, dtype=np.float64)
    s = np.asarray(slope, dtype=np.float64)
    b = np.asarray(batch, dtype=np.float64)
    t = a + s * b
    if knee is None or beyond is None:
        return t
    k = np.asarray(knee, dtype=np.float64)
    c = np.asarray(beyond, dtype=np.float64)
    finite = np.isfinite(k)
    kf = np.where(finite, k, 0.0)
    return np.where(finite & (b > kf), (a + s * kf - c * kf) + c * b, t)


@dataclass(frozen=True)
class TimeModelParams:
    """A fitted line: ``seconds(b) = intercept + slope * b``."""

    intercept: float
    slope: float

    def predict(self, batch_size: float) -> float:
        return self.intercept + self.slope * batch_size


class TimeModelLines(Sequence):  # type: ignore[type-arg]
    """The fitted lines of many ranks as arrays, readable as a sequence of :class:`TimeModelParams` (``None``
    where a rank has no model yet). Allocators read the arrays directly.

    Attributes:
        intercept, slope: per-rank line (``nan`` where unknown).
        known: per-rank flag, ``True`` where the rank has a line.
        knee, beyond: ``None``, or per rank the batch size past which the time grows by ``beyond`` seconds per
            sample instead of ``slope`` (``inf``: never; see :func:`curve_times`). The planner sets them with
            ``extrapolate="proportional"``: beyond the largest batch a rank has measured, no economy of scale.
        data: ``None``, or per rank the seconds of ``intercept`` that are the wait for data, not compute (the
            planner's ``count_data_time``). A co-runner slows the compute: corrections for one (the learned
            allocators') scale ``intercept - data`` and ``slope``, not the data (:func:`data_seconds`).
    """

    __slots__ = ("intercept", "slope", "known", "knee", "beyond", "data")

    def __init__(self, intercept: np.ndarray, slope: np.ndarray, known: np.ndarray, knee: np.ndarray | None = None,
                 beyond: np.ndarray | None = None, data: np.ndarray | None = None) -> None:
        self.intercept = np.asarray(intercept, dtype=np.float64)
        self.slope = np.asarray(slope, dtype=np.float64)
        self.known = np.asarray(known, dtype=bool)
        if (knee is None) != (beyond is None):
            raise ValueError(f"`knee` and `beyond` go together, got knee={knee!r} and beyond={beyond!r}. HINT: pass "
                             "both (one entry per rank) or neither.")
        self.knee = None if knee is None else np.asarray(knee, dtype=np.float64)
        self.beyond = None if beyond is None else np.asarray(beyond, dtype=np.float64)
        self.data = None if data is None else np.asarray(data, dtype=np.float64)

    def times(self, batch: Any) -> np.ndarray:
        """Each rank's predicted seconds at its entry of ``batch`` (the knee applied; ``nan`` where unknown)."""
        return curve_times(self.intercept, self.slope, batch, self.knee, self.beyond)

    def scaled(self, factor: Any) -> TimeModelLines:
        """These lines with every rank's times multiplied by ``factor`` (per rank, or one number)."""
        f = np.broadcast_to(np.asarray(factor, dtype=np.float64), self.intercept.shape)
        return TimeModelLines(self.intercept * f, self.slope * f, self.known, self.knee,
                              None if self.beyond is None else self.beyond * f,
                              None if self.data is None else self.data * f)

    def __len__(self) -> int:
        return len(self.known)

    @overload
    def __getitem__(self, i: int) -> TimeModelParams | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[TimeModelParams | None]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not self.known[i]:
            return None
        return TimeModelParams(float(self.intercept[i]), float(self.slope[i]))

    def __iter__(self) -> Iterator[TimeModelParams | None]:
        for k in range(len(self)):
            yield self[k]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"TimeModelLines({list(self)!r})"


def data_seconds(lines: Any, n: int) -> np.ndarray:
    """The seconds per step of each of ``n`` ranks that ``lines``' intercepts hold for the wait for data
    (:attr:`TimeModelLines.data`; zeros for lines without it, e.g. a list of :class:`TimeModelParams`).

    Example::

        >>> lines = TimeModelLines(np.array([0.05, 0.01]), np.array([1e-3, 1e-3]), np.array([True, True]),
        ...                        data=np.array([0.04, 0.0]))
        >>> data_seconds(lines, 2).tolist(), data_seconds(list(lines), 2).tolist()
        ([0.04, 0.0], [0.0, 0.0])
    """
    d = getattr(lines, "data", None)
    if d is None or len(d) != n:
        return np.zeros(n)
    return np.asarray(d, dtype=np.float64)


def proportional_knees(lines: TimeModelLines, measured: Any, factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the knee past which ``lines`` stop being trusted (``factor`` times the largest batch size the rank
    has ``measured``; ``inf``: none, where the line has no fixed cost or nothing was measured) and the seconds per
    sample past it: the line's time at the knee over the knee, so that beyond it the time grows in proportion to
    the batch (the planner's ``extrapolate="proportional"``).

    Example::

        >>> flat = TimeModelLines(np.array([0.0992]), np.array([0.00005]), np.array([True]))  # a plateau
        >>> knee, beyond = proportional_knees(flat, [32])
        >>> int(knee[0]), round(float(curve_times(flat.intercept, flat.slope, [64], knee, beyond)[0]), 4)
        (32, 0.2016)
    """
    big = np.floor(np.asarray(measured, dtype=np.float64) * factor)
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = lines.known & (big > 0) & (lines.intercept > 0)
        per = np.where(ok, (lines.intercept + lines.slope * big) / np.where(ok, big, 1.0), lines.slope)
    return np.where(ok, big, np.inf), np.where(ok, per, 1.0)
