"""``hh.DistributedOptimizer``: a factory over one thin wrapper, :class:`AggregatingOptimizer`.

The aggregation itself is an :class:`~hetero_plugins.aggregation.base.Aggregator` (one per mode, framework-free);
the wrapper only connects it to a ``horovodrun`` training loop and to the :class:`HeteroBatchSampler`, like
PyTorch's ``PostLocalSGDOptimizer(optim, averager)`` wraps an injected averager (Lin et al. 2018). In
``"weighted"`` the wrapped optimizer is Horovod's own ``hvd.DistributedOptimizer`` (``op=hvd.Sum``), fed
gradients scaled by b_i / B; in the other modes it is the user's optimizer and the aggregator exchanges
through ``hvd.allreduce`` itself.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from hetero_plugins._validation import check_int
from hetero_plugins.aggregation import AggregationStats, Aggregator, StepContext, make_aggregator
from hetero_plugins.aggregation.options import AggregationOptions, resolve_aggregation
from hetero_plugins.collectives import CollectiveError, is_transport_failure
from hetero_plugins.horovod.runtime import horovod_torch as _hvd
from hetero_plugins.horovod.carry import CARRY_KEY, carry_state, restore_carry
from hetero_plugins.horovod.exchange import HorovodExchange
from hetero_plugins.horovod.gradient_sync import GRADIENT_ALLREDUCE, wait_for_gradients
from hetero_plugins.horovod.sampler import HeteroBatchSampler
from hetero_plugins.horovod.weighting import GradientWeighting

__all__ = ["AggregatingOptimizer", "DistributedOptimizer"]

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
) -> AggregatingOptimizer:
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
        An :class:`AggregatingOptimizer` in every mode (in ``"weighted"`` it wraps Horovod's distributed
        optimizer). It has ``micro_batches(batch)``, ``flush()``, ``communication_bytes``,
        ``communication_rounds``, ``carried_samples`` and ``stolen_samples``, so one training loop serves
        every mode.

    Example::

        optimizer = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), batch_sampler=sampler)
    """
    hvd = _hvd()
    options = resolve_aggregation(aggregation)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"`optimizer` must be a torch.optim.Optimizer, got {optimizer!r}. HINT: wrap the optimizer "
                         "itself, e.g. DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ...).")
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
            f"`gradient_predivide_factor`={gradient_predivide_factor!r} only applies to op=hvd.Average, which "
            "per-rank batch sizes cannot use. HINT: drop it; gradients are weighted by b_i / B instead."
        )
    check_int("backward_passes_per_step", backward_passes_per_step, minimum=1)
    if collate_fn is not None and not callable(collate_fn):
        raise ValueError(f"`collate_fn` must be callable, got {collate_fn!r}. HINT: pass loader.collate_fn.")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"`model` must be a torch.nn.Module, got {type(model).__name__}. HINT: pass the model.")
    inner = optimizer
    if options.explicit_sync:
        options.check_accumulation("backward_passes_per_step", backward_passes_per_step)
        for key in kwargs:
            if key in _HOROVOD_ONLY:
                raise ValueError(
                    f"`{key}` is an hvd.DistributedOptimizer option, which aggregation={options.mode!r} does not "
                    f"use: this mode exchanges gradients itself. HINT: drop `{key}`, or use aggregation='weighted'."
                )
            raise ValueError(
                f"`{key}` is not an option of hetero_plugins.horovod.DistributedOptimizer with "
                f"aggregation={options.mode!r}. HINT: see help(hetero_plugins.horovod.DistributedOptimizer)."
            )
        options.check_locality(batch_sampler.locality)
        if options.mode == "wbsp" and dataset is None:
            raise ValueError(
                "aggregation='wbsp' loads micro-batches of other ranks' shares, so it needs `dataset` (got None). "
                "HINT: DistributedOptimizer(..., aggregation='wbsp', dataset=train_set, collate_fn=loader.collate_fn)."
            )
        if options.mode == "wbsp" and not hasattr(dataset, "__getitem__"):
            raise ValueError(
                f"aggregation='wbsp' loads samples as dataset[i], so `dataset` must be indexable, got "
                f"{dataset!r}. HINT: pass the training dataset itself (a torch Dataset, a list...)."
            )
    else:
        inner = hvd.DistributedOptimizer(
            optimizer, named_parameters=None if named_parameters is None else list(named_parameters), op=hvd.Sum,
            backward_passes_per_step=backward_passes_per_step, **kwargs,
        )
    params = [p for group in inner.param_groups for p in group["params"]]
    buffers = list(model.buffers()) if model is not None else []
    aggregator = make_aggregator(options, HorovodExchange(), params, buffers=buffers)
    return AggregatingOptimizer(inner, batch_sampler, aggregator, dataset=dataset, collate_fn=collate_fn,
                                backward_passes_per_step=backward_passes_per_step)


class AggregatingOptimizer(torch.optim.Optimizer):
    """The optimizer :func:`DistributedOptimizer` returns: ``optimizer`` driven by an injected ``aggregator``.

    It behaves like the wrapped optimizer (``param_groups``, ``state``, ``defaults``, ``zero_grad``,
    ``state_dict`` / ``load_state_dict`` all act on it, other attributes such as Horovod's ``synchronize``
    are forwarded; ``isinstance(opt, torch.optim.Optimizer)`` holds, so torch LR schedulers accept it). Tensor
    hooks (:class:`GradientWeighting`) weight each backward pass's gradients as the mode needs and report the
    step timings to the sampler, so per-epoch rebalancing keeps working. :meth:`step` asks the aggregator to
    exchange, steps the wrapped optimizer unless the exchange says to skip, and lets the aggregator finish the
    step.

    - ``"weighted"``: ``optimizer`` is Horovod's distributed optimizer; each rank's gradients are scaled by its
      share b_i / B of the step and summed by Horovod's own all-reduce in :meth:`step`.
    - ``"deadline"`` / ``"wbsp"`` run a step as micro-batches, so the training loop must let the optimizer
      hand them out::

          for batch in loader:
              optimizer.zero_grad()
              for x, y in optimizer.micro_batches(batch):
                  loss_fn(model(x), y).backward()
              optimizer.step()

      Each micro-batch's gradient is scaled by n_j / B (B the step's planned global batch); :meth:`step` sums
      the ranks' gradients and the samples actually processed in one all-reduce and rescales, so the update is
      the mean gradient over exactly the samples the step processed. ``deadline`` stops before the step's
      deadline (``AggregationOptions.deadline`` of the planner's predicted step time; none on the epoch's last
      step) and carries the rest into the next steps (first in line); ``wbsp`` claims its own micro-batches
      and then takes unclaimed ones of other ranks' shares (loaded from ``dataset``) through a
      ``torch.distributed.TCPStore`` served by rank 0.
    - ``"pseudo_sync"``: :meth:`step` launches the all-reduce of this step's weighted gradient and applies the
      previous step's reduced gradient, corrected by
      :class:`~hetero_plugins.aggregation.pseudo_sync.PseudoSyncCorrector`; the first step only launches. Call
      :meth:`flush` after the last step to apply the gradient still in flight (and before saving a checkpoint).
    - ``"local_sgd"``: :meth:`step` is a local step on this rank's mean gradient; every ``local_steps`` steps
      and at every epoch's last step the parameters (and ``model``'s floating buffers) are averaged, weighted
      by the samples each rank processed since the last average.

    ``micro_batches(batch)`` yields ``batch`` once in the modes that do not cut steps, and :meth:`flush` does
    nothing outside ``pseudo_sync`` and ``local_sgd`` (which averages a window the loop stopped inside), so one
    loop works for every mode.

    A :meth:`step` with no backward pass (and no ``micro_batches`` loop) since the previous step only
    initialises the optimizer's state: it steps the wrapped optimizer on the gradients as they are, with no
    exchange. That is what ``hvd.broadcast_optimizer_state`` does to a new optimizer (zero gradients, then
    ``step()``), on every rank alike.

    Args:
        optimizer: the optimizer to step (Horovod's distributed optimizer in ``"weighted"``).
        batch_sampler: the :class:`HeteroBatchSampler` feeding this rank.
        aggregator: the mode's :class:`~hetero_plugins.aggregation.base.Aggregator` over the parameters of
            ``optimizer`` (see :func:`~hetero_plugins.aggregation.make_aggregator`).
        dataset: ``"wbsp"``: where stolen micro-batches are loaded from.
        collate_fn: ``"wbsp"``: how they are collated (default ``default_collate``).
        backward_passes_per_step: ``"weighted"``: backward passes accumulated per step.

    Attributes:
        optimizer: the wrapped optimizer.
        aggregator: the mode's engine.
        weighting: the :class:`GradientWeighting` hooks on the parameters.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        batch_sampler: HeteroBatchSampler,
        aggregator: Aggregator,
        dataset: Any = None,
        collate_fn: Any = None,
        backward_passes_per_step: int = 1,
    ) -> None:
        # No Optimizer.__init__: the wrapped optimizer owns param_groups, state and the step hooks.
        self.__dict__["optimizer"] = optimizer
        self.aggregator = aggregator
        self.batch_sampler = batch_sampler
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.backward_passes_per_step = backward_passes_per_step
        self._ctx: StepContext | None = None  # the micro-batched step in progress
        self._loop: str | None = None  # its loop over micro_batches(): None, "running", "done"
        self._backwards = 0  # backward passes since the last step
        self._backward_step: int | None = None  # the sampler's step of the last backward pass
        self._saved_carry: dict[str, Any] | None = None  # deadline: carried micro-batches of a loaded state
        explicit = aggregator.options.explicit_sync
        self.weighting = GradientWeighting(
            aggregator.params,
            timer=None if aggregator.micro_batched else batch_sampler.timer,  # micro-batched: timed at the loop's end
            weight_fn=None if explicit else batch_sampler.current_weight,  # weighted: b_i / B of each pass's step
            on_backward_end=self._backward_end,
        )
        aggregator.setup([optimizer])  # collective: wbsp opens its claim store

    # ------------------------------------------------------------------ what the run reports
    @property
    def aggregation(self) -> AggregationOptions:
        """The :class:`~hetero_plugins.aggregation.AggregationOptions` in force."""
        return self.aggregator.options

    @property
    def stats(self) -> AggregationStats:
        """What the aggregator did so far on this rank (bytes, rounds, carried and stolen samples)."""
        return self.aggregator.stats

    @property
    def communication_bytes(self) -> int:
        """Bytes this rank put into gradient / model exchanges (``"weighted"``: uncompressed gradients)."""
        return self.aggregator.stats.bytes

    @property
    def communication_rounds(self) -> int:
        """Number of those exchanges."""
        return self.aggregator.stats.rounds

    @property
    def carried_samples(self) -> int:
        """Samples that missed a deadline so far (``deadline``; each was processed later)."""
        return self.aggregator.stats.carried

    @property
    def stolen_samples(self) -> int:
        """Samples this rank processed from other ranks' shares (``wbsp``)."""
        return self.aggregator.stats.stolen

    @property
    def last_step_samples(self) -> list[int] | None:
        """Every rank's processed samples in the last ``deadline`` / ``wbsp`` step."""
        return self.aggregator.last_counts

    @property
    def backlogs(self) -> list[int] | None:
        """Every rank's carried samples after the last ``deadline`` step."""
        return self.aggregator.backlogs

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
        """Reset the gradients: to ``None`` (default), or, with ``set_to_none=False``, to zero tensors."""
        inner = self.optimizer
        if self.aggregation.explicit_sync:
            inner.zero_grad(set_to_none=set_to_none)
        elif set_to_none or getattr(inner, "_handles", None):
            inner.zero_grad()  # Horovod's own: no argument (None), and its error between backward and step
        else:  # Horovod's zero_grad() always sets None: its base class (the wrapped optimizer's) zeroes in place
            super(type(inner), inner).zero_grad(set_to_none=False)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (``pseudo_sync``: :meth:`flush` first; nothing in flight is saved).

        ``"deadline"``: also this rank's carried micro-batches, their data included (see
        :mod:`hetero_plugins.horovod.carry`), so a mid-epoch checkpoint resumes with them: save every rank's own
        state with its ``sampler.state_dict()``; samples another rank carried are not in this one.
        """
        state = self.optimizer.state_dict()
        if getattr(self.aggregator, "carry", None) is None:
            return state  # a mode that carries nothing: no rank asked (an elastic restore may have no Horovod)
        sampler = self.batch_sampler
        carry = carry_state(self.aggregator, sampler.rank, sampler.world_size, sampler.epoch, sampler.steps_done)
        return {**state, CARRY_KEY: carry}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state; a step in progress is forgotten (an elastic reset restores the
        last commit this way, and every rank then starts the next step afresh).

        ``"deadline"``: what this rank carried no longer applies and is dropped; the carried micro-batches saved
        in ``state_dict`` are put back in line at the next step if the rank, the world size and the sampler's
        epoch and step are those they were saved at, else a ``RuntimeWarning`` says how many samples are lost.
        """
        state = dict(state_dict)
        saved = state.pop(CARRY_KEY, None)
        self.optimizer.load_state_dict(state)
        self._ctx, self._loop, self._backward_step, self._backwards = None, None, None, 0
        carry = getattr(self.aggregator, "carry", None)
        if carry is not None:
            carry.clear()  # samples of steps after the saved state: the sampler hands them out again
            self.aggregator.backlogs = None
        elif saved and saved["micro_batches"]:
            warnings.warn(f"the optimizer state loaded holds micro-batches carried under aggregation='deadline', which "
                          f"aggregation={self.aggregation.mode!r} does not process. HINT: resume with the same "
                          "aggregation, or from a checkpoint taken at an epoch end.", RuntimeWarning, stacklevel=2)
        self._saved_carry = saved if carry is not None else None

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
        aggregator = self.aggregator
        if not aggregator.micro_batched:
            yield batch
            return
        if self._loop is not None:
            raise RuntimeError(
                "optimizer.micro_batches() was called again before optimizer.step() "
                f"(aggregation={self.aggregation.mode!r}). "
                "HINT: per batch: zero_grad(); for mb in optimizer.micro_batches(batch): backward; then step()."
            )
        sampler = self.batch_sampler
        ctx = self._context(sampler.steps_done, batch)
        if self._saved_carry is not None:  # loaded with the state: decided at the first step, with Horovod up
            saved, self._saved_carry = self._saved_carry, None
            device = _device_of(batch)
            restore_carry(aggregator, saved, ctx, sampler.epoch,
                          lambda data: data if device is None else _to_device(data, device))
        self._loop, self._ctx = "running", ctx
        done = 0
        for mb in aggregator.micro_batches(batch, ctx):
            self.weighting.set_weight(mb.weight)
            yield mb.data
            done += mb.samples
        sampler.timer.set_samples(done)  # stolen samples count for this rank, missed ones do not
        sampler.timer.mark_gradients_ready()
        self._loop = "done"
        sampler.backward_done()

    def step(self, closure: Any = None) -> Any:
        """Exchange as the mode does, then step the wrapped optimizer (see the class doc)."""
        aggregator = self.aggregator
        mode = self.aggregation.mode
        explicit = self.aggregation.explicit_sync
        if closure is not None and aggregator.micro_batched:
            raise ValueError(
                f"aggregation={mode!r} does not take a `closure`: the micro-batches are back-propagated by the "
                "loop over optimizer.micro_batches(batch). HINT: call optimizer.step() without arguments."
            )
        loss = None
        if closure is not None and explicit:
            with torch.enable_grad():
                loss = closure()
        if closure is None and self._backwards == 0 and self._loop is None:
            return self._initialise_state()
        if aggregator.micro_batched:
            if self._loop is None:
                raise RuntimeError(
                    f"aggregation={mode!r} runs each step as micro-batches, but optimizer.step() was called without "
                    "them. HINT: `for x, y in optimizer.micro_batches(batch): loss_fn(model(x), y).backward()` "
                    "before optimizer.step()."
                )
            if self._loop == "running":
                raise RuntimeError(
                    f"optimizer.step() was called before the loop over optimizer.micro_batches(batch) ended "
                    f"(aggregation={mode!r}); its remaining micro-batches would be lost. HINT: iterate "
                    "micro_batches(batch) to the end (no break) before optimizer.step()."
                )
            ctx = self._ctx
            assert ctx is not None
        else:
            step = self._backward_step
            ctx = self._context(step if step is not None else max(0, self.batch_sampler.steps_done - 1))
        if aggregator.exchange(ctx):
            out = self._step_inner(None if explicit else closure, explicit)  # weighted: Horovod's step all-reduces
            if not explicit:
                loss = out
        aggregator.after_step(ctx)
        self._ctx, self._loop, self._backward_step, self._backwards = None, None, None, 0
        self.batch_sampler.step_done()
        return loss

    def flush(self) -> bool:
        """``pseudo_sync``: apply the last step's gradient, still in flight; ``local_sgd``: average the models if
        steps were taken since the last average (a loop stopped inside a window). Call it after the last step.

        Returns whether a gradient was applied (always ``False`` outside ``pseudo_sync``). Every rank must call it.
        """
        if not self.aggregator.flush():
            return False
        self.optimizer.step()
        self.optimizer.zero_grad()
        return True

    def synchronize(self) -> None:
        """``"weighted"``: Horovod's ``synchronize()``, with its wait bounded by the exchange's timeout as in
        :meth:`step`: the gradient all-reduces end (those of parameters that got no gradient are started first, as
        Horovod starts them) and ``.grad`` holds the step's sample-weighted gradient, e.g. to clip it before
        ``with optimizer.skip_synchronize(): optimizer.step()``. A stalled peer raises
        :class:`~hetero_plugins.collectives.CollectiveError` naming it instead of hanging.

        The other modes exchange the gradients inside :meth:`step`, so there is nothing to synchronize before it,
        and calling it raises a ``RuntimeError`` that says so.
        """
        if self.aggregation.explicit_sync:
            raise RuntimeError(
                f"optimizer.synchronize() applies to aggregation='weighted' only: aggregation="
                f"{self.aggregation.mode!r} exchanges the gradients inside optimizer.step(), so .grad holds this "
                "rank's own gradient until then. HINT: drop the synchronize() / skip_synchronize() calls and call "
                "optimizer.step()."
            )
        comm = self.aggregator.comm
        with self._naming_gradient_failures():
            if hasattr(comm, "wait_all"):
                wait_for_gradients(self.optimizer, comm, GRADIENT_ALLREDUCE)
            self.optimizer.synchronize()

    # ------------------------------------------------------------------ internals
    def _step_inner(self, closure: Any, explicit: bool) -> Any:
        """Step the wrapped optimizer. ``"weighted"``: first start the gradient all-reduces the backward pass did not
        (parameters that got no gradient) and wait, bounded by the exchange's timeout, for all of them
        (:func:`~hetero_plugins.horovod.gradient_sync.wait_for_gradients`; ``hvd.DistributedOptimizer.step`` would
        wait without a bound), and name a failure of them."""
        if explicit:
            return self.optimizer.step(closure)
        comm = self.aggregator.comm
        with self._naming_gradient_failures():
            if hasattr(comm, "wait_all"):
                # Horovod's step() synchronizes unless inside skip_synchronize() (the user synchronized already).
                wait_for_gradients(self.optimizer, comm, GRADIENT_ALLREDUCE,
                                   start_missing=bool(getattr(self.optimizer, "_should_synchronize", True)))
            return self.optimizer.step(closure)

    @contextlib.contextmanager
    def _naming_gradient_failures(self) -> Iterator[None]:
        """``"weighted"``: a transport failure of Horovod's gradient all-reduce becomes the exchange's
        :class:`~hetero_plugins.collectives.CollectiveError` naming it (other errors pass unchanged)."""
        comm = self.aggregator.comm
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as err:
            failure = getattr(comm, "failure", None)
            if failure is None or not is_transport_failure(err):
                raise
            raise failure(GRADIENT_ALLREDUCE, err) from err

    def _initialise_state(self) -> Any:
        """A step with no backward pass: create the optimizer's state from the gradients as they are."""
        skip = getattr(self.optimizer, "skip_synchronize", None)  # Horovod's optimizer: no all-reduce either
        if skip is None:
            return self.optimizer.step()
        with skip():
            return self.optimizer.step()

    def _backward_end(self) -> None:
        self._backwards += 1
        if self.aggregator.micro_batched:
            return  # the loop over micro_batches() ends the step's backward once
        sampler = self.batch_sampler
        self._backward_step = sampler.steps_done
        sampler.backward_done()
        if self._backwards < self.backward_passes_per_step:
            sampler.step_done()  # an accumulated pass: no collective waits before the next

    def _context(self, step: int, batch: Any = None) -> StepContext:
        """Step ``step`` of the sampler's epoch (segment) as the aggregator sees it."""
        sampler = self.batch_sampler
        steps = sampler.segment().steps  # the epoch's layout: the one source of its last step
        micro = self.aggregator.micro_batched
        if micro and step >= steps:
            raise RuntimeError(
                f"step {step} is past the epoch's {steps} steps (aggregation={self.aggregation.mode!r}). "
                "HINT: call sampler.set_epoch(epoch) every epoch and micro_batches() once per batch of the loader."
            )
        step = min(step, steps - 1)  # "weighted" past the end: the sampler already warned
        counts = tuple(sampler.step_counts(step))
        last = step + 1 >= steps
        if not micro:
            return StepContext(step, counts, sampler.rank, last)
        device = _device_of(batch)

        def load(indices: Sequence[int]) -> Any:
            data = self.collate_fn([self.dataset[i] for i in indices])
            return data if device is None else _to_device(data, device)

        return StepContext(step, counts, sampler.rank, last, planner=sampler.planner,
                           indices_of=lambda owner: sampler.batch_indices(step, owner), load=load)


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
