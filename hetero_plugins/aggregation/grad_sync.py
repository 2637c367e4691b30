"""Explicit gradient exchange for the aggregation modes that do not use the framework's per-step hook.

The collective itself is injected (``allreduce``: sum a flat tensor over all ranks, in place or returned),
so this module stays free of any distributed framework: the DDP strategy passes ``torch.distributed``'s
all-reduce, the Horovod integrations ``hvd.allreduce(op=hvd.Sum)``.

:func:`sync_sample_weighted` is the ``deadline`` / ``wbsp`` exchange: each rank holds the sum of its
processed samples' gradients divided by the planned global batch B, and the per-rank sample counts (and
carried-over backlogs) ride in the same buffer, so one all-reduce yields both the gradient sum and the
total N of samples actually processed; the result is rescaled by B / N. The update is then the mean
gradient over exactly the samples the step processed, whatever each rank managed (SA-ATP, Li et al. 2024:
partial contributions stay unbiased when weighted by samples).

The buffer has the gradients' dtype. Each count slot is written by one rank only (the others add zeros), so
it comes back exact when its value is representable: a float32 / float64 buffer holds a count in one slot,
as always; a narrower one (bfloat16 holds integers exactly only up to 256, float16 up to 2048) holds it as
base-2^(mantissa bits + 1) digits, one slot each, which every rank decodes exactly (:func:`count_slots`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["count_slots", "flat_gradients", "set_flat_gradients", "sync_sample_weighted", "trainable"]

#: Bits of a count (or backlog) that a narrow dtype's digit slots carry exactly (as much as a float64 slot).
_COUNT_BITS = 53


def trainable(params: Sequence[torch.nn.Parameter] | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that take gradients, in the given (rank-independent) order, without duplicates."""
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def flat_gradients(params: Sequence[torch.Tensor], extra: int = 0) -> torch.Tensor:
    """All gradients concatenated (zeros for a parameter without one), followed by ``extra`` zero slots."""
    if not params:
        return torch.zeros(extra)
    dtype = params[0].dtype if params[0].is_floating_point() else torch.float32
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(dtype) for p in params
    ]
    if extra:
        parts.append(torch.zeros(extra, dtype=dtype, device=parts[0].device))
    return torch.cat(parts)


def set_flat_gradients(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write ``flat`` (as made by :func:`flat_gradients`, extra slots ignored) back into ``p.grad``."""
    offset = 0
    for p in params:
        n = p.numel()
        value = flat[offset : offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
        offset += n


def count_slots(dtype: torch.dtype) -> tuple[int, int]:
    """``(base, digits)``: how :func:`sync_sample_weighted` carries a count in a buffer of ``dtype`` exactly.

    float32 and float64 (and a non-float dtype, whose gradients travel as float32) take one slot per count
    (``base`` 0: the value itself). A narrower float takes ``digits`` slots of base ``2 ** significand bits`` (every
    digit is an integer the dtype holds exactly), enough for counts below ``2 ** 53``.

    Example::

        >>> [count_slots(d) for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)]
        [(0, 1), (0, 1), (256, 7), (2048, 5)]
    """
    if not dtype.is_floating_point or dtype in (torch.float32, torch.float64):
        return 0, 1
    bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # the significand's bits: every integer up to 2**bits
    return 2**bits, -(-_COUNT_BITS // bits)


def _digits(value: int, base: int, digits: int) -> list[float]:
    """``value`` as ``digits`` slot values (least significant first; a negative value negates every digit)."""
    if not base:
        return [float(value)]
    sign, rest, out = (-1 if value < 0 else 1), abs(int(value)), []
    for _ in range(digits):
        rest, digit = divmod(rest, base)
        out.append(float(sign * digit))
    return out


def _undigits(slots: Sequence[float], base: int) -> int:
    """The integer that :func:`_digits` wrote into ``slots`` (summed over the ranks: one rank's, the rest 0)."""
    if not base:
        return round(float(slots[0]))
    return sum(round(float(d)) * base**i for i, d in enumerate(slots))


def sync_sample_weighted(
    params: Sequence[torch.Tensor],
    samples: int,
    planned_global_batch: int,
    rank: int,
    world_size: int,
    allreduce: Callable[[torch.Tensor], torch.Tensor | None],
    backlog: int = 0,
) -> tuple[list[int], list[int]]:
    """Sum the ranks' gradients and rescale to the mean over the samples actually processed.

    Args:
        params: the trainable parameters (same order on every rank); ``p.grad`` holds this rank's sum of
            per-sample gradients divided by ``planned_global_batch``.
        samples: samples this rank processed in the step.
        planned_global_batch: B, the divisor the gradients were accumulated with.
        rank, world_size: this rank and the number of ranks.
        allreduce: sums a flat tensor over all ranks (returns the result, or ``None`` when in place).
        backlog: samples this rank carries into later steps (shared with every rank for re-planning).

    Returns:
        ``(samples_per_rank, backlog_per_rank)`` as seen by every rank, exact whatever the gradients' dtype
        (:func:`count_slots`).

    Example (one rank)::

        >>> p = torch.zeros(2, requires_grad=True); p.grad = torch.tensor([3.0, 6.0]) / 8
        >>> sync_sample_weighted([p], samples=3, planned_global_batch=8, rank=0, world_size=1, allreduce=lambda t: t)
        ([3], [0])
        >>> p.grad.tolist()
        [1.0, 2.0]
    """
    first = params[0] if params else torch.zeros(0)  # flat_gradients gives the buffer this dtype
    base, digits = count_slots(first.dtype if first.is_floating_point() else torch.float32)
    flat = flat_gradients(params, extra=2 * world_size * digits)
    n = flat.numel() - 2 * world_size * digits
    for slot, value in ((rank, samples), (world_size + rank, backlog)):
        for i, digit in enumerate(_digits(value, base, digits)):
            flat[n + slot * digits + i] = digit
    out = allreduce(flat)
    if out is not None:
        flat = out
    tail = flat[n:].tolist()
    values = [_undigits(tail[k * digits : (k + 1) * digits], base) for k in range(2 * world_size)]
    counts, backlogs = values[:world_size], values[world_size:]
    total = sum(counts)
    if total > 0:
        flat[:n].mul_(planned_global_batch / total)
    set_flat_gradients(params, flat[:n])
    return counts, backlogs
