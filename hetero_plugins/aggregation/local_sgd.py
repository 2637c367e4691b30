"""Local SGD with sample-weighted model averaging and the distributed norm test for adaptive batch sizes.

Local SGD (Lin et al. 2018, "Don't Use Large Mini-Batches, Use Local SGD"): every rank takes ``H`` local
optimizer steps, then the models are averaged, so communication drops by the factor ``H``. With
heterogeneous ranks the average is weighted by the samples each rank processed since the last average,
and the counts travel in the same all-reduce as the parameters.

Adaptive batch (Lau et al. 2024, "Communication-Efficient Adaptive Batch Size Strategies for Distributed
Local Gradient Methods", arXiv 2406.13936): at an average, a distributed norm test on the ranks' parameter
deltas since the previous average grows the batch when their variance dominates their mean. The exact
test is the one of AdLoCo's ``NormTestBatching`` (that it matches Lau et al. exactly is inferred).

Framework-free: the all-reduce is an injected callable. :class:`LocalSGDAggregator` is the
``aggregation="local_sgd"`` engine.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.aggregation.base import Aggregator, StepContext

log = logging.getLogger(__name__)

__all__ = ["LocalSGDAggregator", "LocalSGDSchedule", "weighted_average_"]


class LocalSGDSchedule:
    """Local SGD: H local optimizer steps between sample-weighted model averages (Lin et al. 2018), with the
    adaptive global batch of Lau et al. 2024 as an option.

    Norm test (:meth:`suggest_global_batch`), on the deltas ``d_m`` of the ``M`` ranks' parameters since the
    last average (the local-method analogue of the gradients; ``d_bar`` their sample-weighted mean)::

        sigma2 = b / (M - 1) * (sum_m ||d_m||^2 - M * ||d_bar||^2)
        T      = ceil(sigma2 / (M * eta^2 * ||d_bar||^2))         (per-rank batch of one step)
        new global batch = min(max_global_batch, max(current, M * T))

    ``b`` is the number of samples each delta averages over, i.e. the samples per rank *since the last
    average* (``H`` steps' worth, default ``current_global_batch * local_steps / M``): a delta is ``lr * H``
    times the mean gradient over those samples, so ``sigma2 / ||d_bar||^2`` then estimates the per-sample
    gradient variance over the squared mean gradient, as the gradient norm test needs. The batch never
    shrinks, and ``eta`` (``tolerance``) smaller means larger batches.

    Args:
        local_steps: ``H``, local optimizer steps between averages (1 = averaging every step).
        adaptive: enable the norm test; otherwise :meth:`suggest_global_batch` returns the current batch.
        tolerance: ``eta > 0`` of the norm test.
        max_global_batch: cap of the suggested global batch (``None``: uncapped).

    Example::

        >>> s = LocalSGDSchedule(local_steps=2, adaptive=True, tolerance=0.5, max_global_batch=1024)
        >>> [s.step_done(samples=32), s.step_done(samples=32)]
        [False, True]
        >>> s.samples_since_average
        64
        >>> s.averaged(); s.communication_rounds
        1
        >>> s.suggest_global_batch(128, sq_norm_sum=3.5, mean_sq_norm=0.5, ranks=4)  # b = 64, sigma2 = 32
        256
    """

    def __init__(
        self,
        local_steps: int = 4,
        adaptive: bool = False,
        tolerance: float = 0.8,
        max_global_batch: int | None = None,
    ) -> None:
        self.local_steps = check_int(
            "local_steps", local_steps, minimum=1, hint="H = 1 averages after every step; 4-16 are common"
        )
        if not isinstance(adaptive, bool):
            raise ValueError(f"`adaptive` must be a bool, got {adaptive!r}.")
        self.adaptive = adaptive
        self.tolerance = check_float(
            "tolerance", tolerance, minimum=0.0, strict_minimum=True, hint="the norm test's eta, e.g. 0.8"
        )
        if max_global_batch is not None:
            check_int("max_global_batch", max_global_batch, minimum=1, hint="or None for no cap")
        self.max_global_batch = max_global_batch
        self.steps_since_average = 0
        self.samples_since_average = 0
        self.communication_rounds = 0
        self.last_test: dict[str, float] = {}

    def step_done(self, samples: int) -> bool:
        """Record one local step of ``samples`` samples on this rank; True when it is time to average."""
        check_int("samples", samples, minimum=0, hint="pass this rank's batch size of the step")
        self.steps_since_average += 1
        self.samples_since_average += samples
        return self.steps_since_average >= self.local_steps

    def averaged(self) -> None:
        """Reset the per-round counters after an average and count the communication round."""
        self.steps_since_average = 0
        self.samples_since_average = 0
        self.communication_rounds += 1

    def suggest_global_batch(
        self,
        current_global_batch: int,
        sq_norm_sum: float,
        mean_sq_norm: float,
        ranks: int,
        samples_per_rank: float | None = None,
    ) -> int:
        """Distributed norm test on the parameter deltas since the last average (see the class docstring).

        Args:
            current_global_batch: global batch of one step now.
            sq_norm_sum: ``sum_m ||d_m||^2`` (``weighted_average_``'s ``"sq_norm_sum"``).
            mean_sq_norm: ``||d_bar||^2`` (``weighted_average_``'s ``"mean_sq_norm"``).
            ranks: ``M``, the ranks that contributed (``weighted_average_``'s ``"ranks"``).
            samples_per_rank: ``b``, samples per rank since the last average; default
                ``current_global_batch * local_steps / ranks``; exact: ``total_samples / ranks``.

        Returns ``current_global_batch`` when ``adaptive=False``; otherwise the batch is monotone
        non-decreasing and capped by ``max_global_batch``. With fewer than two ranks or ``d_bar = 0`` the test
        has no information and the current batch is kept (capped).
        """
        check_int("current_global_batch", current_global_batch, minimum=1)
        check_float("sq_norm_sum", sq_norm_sum, minimum=0.0, hint="a sum of squared norms cannot be negative")
        check_float("mean_sq_norm", mean_sq_norm, minimum=0.0, hint="a squared norm cannot be negative")
        check_int("ranks", ranks, minimum=1)
        if samples_per_rank is None:
            b = current_global_batch * self.local_steps / ranks
        else:
            b = check_float("samples_per_rank", samples_per_rank, minimum=0.0, strict_minimum=True)
        if not self.adaptive:
            return current_global_batch
        sigma2, candidate = 0.0, 0
        if ranks >= 2 and mean_sq_norm > 0.0:
            sigma2 = b / (ranks - 1) * max(0.0, sq_norm_sum - ranks * mean_sq_norm)
            per_rank = sigma2 / (ranks * self.tolerance**2 * mean_sq_norm)
            if math.isfinite(per_rank) and per_rank < 2**62 / ranks:
                candidate = ranks * math.ceil(per_rank)
            else:
                candidate = self.max_global_batch if self.max_global_batch is not None else current_global_batch
        new = max(current_global_batch, candidate)
        if self.max_global_batch is not None:
            new = min(self.max_global_batch, new)
        self.last_test = {"sigma2": sigma2, "candidate": float(candidate), "global_batch": float(new)}
        if new != current_global_batch:
            log.info("LocalSGDSchedule: norm test grows the global batch %d -> %d", current_global_batch, new)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {
            "local_steps": self.local_steps,
            "adaptive": self.adaptive,
            "tolerance": self.tolerance,
            "max_global_batch": self.max_global_batch,
            "steps_since_average": self.steps_since_average,
            "samples_since_average": self.samples_since_average,
            "communication_rounds": self.communication_rounds,
            "last_test": dict(self.last_test),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; the options stay those given to the constructor."""
        keys = ("steps_since_average", "samples_since_average", "communication_rounds")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(
                f"`state` lacks {missing}. HINT: pass a dict produced by LocalSGDSchedule.state_dict()."
            )
        for k in keys:
            setattr(self, k, check_int(f"state['{k}']", state[k], minimum=0))
        self.last_test = dict(state.get("last_test", {}))


def weighted_average_(
    tensors: Sequence[torch.Tensor],
    samples: int,
    allreduce: Callable[[torch.Tensor], torch.Tensor],
    base: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Sample-weighted model average over ranks, in place: ``t <- sum_i n_i t_i / sum_i n_i``.

    ``n_i`` is this rank's ``samples`` since the last average. ONE ``allreduce`` (a SUM over ranks, returning
    the reduced tensor; in place or not) of a single flat buffer ``[n_i * t_i for all tensors, n_i, 1,
    n_i * ||t_i - base_i||^2]`` carries the parameters, the counts, the number of contributing ranks and,
    when ``base`` (the tensors at the last average) is given, the squared deltas for the norm test. Ranks
    with ``samples=0`` send zeros and contribute nothing; if no rank has samples the tensors are unchanged.

    Integer and bool tensors (e.g. BatchNorm's ``num_batches_tracked``) are skipped and keep this rank's
    value: they are step counters, not statistics, and under a common ``H`` the ranks count alike.
    Complex tensors are rejected.

    Args:
        tensors: parameters and floating buffers (optimizer momenta may be included) of this rank.
        samples: ``n_i >= 0``.
        allreduce: sums a tensor over all ranks and returns the result.
        base: same-shaped tensors at the last average, for the norm test (``None``: no deltas).
        dtype: buffer dtype; default the widest floating dtype of ``tensors``, at least float32. Pass
            ``torch.float64`` for an exact accumulation of low-precision parameters.

    Returns:
        ``{"total_samples": N, "ranks": ranks with samples > 0, "bytes": buffer bytes,
        "sq_norm_sum": sum_m (n_m / n_bar) ||d_m||^2, "mean_sq_norm": ||d_bar||^2}`` with ``n_bar = N / ranks``:
        ``sq_norm_sum`` is sample-weighted so that ``sq_norm_sum - ranks * mean_sq_norm`` equals
        ``sum_m (n_m / n_bar) ||d_m - d_bar||^2`` exactly for uneven counts (the plain sums for equal ones);
        both are 0 without ``base``. Feed them to :meth:`LocalSGDSchedule.suggest_global_batch`.

    Example::

        >>> w = [torch.tensor([1.0, 3.0])]
        >>> other = torch.tensor([4.0, 0.0, 2.0, 1.0, 0.0])  # the other rank's buffer: [2.0, 0.0] x 2 samples
        >>> stats = weighted_average_(w, samples=2, allreduce=lambda b: b + other)
        >>> w[0].tolist(), stats["total_samples"], stats["bytes"]
        ([1.5, 1.5], 4, 20)
    """
    check_int("samples", samples, minimum=0, hint="pass this rank's samples since the last average")
    if not callable(allreduce):
        raise ValueError(
            f"`allreduce` must be callable, got {allreduce!r}. HINT: pass a function that sums a tensor over ranks."
        )
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"`tensors[{i}]` must be a torch.Tensor, got {type(t).__name__}.")
        if t.is_complex():
            raise ValueError(f"`tensors[{i}]` is complex ({t.dtype}); HINT: average its torch.view_as_real view.")
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    if base is not None:
        base = list(base)
        if len(base) != len(tensors):
            raise ValueError(
                f"`base` must have one tensor per entry of `tensors` ({len(tensors)}), got {len(base)}. "
                "HINT: pass copies of the same tensors taken at the last average."
            )
        for i in floats:
            if not isinstance(base[i], torch.Tensor) or base[i].shape != tensors[i].shape:
                raise ValueError(
                    f"`base[{i}]` must be a tensor of shape {tuple(tensors[i].shape)}, got "
                    f"{tuple(base[i].shape) if isinstance(base[i], torch.Tensor) else type(base[i]).__name__}."
                )
    if dtype is None:
        dtype = torch.float32
        for i in floats:
            dtype = torch.promote_types(dtype, tensors[i].dtype)
    elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"`dtype` must be a floating torch.dtype, got {dtype!r}. HINT: use torch.float64 or None.")
    device = tensors[floats[0]].device if floats else torch.device("cpu")
    sizes = [tensors[i].numel() for i in floats]
    total = sum(sizes)

    buf = torch.zeros(total + 3, dtype=dtype, device=device)
    if samples > 0:
        offset = 0
        for i, k in zip(floats, sizes):
            buf[offset : offset + k].copy_(tensors[i].detach().reshape(-1))
            offset += k
        buf[:total].mul_(samples)
        sq = 0.0
        if base is not None:
            sq = _sq_dist(tensors, base, floats)
        buf[total:].copy_(torch.tensor([float(samples), 1.0, samples * sq], dtype=torch.float64))
    reduced = allreduce(buf)
    if not isinstance(reduced, torch.Tensor) or reduced.shape != buf.shape:
        raise ValueError(
            f"`allreduce` must return a tensor of shape {tuple(buf.shape)}, got {_describe(reduced)}. "
            "HINT: return the summed tensor (e.g. `dist.all_reduce(b); return b`)."
        )
    n_total, ranks, weighted_sq = (float(v) for v in reduced[total:].tolist())
    stats: dict[str, Any] = {
        "total_samples": int(round(n_total)),
        "ranks": int(round(ranks)),
        "bytes": buf.numel() * buf.element_size(),
        "sq_norm_sum": 0.0,
        "mean_sq_norm": 0.0,
    }
    if n_total <= 0:
        return stats
    avg = reduced[:total] / n_total
    offset = 0
    with torch.no_grad():
        for i, k in zip(floats, sizes):
            tensors[i].copy_(avg[offset : offset + k].view(tensors[i].shape))
            offset += k
    if base is not None:
        stats["mean_sq_norm"] = _sq_dist(tensors, base, floats)
        stats["sq_norm_sum"] = weighted_sq * ranks / n_total
    return stats


class LocalSGDAggregator(Aggregator):
    """``aggregation="local_sgd"``: each step is a local step on this rank's own mean gradient; after every
    ``local_steps`` steps and at every epoch's last step the parameters and floating ``buffers`` are averaged,
    weighted by the samples each rank processed since the last average (:func:`weighted_average_`);
    :meth:`flush` averages a window the fit left unfinished.

    Attributes:
        schedule: the :class:`LocalSGDSchedule`.
        tensors: what an average covers: the trainable parameters, then the other floating tensors given as
            ``buffers`` (frozen parameters, BatchNorm statistics), each once.
    """

    mode = "local_sgd"

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        assert self.options.local_steps is not None  # filled per mode
        self.schedule = LocalSGDSchedule(local_steps=self.options.local_steps)
        self.tensors = list(self.params)
        seen = {id(t) for t in self.tensors}
        for t in buffers:
            if t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                self.tensors.append(t)

    def exchange(self, ctx: StepContext) -> bool:
        return True  # a local step: nothing is exchanged before it

    def after_step(self, ctx: StepContext) -> None:
        due = self.schedule.step_done(ctx.counts[ctx.rank])
        if due or ctx.last:  # also at the epoch's (or the fit's) end: every epoch ends on one model
            self._average()

    def flush(self, grad_scale: float = 1.0) -> bool:
        """Average now if local steps were taken since the last average (a fit that stopped inside a window,
        e.g. on ``max_steps`` or ``max_time``), so every rank ends on one model; nothing to apply after."""
        if self.schedule.steps_since_average > 0:
            self._average()
        return False

    def _average(self) -> None:
        weighted_average_(self.tensors, self.schedule.samples_since_average,
                          lambda t: self._allreduce_sum(t, "hetero_plugins.aggregation.local_sgd"))
        self.schedule.averaged()


def _sq_dist(tensors: list[torch.Tensor], base: list[torch.Tensor], indices: list[int]) -> float:
    """``sum_i ||tensors[i] - base[i]||^2`` over ``indices`` in float64, with one host synchronisation."""
    if not indices:
        return 0.0
    parts = [
        torch.sum((tensors[i].detach().to(torch.float64) - base[i].detach().to(tensors[i].device, torch.float64)) ** 2)
        for i in indices
    ]
    return float(torch.stack(parts).sum())


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"
