"""``aggregation="wbsp"``: a rank that finishes its share takes unclaimed micro-batches of slower ranks.

After one unit, a rank claims as much of its share as it can finish by the *balanced time* (when all ranks
would finish if the step's samples were shared by this step's measured rates, which each rank reports after
its first unit); the units it leaves are claimed by ranks that finish early, which load them from the dataset
(WBSP's busy workers, Yang et al. 2024, translated to all-reduce; SA-ATP's leading workers helping the
straggler, Li et al. 2024). A thief that would finish a unit late leaves it to faster ones until the step is
overdue, so no unit is stranded. Every unit is claimed exactly once, so the step's samples are exactly the
planned ones and the update is exact DDP maths.

- :class:`StepClaims` claims micro-batches of any rank's share exactly once through a key-value store's atomic
  ``add`` (:func:`open_claim_store`: the job's rendezvous store, or one rank 0 serves on the job's address; keys
  under a per-job secret; every operation bounded in time);
- :class:`ClaimKeys` deletes the keys of steps every rank is past;
- :func:`wbsp_micro_batches` yields a rank's micro-batches of a step (no collective: the store coordinates);
- :class:`WBSPAggregator` is the mode's engine.

The store is shared with whoever can reach its port, so the claims are checked against the step's plan: a
counter no rank of the job can produce (below zero, more ranks done than there are) raises
:class:`ClaimError` at once, and after the exchange every rank checks that the step processed exactly its
planned samples and, unit by unit, that every micro-batch of the plan was taken exactly once: each claim
records the unit it took (:attr:`StepClaims.units`) and the ranks' tallies ride in the exchange's own
all-reduce, which no client of the store can write. So a claim made from outside the job cannot drop or
repeat samples silently, even one that repeats a micro-batch and drops another of the same size.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hetero_plugins.aggregation.base import SampleWeightedAggregator, StepContext
from hetero_plugins.aggregation.microbatch import MicroBatch, micro_batch_sizes, offsets_of, take_rows, unit_indices
from hetero_plugins.collectives import Collectives, open_store

__all__ = ["ClaimError", "ClaimKeys", "StepClaims", "WBSPAggregator", "open_claim_store", "wbsp_micro_batches"]

#: Every claim key starts with this, followed by the step's number in the aggregator's life (``/{n}``).
CLAIM_NAMESPACE = "hetero_plugins/wbsp"


class ClaimError(RuntimeError):
    """The claim counters hold what no rank of the job can produce: a client outside the job changed them."""


_TAMPERED = ("HINT: something outside the job reaches the claim store and writes to it; keep the rendezvous "
             "port (MASTER_PORT) and rank 0's ports off untrusted networks, or use aggregation='weighted'.")


@dataclass
class StepClaims:
    """Claims on the micro-batches of one step, exactly once each, through a store's atomic ``add``.

    Every rank's share of the step is cut into ``counts[r]`` micro-batches; a claim on rank r's share returns
    the next unclaimed index, or ``None`` once all are taken. Owners claim their own share first; a rank
    whose share is used up claims from the share with most micro-batches left (WBSP's busy workers).

    Args:
        store: anything with ``add(key: str, amount: int) -> int`` that is atomic across ranks.
        prefix: a key prefix unique to this step (e.g. ``"hetero_plugins/wbsp/{n}"``).
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
    #: Every micro-batch this rank claimed in the step, as ``(owner, index)``, in claim order.
    units: list[tuple[int, int]] = field(default_factory=list)

    def _key(self, owner: int) -> str:
        return f"{self.prefix}/{owner}"

    def _add(self, owner: int, amount: int) -> int:
        n = int(self.store.add(self._key(owner), int(amount)))
        if n - int(amount) < 0:
            raise ClaimError(
                f"aggregation='wbsp': the claim counter of rank {owner}'s share read {n - int(amount)} before this "
                f"claim; the job's ranks only ever count up from 0. {_TAMPERED}"
            )
        return n

    def claim(self, owner: int) -> int | None:
        """The next unclaimed micro-batch of ``owner``'s share, or ``None``."""
        n = self._add(owner, 1)
        if n > self.counts[owner]:
            return None
        self.units.append((owner, n - 1))
        return n - 1

    def claim_many(self, owner: int, count: int) -> range:
        """The next ``count`` unclaimed micro-batches of ``owner``'s share (fewer, or none, near the end)."""
        n = self._add(owner, int(count))
        got = range(min(n - int(count), self.counts[owner]), min(n, self.counts[owner]))
        self.units.extend((owner, i) for i in got)
        return got

    def claimed(self, owner: int) -> int:
        """Micro-batches of ``owner``'s share claimed so far (by anyone)."""
        return min(self._add(owner, 0), int(self.counts[owner]))

    def free(self, amount: int = 0) -> int:
        """Add ``amount`` to the number of ranks done with their own share in this step; the count after it."""
        n = int(self.store.add(self.free_key, int(amount)))
        if not 0 <= n <= len(self.counts):
            raise ClaimError(f"aggregation='wbsp': {n} ranks reported their share done, of {len(self.counts)}. "
                             f"{_TAMPERED}")
        return n

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

    def tally(self) -> list[int]:
        """How often this rank claimed each unit of the step, every rank's share in rank order (summed over
        the ranks, every entry of a sound step is 1).

        Example::

            >>> class Store(dict):
            ...     def add(self, key, n):
            ...         self[key] = self.get(key, 0) + n
            ...         return self[key]
            >>> claims = StepClaims(Store(), "s", [2, 1])
            >>> claims.claim(1), claims.claim_many(0, 2), claims.tally()
            (0, range(0, 2), [1, 1, 1])
        """
        offsets = offsets_of(self.counts)
        out = [0] * offsets[-1]
        for owner, index in self.units:
            out[offsets[owner] + index] += 1
        return out

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


def open_claim_store(comm: Collectives, timeout: float) -> Any:
    """The key-value store of the claim counters (collective): the job's rendezvous store where the transport
    has one, else a ``torch.distributed.TCPStore`` rank 0 serves on the job's address; keys under a per-job
    secret, every operation bounded by ``timeout`` seconds (or the transport's own, shorter, bound), after
    which it raises :class:`~hetero_plugins.collectives.CollectiveError` naming the store's rank."""
    bound = min(float(timeout), float(getattr(comm, "timeout", timeout)))
    return open_store(comm, bound, namespace="hetero_plugins/wbsp")


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
    offsets = offsets_of(sizes)
    rates_known = list(model_rates) if model_rates is not None else [None] * len(counts)
    planned = sum(counts)
    start = clock()
    done = 0
    reported = False

    def finish(samples: int) -> float:
        elapsed = clock() - start
        return elapsed + elapsed / done * samples if done else math.inf

    def others_free() -> bool:
        return claims.free() > 0

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
    claims.free(1)
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


class WBSPAggregator(SampleWeightedAggregator):
    """``aggregation="wbsp"`` (see the module doc).

    Claim keys are ``hetero_plugins/wbsp/{n}/...`` in the store's secret namespace, ``n`` counting the steps
    this aggregator ran (equal on every rank: each runs every step's micro-batches once), so a repeated epoch or
    step number never meets old counters. A rank deletes its keys of a step two steps later: by then every rank
    has passed the exchange of the step in between, so none still reads them. After each exchange every rank
    checks that the step processed exactly its planned samples, and that every micro-batch of the plan ran
    exactly once (the ranks' claim tallies travel in the exchange's all-reduce; :class:`ClaimError` naming the
    micro-batches otherwise).

    Attributes:
        store: the claim store (opened by :meth:`setup`).
    """

    mode = "wbsp"

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        super()._init_state(buffers)
        assert self.options.micro_batches is not None and self.options.claim_timeout is not None  # filled per mode
        self.parts = self.options.micro_batches
        self.claim_timeout = self.options.claim_timeout
        self.store: Any = None
        self._keys = ClaimKeys(keep=2)
        self._steps = 0
        self._claims: StepClaims | None = None  # the step in progress
        self._units: list[int] | None = None  # every rank's tally of the last exchange, summed
        self._step_counts: tuple[int, ...] = ()  # the planned counts of the step being exchanged

    def setup(self, optimizers: Sequence[Any]) -> None:
        super().setup(optimizers)
        if self.store is None:
            self.store = open_claim_store(self.comm, self.claim_timeout)

    def micro_batches(self, batch: Any, ctx: StepContext) -> Iterator[MicroBatch]:
        """This rank's unclaimed micro-batches of its share, then other ranks' (loaded through ``ctx.load``)."""
        if self.store is None or ctx.indices_of is None or ctx.load is None:
            raise RuntimeError(
                "aggregation='wbsp' needs its claim store and a way to load other ranks' samples. HINT: call "
                "setup(optimizers) on every rank first, and give the StepContext `indices_of` and `load`."
            )
        self._begin(batch, ctx)
        parts = self.parts
        claims = StepClaims(self.store, f"{CLAIM_NAMESPACE}/{self._steps}",
                            [len(micro_batch_sizes(c, parts)) for c in ctx.counts])
        self._steps += 1
        self._claims = claims
        indices_of, fetch = ctx.indices_of, ctx.load

        def load(owner: int, index: int) -> tuple[Any, int]:
            chosen = unit_indices(indices_of(owner), parts, index)
            return fetch(chosen), len(chosen)

        rates = ctx.planner.rates(ctx.counts) if ctx.planner is not None else None
        for mb in wbsp_micro_batches(batch, ctx.counts, parts, ctx.rank, claims, load, rates):
            mb.step, mb.weight = ctx.step, mb.samples / ctx.planned
            yield mb
            self.step_samples += mb.samples
            if mb.owner != ctx.rank:
                self.stats.stolen += mb.samples
        self._keys.forget(self.store, claims.keys(ctx.rank))

    def _exchange_allreduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The gradients and counts with this rank's unit tally (:meth:`StepClaims.tally`) appended, summed in
        one all-reduce; the summed tally is kept for :meth:`exchange`'s check."""
        units = sum(len(micro_batch_sizes(c, self.parts)) for c in self._step_counts)
        mine = self._claims.tally() if self._claims is not None else []
        tally = torch.tensor(mine if len(mine) == units else [0] * units, dtype=flat.dtype, device=flat.device)
        joined = torch.cat([flat, tally])
        out = super()._exchange_allreduce(joined)
        joined = joined if out is None else out
        self._units = [int(round(float(v))) for v in joined[flat.numel():].tolist()]
        return joined[: flat.numel()]

    def exchange(self, ctx: StepContext) -> bool:
        self._step_counts = tuple(ctx.counts)
        try:
            out = super().exchange(ctx)
        finally:
            self._claims = None
        done = sum(self.last_counts or ())
        if done != ctx.planned:  # every unit is claimed exactly once, so only a foreign claim changes the sum
            raise ClaimError(
                f"aggregation='wbsp' step {ctx.step}: the ranks processed {done} samples ({self.last_counts}) of the "
                f"{ctx.planned} planned ({list(ctx.counts)}), so some were "
                f"{'skipped' if done < ctx.planned else 'repeated'}; "
                f"the job's own claims hand out each micro-batch exactly once. {_TAMPERED}"
            )
        wrong = self._wrong_units(ctx.counts)
        if wrong:
            raise ClaimError(
                f"aggregation='wbsp' step {ctx.step}: the step's samples add up ({done} of {ctx.planned} planned), "
                f"but not every micro-batch ran exactly once: {'; '.join(wrong)}; the job's own claims hand out "
                f"each micro-batch exactly once. {_TAMPERED}"
            )
        return out

    def _wrong_units(self, counts: Sequence[int]) -> list[str]:
        """The units of the last exchange's tally that did not run exactly once, as ``rank r's micro-batch i
        ran k times``."""
        units = self._units or []
        out, start = [], 0
        for owner, c in enumerate(counts):
            n = len(micro_batch_sizes(c, self.parts))
            for index, times in enumerate(units[start : start + n]):
                if times != 1:
                    out.append(f"rank {owner}'s micro-batch {index} ran {times} time{'' if times == 1 else 's'}")
            start += n
        return out
