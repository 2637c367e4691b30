"""``aggregation=`` for the balanced strategies: the Lightning adapter over :mod:`hetero_plugins.aggregation`.

The modes are described in :mod:`hetero_plugins.aggregation`. ``"weighted"`` is the framework's own path
(DDP comm hook or Horovod's optimizer with weighted gradients), and this adapter stays out of it. Every other
mode is an :class:`~hetero_plugins.aggregation.base.Aggregator` that exchanges through the
:class:`~hetero_plugins.collectives.Collectives` the strategy provides (``torch.distributed`` or Horovod), once
per optimizer step; the model's forward then bypasses the DDP wrapper during training, so no DDP reducer or
buffer broadcast runs a collective that ranks could reach a different number of times.

- ``training_step`` builds the step's :class:`~hetero_plugins.aggregation.base.StepContext` from the balanced
  train sampler. In ``deadline`` and ``wbsp`` it runs the aggregator's micro-batches: each calls the
  LightningModule's ``training_step`` and back-propagates through the strategy (so callbacks'
  ``on_before_backward`` / ``on_after_backward`` and precision plugins see every micro-batch), with the loss
  scaled by the micro-batch's weight n_j / B. Lightning zeroes gradients between ``training_step`` and
  backward, so the accumulated gradients are kept aside and restored before the exchange.
- ``optimizer_step`` runs Lightning's closure, then ``aggregator.exchange()``, the strategy's own optimizer
  step (clipping and ``on_before_optimizer_step`` included) unless the exchange says to skip it, and
  ``aggregator.after_step()``.
- ``on_train_end`` calls ``aggregator.flush()`` and, where it leaves a gradient (``pseudo_sync``'s last one),
  steps the optimizer through the same path as every step: the precision plugin (a ``GradScaler``'s unscale
  and inf check), ``on_before_optimizer_step`` and gradient clipping. ``local_sgd`` averages there a window
  the fit left unfinished; a step that ends the fit on ``max_steps`` is the step context's ``last`` (no
  ``deadline`` there, the carry is worked off; ``local_sgd`` averages).
- The parameters the engine exchanges are re-read from the optimizer at every step (``requires_grad``), so a
  layer unfrozen later (``BackboneFinetuning``) takes part from then on on every rank.
- Under fp16 mixed precision each step's ``grad_scale`` (the ``GradScaler``'s scale) goes into the step
  context, so ``pseudo_sync`` unscales each gradient by the scale it was computed under.
- Checkpoints: a callback the strategy adds saves ``aggregator.state_dict()`` (``pseudo_sync``'s reduced
  gradient in flight and corrector) and restores it on resume; what a checkpoint cannot hold (``deadline``'s
  carried samples) is named in a warning when it is saved.

In every mode, a collective of the strategy (the DDP gradient all-reduce of the backward pass, ``reduce``,
``all_gather``, ``broadcast``, ``barrier``) that fails because a rank froze or died raises
:class:`~hetero_plugins.collectives.CollectiveError`, naming the operation and the rank that did not answer.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from hetero_plugins.aggregation import Aggregator, StepContext, make_aggregator
from hetero_plugins.aggregation.deadline import DeadlineAggregator
from hetero_plugins.aggregation.options import AggregationOptions, resolve_aggregation
from hetero_plugins.balancing.sampler import HeteroBatchSampler
from hetero_plugins.callbacks.batch_balancer import BatchBalancer
from hetero_plugins.collectives import CollectiveError, Collectives, is_transport_failure

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy as _StrategyHost
else:
    _StrategyHost = object

__all__ = ["AggregationMixin"]


class _ExplicitWeights:
    """Takes the balancer's per-step b_i / B in the explicit modes, which weight gradients themselves (from the
    step context); attached so that the balancer registers no DDP weighting hook of its own."""

    def set_weight(self, weight: float) -> None:
        """Ignored: the aggregator reads each step's counts from its :class:`StepContext`."""


class _AggregatorCheckpoint(Callback):
    """Puts the strategy's aggregator state into checkpoints and back (added to the Trainer's callbacks when the
    model is connected, before a checkpoint is restored)."""

    def __init__(self, strategy: AggregationMixin) -> None:
        self.strategy = strategy

    @property
    def state_key(self) -> str:
        return "hetero_plugins.aggregation"

    def state_dict(self) -> dict[str, Any]:
        aggregator = self.strategy.aggregator
        if aggregator is None:
            return {}
        lost = aggregator.checkpoint_losses()
        if lost is not None and self.strategy.global_rank == 0:
            warnings.warn(f"aggregation={aggregator.mode!r}: {lost}. HINT: checkpoint at an epoch's end (e.g. "
                          "ModelCheckpoint(every_n_epochs=1)), where nothing is carried.", RuntimeWarning,
                          stacklevel=2)
        return aggregator.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy._load_aggregation_state(dict(state_dict))


class AggregationMixin(_StrategyHost):
    """Adds the ``aggregation=`` modes to a balanced strategy (``HeteroDDPStrategy``, ``HeteroHorovodStrategy``).

    The host is a Lightning ``ParallelStrategy`` that holds ``self.balancer`` and implements
    :meth:`_collectives` (its transport for the engine's exchanges).

    Attributes:
        aggregation: the :class:`~hetero_plugins.aggregation.AggregationOptions` in force.
        aggregator: the mode's engine while fitting (``None`` in ``"weighted"`` and before ``setup``).
        micro_batch_samples: samples of the micro-batch being back-propagated (``None`` outside
            micro-batched steps; ``HeterogeneityEmulator`` reads it).
    """

    balancer: BatchBalancer
    aggregation: AggregationOptions
    aggregator: Aggregator | None
    micro_batch_samples: int | None

    def _init_aggregation(self, aggregation: str | AggregationOptions | None) -> None:
        self.aggregation = resolve_aggregation(aggregation)
        self.aggregation.check_locality(self.balancer.locality)
        self.aggregator = None
        self.micro_batch_samples = None
        self._step_ctx: StepContext | None = None
        self._stash: list[Tensor | None] | None = None
        self._transport: Collectives | None = None
        self._step_fn: Callable[..., Any] | None = None  # the strategy's own optimizer step (for the flush)
        self._loaded_state: dict[str, Any] | None = None  # aggregator state from a checkpoint, not applied yet
        self._checkpoint_callback = _AggregatorCheckpoint(self)
        if self.aggregation.explicit_sync:
            self.balancer.attach_weighting(_ExplicitWeights())

    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)  # type: ignore[misc]
        trainer = model.trainer
        if self.aggregation.explicit_sync and not any(cb is self._checkpoint_callback for cb in trainer.callbacks):
            trainer.callbacks.append(self._checkpoint_callback)

    def _load_aggregation_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's aggregator state: applied now if the aggregator exists, else once it is set up."""
        self._loaded_state = state or None
        if self.aggregator is not None:
            self._apply_loaded_state(self.aggregator)

    def _apply_loaded_state(self, aggregator: Aggregator) -> None:
        state, self._loaded_state = self._loaded_state, None
        if not state:
            return
        if state.get("mode") != aggregator.mode:
            warnings.warn(f"the checkpoint holds aggregation={state.get('mode')!r} state, but this run uses "
                          f"aggregation={aggregator.mode!r}; it is ignored.", RuntimeWarning, stacklevel=2)
            return
        aggregator.load_state_dict(state)

    def _grad_scale(self) -> float:
        """The loss scale of the precision plugin's ``GradScaler`` (fp16 mixed precision), else 1.0."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else 1.0

    def _collectives(self) -> Collectives:
        """The transport of the engine's exchanges (the strategy implements it)."""
        raise NotImplementedError

    def _comm(self) -> Collectives:
        """The strategy's transport, made once."""
        if getattr(self, "_transport", None) is None:
            self._transport = self._collectives()
        return self._transport  # type: ignore[return-value]

    def _guarded(self, operation: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; a transport failure in it becomes a :class:`CollectiveError` naming ``operation`` and the
        rank that did not answer."""
        try:
            return fn()
        except CollectiveError:
            raise
        except RuntimeError as err:
            if not is_transport_failure(err):
                raise
            failure = getattr(self._comm(), "failure", None)
            if failure is None:
                raise
            raise failure(operation, err) from err

    # ------------------------------------------------------------------ the strategy's collectives, bounded
    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if getattr(self, "aggregator", None) is not None:  # the explicit modes: no collective in backward
            return super().backward(closure_loss, *args, **kwargs)  # type: ignore[misc]
        module = self.lightning_module
        step = module.trainer.global_step if module is not None and module._trainer is not None else "?"
        return self._guarded(f"the gradient all-reduce of DDP's backward pass (global step {step})",
                             lambda: super(AggregationMixin, self).backward(closure_loss, *args, **kwargs))

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._guarded("the strategy's reduce",
                             lambda: super(AggregationMixin, self).reduce(tensor, *args, **kwargs))

    def all_gather(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self._guarded("the strategy's all_gather",
                             lambda: super(AggregationMixin, self).all_gather(tensor, *args, **kwargs))

    def broadcast(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return self._guarded("the strategy's broadcast",
                             lambda: super(AggregationMixin, self).broadcast(obj, *args, **kwargs))

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._guarded("the strategy's barrier", lambda: super(AggregationMixin, self).barrier(*args, **kwargs))

    # ------------------------------------------------------------------ what the run reports
    @property
    def communication_bytes(self) -> int:
        """Bytes this rank sent into gradient / model exchanges during training (all modes)."""
        hook = self.balancer.hook_state
        sent = self.aggregator.stats.bytes if self.aggregator is not None else 0
        return sent + (int(hook.bytes) if hook is not None else 0)

    @property
    def communication_rounds(self) -> int:
        """Number of exchanges by the explicit-exchange modes."""
        return self.aggregator.stats.rounds if self.aggregator is not None else 0

    @property
    def carried_samples(self) -> int:
        """Samples that missed a deadline so far (``deadline`` mode; all were processed later)."""
        return self.aggregator.stats.carried if self.aggregator is not None else 0

    @property
    def stolen_samples(self) -> int:
        """Samples this rank processed from other ranks' shares (``wbsp`` mode)."""
        return self.aggregator.stats.stolen if self.aggregator is not None else 0

    # ------------------------------------------------------------------ set-up
    def _setup_aggregation(self, trainer: pl.Trainer) -> None:
        """Check the run against the mode and build its aggregator (after the optimizers exist; collective).

        In every mode, start this rank's heartbeat where the transport keeps one (it names a frozen rank)."""
        mode = self.aggregation
        start_liveness = getattr(self._comm(), "start_liveness", None)
        if start_liveness is not None:
            start_liveness()
        if not mode.explicit_sync:
            return
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                f"aggregation={mode.mode!r} needs automatic optimization; this LightningModule sets "
                "automatic_optimization=False. HINT: use aggregation='weighted' with manual optimization."
            )
        mode.check_accumulation("accumulate_grad_batches", trainer.accumulate_grad_batches)
        aggregator = make_aggregator(mode, self._comm(), module.parameters(),
                                     buffers=list(module.parameters()) + list(module.buffers()))
        aggregator.follow_optimizer = True  # the loss carries each micro-batch's weight: any parameter may join
        aggregator.setup(self.optimizers)
        self._apply_loaded_state(aggregator)
        if self.aggregator is not None:
            aggregator.stats = self.aggregator.stats  # another fit with this strategy: the counts go on
        if isinstance(aggregator, DeadlineAggregator):
            self.balancer.backlog_fn = aggregator.backlog_per_step  # mid-epoch plans route around the backlog
        self.aggregator = aggregator

    # ------------------------------------------------------------------ training step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        aggregator = self.aggregator
        if aggregator is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        assert module is not None
        batch, batch_idx, rest = _step_arguments(args, kwargs)
        own = self.balancer.own_batch_sampler(module.trainer)
        if aggregator.micro_batched and own is None:
            raise RuntimeError(
                f"aggregation={self.aggregation.mode!r} needs the strategy's balanced train sampler, but the train "
                "loader has another batch sampler. HINT: let Lightning inject its DistributedSampler "
                "(use_distributed_sampler=True, the default) and pass a plain DataLoader(batch_size=...)."
            )
        ctx = self._step_context(aggregator, module.trainer, own, batch, batch_idx)
        self._step_ctx = ctx
        if not aggregator.micro_batched:
            with self.precision_plugin.train_step_context():
                return module.training_step(*args, **kwargs)
        return self._micro_batched_step(aggregator, ctx, batch, rest, kwargs)

    def _step_context(
        self, aggregator: Aggregator, trainer: pl.Trainer, own: HeteroBatchSampler | None, batch: Any, batch_idx: int
    ) -> StepContext:
        rank = self.global_rank
        if own is None:  # a batch sampler of the user's: equal shares, as the balancer assumes then
            counts = (int(extract_batch_size(batch)),) * self.world_size
            steps = trainer.num_training_batches
        else:
            counts = tuple(own.step_counts(batch_idx))
            # The epoch's layout ends it; limit_train_batches may end the loop earlier.
            steps = min(len(own), trainer.num_training_batches)
        # max_steps may end the fit earlier still (one optimizer step per batch: no accumulation here).
        last = batch_idx + 1 >= steps or 0 <= trainer.max_steps <= trainer.global_step + 1
        if own is None or not aggregator.micro_batched:
            return StepContext(batch_idx, counts, rank, last)
        loader = trainer.train_dataloader
        assert loader is not None  # the balanced sampler came from it
        sampler = own

        def load(indices: Any) -> Any:
            """Samples of another rank's share, loaded with the train loader's dataset and collate function."""
            return self.batch_to_device(loader.collate_fn([loader.dataset[i] for i in indices]))

        return StepContext(batch_idx, counts, rank, last, planner=self.balancer.planner,
                           indices_of=lambda owner: sampler.batch_indices(batch_idx, owner), load=load)

    def _micro_batched_step(
        self, aggregator: Aggregator, ctx: StepContext, batch: Any, rest: tuple, kwargs: dict[str, Any]
    ) -> Any:
        params = aggregator.params
        for p in params:
            p.grad = None  # Lightning zeroes gradients only after training_step
        results: list[tuple[Any, float, int]] = []
        for mb in aggregator.micro_batches(batch, ctx):
            self.micro_batch_samples = mb.samples
            results.append(self._run_micro_batch(mb.data, mb.weight, mb.samples, ctx.step, rest, kwargs))
        done = sum(n for _, _, n in results)
        self.balancer.timer.set_samples(done)  # stolen samples count for this rank, missed ones do not
        self.balancer.timer.mark_gradients_ready()
        self._stash = [p.grad for p in params]  # None stays None: a parameter with no gradient is skipped
        for p in params:
            p.grad = None  # Lightning's zero_grad (in place or not) leaves the stash alone
        self.micro_batch_samples = 0  # the placeholder's backward below is not a micro-batch
        mean_loss = sum(loss * n for _, loss, n in results) / max(done, 1)
        placeholder = torch.as_tensor(mean_loss, dtype=torch.float32).detach().clone().requires_grad_(True)
        if not results:  # other ranks claimed this rank's whole share before it started (wbsp)
            return placeholder
        out = results[-1][0]
        if isinstance(out, Mapping):
            out = dict(out)
            out["loss"] = placeholder
            return out
        return placeholder

    def _run_micro_batch(
        self, data: Any, weight: float, samples: int, batch_idx: int, rest: tuple, kwargs: dict[str, Any]
    ) -> tuple[Any, float, int]:
        module = self.lightning_module
        assert module is not None
        with self.precision_plugin.train_step_context():
            out = module.training_step(data, batch_idx, *rest, **kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise RuntimeError(
                f"aggregation={self.aggregation.mode!r} needs training_step to return the loss (a tensor or a dict "
                f"with 'loss'); it returned {type(out).__name__}. HINT: skipping a batch by returning None is not "
                "supported in micro-batched modes."
            )
        self.backward(loss * weight, None)
        return out, float(loss.detach()), samples

    # ------------------------------------------------------------------ the exchange
    def _aggregated_optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: Any,
        kwargs: dict[str, Any],
        step_fn: Callable[..., Any],
    ) -> Any:
        """The optimizer step of an explicit mode; ``step_fn(optimizer, closure, model, **kwargs)`` is the
        strategy's own optimizer step (precision plugin, clipping, hooks)."""
        aggregator = self.aggregator
        assert aggregator is not None
        self._step_fn = step_fn
        result = closure()  # training_step (where micro-batches run) and Lightning's backward
        if self._stash is not None:
            for p, g in zip(aggregator.params, self._stash):
                p.grad = g
            self._stash = None
        ctx = self._step_ctx
        assert ctx is not None, "training_step runs before the optimizer step"
        scale = self._grad_scale()
        if scale != 1.0:
            ctx = dataclasses.replace(ctx, grad_scale=scale)
        if not aggregator.exchange(ctx):
            return None  # pseudo_sync's first step: its exchange is launched, there is nothing to apply yet
        out = step_fn(optimizer, lambda: result, model, **kwargs)
        aggregator.after_step(ctx)
        return out

    def on_train_end(self) -> None:
        aggregator = self.aggregator
        if aggregator is not None and aggregator.flush(self._grad_scale()):  # the last step's gradient, in flight
            # The same path as every step: precision plugin (unscale, inf check), on_before_optimizer_step, clipping.
            step_fn = self._step_fn or super(AggregationMixin, self).optimizer_step  # type: ignore[misc]
            done = torch.zeros(())  # the closure's "loss": not None, so a GradScaler does not skip the step
            for opt in self.optimizers:
                step_fn(opt, lambda: done, None)
                opt.zero_grad()
        super().on_train_end()


def _step_arguments(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, int, tuple]:
    """``(batch, batch_idx, the remaining positional arguments)`` of a ``training_step`` call."""
    batch = args[0] if args else kwargs.get("batch")
    batch_idx = int(args[1]) if len(args) > 1 else int(kwargs.get("batch_idx", 0))
    return batch, batch_idx, tuple(args[2:])
