"""``HeteroDDPStrategy``: DDP with per-rank batch sizes rebalanced every epoch and sample-weighted gradients.

Registered as ``"hetero_ddp"`` (processes started like ``"ddp"``) and ``"hetero_ddp_spawn"``::

    Trainer(strategy="hetero_ddp", accelerator="gpu", devices=4)
    Trainer(strategy=HeteroDDPStrategy(allocator="lbb", min_batch_size=8), devices=4)
    Trainer(strategy=HeteroDDPStrategy(balancing=BalancingOptions(allocator="lbb", min_batch_size=8)), devices=4)

It bundles a :class:`~hetero_plugins.callbacks.BatchBalancer`: the balanced sampler is installed from the
first epoch (train, and validation/test/predict with ``balance_eval=True``), the weighted comm hook is
registered in ``configure_ddp`` (Lightning's ``ddp_comm_hook=`` is dropped on CPU), and the plan, the time
models and the train loader's position are part of the checkpoint (a mid-epoch resume runs each remaining
sample of the epoch once; a resume on another number of ranks re-seeds the plan). A keyword that neither
the balancing options nor ``DDPStrategy`` / ``DistributedDataParallel`` take is refused at construction. The
user's ``DataLoader(batch_size=b)`` means b per rank at the start; the global batch b x world_size stays
constant.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.balancing.options import BalancingOptions
from hetero_plugins.callbacks.batch_balancer import BatchBalancer
from hetero_plugins.collectives import TorchCollectives, release_process_group_at_exit
from hetero_plugins.scheduler.restart_spec import resume_disagreement
from hetero_plugins.strategies._aggregation import AggregationMixin
from hetero_plugins.strategies._balanced import BalancedStrategyMixin, check_strategy_keywords

__all__ = ["HeteroDDPStrategy"]

#: Collectives give up after this long by default (DDP's own default is 30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=10)


class HeteroDDPStrategy(AggregationMixin, BalancedStrategyMixin, DDPStrategy):
    """``DDPStrategy`` plus per-epoch batch rebalancing and sample-weighted gradient aggregation.

    Args:
        balancing: the balancing options, see :class:`~hetero_plugins.balancing.options.BalancingOptions`
            (all of them apply but ``hosts_file``); they may also be given as keywords (``allocator="lbb"``,
            ``policy="auto"``, ``min_batch_size=8``, ``memory_headroom=0.8``, ``log_metrics=False``, ...).
        aggregation: how each step's gradients are combined: ``"weighted"`` (default: every sample counts,
            weighted by rank share), ``"deadline"``, ``"wbsp"``, ``"pseudo_sync"``, ``"local_sgd"``, or an
            :class:`~hetero_plugins.aggregation.AggregationOptions` with the mode's options (see
            :mod:`hetero_plugins.aggregation` for each mode's trade-off).
        timeout: bound on every collective; a rank that dies ends the job after at most this long.
        **kwargs: the balancing keywords above; the rest goes to
            :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``, ``process_group_backend``, DDP
            keyword arguments...).

    Attributes:
        balancer: the bundled :class:`~hetero_plugins.callbacks.BatchBalancer`.
        batch_plan: current per-rank batch sizes, global-rank order (``None`` before training starts).
        plan_history: one dict per epoch (see :class:`~hetero_plugins.callbacks.BatchBalancer`).
        relocated_slot: after a relocation restart under torchrun, this rank's entry of the restart spec (its
            ``device``, ``corunner``, ``from``, and the ``host`` / ``index`` it runs on), else ``None``.

    Example::

        >>> HeteroDDPStrategy(allocator="lbb", min_batch_size=8).balancer.options.allocator
        'lbb'
    """

    strategy_name = "hetero_ddp"

    def __init__(
        self,
        balancing: BalancingOptions | None = None,
        aggregation: str | AggregationOptions | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        check_strategy_keywords("HeteroDDPStrategy", kwargs, HeteroDDPStrategy.__init__, DDPStrategy.__init__,
                                torch.nn.parallel.DistributedDataParallel.__init__)
        options = BalancingOptions.from_kwargs(balancing, kwargs)
        if "ddp_comm_hook" in kwargs:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with HeteroDDPStrategy, which registers its own "
                "sample-weighted hook. HINT: drop `ddp_comm_hook`, or use strategy='ddp' without balancing."
            )
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
            seconds = timeout if number else int(DEFAULT_TIMEOUT.total_seconds())
            raise ValueError(f"`timeout` must be a positive datetime.timedelta, got {timeout!r}. HINT: pass "
                             f"timeout=datetime.timedelta(seconds={seconds}), or None for torch's default.")
        super().__init__(timeout=timeout, **kwargs)
        self.balancer = BatchBalancer(options)
        self.relocated_slot: dict[str, Any] | None = None
        self._init_aggregation(aggregation)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        if not self.aggregation.explicit_sync:
            self.balancer.attach_ddp(self.model, self.world_size)  # type: ignore[arg-type]

    @override
    def setup_environment(self) -> None:
        self._place_relocated_rank()
        super().setup_environment()
        # Release the process group before the interpreter's own teardown: left to static destructors, gloo's
        # threads occasionally abort a spawned worker at exit ("terminate called without an active exception")
        # after training has finished.
        release_process_group_at_exit()

    def _place_relocated_rank(self) -> None:
        """After a relocation restart, run this rank on the accelerator ``index`` its slot names (same host).

        Runs before ``Trainer.fit`` restores the checkpoint (``trainer.ckpt_path`` is still unset), so the spec is
        found by ``resume_checkpoint``'s rule: this torchrun attempt restarts into it. ``relocated_slot`` is then
        this rank's entry of the spec.
        """
        self.relocated_slot = None
        module = self._lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is None or not self.parallel_devices:
            return
        spec = self.balancer.due_relocation(trainer)
        if spec is None:
            return
        slot = next((r for r in spec.get("ranks", []) if r.get("rank") == self.global_rank), None)
        self.relocated_slot = slot
        index = None if slot is None else slot.get("index")
        device = self.parallel_devices[self.local_rank]
        if index is None or device.type == "cpu":
            return
        count = torch.cuda.device_count() if device.type == "cuda" else None
        if count is not None and index >= count:
            raise ValueError(f"the restart spec places rank {self.global_rank} on {device.type}:{index}, but this "
                             f"node has {count} device(s). HINT: fix `index` in the cluster description's free slot.")
        self.parallel_devices[self.local_rank] = torch.device(device.type, index)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_resumed_together(trainer)
            self._setup_aggregation(trainer)

    def _check_resumed_together(self, trainer: pl.Trainer) -> None:
        """With a cluster description (relocations restart the workers): every rank resumes, or none does. A rank
        that found no restart spec after a relocation restart (its node does not share the spec's folder) would
        otherwise train from epoch 0 beside ranks resumed at a later epoch. One all-gather at fit start."""
        if self.balancer.cluster is None or self.world_size < 2:
            return
        flag = torch.tensor([1.0 if trainer.ckpt_path else 0.0], device=self.root_device)
        resumed = [bool(x) for x in self.all_gather(flag).reshape(-1).tolist()]
        problem = resume_disagreement(resumed, self.balancer.spec_path(trainer))
        if problem is not None:
            raise ValueError(problem)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.aggregator is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self._aggregated_optimizer_step(optimizer, closure, model, kwargs, super().optimizer_step)

    def _collectives(self) -> TorchCollectives:
        """The explicit aggregation modes exchange over the default process group, bounded by ``timeout``; a
        ``wbsp`` claim store lives in the job's rendezvous store."""
        env = self.cluster_environment
        timeout = self._timeout.total_seconds() if self._timeout is not None else None
        return TorchCollectives(self.root_device, env.main_address if env is not None else None, timeout=timeout)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning averages an integer tensor with truncation (``result.copy_(result / world_size)``), and its
        # sample-weighted epoch metrics divide by such a tensor: the summed batch sizes. With uneven per-rank
        # batches that sum can be odd, so average it in float64 instead.
        if (
            isinstance(tensor, torch.Tensor)
            and not torch.is_floating_point(tensor)
            and isinstance(reduce_op, str)
            and reduce_op.lower() in ("mean", "avg")
        ):
            tensor = tensor.to(torch.float64)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("hetero_ddp", "popen"), ("hetero_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"Heterogeneity-aware DDP (per-rank batch sizes), start_method={start_method!r}",
                start_method=start_method,
                override=True,
            )
