"""``aggregation="deadline"``: a rank stops at the step's deadline and carries the rest into its next steps.

A rank works through its share in micro-batches until the next one would end past a deadline derived from
the time models (``(1 + deadline_slack)`` times the plan's predicted step time; none on the epoch's last step,
so the carry is worked off); the gradient of what it finished is summed with the others, re-weighted by the
samples actually processed (the counts travel with the gradients), and the rest is carried into its next
steps, first in line, while mid-epoch plans route new samples around the backlog (SA-ATP, Li et al. 2024;
fastest-k SGD with reduced load). Every sample is still processed once per epoch.

- :class:`DeadlineRule` decides from the micro-batches already timed whether another fits;
- :class:`CarryQueue` keeps a rank's unfinished micro-batches for its next steps;
- :func:`deadline_micro_batches` yields what runs before the deadline (a rank that is on time runs one unit of
  its share and then the rest as one piece: two forward passes per step);
- :class:`DeadlineAggregator` is the mode's engine.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hetero_plugins.aggregation.base import SampleWeightedAggregator, StepContext
from hetero_plugins.aggregation.microbatch import MicroBatch, micro_batch_sizes, offsets_of, take_rows

log = logging.getLogger(__name__)

__all__ = ["CarryQueue", "DeadlineAggregator", "DeadlineRule", "deadline_micro_batches"]


class DeadlineRule:
    """Whether a rank should start another micro-batch before a step's deadline.

    The time of the next micro-batch is predicted from this step's own pace so far (seconds per sample of
    the micro-batches already run), so a stall that began in this step is seen at once; before any
    micro-batch ran nothing is known, and the first micro-batch always runs: every step makes progress.

    Example::

        >>> rule = DeadlineRule(deadline=1.0)
        >>> rule.allows(elapsed=0.0, done_samples=0, next_samples=8)
        True
        >>> rule.allows(elapsed=0.6, done_samples=8, next_samples=8)   # 0.6 + 8 * 0.075 > 1.0
        False
    """

    def __init__(self, deadline: float) -> None:
        self.deadline = float(deadline)

    def allows(self, elapsed: float, done_samples: int, next_samples: int) -> bool:
        if done_samples <= 0 or not math.isfinite(self.deadline):
            return True  # the first micro-batch always runs
        pace = elapsed / done_samples
        return elapsed + pace * next_samples <= self.deadline


class CarryQueue:
    """A rank's micro-batches that missed their step's deadline, processed first in its next steps (FIFO).

    Example::

        >>> q = CarryQueue(); q.extend([MicroBatch(None, 3), MicroBatch(None, 2)])
        >>> q.samples, len(q)
        (5, 2)
    """

    def __init__(self) -> None:
        self._items: deque[MicroBatch] = deque()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def samples(self) -> int:
        return sum(m.samples for m in self._items)

    def extend(self, items: Sequence[MicroBatch]) -> None:
        self._items.extend(items)

    def take_all(self) -> list[MicroBatch]:
        items = list(self._items)
        self._items.clear()
        return items

    def clear(self) -> int:
        """Drop everything (e.g. when training stops mid-epoch); returns the samples dropped."""
        dropped = self.samples
        self._items.clear()
        return dropped


def deadline_micro_batches(
    batch: Any,
    sizes: Sequence[int],
    rule: DeadlineRule,
    carry: CarryQueue,
    rank: int = 0,
    step: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[MicroBatch]:
    """Yield the micro-batches to run before ``rule``'s deadline; the rest is put in ``carry``.

    Args:
        batch: this rank's batch of the step (collated).
        sizes: its units (see :func:`~hetero_plugins.aggregation.microbatch.micro_batch_sizes`).
        rule: the step's deadline, in seconds from the first ``next()``.
        carry: this rank's carried micro-batches: run first, refilled with what misses the deadline.

    Example::

        >>> import torch
        >>> q = CarryQueue()
        >>> [m.samples for m in deadline_micro_batches(torch.zeros(6, 1), [2, 2, 2], DeadlineRule(math.inf), q)]
        [2, 4]
    """
    start = clock()
    offsets = offsets_of(sizes)
    queue = carry.take_all()
    done, j = 0, 0
    try:
        while queue or j < len(sizes):
            if not queue:
                elapsed = clock() - start
                rest = offsets[-1] - offsets[j]
                fits = done > 0 and elapsed + elapsed / done * rest <= rule.deadline
                k = len(sizes) - j if fits else 1  # on time: the rest of the share as one piece
                queue.append(MicroBatch(take_rows(batch, offsets[j], offsets[j + k]), rest if fits else sizes[j],
                                        rank, step, j))
                j += k
            mb = queue[0]
            if done and not rule.allows(clock() - start, done, mb.samples):
                break
            queue.pop(0)
            yield mb
            done += mb.samples
    finally:
        carry.extend(queue + [MicroBatch(take_rows(batch, offsets[i], offsets[i + 1]), sizes[i], rank, step, i)
                              for i in range(j, len(sizes))])


class DeadlineAggregator(SampleWeightedAggregator):
    """``aggregation="deadline"`` (see the module doc).

    Attributes:
        carry: this rank's carried micro-batches.
    """

    mode = "deadline"

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        super()._init_state(buffers)
        assert self.options.micro_batches is not None  # AggregationOptions fills every option of its mode
        self.parts = self.options.micro_batches
        self.carry = CarryQueue()

    def micro_batches(self, batch: Any, ctx: StepContext) -> Iterator[MicroBatch]:
        """The carried micro-batches first, then this step's, until the deadline; the rest is carried."""
        if ctx.step == 0:
            self.end_epoch()
        self._begin(batch, ctx)
        predicted = ctx.planner.predict_step_time(ctx.counts) if ctx.planner is not None and not ctx.last else math.nan
        rule = DeadlineRule(math.inf if ctx.last else self.options.deadline(predicted))
        sizes = micro_batch_sizes(ctx.counts[ctx.rank], self.parts)
        before, from_carry = self.carry.samples, 0
        for mb in deadline_micro_batches(batch, sizes, rule, self.carry, ctx.rank, ctx.step):
            mb.weight = mb.samples / ctx.planned
            yield mb
            self.step_samples += mb.samples
            from_carry += mb.samples if mb.step != ctx.step else 0
        self.stats.carried += self.carry.samples - (before - from_carry)  # newly carried this step

    def _backlog(self) -> int:
        return self.carry.samples

    def backlog_per_step(self, steps_left: int) -> list[int] | None:
        """Every rank's carried samples (the same on every rank: they travel with the gradients), to be worked
        off over the next four steps, or the steps left in the epoch if fewer; ``None`` before any exchange.

        Example::

            >>> import torch
            >>> from hetero_plugins.aggregation.options import AggregationOptions
            >>> from hetero_plugins.collectives import TorchCollectives
            >>> agg = DeadlineAggregator(AggregationOptions("deadline"), TorchCollectives(), [])
            >>> agg.backlogs = [0, 10]
            >>> agg.backlog_per_step(steps_left=2)
            [0, 5]
        """
        if self.backlogs is None:
            return None
        spread = max(1, min(4, int(steps_left)))
        return [math.ceil(c / spread) for c in self.backlogs]

    def flush(self, grad_scale: float = 1.0) -> bool:
        """After the fit: carried samples left now were never processed (the fit stopped mid-epoch, other than
        on ``max_steps``, whose step is the last and has no deadline); warned about and dropped."""
        if self.carry.samples:
            log.warning("aggregation='deadline': %d samples carried by this rank were never processed: the fit "
                        "stopped mid-epoch before they were worked off", self.carry.clear())
        return False

    def checkpoint_losses(self) -> str | None:
        """The samples the ranks carry after the last exchange (every rank knows every rank's): a checkpoint
        does not hold them, so a resume from it never processes them."""
        carried = sum(self.backlogs or ())
        if not carried:
            return None
        return (f"{carried} samples carried past a deadline (per rank {list(self.backlogs or ())}) are not in the "
                "checkpoint, and a resume from it will not process them")

    def end_epoch(self) -> None:
        if self.carry.samples:
            log.warning("aggregation='deadline': %d carried samples dropped: the epoch ended before they were "
                        "processed (the loop was cut short)", self.carry.clear())
        self.backlogs = None
