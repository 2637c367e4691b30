"""Micro-batches of a rank's share of a step: what the micro-batched modes share.

The ``deadline`` and ``wbsp`` aggregation modes (see :mod:`hetero_plugins.aggregation`) run a step as a
sequence of micro-batches. This module holds what both use: cutting a collated batch (tensors, or tuples /
lists / dicts of them) along its first dimension into near-equal units, the indices of a unit of a share,
and :class:`MicroBatch`. Each mode's own parts live in its module: the deadline rule and the carry queue in
:mod:`~hetero_plugins.aggregation.deadline`, the shared claims in :mod:`~hetero_plugins.aggregation.wbsp`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MicroBatch", "batch_length", "micro_batch_sizes", "offsets_of", "split_batch", "take_rows", "unit_indices"]


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


def offsets_of(sizes: Sequence[int]) -> list[int]:
    """Where each piece of ``sizes`` starts in their concatenation, and the total last.

    Example::

        >>> offsets_of([3, 2, 4])
        [0, 3, 5, 9]
    """
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


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
        weight: the factor its mean-loss gradient gets during the backward pass: ``samples / B`` in the
            micro-batched modes (B the step's planned global batch, so the step's accumulated gradient is the
            sum of its per-sample gradients over B), b_i / B in ``weighted`` (the framework sums the ranks), 1
            where the exchange weights (``pseudo_sync``) or nothing is weighted (``local_sgd``).
    """

    data: Any
    samples: int
    owner: int = 0
    step: int = 0
    index: int = 0
    weight: float = 1.0
