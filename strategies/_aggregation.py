"""``aggregation=`` for the balanced strategies: how each step's work becomes one update.

The modes are described in :mod:`hetero_plugins.aggregation`. ``"weighted"`` is the framework's own path
(DDP comm hook or Horovod's optimizer with weighted gradients). Every other mode exchanges gradients
itself, once per optimizer step, through two transport methods the strategy provides
(``_allreduce_sum`` and ``_allreduce_sum_async``); the model's forward then bypasses the DDP wrapper
during training, so no DDP reducer or buffer broadcast runs a collective that ranks could reach a
different number of times.

``deadline`` and ``wbsp`` run a step as micro-batches inside ``training_step``: each micro-batch calls the
LightningModule's ``training_step`` and back-propagates through the strategy (so callbacks'
``on_before_backward`` / ``on_after_backward`` and precision plugins see every micro-batch); the loss is
scaled by n_j / B so the accumulated gradient is the sum of per-sample gradients over B. Lightning zeroes
gradients between ``training_step`` and backward, so the accumulated gradients are kept aside and restored
inside the optimizer closure, where the exchange re-weights them by the samples actually processed.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning.pytorch.utilities import rank_zero_warn

from hetero_plugins.aggregation.options import AggregationOptions, resolve_aggregation
from hetero_plugins.aggregation.grad_sync import flat_gradients, set_flat_gradients, sync_sample_weighted, trainable
from hetero_plugins.aggregation.microbatch import (
    CarryQueue,
    ClaimKeys,
    DeadlineRule,
    StepClaims,
    micro_batch_sizes,
    open_claim_store,
    unit_indices,
)
from hetero_plugins.aggregation.work_sharing import deadline_micro_batches, wbsp_micro_batches

log = logging.getLogger(__name__)

__all__ = ["AggregationMixin"]


class _StepWeight:
    """Receives the balancer's b_i / B for the step in progress (instead of a DDP hook or Horovod hooks)."""

    def __init__(self) -> None:
        self.weight = 1.0

    def set_weight(self, weight: float) -> None:
        self.weight = float(weight)


class AggregationMixin:
    """Adds the ``aggregation=`` modes to a balanced strategy (``HeteroDDPStrategy``, ``HeteroHorovodStrategy``).

    Attributes:
        aggregation: the :class:`~hetero_plugins.aggregation.AggregationOptions` in force.
        communication_bytes: bytes this rank sent into gradient / model exchanges during training (all modes).
        communication_rounds: number of exchanges by the explicit-exchange modes.
        micro_batch_samples: samples of the micro-batch being back-propagated (``None`` outside
            micro-batched steps; ``HeterogeneityEmulator`` reads it).
        carried_samples: samples that missed a deadline so far (``deadline`` mode; all were processed later).
        stolen_samples: samples this rank processed from other ranks' shares (``wbsp`` mode).
    """

    balancer: Any
    aggregation: AggregationOptions

    def _init_aggregation(self, aggregation: str | AggregationOptions | None) -> None:
        self.aggregation = resolve_aggregation(aggregation)
        mode = self.aggregation
        if mode.micro_batched and self.balancer.locality:
            raise ValueError(
                f"aggregation={mode.mode!r} moves samples between steps and ranks, which `locality=True` forbids "
                "(each rank keeps its shard). HINT: use locality=False, or aggregation='weighted'."
            )
        self._comm_bytes = 0
        self.communication_rounds = 0
        self.micro_batch_samples: int | None = None
        self.carried_samples = 0
        self.stolen_samples = 0
        self._carry = CarryQueue()
        self._stash: Tensor | None = None
        self._step_samples = 0
        self._step_global = 0
        self._backlogs: list[int] | None = None
        self._store: Any = None
        self._claim_keys = ClaimKeys(keep=4)
        self._params: list[Tensor] | None = None
        self._weight = _StepWeight()
        self._corrector: Any = None
        self._delayed: Any = None
        self._local: Any = None
        self._skip_first = False
        self._batch_idx = 0
        if mode.explicit_sync:
            self.balancer.attach_weighting(self._weight)
        if mode.mode == "deadline":
            self.balancer.backlog_fn = self._backlog_per_step

    @property
    def communication_bytes(self) -> int:
        hook = getattr(self.balancer, "_hook_state", None)
        return self._comm_bytes + (int(hook.bytes) if hook is not None else 0)

    # ------------------------------------------------------------------ transport (the strategy implements)
    def _allreduce_sum(self, tensor: Tensor) -> Tensor:
        raise NotImplementedError

    def _allreduce_sum_async(self, tensor: Tensor) -> Any:
        """Start summing ``tensor`` over ranks; return an object whose ``wait()`` returns the sum."""
        raise NotImplementedError

    def _store_host(self) -> str:
        return socket.gethostname()

    # ------------------------------------------------------------------ set-up
    def _setup_aggregation(self, trainer: Any) -> None:
        """Check the run against the mode and prepare its state (after the optimizers exist)."""
        mode = self.aggregation
        if not mode.explicit_sync:
            return
        module = self.lightning_module  # type: ignore[attr-defined]
        if not module.automatic_optimization:
            raise ValueError(
                f"aggregation={mode.mode!r} needs automatic optimization; this LightningModule sets "
                "automatic_optimization=False. HINT: use aggregation='weighted' with manual optimization."
            )
        if int(trainer.accumulate_grad_batches) != 1:
            raise ValueError(
                f"aggregation={mode.mode!r} does not combine with accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}. HINT: raise the DataLoader's batch_size instead, or use "
                "aggregation='weighted'."
            )
        if len(self.optimizers) != 1:  # type: ignore[attr-defined]
            raise ValueError(
                f"aggregation={mode.mode!r} supports one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}. HINT: use aggregation='weighted'."  # type: ignore[attr-defined]
            )
        self._params = trainable(list(module.parameters()))
        if mode.mode == "pseudo_sync":
            from hetero_plugins.aggregation.pseudo_sync import DelayedExchange, PseudoSyncCorrector

            self._corrector = PseudoSyncCorrector(smoothing=mode.smoothing, min_confidence=mode.min_confidence)  # type: ignore[arg-type]
            momentum = max(float(g.get("momentum", 0.0) or 0.0) for g in self.optimizers[0].param_groups)  # type: ignore[attr-defined]
            if momentum > 0.5:
                # Heavy-ball SGD on a quadratic of curvature h is stable for lr*h < 2(1 + momentum); with the
                # gradient one step late the bound drops to lr*h < 1 - momentum (0.1 at momentum 0.9).
                rank_zero_warn(
                    f"aggregation='pseudo_sync' applies each gradient one step late, and with SGD momentum "
                    f"{momentum} that is stable only for learning rates about {2 * (1 + momentum) / (1 - momentum):.0f}x "
                    "smaller than without the delay (the digits CNN at lr 0.1, momentum 0.9 diverges). HINT: use "
                    "momentum <= 0.5 or a smaller learning rate with pseudo_sync.",
                    category=RuntimeWarning,
                )
            self._delayed = DelayedExchange(self._allreduce_sum_async)
            self._skip_first = True
        elif mode.mode == "local_sgd":
            from hetero_plugins.aggregation.local_sgd import LocalSGDSchedule

            self._local = LocalSGDSchedule(local_steps=mode.local_steps)  # type: ignore[arg-type]

    def _start_claim_store(self) -> None:
        """``wbsp``: one TCP key-value store for the claim counters, served by rank 0 (collective)."""
        if self._store is None:
            self._store = open_claim_store(
                self.global_rank, self._store_host(), lambda obj: self.broadcast(obj, src=0),  # type: ignore[attr-defined]
                float(self.aggregation.claim_timeout),  # type: ignore[arg-type]
            )

    # ------------------------------------------------------------------ training step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.aggregation.explicit_sync:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        return self._aggregated_training_step(args, kwargs)

    def on_train_end(self) -> None:
        self._flush_pseudo_sync()
        super().on_train_end()  # type: ignore[misc]

    def _aggregated_training_step(self, args: tuple, kwargs: dict) -> Any:
        """The training step of an explicit-exchange mode (the caller handles ``"weighted"``)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        self._batch_idx = int(args[1]) if len(args) > 1 else int(kwargs.get("batch_idx", 0))
        if self._batch_idx == 0:
            self._reset_epoch_state()
        if not self.aggregation.micro_batched:
            with self.precision_plugin.train_step_context():  # type: ignore[attr-defined]
                return module.training_step(*args, **kwargs)
        return self._micro_batched_step(*args, **kwargs)

    def _micro_batched_step(self, batch: Any, batch_idx: int, *extra: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        own = self.balancer._own_batch_sampler(trainer)
        if own is None:
            raise RuntimeError(
                f"aggregation={self.aggregation.mode!r} needs the strategy's balanced train sampler, but the train "
                "loader has another batch sampler. HINT: let Lightning inject its DistributedSampler "
                "(use_distributed_sampler=True, the default) and pass a plain DataLoader(batch_size=...)."
            )
        assert self._params is not None
        rank = self.global_rank  # type: ignore[attr-defined]
        counts = own.step_counts(batch_idx)
        planned = sum(counts)
        parts = int(self.aggregation.micro_batches)  # type: ignore[arg-type]
        sizes = micro_batch_sizes(counts[rank], parts)
        for p in self._params:
            p.grad = None  # Lightning zeroes gradients only after training_step
        results: list[tuple[Any, float, int]] = []

        def run(data: Any, samples: int) -> None:
            results.append(self._run_micro_batch(data, samples, planned, batch_idx, extra, kwargs))

        if self.aggregation.mode == "deadline":
            last = batch_idx + 1 >= trainer.num_training_batches or bool(trainer.is_last_batch)
            predicted = self.balancer.planner.predict_step_time(counts) if self.balancer.planner else math.nan
            rule = DeadlineRule(math.inf if last else self.aggregation.deadline(predicted))
            before, from_carry = self._carry.samples, 0
            for mb in deadline_micro_batches(batch, sizes, rule, self._carry, rank, batch_idx):
                run(mb.data, mb.samples)
                from_carry += mb.samples if mb.step != batch_idx else 0
            self.carried_samples += self._carry.samples - (before - from_carry)  # newly carried this step
        else:  # wbsp
            self._start_claim_store()
            prefix = f"hp/{trainer.current_epoch}/{batch_idx}"
            claims = StepClaims(self._store, prefix, [len(micro_batch_sizes(c, parts)) for c in counts])

            def load(owner: int, index: int) -> tuple[Any, int]:
                return self._load_micro_batch(own, batch_idx, owner, index, parts, trainer)

            rates = self.balancer.planner.rates(counts) if self.balancer.planner is not None else None
            for mb in wbsp_micro_batches(batch, counts, parts, rank, claims, load, rates):
                run(mb.data, mb.samples)
                if mb.owner != rank:
                    self.stolen_samples += mb.samples
            self._claim_keys.forget(self._store, claims.keys(rank))
        done = sum(n for _, _, n in results)
        self._step_samples, self._step_global = done, planned
        self.balancer.timer.set_samples(done)
        self.balancer.timer.mark_gradients_ready()
        self._stash = flat_gradients(self._params)
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
        self, data: Any, samples: int, planned: int, batch_idx: int, rest: tuple, kwargs: dict
    ) -> tuple[Any, float, int]:
        module = self.lightning_module  # type: ignore[attr-defined]
        self.micro_batch_samples = samples
        with self.precision_plugin.train_step_context():  # type: ignore[attr-defined]
            out = module.training_step(data, batch_idx, *rest, **kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise RuntimeError(
                f"aggregation={self.aggregation.mode!r} needs training_step to return the loss (a tensor or a dict "
                f"with 'loss'); it returned {type(out).__name__}. HINT: skipping a batch by returning None is not "
                "supported in micro-batched modes."
            )
        self.backward(loss * (samples / planned), None)  # type: ignore[attr-defined]
        return out, float(loss.detach()), samples

    def _load_micro_batch(self, own: Any, step: int, owner: int, index: int, parts: int, trainer: Any) -> tuple[Any, int]:
        """Another rank's micro-batch, loaded from the dataset with the train loader's collate function."""
        chosen = unit_indices(own.batch_indices(step, owner), parts, index)
        loader = trainer.train_dataloader
        data = loader.collate_fn([loader.dataset[i] for i in chosen])
        return self.batch_to_device(data), len(chosen)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ the exchange
    def _aggregated_optimizer_step(self, optimizer: Any, closure: Any, model: Any, kwargs: dict, step_fn: Any) -> Any:
        """``step_fn(optimizer, closure, model, **kwargs)`` is the strategy's own optimizer step."""
        mode = self.aggregation.mode
        if mode == "pseudo_sync" and self._skip_first:
            closure()  # the very first step only launches its exchange: there is no earlier gradient to apply
            self._delayed.exchange(self._weighted_flat())
            self._count(self._params)
            self._skip_first = False
            return None

        def exchanged() -> Any:
            result = closure()
            self._exchange()
            return result

        out = step_fn(optimizer, exchanged if mode != "local_sgd" else closure, model, **kwargs)
        if mode == "local_sgd":
            self._after_local_step()
        return out

    def _weighted_flat(self) -> Tensor:
        assert self._params is not None
        return flat_gradients(self._params) * self._weight.weight

    def _count(self, tensors: Any, extra_bytes: int = 0) -> None:
        self._comm_bytes += sum(t.numel() * t.element_size() for t in tensors) + extra_bytes
        self.communication_rounds += 1

    def _exchange(self) -> None:
        mode = self.aggregation.mode
        params = self._params
        assert params is not None
        if mode in ("deadline", "wbsp"):
            if self._stash is not None:
                set_flat_gradients(params, self._stash)
                self._stash = None
            world = self.world_size  # type: ignore[attr-defined]
            counts, backlogs = sync_sample_weighted(
                params, self._step_samples, self._step_global, self.global_rank, world,  # type: ignore[attr-defined]
                self._allreduce_sum, backlog=self._carry.samples,
            )
            self._count(params, extra_bytes=16 * world)
            self._backlogs = backlogs
            if sum(counts) != self._step_global and self.global_rank == 0:  # type: ignore[attr-defined]
                log.debug("deadline step: %d of %d planned samples processed; backlog %s", sum(counts),
                          self._step_global, backlogs)
        elif mode == "pseudo_sync":
            previous = self._delayed.exchange(self._weighted_flat())
            self._count(params)
            set_flat_gradients(params, self._corrector.combine(previous))

    def _after_local_step(self) -> None:
        from hetero_plugins.aggregation.local_sgd import weighted_average_

        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        samples = int(round(self._weight.weight * self._planned_global(trainer)))
        due = self._local.step_done(samples)
        last = trainer.is_last_batch or self._batch_idx + 1 >= trainer.num_training_batches
        if due or last:
            tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
            info = weighted_average_(tensors, self._local.samples_since_average, self._allreduce_sum)
            self._comm_bytes += int(info["bytes"])
            self.communication_rounds += 1
            self._local.averaged()

    def _planned_global(self, trainer: Any) -> int:
        planner = self.balancer.planner
        return int(planner.global_batch) if planner is not None else 1

    def _flush_pseudo_sync(self) -> None:
        """At the end of training: apply the last step's gradient, still in flight."""
        if self.aggregation.mode != "pseudo_sync" or self._delayed is None or self._params is None:
            return
        last = self._delayed.flush()
        if last is None:
            return
        set_flat_gradients(self._params, self._corrector.combine(last))
        for opt in self.optimizers:  # type: ignore[attr-defined]
            opt.step()
            opt.zero_grad()

    def _backlog_per_step(self, steps_left: int) -> list[int] | None:
        """``deadline``: every rank's carried samples (the same on every rank: they travel with the gradients),
        to be worked off over the next four steps, or the steps left in the epoch if fewer."""
        if self._backlogs is None:
            return None
        spread = max(1, min(4, int(steps_left)))
        return [math.ceil(c / spread) for c in self._backlogs]

    def _reset_epoch_state(self) -> None:
        if self._carry.samples:
            log.warning("aggregation='deadline': %d carried samples dropped at an epoch's end (the epoch was cut "
                        "short, e.g. by limit_train_batches)", self._carry.clear())
        self._backlogs = None
