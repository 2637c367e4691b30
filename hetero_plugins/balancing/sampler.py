"""Samplers that give each rank its own batch size while every rank runs the same number of steps."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from hetero_plugins._validation import check_int
from hetero_plugins.balancing.partition import (
    PLAN_HINT,
    EpochLayout,
    check_plan,
    contiguous_split,
    ddp_order,
    epoch_layout,
    epoch_shards,
    split_remainder,
)

__all__ = ["HeteroBatchSampler", "HeteroDistributedSampler", "HeteroInferenceBatchSampler"]


class HeteroDistributedSampler(Sampler[int]):
    """A ``DistributedSampler`` whose per-rank shard follows a plan of per-rank batch sizes.

    Yields this rank's sample indices for the epoch; wrap it in a ``BatchSampler`` of ``plan[rank]`` (the
    Lightning integration does this for you). Every sample appears exactly once per epoch over all ranks
    (see :mod:`hetero_plugins.balancing.partition` for the remainder's padding and ``drop_last`` semantics).

    Args:
        num_samples: length of the dataset.
        plan: per-rank batch sizes in global-rank order; their sum is the global batch.
        rank: this process's global rank.
        shuffle: shuffle with a seeded, epoch-dependent order.
        seed: shared by all ranks.
        drop_last: drop the last partial global batch instead of sharing it.
        locality: keep each rank's shard across epochs and plan changes (LOFT); by default the step unions
            are exactly ``DistributedSampler``'s (see :mod:`hetero_plugins.balancing.partition`). With
            ``shuffle`` and ``drop_last`` the samples dropped change every epoch; without ``shuffle`` the same
            tail is dropped every epoch, as ``DistributedSampler(shuffle=False)`` does.
        pad_to_world_size: pad the epoch to a multiple of the world size as ``DistributedSampler`` does
            (training); ``False`` pads only where a rank would get no sample (evaluation: exact metrics).

    Example::

        >>> s = HeteroDistributedSampler(10, plan=[3, 1], rank=1, shuffle=False)
        >>> list(s)
        [3, 7, 9]
    """

    def __init__(
        self,
        num_samples: int,
        plan: Sequence[int],
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        locality: bool = False,
        pad_to_world_size: bool = True,
    ) -> None:
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.pad_to_world_size = bool(pad_to_world_size)
        self.rank = check_int("rank", rank, minimum=0)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.locality = bool(locality)
        self.epoch = 0
        self.plan: tuple[int, ...] = ()
        self.set_plan(plan)

    @property
    def num_replicas(self) -> int:
        return len(self.plan)

    def set_plan(self, plan: Sequence[int]) -> None:
        """Adopt new per-rank batch sizes; takes effect at the next ``iter()``."""
        self.plan = self.checked_plan(plan)

    def checked_plan(self, plan: Sequence[int]) -> tuple[int, ...]:
        """``plan`` as a tuple of ints if this sampler can adopt it, else ``ValueError`` (nothing is changed)."""
        plan = check_plan(plan)
        if self.rank >= len(plan):
            raise ValueError(
                f"`rank`={self.rank} is out of range for a plan of {len(plan)} ranks: {list(plan)}. HINT: pass one "
                f"batch size per rank (the plan's length is the world size, so at least {self.rank + 1} here)."
            )
        epoch_layout(self.num_samples, plan, self.drop_last, self.pad_to_world_size)  # validates
        return plan

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @property
    def layout(self) -> EpochLayout:
        return epoch_layout(self.num_samples, self.plan, self.drop_last, self.pad_to_world_size)

    @property
    def batch_size(self) -> int:
        """This rank's local batch size under the current plan."""
        return self.plan[self.rank]

    def step_counts(self, step: int) -> tuple[int, ...]:
        """All ranks' sample counts of step ``step`` of the current epoch."""
        return self.layout.step_counts(step)

    def shards(self) -> list:
        return epoch_shards(
            self.num_samples, self.plan, self.epoch, self.seed, self.shuffle, self.drop_last, self.locality,
            self.pad_to_world_size,
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.shards()[self.rank].tolist())

    def __len__(self) -> int:
        return self.layout.shard_sizes()[self.rank]


class HeteroBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches (lists of indices) under a plan; ``len`` is the same on every rank.

    Pass it as ``DataLoader(dataset, batch_sampler=...)``. Same arguments as :class:`HeteroDistributedSampler`.

    With the default layout (``locality=False``) every step's global batch is fixed by the epoch's order
    alone, so the plan may change in the middle of an epoch without losing or repeating a sample:
    ``set_plan(plan, from_step=k)`` applies from step k on. Batches are drawn lazily, step by step, so a
    change reaches every step that the loader has not drawn yet (keep k beyond the loader's prefetch).
    ``set_plan(plan)`` sets a whole epoch's plan: set while an epoch is being iterated, it applies from the next
    :meth:`set_epoch` or iteration, and the running iteration keeps the steps it started with.

    Resuming mid-epoch: :meth:`state_dict` holds the epoch, its plans and the steps done; after
    :meth:`load_state_dict` the next iteration over that epoch starts at the first step not done, so a resumed
    epoch runs every remaining sample exactly once (torchdata's ``StatefulDataLoader`` protocol, which
    Lightning saves in the fit loop's checkpoint). ``len`` stays the epoch's number of steps, as Lightning
    counts the resumed epoch's steps from the step it restarts at.

    Example::

        >>> s = HeteroBatchSampler(12, plan=[3, 3], rank=0, shuffle=False)
        >>> list(s)
        [[0, 1, 2], [6, 7, 8]]
        >>> s.set_plan([5, 1], from_step=1)
        >>> list(s), s.step_counts(1)
        ([[0, 1, 2], [6, 7, 8, 9, 10]], (5, 1))
    """

    def __init__(
        self,
        num_samples: int,
        plan: Sequence[int],
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        locality: bool = False,
        pad_to_world_size: bool = True,
    ) -> None:
        self.sampler = HeteroDistributedSampler(
            num_samples, plan, rank, shuffle, seed, drop_last, locality, pad_to_world_size
        )
        # The epoch's mid-epoch changes: changed in place within an epoch, a new list for each epoch, so that an
        # iteration keeps its own epoch's list.
        self._changes: list[tuple[int, tuple[int, ...]]] = []
        self._next: tuple[int, ...] | None = None  # a whole-epoch plan set while an epoch was being iterated
        self._running: object | None = None  # the token of the iteration in progress
        self._resume: tuple[int, int] | None = None  # (epoch, first step) of a restored mid-epoch position
        self.steps_drawn = 0

    rank = property(lambda self: self.sampler.rank)
    epoch = property(lambda self: self.sampler.epoch)

    @property
    def plan(self) -> tuple[int, ...]:
        """The latest plan set: the next epoch's if one waits for the running iteration to end, else the plan of
        this epoch's last steps."""
        if self._next is not None:
            return self._next
        return self._changes[-1][1] if self._changes else self.sampler.plan

    @property
    def batch_size(self) -> int:
        return self.plan[self.rank]

    @property
    def plan_changes(self) -> list[tuple[int, tuple[int, ...]]]:
        """``(from_step, plan)`` changes made within the current epoch."""
        return list(self._changes)

    def set_plan(self, plan: Sequence[int], from_step: int | None = None) -> None:
        """Adopt ``plan`` for the whole next epoch (``from_step=None``) or from step ``from_step`` of this one.

        A whole-epoch plan set while an epoch is being iterated waits for the next :meth:`set_epoch` or
        iteration; until then the running iteration, ``len`` and :meth:`step_counts` keep the current epoch's
        steps. ``from_step=0`` changes the current epoch from its first step, under the same checks as any
        ``from_step`` (the same ranks and global batch).
        """
        if from_step is None:
            plan = self.sampler.checked_plan(plan)
            if self._running is not None:
                self._next = plan
            else:
                self._adopt(plan)
            return
        check_int("from_step", from_step, minimum=0, hint="pass the first step of the epoch the plan applies to, "
                  "or from_step=None for a whole-epoch plan.")
        plan = check_plan(plan)
        if self.sampler.locality:
            raise ValueError("`from_step` needs locality=False: with locality=True a plan applies to whole epochs. "
                             "HINT: call set_plan(plan) without from_step, or use locality=False.")
        current = self.sampler.plan
        if len(plan) != len(current) or sum(plan) != sum(current):
            raise ValueError(
                f"a mid-epoch plan must keep {len(current)} ranks and the global batch {sum(current)}, each rank "
                f">= 1; got {list(plan)}. HINT: spread {sum(current)} samples over {len(current)} ranks, or set a "
                "plan of another global batch for whole epochs with set_plan(plan) (from_step=None)."
            )
        self._changes[:] = [c for c in self._changes if c[0] < from_step] + [(from_step, plan)]

    def _adopt(self, plan: Sequence[int]) -> None:
        """Make ``plan`` the whole current epoch's plan (a new epoch's list of changes)."""
        self.sampler.set_plan(plan)
        self._changes = []
        self._next = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: its plan is the whole-epoch plan set last while an epoch ran, else the latest
        plan of the epoch before."""
        if self._next is not None:
            self._adopt(self._next)
        elif self._changes:
            self._adopt(self._changes[-1][1])
        self.sampler.set_epoch(epoch)

    @property
    def start_step(self) -> int:
        """The step the next iteration starts at: 0, or the first step not done of a restored epoch."""
        resume = self._resume
        return resume[1] if resume is not None and resume[0] == self.sampler.epoch else 0

    def state_dict(self, steps_done: int | None = None) -> dict[str, Any]:
        """The epoch, its plans and ``steps_done`` (default: the batches this sampler has yielded in the epoch;
        a loader that draws ahead passes the steps it has delivered)."""
        s = self.sampler
        state = {
            "epoch": s.epoch, "num_samples": s.num_samples, "plan": list(s.plan),
            "plan_changes": [[k, list(p)] for k, p in self._changes],
            "steps_done": self.steps_drawn if steps_done is None else int(steps_done),
        }
        if self._next is not None:
            state["next_plan"] = list(self._next)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the next iteration over its epoch starts at its first step not done.

        A state saved with another number of ranks, global batch or dataset length cannot place the remaining
        samples in this sampler's steps: its plan is ignored (with a ``RuntimeWarning``) and the epoch's
        remaining steps are this sampler's own from the same step on.
        """
        s = self.sampler
        plan = [int(b) for b in state["plan"]]
        steps = int(state["steps_done"])
        if steps < 0:
            raise ValueError(f"`steps_done`={steps} in the sampler state is negative. HINT: pass the steps of the "
                             "epoch already run (>= 0), as `state_dict(steps_done=...)` records them.")
        same = (len(plan) == len(s.plan) and sum(plan) == sum(s.plan)
                and int(state.get("num_samples", s.num_samples)) == s.num_samples)
        if same:
            s.set_plan(plan)
            self._changes = [(int(k), tuple(int(b) for b in p)) for k, p in state.get("plan_changes", [])]
            nxt = state.get("next_plan")
            self._next = None if nxt is None else s.checked_plan(nxt)
        elif 0 < steps < s.layout.steps:
            warnings.warn(
                f"HeteroBatchSampler: the saved position (epoch {state['epoch']}, step {steps}) is for "
                f"{len(plan)} ranks, a global batch of {sum(plan)} and {state.get('num_samples')} samples; this run "
                f"has {len(s.plan)} ranks, {sum(s.plan)} and {s.num_samples}: the epoch resumes at step {steps} of "
                "this run's order, so some samples of it may run twice or not at all. HINT: resume a mid-epoch "
                "checkpoint with the same world size and batch size, or from an end-of-epoch checkpoint.",
                RuntimeWarning, stacklevel=2,
            )
        s.set_epoch(int(state["epoch"]))
        self._resume = (s.epoch, steps)

    def plan_at(self, step: int) -> tuple[int, ...]:
        """The plan of step ``step`` of the current epoch."""
        return _plan_at(self.sampler.plan, self._changes, step)

    def step_counts(self, step: int) -> tuple[int, ...]:
        """All ranks' sample counts of step ``step`` of the current epoch."""
        return _step_counts(self.sampler.layout, self.plan_at(step), step)

    def batch_indices(self, step: int, rank: int | None = None) -> list[int]:
        """The sample indices of ``rank``'s batch at ``step`` (default this rank), under the plans set so far.

        Any rank can compute any other rank's batch (the ``wbsp`` aggregation loads micro-batches of a slower
        rank's share this way). Needs the default layout (``locality=False``).
        """
        s = self.sampler
        if s.locality:
            raise ValueError("`batch_indices` needs locality=False: with locality=True shards are per rank.")
        rank = s.rank if rank is None else rank
        layout = s.layout
        order = ddp_order(s.num_samples, layout.padding, s.epoch, s.seed, s.shuffle)
        counts = self.step_counts(step)
        lo = step * sum(layout.plan) + sum(counts[:rank])
        return order[lo : lo + counts[rank]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        # Runs when the first batch is drawn, after the loop set the epoch. A whole-epoch plan set while the last
        # iteration ran applies now, unless this iteration resumes a restored mid-epoch position.
        s = self.sampler
        resume = self._resume
        if self._next is not None and (resume is None or resume[0] != s.epoch):
            self._adopt(self._next)
        first = self.start_step
        self._resume = None
        self.steps_drawn = first
        token = self._running = object()
        try:
            if s.locality:
                shard = list(s)
                b = s.batch_size
                for start in range(first * b, len(shard), b):
                    self.steps_drawn += 1
                    yield shard[start : start + b]
                return
            layout, base, changes, rank = s.layout, s.plan, self._changes, s.rank
            order = ddp_order(s.num_samples, layout.padding, s.epoch, s.seed, s.shuffle)
            global_batch = sum(layout.plan)
            for k in range(first, layout.steps):
                # read now: a mid-epoch change made while iterating applies to later steps of this epoch
                counts = _step_counts(layout, _plan_at(base, changes, k), k)
                lo = k * global_batch + sum(counts[:rank])
                self.steps_drawn += 1
                yield order[lo : lo + counts[rank]].tolist()
        finally:
            if self._running is token:
                self._running = None

    def __len__(self) -> int:
        return self.sampler.layout.steps


def _plan_at(base: tuple[int, ...], changes: Sequence[tuple[int, tuple[int, ...]]], step: int) -> tuple[int, ...]:
    plan = base
    for start, p in changes:
        if start <= step:
            plan = p
    return plan


def _step_counts(layout: EpochLayout, plan: tuple[int, ...], step: int) -> tuple[int, ...]:
    if step >= layout.steps:
        raise IndexError(f"step {step} is out of range for an epoch of {layout.steps} steps")
    if step < layout.full_steps:
        return plan
    return tuple(split_remainder(sum(layout.last_counts), plan))


class HeteroInferenceBatchSampler(Sampler[list[int]]):
    """Inference batches: rank ``rank`` takes a contiguous slice of ``order`` sized in proportion to ``plan``
    and yields it in batches of ``plan[rank]``. No padding and no shuffling, so concatenating every rank's
    outputs in rank order gives the outputs in ``order``. Ranks may run different numbers of batches.

    Example::

        >>> [list(HeteroInferenceBatchSampler(range(10), [3, 1], r)) for r in (0, 1)]
        [[[0, 1, 2], [3, 4, 5], [6, 7]], [[8], [9]]]
    """

    def __init__(self, order: Sequence[int], plan: Sequence[int], rank: int) -> None:
        self.order = list(order)
        self.plan = check_plan(plan)
        self.rank = check_int("rank", rank, minimum=0)
        if self.rank >= len(self.plan):
            raise ValueError(f"`plan`={list(self.plan)} must hold a batch size >= 1 for rank {self.rank}. "
                             f"HINT: {PLAN_HINT}")
        self.start, self.stop = contiguous_split(len(self.order), self.plan)[self.rank]

    def __iter__(self) -> Iterator[list[int]]:
        b = self.plan[self.rank]
        for lo in range(self.start, self.stop, b):
            yield self.order[lo : min(lo + b, self.stop)]

    def __len__(self) -> int:
        return -(-(self.stop - self.start) // self.plan[self.rank])
