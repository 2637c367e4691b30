"""How one epoch's samples are cut into per-rank shards for a plan of per-rank batch sizes.

Every rank runs the same number of steps (so collectives pair up). With N samples and a plan b (global
batch B = sum b), the epoch has F = N // B full steps, in which rank i takes b_i samples, and, unless
``drop_last``, one last step that shares the R = N - F*B leftover samples in proportion to the plan
(largest remainder), every rank getting at least one. Where R < world size, the last step is padded with
samples from the start of the epoch's order, as ``torch.utils.data.DistributedSampler`` pads.

Rank i's shard is a contiguous slice of a base order of the dataset. With ``locality=True`` (default) the
base order is fixed for the run (a seeded permutation, or the identity without shuffling) and each rank
reshuffles only within its own shard every epoch; when the plan changes, shard boundaries move a little and
each rank keeps as much of its previous shard as a contiguous split allows (LOFT, Liu et al., IEEE TCC 2024:
data-fetch locality dominates on distributed datasets). With ``locality=False`` the base order is a fresh
permutation every epoch, like ``DistributedSampler``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetero_plugins._validation import check_int

__all__ = ["EpochLayout", "epoch_layout", "epoch_shards", "split_remainder"]


def split_remainder(remainder: int, plan: Sequence[int]) -> list[int]:
    """Share ``remainder`` samples over ranks in proportion to ``plan``, each rank getting at least one.

    Example::

        >>> split_remainder(10, [30, 10])
        [8, 2]
        >>> split_remainder(3, [1, 1, 1])
        [1, 1, 1]
    """
    w = len(plan)
    if remainder < w:
        raise ValueError(f"cannot give each of {w} ranks a sample out of {remainder}")
    total = sum(plan)
    exact = [remainder * b / total for b in plan]
    out = [max(1, int(x)) for x in exact]
    order = sorted(range(w), key=lambda i: (-(exact[i] - int(exact[i])), i))
    while sum(out) < remainder:
        for i in order:
            if sum(out) == remainder:
                break
            out[i] += 1
    while sum(out) > remainder:
        i = max(range(w), key=lambda k: (out[k] - exact[k], out[k]))
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


def epoch_layout(num_samples: int, plan: Sequence[int], drop_last: bool = False) -> EpochLayout:
    """The step structure of an epoch of ``num_samples`` under ``plan``."""
    check_int("num_samples", num_samples, minimum=1)
    plan = tuple(int(b) for b in plan)
    if not plan or min(plan) < 1:
        raise ValueError(f"every rank needs a batch size >= 1, got plan {list(plan)}.")
    global_batch = sum(plan)
    full, rem = divmod(num_samples, global_batch)
    if drop_last or rem == 0:
        if full == 0:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch} "
                f"(per-rank {list(plan)}) with drop_last=True. HINT: lower the batch size or set drop_last=False."
            )
        return EpochLayout(plan, full, (), 0)
    padding = max(0, len(plan) - rem)
    return EpochLayout(plan, full, tuple(split_remainder(rem + padding, plan)), padding)


def _base_order(num_samples: int, epoch: int, seed: int, shuffle: bool, locality: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([seed] if locality else [seed, epoch])
    return rng.permutation(num_samples).astype(np.int64)


def epoch_shards(
    num_samples: int,
    plan: Sequence[int],
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    locality: bool = True,
) -> list[np.ndarray]:
    """Every rank's sample indices for one epoch, in the order that rank visits them.

    Rank i's step k batch is ``shards[i][k * plan[i] : (k + 1) * plan[i]]``; the last step holds the rest.
    Deterministic in its arguments, so every rank computes the same split without communication.

    Example::

        >>> [s.tolist() for s in epoch_shards(10, [3, 1], shuffle=False)]
        [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]
    """
    layout = epoch_layout(num_samples, plan, drop_last)
    order = _base_order(num_samples, epoch, seed, shuffle, locality)
    if layout.padding:
        order = np.concatenate([order, np.resize(order, layout.padding)])
    sizes = layout.shard_sizes()
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    shards = []
    for r in range(len(sizes)):
        shard = order[bounds[r] : bounds[r + 1]].copy()
        if shuffle and locality:
            np.random.default_rng([seed, epoch, r]).shuffle(shard)
        shards.append(shard)
    return shards
