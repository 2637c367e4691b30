"""``HeteroHorovodStrategy``: Lightning under ``horovodrun`` with per-rank batch sizes rebalanced every epoch.

Registered as ``"hetero_horovod"``; the processes are started by Horovod, one per device::

    # horovodrun -np 2 -H localhost:2 --gloo python train.py
    Trainer(strategy="hetero_horovod", accelerator="cpu", devices=1, max_epochs=10)

It bundles the same :class:`~hetero_plugins.callbacks.BatchBalancer` as
:class:`~hetero_plugins.strategies.HeteroDDPStrategy`: the same plans, telemetry, ``hetero/*`` metrics,
checkpointed planner state, and ``batch_plan`` / ``plan_history``. Only the transport differs: the
epoch-end exchange runs on ``hvd.allgather`` / ``hvd.broadcast_object`` (through this strategy's
``all_gather`` / ``broadcast``), and gradients go through ``hvd.DistributedOptimizer(op=hvd.Sum)`` after
tensor hooks scale each rank's gradient by its share b_i / B of the step (LBB, Yao et al. 2024; the stock
``op=hvd.Average`` would be wrong for unequal batches). The hooks also time-stamp the moment this rank's
gradients are ready, before the all-reduce waits for the others.

The user's ``DataLoader(batch_size=b)`` means b per rank at the start; the global batch b x world size stays
constant, so, unlike Lightning 1.x's ``HorovodStrategy``, the learning rate is not scaled by the world size.
Gradient accumulation (``accumulate_grad_batches=k``) maps to ``backward_passes_per_step=k``; a
``GradientAccumulationScheduler`` (changing k) is rejected.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.balancing.options import BalancingOptions
from hetero_plugins.callbacks.batch_balancer import BatchBalancer
from hetero_plugins.strategies._aggregation import AggregationMixin
from hetero_plugins.strategies._balanced import BalancedStrategyMixin, check_strategy_keywords
from hetero_plugins.horovod.runtime import horovod_torch as _hvd
from hetero_plugins.horovod.exchange import HorovodExchange
from hetero_plugins.horovod.gradient_sync import wait_for_gradients
from hetero_plugins.horovod.weighting import GradientWeighting

__all__ = ["HeteroHorovodStrategy", "HorovodEnvironment"]


def _hvd_initialized() -> bool:
    try:
        hvd = _hvd()
        return bool(hvd.is_initialized())
    except (ImportError, ValueError):
        return False


class HorovodEnvironment(ClusterEnvironment):
    """Ranks and sizes of a job that ``horovodrun`` (or ``mpirun``) started; Horovod's once initialised.

    Before ``hvd.init()`` it reads the ``HOROVOD_RANK`` / ``HOROVOD_SIZE`` / ``HOROVOD_LOCAL_RANK`` /
    ``HOROVOD_CROSS_RANK`` variables that ``horovodrun`` sets (there is no ``LOCAL_RANK`` there).

    Example::

        >>> HorovodEnvironment().creates_processes_externally
        True
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return "HOROVOD_RANK" in os.environ or _hvd_initialized()

    def _get(self, fn: str, var: str) -> int:
        if _hvd_initialized():
            return int(getattr(_hvd(), fn)())
        return int(os.environ.get(var, 1 if fn.endswith("size") else 0))

    def world_size(self) -> int:
        return self._get("size", "HOROVOD_SIZE")

    def set_world_size(self, size: int) -> None:
        """Ignored: Horovod owns the world size."""

    def global_rank(self) -> int:
        return self._get("rank", "HOROVOD_RANK")

    def set_global_rank(self, rank: int) -> None:
        """Ignored: Horovod owns the ranks."""

    def local_rank(self) -> int:
        return self._get("local_rank", "HOROVOD_LOCAL_RANK")

    def node_rank(self) -> int:
        return self._get("cross_rank", "HOROVOD_CROSS_RANK")


class HeteroHorovodStrategy(AggregationMixin, BalancedStrategyMixin, ParallelStrategy):
    """Horovod data parallelism plus per-epoch batch rebalancing and sample-weighted gradient sums.

    Args:
        balancing: the balancing options, see :class:`~hetero_plugins.balancing.options.BalancingOptions`
            (all of them apply but ``hosts_file``); they may also be given as keywords (``allocator="lbb"``,
            ``policy="auto"``, ``min_batch_size=8``, ``memory_headroom=0.8``, ``log_metrics=False``, ...).
        aggregation: ``"weighted"`` (default), ``"deadline"``, ``"wbsp"``, ``"pseudo_sync"``, ``"local_sgd"`` or an
            :class:`~hetero_plugins.aggregation.AggregationOptions` (see :mod:`hetero_plugins.aggregation`); the
            modes other than ``"weighted"`` exchange through ``hvd.allreduce`` themselves instead of wrapping the
            optimizer in ``hvd.DistributedOptimizer``.
        **kwargs: the balancing keywords above; the rest goes to
            :class:`~lightning.pytorch.strategies.ParallelStrategy` (``accelerator``, ``checkpoint_io``,
            ``precision_plugin``).

    Attributes:
        balancer: the bundled :class:`~hetero_plugins.callbacks.BatchBalancer`.
        batch_plan: current per-rank batch sizes, global-rank order (``None`` before training starts).
        plan_history: one dict per epoch (see :class:`~hetero_plugins.callbacks.BatchBalancer`).

    Example::

        # horovodrun -np 2 -H localhost:2 --gloo python train.py
        trainer = Trainer(strategy=HeteroHorovodStrategy(allocator="lbb"), accelerator="cpu", devices=1)
    """

    strategy_name = "hetero_horovod"
    #: Lightning injects a DistributedSampler (which the balancer replaces) only for distributed strategies.
    is_distributed = True

    def __init__(
        self,
        balancing: BalancingOptions | None = None,
        aggregation: str | AggregationOptions | None = None,
        **kwargs: Any,
    ) -> None:
        check_strategy_keywords("HeteroHorovodStrategy", kwargs, HeteroHorovodStrategy.__init__,
                                ParallelStrategy.__init__)
        options = BalancingOptions.from_kwargs(balancing, kwargs)
        if "cluster_environment" in kwargs or "parallel_devices" in kwargs:
            raise ValueError(
                "`cluster_environment` and `parallel_devices` come from Horovod in HeteroHorovodStrategy. "
                "HINT: drop them; start the job with `horovodrun -np N --gloo python train.py`."
            )
        super().__init__(cluster_environment=HorovodEnvironment(), **kwargs)
        self.balancer = BatchBalancer(options)
        self._auto_sync = False
        self._weightings: list[GradientWeighting] = []
        self._init_aggregation(aggregation)

    # ------------------------------------------------------------------ ranks and devices
    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or []
        if devices and devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        hvd = _hvd()
        if not hvd.is_initialized():
            hvd.init()
        rank_zero_only.rank = self.global_rank
        super().setup_environment()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        hvd = _hvd()
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError(
                "HeteroHorovodStrategy cannot follow a GradientAccumulationScheduler: Horovod fixes the number "
                "of accumulated backward passes when the optimizer is wrapped. HINT: use a constant "
                "`Trainer(accumulate_grad_batches=k)`."
            )
        module = self.lightning_module
        assert module is not None
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        for opt in self.optimizers:
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        if self.aggregation.explicit_sync:
            self._setup_aggregation(trainer)  # the mode exchanges through hvd.allreduce itself
            return
        passes = int(trainer.accumulate_grad_batches)
        wrapped = []
        for i, opt in enumerate(self.optimizers):
            if not hasattr(opt, "synchronize"):
                named = _named_parameters_of(module, opt, prefix=f"opt{i}.")
                opt = hvd.DistributedOptimizer(opt, named_parameters=named, op=hvd.Sum, backward_passes_per_step=passes)
            wrapped.append(opt)
        self.optimizers = wrapped
        # With automatic optimization, gradients are synchronised in post_backward, before clipping and the
        # update: Horovod's own step() would synchronise before running Lightning's closure (the backward).
        self._auto_sync = bool(module.automatic_optimization)
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        weighting = GradientWeighting(params, timer=self.balancer.timer)
        self._weightings.append(weighting)
        self.balancer.attach_weighting(weighting)

    # ------------------------------------------------------------------ training
    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        module = self.lightning_module
        if module is None or not self._auto_sync:
            return
        trainer = module.trainer
        if trainer.training and not trainer.fit_loop._should_accumulate():
            bounded = self._bounded()
            for opt in self.optimizers:
                # Every gradient all-reduce (also those synchronize() would start for parameters that got no
                # gradient) ends within the timeout, or the error names who hangs; synchronize() then only collects.
                wait_for_gradients(opt, bounded)
                opt.synchronize()

    def _collectives(self) -> HorovodExchange:
        """The explicit aggregation modes exchange through ``hvd.allreduce`` (``op=hvd.Sum``), on the strategy's one
        bounded exchange (:meth:`_bounded`)."""
        return self._bounded()

    def _bounded(self) -> HorovodExchange:
        """Horovod's collectives, each waited for at most ``HETERO_PLUGINS_TIMEOUT`` seconds (a frozen rank ends the
        job with a ``CollectiveError`` naming the operation instead of hanging it); one exchange, made on first use,
        serves the strategy's own collectives, the gradient waits and the aggregation modes."""
        if getattr(self, "_exchange", None) is None:
            self._exchange = HorovodExchange()
        return self._exchange

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.aggregator is not None:
            return self._aggregated_optimizer_step(optimizer, closure, model, kwargs, super().optimizer_step)
        if self._auto_sync and hasattr(optimizer, "skip_synchronize"):
            # Entered per step: Horovod's load_state_dict (checkpoint restore) resets the flag.
            with optimizer.skip_synchronize():
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        hvd = _hvd()
        op_name = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
        ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}
        op = next((v for k, v in ops.items() if op_name.endswith(k)), None)
        if op is None:
            raise ValueError(
                f"`reduce_op`={reduce_op!r} is not supported by HeteroHorovodStrategy. HINT: use 'mean', 'sum', "
                "'max' or 'min'."
            )
        if group is not None:
            raise ValueError(f"`group`={group!r}: HeteroHorovodStrategy reduces over all ranks only; pass group=None.")
        dtype = tensor.dtype
        out = self._bounded().wait(
            hvd.allreduce_async(tensor.detach().to(torch.float64 if not dtype.is_floating_point else dtype), op=op),
            "allreduce (the strategy's reduce)")
        return out.to(dtype) if dtype.is_floating_point else out

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked along a new leading dimension, like DDP's ``all_gather``."""
        if group is not None:
            raise ValueError(f"`group`={group!r}: HeteroHorovodStrategy gathers over all ranks only; pass group=None.")
        return self._bounded().wait(_hvd().allgather_async(tensor.detach().unsqueeze(0)),
                                    "allgather (the strategy's all_gather)")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._bounded().broadcast_object(obj, name="hetero_horovod.broadcast", root=src)

    @override
    def barrier(self, name: str | None = None) -> None:
        if _hvd_initialized() and self.world_size > 1:
            self._bounded().allreduce_sum(torch.zeros(1), name="hetero_horovod.barrier")

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        self._auto_sync = False
        for w in self._weightings:
            w.remove()
        self._weightings = []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "hetero_horovod", cls,
            description="Heterogeneity-aware Horovod (per-rank batch sizes); start with horovodrun",
            override=True,
        )


def _named_parameters_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer, prefix: str) -> list[tuple[str, Any]]:
    """The optimizer's parameters with unique names (Horovod matches all-reduces by name across ranks)."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            out.append((prefix + names.get(id(p), f"group{g}.{j}"), p))
    return out
