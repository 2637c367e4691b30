"""The fitted step-time lines t(b) = a + s b: one rank's (:class:`TimeModelParams`) and every rank's at once
(:class:`TimeModelLines`, what the planner hands the allocators)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

__all__ = ["TimeModelLines", "TimeModelParams"]


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
    """

    __slots__ = ("intercept", "slope", "known")

    def __init__(self, intercept: np.ndarray, slope: np.ndarray, known: np.ndarray) -> None:
        self.intercept = np.asarray(intercept, dtype=np.float64)
        self.slope = np.asarray(slope, dtype=np.float64)
        self.known = np.asarray(known, dtype=bool)

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
