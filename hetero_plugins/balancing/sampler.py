"""Samplers that give each rank its own batch size while every rank runs the same number of steps."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

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
        if s.locality:
            shard = list(s)
            b = s.batch_size
            for start in range(0, len(shard), b):
                yield shard[start : start + b]
            return
        layout = s.layout
        order = ddp_order(s.num_samples, layout.padding, s.epoch, s.seed, s.shuffle)
        global_batch = sum(layout.plan)
        for k in range(layout.steps):
            counts = self.step_counts(k)  # read now: a change made while iterating applies to later steps
            lo = k * global_batch + sum(counts[: s.rank])
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
