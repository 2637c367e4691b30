"""Micro-batches of a rank's share of a step: splitting, the deadline rule, the carry queue, shared claims.

The ``deadline`` and ``wbsp`` aggregation modes (see :mod:`hetero_plugins.aggregation`) run a step as a
sequence of micro-batches. This module holds the framework-free parts: cutting a collated batch (tensors,
or tuples / lists / dicts of them) along its first dimension; :class:`DeadlineRule`, which decides from the
micro-batches already timed whether another fits before the deadline; :class:`CarryQueue`, which keeps a
rank's unfinished micro-batches for its next steps; and :class:`StepClaims`, which lets ranks claim
micro-batches of any rank's share exactly once through a key-value store's atomic ``add`` (a
``torch.distributed.TCPStore`` in the integrations).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "CarryQueue",
    "ClaimKeys",
    "DeadlineRule",
    "MicroBatch",
    "StepClaims",
    "batch_length",
    "micro_batch_sizes",
    "open_claim_store",
    "split_batch",
    "take_rows",
    "unit_indices",
]


def batch_length(batch: Any) -> int:
    """Number of samples in a collated batch: the first dimension shared by its tensors.

    Example::

        >>> batch_length((torch.zeros(5, 3), torch.arange(5)))
        5
    """
    sizes = {int(t.shape[0]) for t in _tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"cannot tell the number of samples of a batch whose tensors have first dimensions {sorted(sizes)}. "
            "HINT: micro-batched aggregation needs batches of tensors (or tuples/lists/dicts of tensors) that "
            "share the sample dimension first; use aggregation='weighted' otherwise."
        )
    return sizes.pop()


def micro_batch_sizes(samples: int, parts: int) -> list[int]:
    """``samples`` cut into at most ``parts`` near-equal positive sizes, larger first.

    Example::

        >>> micro_batch_sizes(10, 4), micro_batch_sizes(2, 4)
        ([3, 3, 2, 2], [1, 1])
    """
    parts = max(1, min(int(parts), int(samples)))
    base, extra = divmod(int(samples), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)] if samples > 0 else []


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Cut a collated batch along its first dimension into consecutive pieces of ``sizes``.

    Example::

        >>> [b[1].tolist() for b in split_batch((torch.zeros(5, 2), torch.arange(5)), [3, 2])]
        [[0, 1, 2], [3, 4]]
    """
    n = batch_length(batch)
    if sum(sizes) != n:
        raise ValueError(f"`sizes`={list(sizes)} must sum to the batch's {n} samples.")
    out, lo = [], 0
    for s in sizes:
        out.append(_slice(batch, lo, lo + s, n))
        lo += s
    return out


def unit_indices(indices: Sequence[int], parts: int, index: int) -> list[int]:
    """The sample indices of unit ``index`` when a share ``indices`` is cut into ``parts`` units.

    Example::

        >>> unit_indices([10, 11, 12, 13, 14], 2, 1)
        [13, 14]
    """
    sizes = micro_batch_sizes(len(indices), parts)
    lo = sum(sizes[:index])
    return list(indices[lo : lo + sizes[index]])


def take_rows(batch: Any, lo: int, hi: int) -> Any:
    """Samples ``lo:hi`` of a collated batch (the same structure, cut along the first dimension).

    Example::

        >>> take_rows({"x": torch.arange(6)}, 2, 5)["x"].tolist()
        [2, 3, 4]
    """
    return _slice(batch, lo, hi, batch_length(batch))


def _slice(batch: Any, lo: int, hi: int, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, lo, hi, n) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_slice(v, lo, hi, n) for v in batch))
    if isinstance(batch, (list, tuple)):
        if len(batch) == n and not any(isinstance(v, torch.Tensor) for v in batch):
            return type(batch)(batch[lo:hi])  # a list of per-sample values (e.g. strings)
        return type(batch)(_slice(v, lo, hi, n) for v in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


@dataclass
class MicroBatch:
    """A piece of some rank's share of a step.

    Attributes:
        data: the collated samples (on the training device once the integration moved them).
        samples: how many samples ``data`` holds.
        owner: the rank whose share it was planned in.
        step: the step it was planned for.
        index: its position among the owner's micro-batches of that step.
    """

    data: Any
    samples: int
    owner: int = 0
    step: int = 0
    index: int = 0


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


@dataclass
class StepClaims:
    """Claims on the micro-batches of one step, exactly once each, through a store's atomic ``add``.

    Every rank's share of the step is cut into ``counts[r]`` micro-batches; a claim on rank r's share returns
    the next unclaimed index, or ``None`` once all are taken. Owners claim their own share first; a rank
    whose share is used up claims from the share with most micro-batches left (WBSP's busy workers).

    Args:
        store: anything with ``add(key: str, amount: int) -> int`` that is atomic across ranks.
        prefix: a key prefix unique to this step (e.g. ``"hp/{epoch}/{step}"``).
        counts: micro-batches of each rank's share.

    Example::

        >>> class Store(dict):
        ...     def add(self, key, n):
        ...         self[key] = self.get(key, 0) + n
        ...         return self[key]
        >>> claims = StepClaims(Store(), "s0", [2, 1])
        >>> [claims.claim(0), claims.claim(0), claims.claim(0)], claims.steal(exclude=0)
        ([0, 1, None], (1, 0))
    """

    store: Any
    prefix: str
    counts: Sequence[int]
    taken: dict[int, int] = field(default_factory=dict)

    def _key(self, owner: int) -> str:
        return f"{self.prefix}/{owner}"

    def claim(self, owner: int) -> int | None:
        """The next unclaimed micro-batch of ``owner``'s share, or ``None``."""
        n = int(self.store.add(self._key(owner), 1))
        return n - 1 if n <= self.counts[owner] else None

    def claim_many(self, owner: int, count: int) -> range:
        """The next ``count`` unclaimed micro-batches of ``owner``'s share (fewer, or none, near the end)."""
        n = int(self.store.add(self._key(owner), int(count)))
        return range(min(n - int(count), self.counts[owner]), min(n, self.counts[owner]))

    def claimed(self, owner: int) -> int:
        """Micro-batches of ``owner``'s share claimed so far (by anyone)."""
        return min(int(self.store.add(self._key(owner), 0)), int(self.counts[owner]))

    def left(self, exclude: int | None = None) -> int:
        """Micro-batches not yet claimed, over every share but ``exclude``'s."""
        return sum(self.counts[r] - self.claimed(r) for r in range(len(self.counts)) if r != exclude)

    def steal(self, exclude: int) -> tuple[int, int] | None:
        """Claim a micro-batch from the share with most left; ``(owner, index)`` or ``None`` when none is left."""
        while True:
            left = {r: self.counts[r] - self.claimed(r) for r in range(len(self.counts)) if r != exclude}
            left = {r: n for r, n in left.items() if n > 0}
            if not left:
                return None
            victim = max(left, key=lambda r: (left[r], -r))
            index = self.claim(victim)
            if index is not None:
                self.taken[victim] = self.taken.get(victim, 0) + 1
                return victim, index

    def rate_key(self, rank: int) -> str:
        """Where ``rank`` reports its pace in this step (``wbsp``)."""
        return f"{self.prefix}/rate/{rank}"

    @property
    def free_key(self) -> str:
        """Counts the ranks that have finished their own share in this step (``wbsp``)."""
        return f"{self.prefix}/free"

    def keys(self, rank: int) -> list[str]:
        """The keys ``rank`` leaves in the store for this step (to delete once every rank is past it)."""
        return [self._key(rank), self.rate_key(rank), self.free_key]


class ClaimKeys:
    """Deletes the store keys of past steps, keeping the last ``keep`` steps' (slower ranks may still read them).

    Example::

        >>> class Store(dict):
        ...     def delete_key(self, key):
        ...         return self.pop(key, None) is not None
        >>> store, keys = Store(a=1, b=2), ClaimKeys(keep=1)
        >>> keys.forget(store, ["a"]); keys.forget(store, ["b"]); sorted(store)
        ['b']
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._steps: deque[list[str]] = deque()

    def forget(self, store: Any, keys: Sequence[str]) -> None:
        self._steps.append(list(keys))
        while len(self._steps) > self.keep:
            for key in self._steps.popleft():
                try:
                    store.delete_key(key)
                except Exception:  # noqa: BLE001 - cleanup only
                    pass


def open_claim_store(rank: int, host: str, broadcast: Any, timeout: float) -> Any:
    """A ``torch.distributed.TCPStore`` for claim counters, served by rank 0 on a free port. Collective:
    ``broadcast(obj)`` must return rank 0's ``obj`` on every rank (the strategy's or Horovod's broadcast)."""
    from datetime import timedelta

    import torch.distributed as dist

    wait = timedelta(seconds=float(timeout))
    store, address = None, None
    if rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=wait)
        address = (host, int(store.port))
    address = broadcast(address)
    if store is None:
        store = dist.TCPStore(address[0], int(address[1]), is_master=False, timeout=wait)
    return store
