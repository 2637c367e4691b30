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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["flat_gradients", "set_flat_gradients", "sync_sample_weighted", "trainable"]


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
        ``(samples_per_rank, backlog_per_rank)`` as seen by every rank.

    Example (one rank)::

        >>> p = torch.zeros(2, requires_grad=True); p.grad = torch.tensor([3.0, 6.0]) / 8
        >>> sync_sample_weighted([p], samples=3, planned_global_batch=8, rank=0, world_size=1, allreduce=lambda t: t)
        ([3], [0])
        >>> p.grad.tolist()
        [1.0, 2.0]
    """
    flat = flat_gradients(params, extra=2 * world_size)
    n = flat.numel() - 2 * world_size
    flat[n + rank] = float(samples)
    flat[n + world_size + rank] = float(backlog)
    out = allreduce(flat)
    if out is not None:
        flat = out
    counts = [int(round(float(c))) for c in flat[n : n + world_size].tolist()]
    backlogs = [int(round(float(c))) for c in flat[n + world_size :].tolist()]
    total = sum(counts)
    if total > 0:
        flat[:n].mul_(planned_global_batch / total)
    set_flat_gradients(params, flat[:n])
    return counts, backlogs
