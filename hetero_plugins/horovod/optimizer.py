"""``hh.DistributedOptimizer`` and the ``AggregatingOptimizer`` of the explicit-exchange aggregation modes."""


from __future__ import annotations

import collections
import logging
import math
import os
import socket
import sys
import time
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler, default_collate

from hetero_plugins._validation import check_choice, check_int, check_path
from hetero_plugins.aggregation.options import AGGREGATION_MODES, AggregationOptions, resolve_aggregation
from hetero_plugins.aggregation.grad_sync import flat_gradients, set_flat_gradients, sync_sample_weighted, trainable
from hetero_plugins.aggregation.local_sgd import LocalSGDSchedule, weighted_average_
from hetero_plugins.aggregation.microbatch import (
    CarryQueue,
    ClaimKeys,
    DeadlineRule,
    StepClaims,
    batch_length,
    micro_batch_sizes,
    open_claim_store,
    unit_indices,
)
from hetero_plugins.aggregation.pseudo_sync import DelayedExchange, PseudoSyncCorrector
from hetero_plugins.aggregation.work_sharing import deadline_micro_batches, wbsp_micro_batches
from hetero_plugins.balancing.allocators import Allocator
from hetero_plugins.cluster import ClusterSource, resolve_cluster_source
from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor, data_times
from hetero_plugins.balancing.partition import EpochLayout, epoch_layout, epoch_shards
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.telemetry import StepTimer
from hetero_plugins.horovod._hvd import hvd as _hvd
from hetero_plugins.horovod.sampler import HeteroBatchSampler
from hetero_plugins.horovod.weighting import GradientWeighting

log = logging.getLogger(__name__)

__all__ = ["AggregatingOptimizer", "DistributedOptimizer"]


# ------------------------------------------------------------------------------------------- the optimizer
#: ``hvd.DistributedOptimizer`` keyword arguments that only the ``"weighted"`` mode (Horovod's own
#: per-gradient all-reduce) can use.
_HOROVOD_ONLY = ("compression", "groups", "sparse_as_dense", "process_set", "num_groups")


def DistributedOptimizer(  # noqa: N802 - mirrors hvd.DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    batch_sampler: HeteroBatchSampler | None = None,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    backward_passes_per_step: int = 1,
    aggregation: str | AggregationOptions = "weighted",
    dataset: Any = None,
    collate_fn: Any = None,
    model: torch.nn.Module | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Drop-in for ``hvd.DistributedOptimizer`` that sums sample-weighted gradients and times each step.

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: as for Horovod (``model.named_parameters()``).
        batch_sampler: the :class:`HeteroBatchSampler` feeding this rank; required.
        op: ``None`` or ``hvd.Sum``; the weighting needs a sum (``hvd.Average`` and ``hvd.Adasum`` are
            rejected).
        gradient_predivide_factor: must stay 1.0 (Horovod allows it with ``op=hvd.Average`` only).
        backward_passes_per_step: accumulate this many backward passes (each weighted by its own step's
            shares; divide the loss by it as with stock Horovod) before reducing. ``"weighted"`` only.
        aggregation: ``"weighted"`` (default), ``"deadline"``, ``"wbsp"``, ``"pseudo_sync"``, ``"local_sgd"``
            or an :class:`~hetero_plugins.aggregation.AggregationOptions` (see :mod:`hetero_plugins.aggregation`
            and :class:`AggregatingOptimizer`).
        dataset: ``"wbsp"``: the training dataset (``dataset[i]`` is sample i), to load micro-batches taken
            from other ranks' shares; required there, ignored elsewhere.
        collate_fn: ``"wbsp"``: how the loader collates samples (default ``torch.utils.data.default_collate``).
        model: ``"local_sgd"``: also average this module's floating buffers (e.g. BatchNorm statistics).
        **kwargs: passed to ``hvd.DistributedOptimizer`` (``compression``, ``groups``, ``sparse_as_dense``,
            ``process_set``...); ``"weighted"`` only.

    Returns:
        ``"weighted"``: Horovod's distributed optimizer, whose ``step`` also reports the step's end to the
        sampler. Any other mode: an :class:`AggregatingOptimizer`. Both have ``micro_batches(batch)``,
        ``flush()``, ``communication_bytes``, ``communication_rounds``, ``carried_samples`` and
        ``stolen_samples``, so one training loop serves every mode.

    Example::

        optimizer = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), batch_sampler=sampler)
    """
    hvd = _hvd()
    if isinstance(aggregation, str) and aggregation not in AGGREGATION_MODES:
        raise ValueError(
            f"`aggregation` must be one of {list(AGGREGATION_MODES)}, got {aggregation!r}. HINT: e.g. "
            "aggregation='deadline', or aggregation=AggregationOptions('deadline', deadline_slack=0.3)."
        )
    options = resolve_aggregation(aggregation)
    if not isinstance(batch_sampler, HeteroBatchSampler):
        raise ValueError(
            f"`batch_sampler` must be the hetero_plugins.horovod.HeteroBatchSampler that feeds this rank, got "
            f"{batch_sampler!r}. HINT: DistributedOptimizer(opt, named_parameters=..., batch_sampler=sampler)."
        )
    if op is not None and op != hvd.Sum:
        raise ValueError(
            f"`op`={op!r} cannot weight per-rank batch sizes: each rank's gradient is scaled by its share of "
            "the global batch and the ranks must be summed. HINT: leave `op` unset (or pass hvd.Sum)."
        )
    if gradient_predivide_factor != 1.0:
        raise ValueError(
            f"`gradient_predivide_factor`={gradient_predivide_factor} only applies to op=hvd.Average, which "
            "per-rank batch sizes cannot use. HINT: drop it; gradients are weighted by b_i / B instead."
        )
    check_int("backward_passes_per_step", backward_passes_per_step, minimum=1)
    if options.explicit_sync:
        return AggregatingOptimizer(
            optimizer, batch_sampler, options, dataset=dataset, collate_fn=collate_fn, model=model,
            backward_passes_per_step=backward_passes_per_step, **kwargs,
        )
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    dist_opt = hvd.DistributedOptimizer(
        optimizer, named_parameters=named_parameters, op=hvd.Sum,
        backward_passes_per_step=backward_passes_per_step, **kwargs,
    )
    sampler = batch_sampler
    passes = [0]

    def backward_end() -> None:
        sampler._on_backward_end()
        passes[0] += 1
        if passes[0] < dist_opt.backward_passes_per_step:
            sampler._on_step_end()  # an accumulated micro-batch: no collective waits before the next

    params = [p for group in dist_opt.param_groups for p in group["params"]]
    weighting = GradientWeighting(params, timer=sampler.timer, weight_fn=sampler.current_weight,
                                  on_backward_end=backward_end)
    horovod_step = dist_opt.step
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable(params))

    def step(self: Any, closure: Any = None) -> Any:
        out = horovod_step(closure)
        passes[0] = 0
        dist_opt.communication_bytes += grad_bytes  # type: ignore[attr-defined]
        dist_opt.communication_rounds += 1  # type: ignore[attr-defined]
        sampler._on_step_end()
        return out

    def micro_batches(batch: Any) -> Iterator[Any]:
        """``"weighted"``: the whole batch, once (the loop of the micro-batched modes works unchanged)."""
        yield batch

    dist_opt.step = types.MethodType(step, dist_opt)  # type: ignore[method-assign]  # bound: LR schedulers wrap it
    dist_opt.hetero_weighting = weighting  # type: ignore[attr-defined]
    dist_opt.hetero_sampler = sampler  # type: ignore[attr-defined]
    dist_opt.aggregation = options  # type: ignore[attr-defined]
    dist_opt.micro_batches = micro_batches  # type: ignore[attr-defined]
    dist_opt.flush = lambda: False  # type: ignore[attr-defined]
    dist_opt.communication_bytes = 0  # type: ignore[attr-defined]  (uncompressed gradient bytes reduced)
    dist_opt.communication_rounds = 0  # type: ignore[attr-defined]
    dist_opt.carried_samples = 0  # type: ignore[attr-defined]
    dist_opt.stolen_samples = 0  # type: ignore[attr-defined]
    return dist_opt


class _HorovodHandle:
    """``hvd.allreduce_async``'s handle as a :class:`~hetero_plugins.aggregation.pseudo_sync.ReduceHandle`."""

    def __init__(self, hvd: Any, handle: Any) -> None:
        self._hvd, self._handle = hvd, handle

    def wait(self) -> torch.Tensor:
        return self._hvd.synchronize(self._handle)


def _called_by_horovod_broadcast() -> bool:
    """Whether ``step`` was called by ``hvd.broadcast_optimizer_state`` (to initialise the optimizer's state)."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the outermost frame
        return False
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "broadcast_optimizer_state" and str(frame.f_globals.get("__name__", "")).startswith(
            "horovod"
        ):
            return True
        frame = frame.f_back
    return False


def _device_of(batch: Any) -> torch.device | None:
    if isinstance(batch, torch.Tensor):
        return batch.device
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for v in batch:
            d = _device_of(v)
            if d is not None:
                return d
    return None


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class AggregatingOptimizer(torch.optim.Optimizer):
    """The optimizer :func:`DistributedOptimizer` returns for the explicit-exchange aggregation modes.

    It behaves like the wrapped torch optimizer (``param_groups``, ``state``, ``defaults``, ``zero_grad``,
    ``state_dict`` / ``load_state_dict`` all act on it; ``isinstance(opt, torch.optim.Optimizer)`` holds, so
    torch LR schedulers accept it), and its :meth:`step` exchanges what the mode exchanges through Horovod
    (``hvd.allreduce(op=hvd.Sum)``; ``hvd.allreduce_async`` + ``hvd.synchronize`` for ``pseudo_sync``) before
    stepping it. It keeps reporting step timings to the sampler, so per-epoch rebalancing keeps working.

    - ``"deadline"`` / ``"wbsp"`` run a step as micro-batches, so the training loop must let the optimizer
      hand them out::

          for batch in loader:
              optimizer.zero_grad()
              for x, y in optimizer.micro_batches(batch):
                  loss_fn(model(x), y).backward()
              optimizer.step()

      Each micro-batch's gradient is scaled by n_j / B (B the step's planned global batch) by tensor hooks;
      :meth:`step` sums the ranks' gradients and the samples actually processed in one all-reduce and rescales,
      so the update is the mean gradient over exactly the samples the step processed. ``deadline`` stops
      before the step's deadline (``AggregationOptions.deadline`` of the planner's predicted step time; none
      on the epoch's last step) and carries the rest into the next steps (first in line); ``wbsp`` claims
      its own micro-batches and then takes unclaimed ones of other ranks' shares (loaded from ``dataset``)
      through a ``torch.distributed.TCPStore`` served by rank 0.
    - ``"pseudo_sync"``: :meth:`step` launches the all-reduce of this step's weighted gradient and applies the
      previous step's reduced gradient, corrected by :class:`~hetero_plugins.aggregation.pseudo_sync.PseudoSyncCorrector`;
      the first step only launches. Call :meth:`flush` after the last step to apply the gradient still in
      flight (and before saving a checkpoint).
    - ``"local_sgd"``: :meth:`step` is a local step on this rank's mean gradient; every ``local_steps`` steps
      and at every epoch's last step the parameters (and ``model``'s floating buffers) are averaged, weighted
      by the samples each rank processed since the last average.

    ``micro_batches(batch)`` yields ``batch`` once in the modes that do not cut steps, and :meth:`flush` does
    nothing outside ``pseudo_sync``, so one loop works for every mode.

    Attributes:
        optimizer: the wrapped torch optimizer.
        aggregation: the :class:`~hetero_plugins.aggregation.AggregationOptions` in force.
        communication_bytes: bytes this rank put into gradient / model exchanges.
        communication_rounds: number of those exchanges.
        carried_samples: samples that missed a deadline so far (``deadline``; each was processed later).
        stolen_samples: samples this rank processed from other ranks' shares (``wbsp``).
        last_step_samples: every rank's processed samples in the last ``deadline`` / ``wbsp`` step.
        backlogs: every rank's carried samples after the last ``deadline`` step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        batch_sampler: HeteroBatchSampler,
        aggregation: str | AggregationOptions,
        dataset: Any = None,
        collate_fn: Any = None,
        model: torch.nn.Module | None = None,
        backward_passes_per_step: int = 1,
        **kwargs: Any,
    ) -> None:
        # No Optimizer.__init__: the wrapped optimizer owns param_groups, state and the step hooks.
        options = resolve_aggregation(aggregation)
        mode = options.mode
        if not options.explicit_sync:
            raise ValueError(
                "AggregatingOptimizer serves the explicit-exchange modes, not aggregation='weighted'. "
                "HINT: use hetero_plugins.horovod.DistributedOptimizer(..., aggregation=...)."
            )
        if not isinstance(batch_sampler, HeteroBatchSampler):
            raise ValueError(
                f"`batch_sampler` must be the hetero_plugins.horovod.HeteroBatchSampler that feeds this rank, got "
                f"{batch_sampler!r}."
            )
        if backward_passes_per_step != 1:
            raise ValueError(
                f"`backward_passes_per_step`={backward_passes_per_step} does not combine with aggregation={mode!r} "
                "(the mode exchanges once per optimizer step). HINT: raise the sampler's batch_size instead, or use "
                "aggregation='weighted'."
            )
        for key in kwargs:
            if key in _HOROVOD_ONLY:
                raise ValueError(
                    f"`{key}` is an hvd.DistributedOptimizer option, which aggregation={mode!r} does not use: this "
                    f"mode exchanges gradients itself. HINT: drop `{key}`, or use aggregation='weighted'."
                )
            raise ValueError(
                f"`{key}` is not an option of hetero_plugins.horovod.DistributedOptimizer with aggregation={mode!r}. "
                "HINT: see help(hetero_plugins.horovod.DistributedOptimizer)."
            )
        if options.micro_batched and batch_sampler.locality:
            raise ValueError(
                f"aggregation={mode!r} moves samples between steps and ranks, which a HeteroBatchSampler with "
                "`locality=True` forbids (each rank keeps its shard). HINT: build the sampler with locality=False, "
                "or use aggregation='weighted'."
            )
        if mode == "wbsp" and dataset is None:
            raise ValueError(
                "aggregation='wbsp' loads micro-batches of other ranks' shares, so it needs `dataset` (got None). "
                "HINT: DistributedOptimizer(..., aggregation='wbsp', dataset=train_set, collate_fn=loader.collate_fn)."
            )
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError(f"`collate_fn` must be callable, got {collate_fn!r}. HINT: pass loader.collate_fn.")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
        hvd = _hvd()
        self.__dict__["optimizer"] = optimizer
        self._hvd = hvd
        self.aggregation = options
        self.hetero_sampler = batch_sampler
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self._model = model
        self._params = trainable([p for g in optimizer.param_groups for p in g["params"]])
        self.communication_bytes = 0
        self.communication_rounds = 0
        self.carried_samples = 0
        self.stolen_samples = 0
        self.last_step_samples: list[int] | None = None
        self.backlogs: list[int] | None = None
        self._steps = 0  # optimizer steps taken through this wrapper: equal on every rank
        self._carry = CarryQueue()
        self._mb: str | None = None  # the micro-batch loop of the step in progress: None, "running", "done"
        self._mb_samples = 0
        self._mb_planned = 0
        self._backward_step: int | None = None
        self._store: Any = None
        self._claim_keys = ClaimKeys(keep=2)  # a step's keys are dead once every rank passed its exchange
        self._corrector: PseudoSyncCorrector | None = None
        self._delayed: DelayedExchange | None = None
        self._local: LocalSGDSchedule | None = None
        sampler = batch_sampler
        if options.micro_batched:  # the weight n_j / B is set before every micro-batch; timing at the loop's end
            self.hetero_weighting = GradientWeighting(self._params)
        elif mode == "pseudo_sync":
            self.hetero_weighting = GradientWeighting(
                self._params, timer=sampler.timer, weight_fn=sampler.current_weight, on_backward_end=self._backward_end
            )
            self._corrector = PseudoSyncCorrector(
                smoothing=float(options.smoothing),  # type: ignore[arg-type]
                min_confidence=float(options.min_confidence),  # type: ignore[arg-type]
            )
            self._delayed = DelayedExchange(self._launch)
        else:  # local_sgd: local steps on this rank's own mean gradient (weight 1)
            self.hetero_weighting = GradientWeighting(
                self._params, timer=sampler.timer, on_backward_end=self._backward_end
            )
            self._local = LocalSGDSchedule(local_steps=options.local_steps)  # type: ignore[arg-type]
        if mode == "wbsp":
            self._start_claim_store()

    # ------------------------------------------------------------------ the wrapped optimizer
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.__dict__["optimizer"]

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "an AggregatingOptimizer cannot be pickled (it holds Horovod handles and a store connection). "
            "HINT: save optimizer.state_dict() instead."
        )

    def __repr__(self) -> str:
        return f"AggregatingOptimizer(aggregation={self.aggregation.mode!r}, optimizer={self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (``pseudo_sync``: :meth:`flush` first; nothing in flight is saved)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            f"aggregation={self.aggregation.mode!r} exchanges the parameters it saw when it was built. "
            "HINT: add the parameter group to the torch optimizer before hh.DistributedOptimizer wraps it."
        )

    # ------------------------------------------------------------------ the training loop's side
    def micro_batches(self, batch: Any) -> Iterator[Any]:
        """The pieces of ``batch`` (this rank's batch of the step) to back-propagate one after the other.

        ``deadline``: the micro-batches carried from earlier steps first, then this step's, until the
        deadline; ``wbsp``: this rank's unclaimed micro-batches, then other ranks' (loaded from ``dataset``).
        Other modes: ``batch`` once. Iterate it to the end, then call :meth:`step`.
        """
        options = self.aggregation
        if not options.micro_batched:
            yield batch
            return
        if self._mb is not None:
            raise RuntimeError(
                f"optimizer.micro_batches() was called again before optimizer.step() (aggregation={options.mode!r}). "
                "HINT: per batch: zero_grad(); for mb in optimizer.micro_batches(batch): backward; then step()."
            )
        sampler = self.hetero_sampler
        rank = sampler.rank
        step = sampler.steps_done
        layout = sampler._segment()[2]
        if step >= layout.steps:
            raise RuntimeError(
                f"step {step} is past the epoch's {layout.steps} steps (aggregation={options.mode!r}). "
                "HINT: call sampler.set_epoch(epoch) every epoch and micro_batches() once per batch of the loader."
            )
        counts = sampler.step_counts(step)
        planned = sum(counts)
        n = batch_length(batch)
        if n != counts[rank]:
            raise ValueError(
                f"micro_batches() got a batch of {n} samples, but this rank's batch of step {step} has "
                f"{counts[rank]} (aggregation={options.mode!r}). HINT: pass the batch the HeteroBatchSampler's "
                "loader yields, unchanged, once per step."
            )
        if step == 0 and len(self._carry):
            log.warning("aggregation='deadline': %d carried samples dropped at an epoch's start (the previous epoch "
                        "was cut short)", self._carry.clear())
        parts = int(options.micro_batches)  # type: ignore[arg-type]
        sizes = micro_batch_sizes(counts[rank], parts)
        weighting = self.hetero_weighting
        self._mb, self._mb_samples, self._mb_planned = "running", 0, planned
        if options.mode == "deadline":
            last = step + 1 >= layout.steps  # the epoch's last step has no deadline: the carry is flushed
            predicted = sampler.planner.predict_step_time(counts)
            rule = DeadlineRule(math.inf if last else options.deadline(predicted))
            before, from_carry = self._carry.samples, 0
            for mb in deadline_micro_batches(batch, sizes, rule, self._carry, rank, step):
                weighting.set_weight(mb.samples / planned)
                yield mb.data
                self._mb_samples += mb.samples
                from_carry += mb.samples if mb.step != step else 0
            self.carried_samples += self._carry.samples - (before - from_carry)  # newly carried this step
        else:  # wbsp
            prefix = f"hetero_plugins/{self._steps}"
            per_rank = [len(micro_batch_sizes(c, parts)) for c in counts]
            claims = StepClaims(self._store, prefix, per_rank)
            device = _device_of(batch)

            def load(owner: int, index: int) -> tuple[Any, int]:
                return self._load_micro_batch(step, owner, index, parts, device)

            for mb in wbsp_micro_batches(batch, counts, parts, rank, claims, load, sampler.planner.rates(counts)):
                weighting.set_weight(mb.samples / planned)
                yield mb.data
                self._mb_samples += mb.samples
                if mb.owner != rank:
                    self.stolen_samples += mb.samples
            self._claim_keys.forget(self._store, claims.keys(rank))
        timer = sampler.timer
        timer.set_samples(self._mb_samples)  # stolen samples count for this rank, missed ones do not
        timer.mark_gradients_ready()
        self._mb = "done"
        sampler._on_backward_end()

    def step(self, closure: Any = None) -> Any:
        """Exchange as the mode does, then step the wrapped optimizer (see the class doc)."""
        if _called_by_horovod_broadcast():  # hvd.broadcast_optimizer_state initialising the state
            return self.optimizer.step(closure)
        options = self.aggregation
        mode = options.mode
        sampler = self.hetero_sampler
        loss = None
        if options.micro_batched:
            if closure is not None:
                raise ValueError(
                    f"aggregation={mode!r} does not take a `closure`: the micro-batches are back-propagated by the "
                    "loop over optimizer.micro_batches(batch). HINT: call optimizer.step() without arguments."
                )
            if self._mb is None:
                raise RuntimeError(
                    f"aggregation={mode!r} runs each step as micro-batches, but optimizer.step() was called without "
                    "them. HINT: `for x, y in optimizer.micro_batches(batch): loss_fn(model(x), y).backward()` "
                    "before optimizer.step()."
                )
            if self._mb == "running":
                raise RuntimeError(
                    f"optimizer.step() was called before the loop over optimizer.micro_batches(batch) ended "
                    f"(aggregation={mode!r}); its remaining micro-batches would be lost. HINT: iterate "
                    "micro_batches(batch) to the end (no break) before optimizer.step()."
                )
            self._mb = None
            world = sampler.world_size
            counts, backlogs = sync_sample_weighted(
                self._params, self._mb_samples, self._mb_planned, sampler.rank, world, self._allreduce,
                backlog=self._carry.samples,
            )
            self._count(sum(p.numel() for p in self._params) + 2 * world)
            self.last_step_samples, self.backlogs = counts, backlogs
            self.optimizer.step()
        elif mode == "pseudo_sync":
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            assert self._delayed is not None and self._corrector is not None
            flat = flat_gradients(self._params)
            previous = self._delayed.exchange(flat)
            self._count(flat.numel())
            if previous is not None:  # the very first step only launches: there is no earlier gradient yet
                set_flat_gradients(self._params, self._corrector.combine(previous))
                self.optimizer.step()
        else:  # local_sgd
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self.optimizer.step()
            self._after_local_step()
        self._steps += 1
        self._backward_step = None
        sampler._on_step_end()
        return loss

    def flush(self) -> bool:
        """``pseudo_sync``: apply the last step's gradient, still in flight; call it after the last step.

        Returns whether a gradient was applied (always ``False`` in the other modes). Every rank must call it.
        """
        if self._delayed is None or self._corrector is None:
            return False
        last = self._delayed.flush()
        if last is None:
            return False
        set_flat_gradients(self._params, self._corrector.combine(last))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return True

    # ------------------------------------------------------------------ internals
    def _backward_end(self) -> None:
        self._backward_step = self.hetero_sampler.steps_done
        self.hetero_sampler._on_backward_end()

    def _count(self, elements: int) -> None:
        dtype = self._params[0].dtype if self._params and self._params[0].is_floating_point() else torch.float32
        self.communication_bytes += int(elements) * torch.tensor([], dtype=dtype).element_size()
        self.communication_rounds += 1

    def _allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._hvd.allreduce(tensor, op=self._hvd.Sum, name="hetero_plugins.aggregation.sync")

    def _launch(self, tensor: torch.Tensor) -> _HorovodHandle:
        assert self._delayed is not None
        name = f"hetero_plugins.aggregation.pseudo_sync.{self._delayed.launched % 2}"  # two may be in flight
        return _HorovodHandle(self._hvd, self._hvd.allreduce_async(tensor, op=self._hvd.Sum, name=name))

    def _after_local_step(self) -> None:
        assert self._local is not None
        sampler = self.hetero_sampler
        step = self._backward_step if self._backward_step is not None else max(0, sampler.steps_done - 1)
        layout = sampler._segment()[2]
        samples = layout.step_counts(min(step, layout.steps - 1))[sampler.rank]
        due = self._local.step_done(samples)
        if due or step + 1 >= layout.steps:  # also at the epoch's end: every epoch ends on one model
            tensors = list(self._params)
            if self._model is not None:
                seen = {id(t) for t in tensors}
                tensors += [b for b in self._model.buffers() if b.is_floating_point() and id(b) not in seen]
            info = weighted_average_(
                tensors, self._local.samples_since_average,
                lambda t: self._hvd.allreduce(t, op=self._hvd.Sum, name="hetero_plugins.aggregation.local_sgd"),
            )
            self.communication_bytes += int(info["bytes"])
            self.communication_rounds += 1
            self._local.averaged()

    def _start_claim_store(self) -> None:
        """``wbsp``: one TCP key-value store for the claim counters, served by rank 0. Collective."""
        self._store = open_claim_store(
            self._hvd.rank(), socket.gethostname(),
            lambda obj: self._hvd.broadcast_object(obj, root_rank=0, name="hetero_plugins.aggregation.store"),
            float(self.aggregation.claim_timeout),  # type: ignore[arg-type]
        )

    def _load_micro_batch(self, step: int, owner: int, index: int, parts: int, device: torch.device | None) -> tuple[Any, int]:
        """Micro-batch ``index`` of ``owner``'s share of ``step``, loaded from the dataset and collated."""
        chosen = unit_indices(self.hetero_sampler.batch_indices(step, owner), parts, index)
        data = self.collate_fn([self.dataset[i] for i in chosen])
        if device is not None:
            data = _to_device(data, device)
        return data, len(chosen)
