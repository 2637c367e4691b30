"""``HeteroDDPStrategy``: DDP with per-rank batch sizes rebalanced every epoch and sample-weighted gradients.

Registered as ``"hetero_ddp"`` (processes started like ``"ddp"``) and ``"hetero_ddp_spawn"``::

    Trainer(strategy="hetero_ddp", accelerator="gpu", devices=4)
    Trainer(strategy=HeteroDDPStrategy(allocator="lbb", min_batch_size=8), devices=4)

It bundles a :class:`~hetero_plugins.callbacks.BatchBalancer`: the balanced sampler is installed from the
first epoch (train, and validation/test/predict with ``balance_eval=True``), the weighted comm hook is
registered in ``configure_ddp`` (Lightning's ``ddp_comm_hook=`` is dropped on CPU), and the plan and time
models are part of the checkpoint. The user's ``DataLoader(batch_size=b)`` means b per rank at the start; the
global batch b x world_size stays constant.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.balancing.allocators import Allocator
from hetero_plugins.callbacks.batch_balancer import BatchBalancer
from hetero_plugins.cluster import ClusterSource
from hetero_plugins.collectives import TorchCollectives
from hetero_plugins.strategies._aggregation import AggregationMixin
from hetero_plugins.strategies._balanced import BalancedStrategyMixin

__all__ = ["HeteroDDPStrategy"]

#: Collectives give up after this long by default (DDP's own default is 30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=10)


class HeteroDDPStrategy(AggregationMixin, BalancedStrategyMixin, DDPStrategy):
    """``DDPStrategy`` plus per-epoch batch rebalancing and sample-weighted gradient aggregation.

    Args:
        allocator: ``"equal_finish"`` (default), ``"lbb"``, ``"proportional"``, ``"static"``, the learned
            ``"dqn"`` / ``"auto"``, or an :class:`~hetero_plugins.balancing.allocators.Allocator`.
        policy: alias of ``allocator`` (e.g. ``HeteroDDPStrategy(policy="auto")``); giving both with
            different values is an error.
        min_batch_size: smallest local batch a rank may get.
        max_batch_size: largest local batch a rank may get (``None``: no cap besides GPU memory).
        min_gain: predicted relative speed-up a new plan needs before it replaces the current one.
        half_life: forgetting of the per-rank time models, in steps.
        locality: keep each rank's data shard across epochs and plan changes (LOFT); by default every
            step's samples over all ranks are exactly those stock DDP's sampler would give.
        balance_eval: per-rank batch sizes for validation, test and predict loaders too.
        timeout: bound on every collective; a rank that dies ends the job after at most this long.
        replan_every: steps between mid-epoch exchanges of step times, after which the plan may change for
            the rest of the epoch (``None``: plans change at epoch ends only).
        policy: alias of ``allocator`` (e.g. ``policy="auto"``).
        aggregation: how each step's gradients are combined: ``"weighted"`` (default: every sample counts,
            weighted by rank share), ``"deadline"``, ``"wbsp"``, ``"pseudo_sync"``, ``"local_sgd"``, or an
            :class:`~hetero_plugins.aggregation.AggregationOptions` with the mode's options (see
            :mod:`hetero_plugins.aggregation` for each mode's trade-off).
        cluster: what runs where, from the cluster manager (a JSON file re-read every epoch, or a callable
            ``epoch -> dict``; default the file in ``HETERO_PLUGINS_CLUSTER``): co-runner changes reach the
            learned allocators, free slots enable relocation (see :mod:`hetero_plugins.cluster`).
        relocation: plan rank relocations to free slots at epoch ends (``True``, ``False`` or a
            :class:`~hetero_plugins.scheduler.relocation.Relocator`); gaining ones are written as a restart spec.
        restart_spec: path of the restart spec (default ``<default_root_dir>/hetero_restart.json``).
        apply_relocation: under torchrun with restarts left, apply a same-host relocation by checkpoint and
            restart (see :class:`~hetero_plugins.callbacks.BatchBalancer`); resume with
            ``Trainer.fit(..., ckpt_path=resume_checkpoint(spec))``.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``,
            ``process_group_backend``, DDP keyword arguments...).

    Attributes:
        batch_plan: current per-rank batch sizes, global-rank order (``None`` before training starts).
        plan_history: one dict per epoch (see :class:`~hetero_plugins.callbacks.BatchBalancer`).
    """

    strategy_name = "hetero_ddp"

    def __init__(
        self,
        allocator: str | Allocator | None = None,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        min_gain: float = 0.03,
        half_life: float = 6.0,
        locality: bool = False,
        balance_eval: bool = True,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        replan_every: int | None = 5,
        policy: str | Allocator | None = None,
        aggregation: str | AggregationOptions | None = None,
        cluster: ClusterSource | None = None,
        relocation: bool | Any = True,
        restart_spec: str | os.PathLike[str] | None = None,
        apply_relocation: bool = True,
        **kwargs: Any,
    ) -> None:
        if "ddp_comm_hook" in kwargs:
            raise ValueError(
                "`ddp_comm_hook` cannot be combined with HeteroDDPStrategy, which registers its own "
                "sample-weighted hook. HINT: drop `ddp_comm_hook`, or use strategy='ddp' without balancing."
            )
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"`timeout` must be a positive datetime.timedelta, got {timeout!r}.")
        super().__init__(timeout=timeout, **kwargs)
        self.balancer = BatchBalancer(
            allocator=allocator, min_batch_size=min_batch_size, max_batch_size=max_batch_size,
            min_gain=min_gain, half_life=half_life, locality=locality, balance_eval=balance_eval,
            replan_every=replan_every, policy=policy, cluster=cluster, relocation=relocation,
            restart_spec=restart_spec, apply_relocation=apply_relocation,
        )
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
        if not _EXIT_HOOK[0]:
            atexit.register(_destroy_process_group)
            _EXIT_HOOK[0] = True

    def _place_relocated_rank(self) -> None:
        """After a relocation restart, run this rank on the accelerator ``index`` its slot names (same host)."""
        module = self._lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is None or not self.parallel_devices:
            return
        spec = self.balancer.resumed_relocation(trainer)
        if spec is None:
            return
        slot = next((r for r in spec.get("ranks", []) if r.get("rank") == self.global_rank), None)
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
            self._setup_aggregation(trainer)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.aggregator is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self._aggregated_optimizer_step(optimizer, closure, model, kwargs, super().optimizer_step)

    def _collectives(self) -> TorchCollectives:
        """The explicit aggregation modes exchange over the default process group; a ``wbsp`` claim store is
        served on the launcher's main address."""
        env = self.cluster_environment
        return TorchCollectives(self.root_device, env.main_address if env is not None else None)

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


_EXIT_HOOK = [False]


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
