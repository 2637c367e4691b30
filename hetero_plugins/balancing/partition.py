"""How one epoch's samples are cut into per-rank shards for a plan of per-rank batch sizes.

Every rank runs the same number of steps (so collectives pair up). With N samples and a plan b (global
batch B = sum b), the epoch has F = N // B full steps, in which rank i takes b_i samples, and, unless
``drop_last``, one last step that shares the R = N - F*B leftover samples in proportion to the plan
(largest remainder), every rank getting at least one. As ``torch.utils.data.DistributedSampler`` does, the
order is first padded to a multiple of the world size with samples from its start.

By default (``locality=False``) the epoch's order is ``DistributedSampler``'s own, and step k of every rank
together covers exactly the k-th global batch of that order: the step unions, hence the SGD updates, are
those of stock DDP for any plan. With ``locality=True``, rank i's shard is a contiguous slice of an order
fixed for the run (a seeded permutation, or the identity without shuffling) and each rank reshuffles only
within its own shard every epoch; when the plan changes, shard boundaries move a little and each rank keeps
as much of its previous shard as a contiguous split allows (LOFT, Liu et al., IEEE TCC 2024: data-fetch
locality dominates on distributed datasets). With ``locality=True``, ``shuffle`` and ``drop_last``, each rank
owns a contiguous region of that fixed order sized in proportion to the plan and drops the samples its epoch's
reshuffle puts last, so the dropped samples change every epoch (as ``DistributedSampler`` with ``shuffle``
drops different ones per epoch) while the rank keeps its region; without ``shuffle`` the epoch's tail is
dropped, the same samples every epoch, as ``DistributedSampler(shuffle=False)`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hetero_plugins._validation import check_int

__all__ = ["EpochLayout", "contiguous_split", "ddp_order", "epoch_layout", "epoch_shards", "split_remainder"]


PLAN_HINT = "pass one int batch size >= 1 per rank, in global-rank order, e.g. plan=[32, 32] for two ranks."


def check_plan(plan: Sequence[int], hint: str = PLAN_HINT) -> tuple[int, ...]:
    """``plan`` as a non-empty tuple of ints (Python or NumPy ones), each >= 1, else ``ValueError``: a float,
    string or bool entry is refused, not truncated.

    Example::

        >>> check_plan([3, 1])
        (3, 1)
    """
    if isinstance(plan, (str, bytes)) or not isinstance(plan, Iterable):
        raise ValueError(f"`plan` must be a sequence of per-rank batch sizes, got {plan!r}. HINT: {hint}")
    plan = tuple(check_int(f"plan[{i}]", b, minimum=1, hint=hint) for i, b in enumerate(plan))
    if not plan:
        raise ValueError(f"every rank needs a batch size >= 1, got plan {list(plan)}. HINT: {hint}")
    return plan


def split_remainder(remainder: int, plan: Sequence[int]) -> list[int]:
    """Share ``remainder`` samples over ranks in proportion to ``plan``: every rank gets at least one and, when
    ``remainder`` is at most ``sum(plan)`` (an epoch's last step), at most its planned batch ``plan[i]``, so that a
    rank the plan capped for memory is never handed more in the last step. Within those bounds the shares are
    the largest remainders of the proportional ones (ties to the lower rank).

    Example::

        >>> split_remainder(10, [30, 10])
        [8, 2]
        >>> split_remainder(3, [1, 1, 4])
        [1, 1, 1]
        >>> split_remainder(14, [1, 8, 8, 8])
        [1, 5, 4, 4]
    """
    w = len(plan)
    if remainder < w:
        raise ValueError(f"cannot give each of {w} ranks a sample out of {remainder}")
    total = sum(plan)
    exact = [remainder * b / total for b in plan]
    cap = [int(b) if remainder <= total else remainder for b in plan]
    out = [min(max(1, int(x)), c) for x, c in zip(exact, cap)]
    while sum(out) < remainder:  # the most under-served rank with room takes the next sample
        i = max((k for k in range(w) if out[k] < cap[k]), key=lambda k: (exact[k] - out[k], -k))
        out[i] += 1
    while sum(out) > remainder:  # the most over-served rank above one gives one back
        i = max((k for k in range(w) if out[k] > 1), key=lambda k: (out[k] - exact[k], out[k], -k))
        out[i] -= 1
    return out


@dataclass(frozen=True)
class EpochLayout:
    """Counts of one epoch: ``full_steps`` steps of ``plan`` plus an optional last step of ``last_counts``."""

    plan: tuple[int, ...]
    full_steps: int
    last_counts: tuple[int, ...]
    padding: int

    @property
    def steps(self) -> int:
        return self.full_steps + (1 if self.last_counts else 0)

    def step_counts(self, step: int) -> tuple[int, ...]:
        """Per-rank sample counts of step ``step`` (0-based)."""
        if step < self.full_steps:
            return self.plan
        if step == self.full_steps and self.last_counts:
            return self.last_counts
        raise IndexError(f"step {step} is out of range for an epoch of {self.steps} steps")

    def shard_sizes(self) -> list[int]:
        last = self.last_counts or (0,) * len(self.plan)
        return [self.full_steps * b + c for b, c in zip(self.plan, last)]


def epoch_layout(
    num_samples: int, plan: Sequence[int], drop_last: bool = False, pad_to_world_size: bool = True
) -> EpochLayout:
    """The step structure of an epoch of ``num_samples`` under ``plan``.

    As ``DistributedSampler`` does, the epoch's order is first padded to a multiple of the world size (with
    samples from its start); the padded order is then cut into full global batches, and the rest is shared
    in proportion to the plan (or dropped with ``drop_last``, as ``DataLoader(drop_last=True)`` drops it).
    With ``pad_to_world_size=False`` (evaluation) the order is padded only where the last step would leave a
    rank without a sample.
    """
    check_int("num_samples", num_samples, minimum=1)
    plan = check_plan(plan)
    world, global_batch = len(plan), sum(plan)
    padding = (-num_samples) % world if pad_to_world_size else 0
    full, rem = divmod(num_samples + padding, global_batch)
    if drop_last or rem == 0:
        if full == 0:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch} "
                f"(per-rank {list(plan)}) with drop_last=True. HINT: lower the batch size or set drop_last=False."
            )
        return EpochLayout(plan, full, (), padding)
    if rem < world:  # a rank would get no sample in the last step
        padding += world - rem
        rem = world
    return EpochLayout(plan, full, tuple(split_remainder(rem, plan)), padding)


def _padded(order: np.ndarray, padding: int) -> np.ndarray:
    return np.concatenate([order, np.resize(order, padding)]) if padding else order


def ddp_order(num_samples: int, padding: int, epoch: int = 0, seed: int = 0, shuffle: bool = True) -> np.ndarray:
    """An epoch's sample order exactly as ``DistributedSampler`` draws it (``torch.randperm`` seeded with
    ``seed + epoch``), padded with ``padding`` samples from its start. Step k's global batch is the k-th
    slice of ``sum(plan)`` indices of it."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        base = torch.randperm(num_samples, generator=g).numpy()
    else:
        base = np.arange(num_samples)
    return _padded(base.astype(np.int64), padding)


def epoch_shards(
    num_samples: int,
    plan: Sequence[int],
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    locality: bool = False,
    pad_to_world_size: bool = True,
) -> list[np.ndarray]:
    """Every rank's sample indices for one epoch, in the order that rank visits them.

    Rank i's step k batch is ``shards[i][k * plan[i] : (k + 1) * plan[i]]``; the last step holds the rest.
    Deterministic in its arguments, so every rank computes the same split without communication.

    With ``locality=False`` (default) the epoch's order is exactly ``DistributedSampler``'s (the same seeded
    ``torch.randperm(seed + epoch)``, the same padding) and step k's samples over all ranks are the k-th
    global batch of that order, whatever the plan: the union of every step, hence every SGD update, is the
    one stock DDP makes; only who computes which part changes. With ``locality=True`` each rank keeps a
    contiguous shard of a fixed seeded order and reshuffles within it every epoch (LOFT); with ``shuffle`` and
    ``drop_last`` too, its shard is a region of that order sized in proportion to the plan, cut after the
    epoch's reshuffle, so that which samples are dropped changes every epoch (none is left out for good).

    Example::

        >>> [s.tolist() for s in epoch_shards(10, [3, 1], shuffle=False)]
        [[0, 1, 2, 4, 5, 6, 8], [3, 7, 9]]
        >>> [s.tolist() for s in epoch_shards(10, [3, 1], shuffle=False, locality=True)]
        [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]
    """
    layout = epoch_layout(num_samples, plan, drop_last, pad_to_world_size)
    offsets = np.concatenate([[0], np.cumsum(layout.plan)])
    if locality:
        base = np.random.default_rng([seed]).permutation(num_samples) if shuffle else np.arange(num_samples)
        order = _padded(base.astype(np.int64), layout.padding)
        sizes = layout.shard_sizes()
        if shuffle and drop_last:
            # Each rank's region holds at least its shard (no padding copy unless a global batch needs one); the
            # samples it drops are those the epoch's reshuffle puts last, so they change from epoch to epoch.
            regions = contiguous_split(max(num_samples, sum(sizes)), layout.plan)
        else:
            bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
            regions = [(int(bounds[r]), int(bounds[r + 1])) for r in range(len(sizes))]
        shards = []
        for r, (lo, hi) in enumerate(regions):
            shard = order[lo:hi].copy()
            if shuffle:
                np.random.default_rng([seed, epoch, r]).shuffle(shard)
            shards.append(shard[: sizes[r]])
        return shards
    order = ddp_order(num_samples, layout.padding, epoch, seed, shuffle)
    global_batch = offsets[-1]
    full = order[: layout.full_steps * global_batch].reshape(layout.full_steps, global_batch)
    last = order[layout.full_steps * global_batch :]
    last_offsets = np.concatenate([[0], np.cumsum(layout.last_counts)]) if layout.last_counts else None
    shards = []
    for r in range(len(layout.plan)):
        parts = [full[:, offsets[r] : offsets[r + 1]].reshape(-1)]
        if last_offsets is not None:
            parts.append(last[last_offsets[r] : last_offsets[r + 1]])
        shards.append(np.concatenate(parts))
    return shards


def contiguous_split(num_samples: int, plan: Sequence[int]) -> list[tuple[int, int]]:
    """Cut ``range(num_samples)`` into one contiguous ``[start, stop)`` slice per rank, sized in proportion to
    ``plan`` (largest remainder), without padding: for inference, where no collective pairs the steps.

    Example::

        >>> contiguous_split(10, [3, 1])
        [(0, 8), (8, 10)]
    """
    total = sum(plan)
    exact = [num_samples * b / total for b in plan]
    sizes = [int(x) for x in exact]
    for i in sorted(range(len(plan)), key=lambda k: (-(exact[k] - sizes[k]), k))[: num_samples - sum(sizes)]:
        sizes[i] += 1
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(bounds[r]), int(bounds[r + 1])) for r in range(len(plan))]


def segment_layout(num_samples: int, plan: Sequence[int], order: Sequence[int] | None, drop_last: bool) -> EpochLayout:
    """Layout of an epoch (``order is None``) or of a resumed remainder of one (``order``: its indices).

    A resumed remainder never drops samples: it holds exactly what the interrupted epoch still owed.
    """
    if order is None:
        return epoch_layout(num_samples, plan, drop_last)
    plan = check_plan(plan)
    if len(order) == 0:
        return EpochLayout(plan, 0, (), 0)
    layout = epoch_layout(len(order), plan, drop_last=False, pad_to_world_size=False)
    if layout.padding and layout.full_steps >= 1:
        # A remainder shorter than the new world size joins the last full step (one slightly larger global
        # batch, still exactly weighted) instead of borrowing repeated samples: an elastic resize then
        # never repeats a sample, whatever the step at which it happened.
        rest = len(order) - layout.full_steps * sum(plan)
        exact = [rest * b / sum(plan) for b in plan]
        extra = [int(x) for x in exact]
        for i in sorted(range(len(plan)), key=lambda k: (-(exact[k] - extra[k]), k))[: rest - sum(extra)]:
            extra[i] += 1
        last = tuple(b + e for b, e in zip(plan, extra))
        return EpochLayout(plan, layout.full_steps - 1, last, 0)
    return layout


def segment_shards(
    num_samples: int,
    plan: Sequence[int],
    order: Sequence[int] | None = None,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    locality: bool = False,
) -> list[np.ndarray]:
    """Every rank's indices of an epoch (``order is None``, as :func:`~hetero_plugins.epoch_shards`) or of a
    resumed remainder ``order``, cut into contiguous per-rank shards under ``plan``.

    Example::

        >>> [s.tolist() for s in segment_shards(10, [2, 1], order=[9, 8, 7, 6, 5])]
        [[9, 8, 7], [6, 5]]
    """
    if order is None:
        return epoch_shards(num_samples, plan, epoch, seed, shuffle, drop_last, locality)
    base = np.asarray(order, dtype=np.int64)
    if base.size == 0:
        return [np.zeros(0, dtype=np.int64) for _ in plan]
    layout = segment_layout(num_samples, plan, base, drop_last)
    if layout.padding:
        base = np.concatenate([base, np.resize(base, layout.padding)])
    bounds = np.concatenate([[0], np.cumsum(layout.shard_sizes())])
    return [base[bounds[r] : bounds[r + 1]].copy() for r in range(len(plan))]


def unprocessed_indices(shards: Sequence[np.ndarray], layout: EpochLayout, steps_done: int) -> np.ndarray:
    """The samples of a segment that its first ``steps_done`` steps did not process, without duplicates.

    Rank i processed the first ``sum(layout.step_counts(s)[i] for s < steps_done)`` entries of its shard.
    Padding (the duplicates a short last step borrows) is never counted twice.

    Example::

        >>> from hetero_plugins.balancing.partition import epoch_layout
        >>> shards = [np.arange(0, 6), np.arange(6, 8)]         # plan [3, 1]: two steps
        >>> unprocessed_indices(shards, epoch_layout(8, [3, 1]), steps_done=1).tolist()
        [3, 4, 5, 7]
    """
    check_int("steps_done", steps_done, minimum=0)
    if steps_done > layout.steps:
        raise ValueError(f"`steps_done`={steps_done} exceeds the segment's {layout.steps} steps.")
    consumed = [0] * len(shards)
    for s in range(steps_done):
        for r, c in enumerate(layout.step_counts(s)):
            consumed[r] += c
    done = set()
    for r, shard in enumerate(shards):
        done.update(shard[: consumed[r]].tolist())
    out: list[int] = []
    seen: set[int] = set()
    for r, shard in enumerate(shards):
        for i in shard[consumed[r] :].tolist():
            if i not in done and i not in seen:
                seen.add(i)
                out.append(i)
    return np.asarray(out, dtype=np.int64)


def resplit_unprocessed(
    shards: Sequence[np.ndarray], layout: EpochLayout, steps_done: int, new_plan: Sequence[int]
) -> list[np.ndarray]:
    """Re-split what an interrupted segment still owes over a new set of ranks (elastic Horovod).

    Args:
        shards: every old rank's indices of the interrupted segment (:func:`segment_shards`).
        layout: that segment's layout (:func:`segment_layout`).
        steps_done: committed steps of the segment; their samples are done.
        new_plan: per-rank batch sizes of the new world, any length.

    Returns:
        The new ranks' shards: together they hold every unprocessed sample exactly once (plus the padding
        a last step shorter than the world size borrows, as ``DistributedSampler`` pads).

    Example::

        >>> from hetero_plugins.balancing.partition import epoch_layout
        >>> shards = [np.arange(0, 6), np.arange(6, 8)]
        >>> [s.tolist() for s in resplit_unprocessed(shards, epoch_layout(8, [3, 1]), 1, [4])]
        [[3, 4, 5, 7]]
    """
    remaining = unprocessed_indices(shards, layout, steps_done)
    return segment_shards(len(remaining), new_plan, order=remaining)
