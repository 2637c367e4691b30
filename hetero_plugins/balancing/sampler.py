"""Samplers that give each rank its own batch size while every rank runs the same number of steps."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from hetero_plugins._validation import check_int
from hetero_plugins.balancing.partition import (
    EpochLayout,
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
            are exactly ``DistributedSampler``'s (see :mod:`hetero_plugins.balancing.partition`).
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
        plan = tuple(int(b) for b in plan)
        if self.rank >= len(plan):
            raise ValueError(f"`rank`={self.rank} is out of range for a plan of {len(plan)} ranks: {list(plan)}.")
        epoch_layout(self.num_samples, plan, self.drop_last, self.pad_to_world_size)  # validates
        self.plan = plan

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
        self._changes: list[tuple[int, tuple[int, ...]]] = []
        self._resume: tuple[int, int] | None = None  # (epoch, first step) of a restored mid-epoch position
        self.steps_drawn = 0

    rank = property(lambda self: self.sampler.rank)
    epoch = property(lambda self: self.sampler.epoch)

    @property
    def plan(self) -> tuple[int, ...]:
        """The plan of the epoch's last steps (the latest plan set)."""
        return self._changes[-1][1] if self._changes else self.sampler.plan

    @property
    def batch_size(self) -> int:
        return self.plan[self.rank]

    @property
    def plan_changes(self) -> list[tuple[int, tuple[int, ...]]]:
        """``(from_step, plan)`` changes made within the current epoch."""
        return list(self._changes)

    def set_plan(self, plan: Sequence[int], from_step: int | None = None) -> None:
        """Adopt ``plan`` for the whole next epoch (``from_step=None``) or from step ``from_step`` of this one."""
        if not from_step:
            self.sampler.set_plan(plan)
            self._changes = []
            return
        plan = tuple(int(b) for b in plan)
        if self.sampler.locality:
            raise ValueError("`from_step` needs locality=False: with locality=True a plan applies to whole epochs.")
        if len(plan) != len(self.sampler.plan) or sum(plan) != sum(self.sampler.plan) or min(plan) < 1:
            raise ValueError(
                f"a mid-epoch plan must keep {len(self.sampler.plan)} ranks and the global batch "
                f"{sum(self.sampler.plan)}, each rank >= 1; got {list(plan)}."
            )
        check_int("from_step", from_step, minimum=1)
        self._changes = [c for c in self._changes if c[0] < from_step] + [(from_step, plan)]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``; the latest plan becomes the whole epoch's plan."""
        if self._changes:
            self.sampler.set_plan(self._changes[-1][1])
            self._changes = []
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
        return {
            "epoch": s.epoch, "num_samples": s.num_samples, "plan": list(s.plan),
            "plan_changes": [[k, list(p)] for k, p in self._changes],
            "steps_done": self.steps_drawn if steps_done is None else int(steps_done),
        }

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
        plan = self.sampler.plan
        for start, p in self._changes:
            if start <= step:
                plan = p
        return plan

    def step_counts(self, step: int) -> tuple[int, ...]:
        layout = self.sampler.layout
        if step >= layout.steps:
            raise IndexError(f"step {step} is out of range for an epoch of {layout.steps} steps")
        plan = self.plan_at(step)
        if step < layout.full_steps:
            return plan
        return tuple(split_remainder(sum(layout.last_counts), plan))

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
        s = self.sampler
        first = self.start_step  # read when the first batch is drawn, after the loop set the epoch
        self._resume = None
        self.steps_drawn = first
        if s.locality:
            shard = list(s)
            b = s.batch_size
            for start in range(first * b, len(shard), b):
                self.steps_drawn += 1
                yield shard[start : start + b]
            return
        layout = s.layout
        order = ddp_order(s.num_samples, layout.padding, s.epoch, s.seed, s.shuffle)
        global_batch = sum(layout.plan)
        for k in range(first, layout.steps):
            counts = self.step_counts(k)  # read now: a change made while iterating applies to later steps
            lo = k * global_batch + sum(counts[: s.rank])
            self.steps_drawn += 1
            yield order[lo : lo + counts[s.rank]].tolist()

    def __len__(self) -> int:
        return self.sampler.layout.steps


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
        self.plan = tuple(int(b) for b in plan)
        self.rank = check_int("rank", rank, minimum=0)
        if self.rank >= len(self.plan) or min(self.plan) < 1:
            raise ValueError(f"`plan`={list(self.plan)} must hold a batch size >= 1 for rank {self.rank}.")
        self.start, self.stop = contiguous_split(len(self.order), self.plan)[self.rank]

    def __iter__(self) -> Iterator[list[int]]:
        b = self.plan[self.rank]
        for lo in range(self.start, self.stop, b):
            yield self.order[lo : min(lo + b, self.stop)]

    def __len__(self) -> int:
        return -(-(self.stop - self.start) // self.plan[self.rank])
