"""The per-step aggregation engine: one :class:`Aggregator` per mode, driven by thin framework adapters.

An aggregator decides how the ranks' work of one step becomes one update; it never calls a training
framework or ``torch.distributed`` itself. It exchanges through an injected
:class:`~hetero_plugins.collectives.Collectives` and learns about the step from a :class:`StepContext` the
adapter builds (the step's planned per-rank counts, whether it is the epoch's last, the planner's
predictions, how to load another rank's samples). The adapters only translate:

- Lightning (``hetero_plugins.strategies``): ``training_step`` runs :meth:`Aggregator.micro_batches` and
  back-propagates each one through the strategy; ``optimizer_step`` runs the closure, then
  :meth:`Aggregator.exchange`, the optimizer step and :meth:`Aggregator.after_step`.
- Horovod scripts (``hetero_plugins.horovod.AggregatingOptimizer``): ``optimizer.micro_batches(batch)`` hands
  the micro-batches to the user's loop, and ``optimizer.step()`` runs the same exchange / step / after-step.

The shape follows PyTorch's ``ddp_comm_hooks`` (one algorithm per module and a registry of them) and its
post-local-SGD optimizer, a thin wrapper around an injected averager (Lin et al. 2018).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from hetero_plugins.aggregation.grad_sync import layout_fingerprint, sync_sample_weighted, trainable
from hetero_plugins.aggregation.microbatch import MicroBatch, batch_length
from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.collectives import Collectives, ReduceHandle

log = logging.getLogger(__name__)

__all__ = ["AggregationStats", "Aggregator", "SampleWeightedAggregator", "StepContext", "StepPredictor"]


class StepPredictor(Protocol):
    """What the engine asks of the plan's time models (``BalancePlanner`` provides both)."""

    def predict_step_time(self, plan: Sequence[int]) -> float:
        """Predicted seconds of one step with per-rank batches ``plan`` (nan when unknown)."""
        ...

    def rates(self, plan: Sequence[int]) -> list[float | None]:
        """Each rank's predicted samples per second at its batch in ``plan`` (``None``: unknown)."""
        ...


@dataclass(frozen=True)
class StepContext:
    """One step as the adapter sees it; the same on every rank except ``rank``.

    Attributes:
        step: the step's index in the epoch (or in the segment of an elastic epoch being resumed).
        counts: every rank's planned samples in the step.
        rank: this rank.
        last: whether it is the last step the training loop runs in this epoch. The one source is the epoch's
            layout (its number of steps); the Lightning adapter ends it earlier where ``limit_train_batches``
            stops the loop. ``deadline`` sets no deadline there (the carry is worked off) and ``local_sgd``
            averages there, so every epoch ends on one model.
        planner: the plan's time models (``deadline``: the predicted step time; ``wbsp``: the ranks' rates).
        indices_of: ``indices_of(owner)``: the dataset indices of ``owner``'s share of the step (``wbsp``).
        load: ``load(indices)``: those samples collated and on the training device (``wbsp``).
        grad_scale: the factor the step's gradients carry (a ``GradScaler``'s loss scale under fp16 mixed
            precision; 1.0 otherwise), the same on every rank. ``pseudo_sync`` exchanges true gradients and hands
            the optimizer each one scaled by the scale of the step that applies it, so the precision plugin's
            unscale matches.
    """

    step: int
    counts: tuple[int, ...]
    rank: int
    last: bool = False
    planner: StepPredictor | None = None
    indices_of: Callable[[int], Sequence[int]] | None = None
    load: Callable[[Sequence[int]], Any] | None = None
    grad_scale: float = 1.0

    @property
    def planned(self) -> int:
        """B, the step's planned global batch."""
        return sum(self.counts)

    @property
    def weight(self) -> float:
        """This rank's share b_i / B of the step's planned samples.

        Example::

            >>> StepContext(step=0, counts=(3, 5), rank=1).weight
            0.625
        """
        return self.counts[self.rank] / self.planned if self.planned else 0.0


@dataclass
class AggregationStats:
    """What an aggregator did so far on this rank.

    Attributes:
        bytes: bytes this rank put into the exchanges (each collective's whole buffer, as sent).
        rounds: number of those exchanges.
        carried: samples that missed a deadline (``deadline``; each was processed later).
        stolen: samples this rank processed from other ranks' shares (``wbsp``).
    """

    bytes: int = 0
    rounds: int = 0
    carried: int = 0
    stolen: int = 0


class Aggregator(ABC):
    """How the ranks' work of one step becomes one update, for one aggregation mode.

    Per step the adapter calls :meth:`micro_batches` (the micro-batched modes; the others back-propagate the
    batch whole), then, once every backward pass of the step is done, :meth:`exchange`; when it returns
    ``True`` the adapter steps the optimizer, and in every case it calls :meth:`after_step`. After the last
    step it calls :meth:`flush` and steps the optimizer once more if it returns ``True``.

    Args:
        options: the mode and its options; ``options.mode`` must be this class's :attr:`mode`.
        comm: the transport (Lightning's process group, Horovod, ...).
        params: the parameters the optimizer updates (those with ``requires_grad`` take part, in this order,
            which must be the same on every rank). Once :meth:`setup` has the optimizers, the parameters are
            those of their parameter groups, and :attr:`params` is read again at every access: with
            :attr:`follow_optimizer` a parameter unfrozen (``requires_grad_(True)``, a parameter group added) or
            frozen later takes part from then on; without it such a change raises a ``ValueError`` naming the fix.
        buffers: other tensors the mode keeps equal across ranks (``local_sgd`` averages the floating ones,
            e.g. BatchNorm statistics); ignored by the other modes.

    Attributes:
        stats: an :class:`AggregationStats`.
        last_counts: every rank's processed samples in the last exchange that shares them (``deadline``,
            ``wbsp``), else ``None``.
        backlogs: every rank's carried samples after the last ``deadline`` exchange, else ``None``.
        follow_optimizer: whether :attr:`params` follows later changes of the trainable parameters (set by an
            adapter whose micro-batch weighting covers any parameter, as the Lightning strategies' loss
            scaling does; ``False``: a change raises).
    """

    #: The ``aggregation=`` value this class implements.
    mode: ClassVar[str]
    #: Whether a step runs as micro-batches handed out by :meth:`micro_batches`.
    micro_batched: ClassVar[bool] = False

    def __init__(
        self,
        options: AggregationOptions,
        comm: Collectives,
        params: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor] = (),
    ) -> None:
        if not isinstance(options, AggregationOptions) or options.mode != self.mode:
            raise ValueError(
                f"{type(self).__name__} implements aggregation={self.mode!r}, got options {options!r}. "
                "HINT: build aggregators with hetero_plugins.aggregation.make_aggregator(options, comm, params)."
            )
        self.options = options
        self.comm = comm
        self.follow_optimizer = False
        self._given = list(params)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._params, self.layout = self._trainable()
        self._param_ids = [id(p) for p in self._params]
        self.stats = AggregationStats()
        self.last_counts: list[int] | None = None
        self.backlogs: list[int] | None = None
        self._init_state(buffers)

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        """The mode's own state, set once the common state is: what a mode overrides instead of ``__init__``
        (calling ``super()._init_state(buffers)`` first). ``buffers``: as given to the constructor."""

    def setup(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Check the run against the mode once the optimizers exist. Collective: every rank calls it (``wbsp``
        opens its claim store here). From now on the parameters are the optimizers' (see :attr:`params`)."""
        if self.options.explicit_sync and len(optimizers) != 1:
            raise ValueError(
                f"aggregation={self.mode!r} supports one optimizer, got {len(optimizers)}. HINT: use one optimizer "
                "over all parameters (with parameter groups), or aggregation='weighted'."
            )
        self._optimizers = [o for o in optimizers if isinstance(o, torch.optim.Optimizer)]
        self._params, self.layout = self._trainable()
        self._param_ids = [id(p) for p in self._params]

    # ------------------------------------------------------------------ the parameters that take part
    def candidates(self) -> list[torch.Tensor]:
        """Every parameter the optimizer may update, trainable or not: its parameter groups' once :meth:`setup`
        has it, else those given to the constructor (the same order on every rank)."""
        if self._optimizers:
            return [p for o in self._optimizers for g in o.param_groups for p in g["params"]]
        return self._given

    def _trainable(self) -> tuple[list[torch.Tensor], int]:
        """The trainable :meth:`candidates` and their layout fingerprint (shapes, dtypes and positions)."""
        candidates = self.candidates()
        params = trainable(candidates)
        index = {id(p): i for i, p in reversed(list(enumerate(candidates)))}
        return params, layout_fingerprint(params, [index[id(p)] for p in params])

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters that take part now: the trainable ones (``requires_grad``) among :meth:`candidates`,
        without duplicates, in their order; read again at each access (see the class doc)."""
        current = trainable(self.candidates())
        if [id(p) for p in current] != self._param_ids:
            if not self.follow_optimizer:
                raise ValueError(
                    f"aggregation={self.mode!r}: the trainable parameters changed after the aggregator was set up "
                    f"({len(self._param_ids)} then, {len(current)} now: `requires_grad` was changed or a parameter "
                    "group added), and this optimizer weights the gradients of the parameters it started with only. "
                    "HINT: build the optimizer again after freezing / unfreezing (e.g. hetero_plugins.horovod."
                    "DistributedOptimizer(...) over the new parameters), or keep every parameter the run will train "
                    "trainable from the start and freeze it with a learning rate of 0 instead."
                )
            old = len(self._param_ids)
            self._params, self.layout = self._trainable()
            self._param_ids = [id(p) for p in self._params]
            log.info("aggregation=%r: the trainable parameters changed (%d -> %d tensors); exchanging the new set",
                     self.mode, old, len(self._params))
            self._params_changed()
        return self._params

    def _params_changed(self) -> None:
        """Called when :attr:`params` adopts a new set of trainable parameters (``pseudo_sync`` resets its
        corrector's history)."""

    def micro_batches(self, batch: Any, ctx: StepContext) -> Iterator[MicroBatch]:
        """The pieces of ``batch`` (this rank's batch of step ``ctx.step``) to back-propagate one after the
        other, each with the :attr:`~MicroBatch.weight` its gradient gets during the backward pass; here the
        batch whole, unweighted (the modes that weight by b_i / B do so in their exchange)."""
        yield MicroBatch(batch, samples=ctx.counts[ctx.rank], owner=ctx.rank, step=ctx.step)

    @abstractmethod
    def exchange(self, ctx: StepContext) -> bool:
        """Combine the ranks' gradients of step ``ctx.step`` (in ``p.grad``) before the optimizer steps.

        Returns ``False`` when the optimizer must not step (``pseudo_sync``'s first step, which has no reduced
        gradient yet). Collective.
        """

    def after_step(self, ctx: StepContext) -> None:
        """After the optimizer step of ``ctx.step`` (``local_sgd``: the periodic model average). Collective."""

    def flush(self, grad_scale: float = 1.0) -> bool:
        """After the last step: ``True`` when gradients were set that the optimizer must still apply
        (``pseudo_sync``'s last reduced gradient, multiplied by ``grad_scale``, the loss scale the precision
        plugin will unscale by). ``local_sgd`` averages the models here if steps were taken since the last
        average (a fit stopped mid-window). Collective: every rank calls it."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this mode where it stopped (``pseudo_sync``: the reduced
        gradient in flight and the corrector's history); ``{}`` for a mode with nothing in flight. Collective
        where something is in flight: every rank calls it."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (call after :meth:`setup`)."""

    def checkpoint_losses(self) -> str | None:
        """What a checkpoint taken now cannot hold (``deadline``: samples carried on the ranks), for a warning;
        ``None`` when nothing is lost."""
        return None

    def end_epoch(self) -> None:
        """Drop per-epoch state left by an epoch the loop cut short. Neither a Lightning strategy nor a
        ``horovodrun`` loop has a dependable epoch-end hook, so the engine calls it itself when a step 0
        begins; calling it at an epoch's end as well does no harm."""

    # ------------------------------------------------------------------ the transport, counted once here
    def _allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        self._count(tensor)
        return self.comm.allreduce_sum(tensor, name)

    def _allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        self._count(tensor)
        return self.comm.allreduce_sum_async(tensor, name)

    def _count(self, tensor: torch.Tensor) -> None:
        self.stats.bytes += tensor.numel() * tensor.element_size()
        self.stats.rounds += 1


class SampleWeightedAggregator(Aggregator):
    """The micro-batched modes (``deadline``, ``wbsp``): a rank may process more or fewer samples than
    planned, and the exchange re-weights by the samples actually processed.

    During :meth:`micro_batches` each micro-batch's gradient is weighted by n_j / B, so ``p.grad`` holds this
    rank's sum of per-sample gradients over B; :meth:`exchange` sums the ranks' gradients together with the
    processed counts (and backlogs) in one all-reduce and rescales by B / N, so the update is the mean
    gradient over exactly the samples the step processed (SA-ATP, Li et al. 2024).
    """

    micro_batched = True

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        super()._init_state(buffers)
        #: Samples this rank processed in the step in progress.
        self.step_samples = 0

    def _begin(self, batch: Any, ctx: StepContext) -> None:
        n = batch_length(batch)
        if n != ctx.counts[ctx.rank]:
            raise ValueError(
                f"micro_batches() got a batch of {n} samples, but this rank's batch of step {ctx.step} has "
                f"{ctx.counts[ctx.rank]} (aggregation={self.mode!r}). HINT: pass the batch the balanced sampler's "
                "loader yields, unchanged, once per step."
            )
        self.step_samples = 0

    def _exchange_allreduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The exchange's one all-reduce of the flat gradients and counts (a mode may ride more slots on it)."""
        return self._allreduce_sum(flat, f"hetero_plugins.aggregation.{self.mode}")

    def _backlog(self) -> int:
        """Samples this rank carries into later steps (shared with every rank through the exchange)."""
        return 0

    def exchange(self, ctx: StepContext) -> bool:
        params = self.params
        counts, backlogs = sync_sample_weighted(
            params, self.step_samples, ctx.planned, ctx.rank, len(ctx.counts), self._exchange_allreduce,
            backlog=self._backlog(), layout=self.layout, mode=self.mode,
        )
        self.last_counts, self.backlogs = counts, backlogs
        if sum(counts) != ctx.planned and ctx.rank == 0:
            log.debug("%s step %d: %d of %d planned samples processed; backlog %s", self.mode, ctx.step,
                      sum(counts), ctx.planned, backlogs)
        return True

