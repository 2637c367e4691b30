"""Which micro-batches a rank runs in a step, for the ``deadline`` and ``wbsp`` aggregation modes.

Both are generators shared by the Lightning strategies and the Horovod optimizer: they yield
:class:`~hetero_plugins.aggregation.microbatch.MicroBatch` items, the caller back-propagates each one before asking
for the next, and the generator reads the clock between items to learn this step's pace. Neither touches a
collective: ``wbsp`` coordinates through a key-value store's atomic ``add`` (a ``torch.distributed.TCPStore``
served by rank 0).

- :func:`deadline_micro_batches`: the rank's carried micro-batches first, then its share, until the next
  one would end past the deadline; what is left goes back to the carry queue. A rank that is on time runs
  one unit of its share and then the rest as one piece (two forward passes per step).
- :func:`wbsp_micro_batches`: after one unit, a rank claims as much of its share as it can finish by the
  *balanced time* (when all ranks would finish if the step's samples were shared by this step's measured
  rates, which each rank reports after its first unit); the units it leaves are claimed by ranks that
  finish early (WBSP's busy workers, Yang et al. 2024; SA-ATP's leading workers helping the straggler,
  Li et al. 2024). A thief that would finish a unit late leaves it to faster ones until the step is
  overdue, so no unit is stranded. Every unit is claimed exactly once, so the step's samples are exactly
  the planned ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hetero_plugins.aggregation.microbatch import CarryQueue, DeadlineRule, MicroBatch, StepClaims, micro_batch_sizes, take_rows

__all__ = ["deadline_micro_batches", "wbsp_micro_batches"]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


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
    offsets = _offsets(sizes)
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


def wbsp_micro_batches(
    batch: Any,
    counts: Sequence[int],
    parts: int,
    rank: int,
    claims: StepClaims,
    load: Callable[[int, int], tuple[Any, int]],
    model_rates: Sequence[float | None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    poll: float = 0.002,
) -> Iterator[MicroBatch]:
    """Yield this rank's micro-batches of a ``wbsp`` step: its own share's units, then other ranks' units.

    Args:
        batch: this rank's batch of the step (collated).
        counts: every rank's planned samples in the step.
        parts: units per share (``micro_batch_sizes(counts[r], parts)``).
        claims: the step's claim counters (same ``prefix`` on every rank).
        load: ``load(owner, index)`` -> ``(data, samples)`` of another rank's unit (from the dataset).
        model_rates: each rank's predicted samples per second (``None`` entries: unknown).

    Example (one rank, a dict store)::

        >>> import torch
        >>> class Store(dict):
        ...     def add(self, key, n):
        ...         self[key] = self.get(key, 0) + n
        ...         return self[key]
        >>> claims = StepClaims(Store(), "s", [4])
        >>> [m.samples for m in wbsp_micro_batches(torch.zeros(8, 1), [8], 4, 0, claims, load=None)]
        [2, 6]
    """
    store = claims.store
    sizes = micro_batch_sizes(counts[rank], parts)
    offsets = _offsets(sizes)
    rates_known = list(model_rates) if model_rates is not None else [None] * len(counts)
    planned = sum(counts)
    start = clock()
    done = 0
    reported = False

    def finish(samples: int) -> float:
        elapsed = clock() - start
        return elapsed + elapsed / done * samples if done else math.inf

    def others_free() -> bool:
        return int(store.add(claims.free_key, 0)) > 0

    def balanced_time() -> float:
        reported_rates = [int(store.add(claims.rate_key(r), 0)) / 1000.0 for r in range(len(counts))]
        known = [x for x in reported_rates if x > 0]
        mean = sum(known) / len(known) if known else 0.0
        rates = [x if x > 0 else (m or mean) for x, m in zip(reported_rates, rates_known)]
        return planned / sum(rates) if rates and all(x > 0 for x in rates) else math.inf

    while (left := len(sizes) - claims.claimed(rank)) > 0:
        first = len(sizes) - left
        if not done:
            count = 1  # one unit first: it tells this rank's pace in this step
        else:
            elapsed = clock() - start
            rate = done / max(elapsed, 1e-9)
            if not reported:
                store.add(claims.rate_key(rank), max(1, int(rate * 1000)))
                reported = True
            budget = (1.15 * balanced_time() - elapsed) * rate
            count, acc = 0, 0
            for unit in sizes[first:]:
                if acc + unit > budget:
                    break
                acc, count = acc + unit, count + 1
            if count == 0:
                # Past the balanced time: give idle ranks a moment to take the next unit, then take it.
                until = 1.2 * balanced_time()
                while others_free() and clock() - start < until and claims.claimed(rank) < len(sizes):
                    time.sleep(poll)
                count = 1
        got = claims.claim_many(rank, count)
        if got:
            lo, hi = offsets[got.start], offsets[got.stop]
            yield MicroBatch(take_rows(batch, lo, hi), hi - lo, rank, 0, got.start)
            done += hi - lo
    store.add(claims.free_key, 1)
    unit = max((max(micro_batch_sizes(c, parts), default=0) for c in counts), default=0)
    while claims.left(exclude=rank):
        horizon = 1.5 * balanced_time()
        if done and finish(unit) > horizon and clock() - start < horizon:
            time.sleep(poll)  # a slow thief leaves the unit to faster ones until the step is overdue
            continue
        stolen = claims.steal(exclude=rank)
        if stolen is None:
            break
        owner, index = stolen
        data, samples = load(owner, index)
        yield MicroBatch(data, samples, owner, 0, index)
        done += samples
