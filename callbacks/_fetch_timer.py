"""The time the train loop spends fetching each batch, read from the profiler calls Lightning makes around it.

A step's data time is what the planner charges a data-bound rank. Measured as the gap between one step's end
and the next one's start, it also holds the wait for the other ranks in Lightning's per-batch collective (its
SIGTERM broadcast): under gradient accumulation a fast rank waits there for the slow one at every micro-batch
and would look data-bound. Lightning's training epoch loop wraps each fetch in the profiler action
``[_TrainingEpochLoop].train_dataloader_next``; :class:`FetchTimer` wraps the trainer's profiler's ``start`` /
``stop`` (whichever profiler it is) to time that action alone. A Lightning release without that action leaves
:meth:`FetchTimer.take` at ``None``, and the caller keeps the gap; :meth:`FetchTimer.missing` tells it so,
so that it can warn once (:data:`MISSING`).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

__all__ = ["FETCH_ACTION", "MISSING", "FetchTimer"]

#: The end of the profiler action Lightning's training epoch loop wraps around each batch fetch.
FETCH_ACTION = ".train_dataloader_next"

#: The warning for a Lightning release whose train loop does not name its batch fetches as this module expects.
MISSING = (f"BatchBalancer: no train-batch fetch was seen under the profiler action '*{FETCH_ACTION}', so each "
           "step's data time is the gap since the previous step, which also holds the wait for other ranks in "
           "Lightning's per-batch collective (under gradient accumulation a fast rank may look data-bound). "
           "HINT: this Lightning release renamed the action; use the Lightning version in constraints.txt, or "
           "report the release so that FETCH_ACTION can follow it.")


class FetchTimer:
    """Seconds spent fetching train batches since the last :meth:`take` (``None`` while no fetch was seen)."""

    def __init__(self) -> None:
        self._began: float | None = None
        self._elapsed: float | None = None
        self._taken = 0  # take() calls since attach()
        self._seen = False  # whether any fetch was timed since attach()

    def attach(self, trainer: Any) -> None:
        """Wrap ``trainer.profiler`` (an earlier fit's wrapper is taken off first). Undo with :meth:`detach`."""
        self.detach(trainer)
        self._taken, self._seen = 0, False
        profiler = trainer.profiler
        start, stop = profiler.start, profiler.stop
        ref = weakref.ref(self)

        def timed_start(action_name: str) -> None:
            me = ref()
            if me is not None and action_name.endswith(FETCH_ACTION):
                me._began = time.perf_counter()
            start(action_name)

        def timed_stop(action_name: str) -> None:
            stop(action_name)
            me = ref()
            if me is not None and action_name.endswith(FETCH_ACTION) and me._began is not None:
                me._elapsed = (me._elapsed or 0.0) + time.perf_counter() - me._began
                me._began = None
                me._seen = True

        profiler.start, profiler.stop = timed_start, timed_stop
        profiler._hetero_fetch_timer = (start, stop)

    @staticmethod
    def detach(trainer: Any) -> None:
        """Give ``trainer.profiler`` its own ``start`` / ``stop`` back (nothing if it is not wrapped)."""
        profiler = trainer.profiler
        if getattr(profiler, "_hetero_fetch_timer", None) is not None:
            for name in ("start", "stop", "_hetero_fetch_timer"):
                profiler.__dict__.pop(name, None)

    def take(self) -> float | None:
        """The fetch seconds since the last call, and start counting afresh."""
        out, self._elapsed = self._elapsed, None
        self._taken += 1
        return out

    def missing(self) -> bool:
        """Whether steps ran since :meth:`attach` (two or more :meth:`take` calls) without one fetch timed."""
        return self._taken >= 2 and not self._seen

    def reset(self) -> None:
        self._began = self._elapsed = None
