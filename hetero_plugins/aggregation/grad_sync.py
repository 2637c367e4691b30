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

The buffer has the widest dtype of the parameters (``torch.promote_types`` over them all: a float64 head beside a
bfloat16 embedding is exchanged in float64, and each gradient comes back in its own parameter's dtype). Each
parameter also has a has-gradient flag in the buffer (1 where this rank's ``p.grad`` is set), summed over the
ranks: a parameter that got no gradient on any rank keeps ``p.grad = None``, so the optimizer skips it (weight
decay and momentum do not move it), as in one process. A layout fingerprint of the trainable parameters rides
along too (:func:`layout_fingerprint`), so ranks that disagree on which parameters train fail with a clear error
instead of summing one parameter's gradient into another's. Each count slot is written by one rank only (the others add zeros), so
it comes back exact when its value is representable: a float32 / float64 buffer holds a count in one slot,
as always; a narrower one (bfloat16 holds integers exactly only up to 256, float16 up to 2048) holds it as
base-2^(mantissa bits + 1) digits, one slot each, which every rank decodes exactly (:func:`count_slots`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "check_layouts",
    "count_slots",
    "exchange_dtype",
    "flat_gradients",
    "has_gradients",
    "layout_fingerprint",
    "set_flat_gradients",
    "sync_sample_weighted",
    "trainable",
]

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


def exchange_dtype(params: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype of an exchange buffer of ``params``: the widest floating dtype among them
    (``torch.promote_types``), float32 when none is floating.

    Example::

        >>> exchange_dtype([torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)])
        torch.float64
        >>> exchange_dtype([torch.zeros(1, dtype=torch.bfloat16)])
        torch.bfloat16
    """
    dtype: torch.dtype | None = None
    for p in params:
        if p.is_floating_point():
            dtype = p.dtype if dtype is None else torch.promote_types(dtype, p.dtype)
    return torch.float32 if dtype is None else dtype


def flat_gradients(params: Sequence[torch.Tensor], extra: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """All gradients concatenated (zeros for a parameter without one), followed by ``extra`` zero slots, in
    ``dtype`` (default :func:`exchange_dtype` of ``params``: no gradient loses precision)."""
    if dtype is None:
        dtype = exchange_dtype(params)
    if not params:
        return torch.zeros(extra, dtype=dtype)
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(dtype) for p in params
    ]
    if extra:
        parts.append(torch.zeros(extra, dtype=dtype, device=parts[0].device))
    return torch.cat(parts)


def has_gradients(params: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each parameter has a gradient (``p.grad is not None``) on this rank."""
    return [p.grad is not None for p in params]


def set_flat_gradients(
    params: Sequence[torch.Tensor], flat: torch.Tensor, has_grad: Sequence[bool] | None = None
) -> None:
    """Write ``flat`` (as made by :func:`flat_gradients`, extra slots ignored) back into ``p.grad``, each in its
    parameter's dtype. Where ``has_grad`` says no rank had a gradient, ``p.grad`` is left (set to) ``None``."""
    offset = 0
    for i, p in enumerate(params):
        n = p.numel()
        if has_grad is not None and not has_grad[i]:
            p.grad = None
            offset += n
            continue
        value = flat[offset : offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
        offset += n


def layout_fingerprint(params: Sequence[torch.Tensor], positions: Sequence[int] | None = None) -> int:
    """A 24-bit fingerprint of the exchanged parameters' layout: their shapes and dtypes (and ``positions``, e.g.
    their indices among the optimizer's parameters), equal on ranks that exchange the same parameters.

    Example::

        >>> a, b = torch.zeros(2, 3), torch.zeros(3)
        >>> layout_fingerprint([a, b]) == layout_fingerprint([a.clone(), b.clone()]) != layout_fingerprint([a])
        True
    """
    desc = repr([(tuple(p.shape), str(p.dtype)) for p in params]) + repr(list(positions or ()))
    return zlib.crc32(desc.encode()) & 0xFFFFFF  # exact in a float32 slot


def check_layouts(fingerprints: Sequence[int], mode: str) -> None:
    """Raise when the ranks' :func:`layout_fingerprint` values differ (they exchanged different parameters)."""
    if len(set(fingerprints)) > 1:
        raise RuntimeError(
            f"aggregation={mode!r}: the ranks exchanged different sets of trainable parameters (layout fingerprints "
            f"{list(fingerprints)}), so their gradients cannot be summed. HINT: change `requires_grad` (freeze / "
            "unfreeze) and the optimizer's parameter groups alike on every rank, e.g. in a Callback hook that every "
            "rank runs (not under `if trainer.is_global_zero`)."
        )


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
    layout: int | None = None,
    mode: str = "deadline",
) -> tuple[list[int], list[int]]:
    """Sum the ranks' gradients and rescale to the mean over the samples actually processed.

    Args:
        params: the trainable parameters (same order on every rank); ``p.grad`` holds this rank's sum of
            per-sample gradients divided by ``planned_global_batch`` (``None``: no gradient on this rank).
        samples: samples this rank processed in the step.
        planned_global_batch: B, the divisor the gradients were accumulated with.
        rank, world_size: this rank and the number of ranks.
        allreduce: sums a flat tensor over all ranks (returns the result, or ``None`` when in place).
        backlog: samples this rank carries into later steps (shared with every rank for re-planning).
        layout: this rank's :func:`layout_fingerprint` of ``params`` (default: from their shapes and dtypes);
            ranks whose fingerprints differ raise a ``RuntimeError`` (named after ``mode``).

    Returns:
        ``(samples_per_rank, backlog_per_rank)`` as seen by every rank, exact whatever the gradients' dtype
        (:func:`count_slots`). A parameter that no rank has a gradient for keeps ``p.grad = None``.

    The buffer: the gradients (:func:`exchange_dtype`), then per rank its count, its backlog and its layout
    fingerprint (each in :func:`count_slots` digits), then one has-gradient flag per parameter.

    Example (one rank)::

        >>> p = torch.zeros(2, requires_grad=True); p.grad = torch.tensor([3.0, 6.0]) / 8
        >>> sync_sample_weighted([p], samples=3, planned_global_batch=8, rank=0, world_size=1, allreduce=lambda t: t)
        ([3], [0])
        >>> p.grad.tolist()
        [1.0, 2.0]
    """
    dtype = exchange_dtype(params)
    base, digits = count_slots(dtype)
    if layout is None:
        layout = layout_fingerprint(params)
    values = 3 * world_size * digits
    flat = flat_gradients(params, extra=values + len(params), dtype=dtype)
    n = flat.numel() - values - len(params)
    for slot, value in ((rank, samples), (world_size + rank, backlog), (2 * world_size + rank, layout)):
        for i, digit in enumerate(_digits(value, base, digits)):
            flat[n + slot * digits + i] = digit
    if params:
        flat[n + values :] = torch.tensor(has_gradients(params), dtype=dtype, device=flat.device)
    out = allreduce(flat)
    if out is not None:
        flat = out
    tail = flat[n:].tolist()
    decoded = [_undigits(tail[k * digits : (k + 1) * digits], base) for k in range(3 * world_size)]
    counts, backlogs = decoded[:world_size], decoded[world_size : 2 * world_size]
    check_layouts(decoded[2 * world_size :], mode)
    flags = [v > 0 for v in tail[values:]]
    total = sum(counts)
    if total > 0:
        flat[:n].mul_(planned_global_batch / total)
    set_flat_gradients(params, flat[:n], flags)
    return counts, backlogs
