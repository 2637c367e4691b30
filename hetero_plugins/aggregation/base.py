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

from hetero_plugins.aggregation.grad_sync import sync_sample_weighted, trainable
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
    """

    step: int
    counts: tuple[int, ...]
    rank: int
    last: bool = False
    planner: StepPredictor | None = None
    indices_of: Callable[[int], Sequence[int]] | None = None
    load: Callable[[Sequence[int]], Any] | None = None

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
            which must be the same on every rank).
        buffers: other tensors the mode keeps equal across ranks (``local_sgd`` averages the floating ones,
            e.g. BatchNorm statistics); ignored by the other modes.

    Attributes:
        stats: an :class:`AggregationStats`.
        last_counts: every rank's processed samples in the last exchange that shares them (``deadline``,
            ``wbsp``), else ``None``.
        backlogs: every rank's carried samples after the last ``deadline`` exchange, else ``None``.
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
        self.params = trainable(list(params))
        self.stats = AggregationStats()
        self.last_counts: list[int] | None = None
        self.backlogs: list[int] | None = None
        self._init_state(buffers)

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        """The mode's own state, set once the common state is: what a mode overrides instead of ``__init__``
        (calling ``super()._init_state(buffers)`` first). ``buffers``: as given to the constructor."""

    def setup(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Check the run against the mode once the optimizers exist. Collective: every rank calls it (``wbsp``
        opens its claim store here)."""
        if self.options.explicit_sync and len(optimizers) != 1:
            raise ValueError(
                f"aggregation={self.mode!r} supports one optimizer, got {len(optimizers)}. HINT: use one optimizer "
                "over all parameters (with parameter groups), or aggregation='weighted'."
            )

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

    def flush(self) -> bool:
        """After the last step: ``True`` when gradients were set that the optimizer must still apply
        (``pseudo_sync``'s last reduced gradient). Collective."""
        return False

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
        counts, backlogs = sync_sample_weighted(
            self.params, self.step_samples, ctx.planned, ctx.rank, len(ctx.counts), self._exchange_allreduce,
            backlog=self._backlog(),
        )
        self.last_counts, self.backlogs = counts, backlogs
        if sum(counts) != ctx.planned and ctx.rank == 0:
            log.debug("%s step %d: %d of %d planned samples processed; backlog %s", self.mode, ctx.step,
                      sum(counts), ctx.planned, backlogs)
        return True

