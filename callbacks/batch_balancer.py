"""``BatchBalancer``: per-rank batch sizes rebalanced every epoch, with sample-weighted gradients.

Drop it beside the stock ``"ddp"`` / ``"ddp_spawn"`` strategy::

    trainer = Trainer(strategy="ddp", devices=4, callbacks=[BatchBalancer()])

Every epoch each rank times its steps (from batch start until its gradients are ready, before waiting for
the others); at the epoch end a :class:`~hetero_plugins.balancing.coordinator.PlanCoordinator` all-gathers
the records, rank 0's planner decides the next plan, every rank adopts it, and it applies at the next epoch
start. The global batch, ``batch_size x world_size`` of the user's ``DataLoader``, never changes. Gradients
are combined as sum_i (b_i / B) g_i through a DDP comm hook that the callback registers itself (Lightning
ignores ``ddp_comm_hook=`` on CPU).

The callback swaps the sampler inside the train loader's ``BatchSampler`` (the ``DistributedSampler`` that
Lightning injected) for a :class:`~hetero_plugins.balancing.sampler.HeteroDistributedSampler` and sets the
``BatchSampler``'s ``batch_size``; both are public attributes of torch's samplers. The first epoch runs with
Lightning's own sampler (its iterator already exists when callbacks first see the loader); with
``HeteroDDPStrategy`` the balanced sampler is in place from the start, for validation too.

Checkpoints hold the plan and the time models. Resumed on another number of ranks, they re-seed the planner
(each remaining rank keeps its time model, a new rank starts without one) with a warning. With
``HeteroDDPStrategy`` the train loader's position is checkpointed too: a fit resumed from a mid-epoch checkpoint
continues that epoch at its first step not done, with its plans, so every remaining sample runs exactly once.
Beside a stock strategy the checkpoint holds the epoch's plan, and the resumed epoch's loader (one whose
``BatchSampler`` Lightning built) is given that plan and skips each rank's batches of the steps already run, with
the same result. Validation beside a stock strategy keeps Lightning's equal batches (its integer average of the
summed batch sizes would make sample-weighted metrics inexact on uneven ones).
A loader the balancer cannot split (a custom sampler, an ``IterableDataset``) keeps its own batches, as under
stock DDP, and ``plan_history`` says ``plan_applied=False``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size

from hetero_plugins.balancing.allocators import get_allocator
from hetero_plugins.balancing.coordinator import PlanCoordinator, start_advisor
from hetero_plugins.balancing.options import BalancingOptions, check_keywords, resolve_policy
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.sampler import HeteroBatchSampler
from hetero_plugins.callbacks._collectives import StrategyCollectives
from hetero_plugins.callbacks._fetch_timer import MISSING as FETCH_MISSING, FetchTimer
from hetero_plugins.callbacks._loaders import UNSIZED, BalancedLoaders, loader_plan
from hetero_plugins.callbacks._midepoch_resume import end_quiet, install_resume, uninstall_resume
from hetero_plugins.callbacks._relocation import (
    RelocationRestart,
    adopt_relocation,
    due_relocation,
    restart_for_relocation,
    resumed_relocation,
    spec_path,
    write_torchrun_relocation,
)
from hetero_plugins.callbacks.comm_hook import WeightedAllreduceState, check_one_weighting, weighted_allreduce_hook
from hetero_plugins.callbacks.shared_weights import unshare_module_memory
from hetero_plugins.cluster import resolve_cluster_source
from hetero_plugins.collectives import release_process_group_at_exit
from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor
from hetero_plugins.telemetry import (
    EPOCH_STATS,
    StepTimer,
    SystemMonitor,
    UtilisationSampler,
    epoch_stats,
    memory_cap,
)

log = logging.getLogger(__name__)

__all__ = ["BatchBalancer", "RelocationRestart", "resolve_policy"]

#: The keywords the balancing classes take: every option of ``BalancingOptions`` and ``policy``.
_OPTION_NAMES = (*(f.name for f in dataclasses.fields(BalancingOptions)), "policy")


class BatchBalancer(Callback):
    """Rebalances per-rank batch sizes every epoch and weights gradients by each rank's samples.

    Args:
        balancing: the balancing options, see :class:`~hetero_plugins.balancing.options.BalancingOptions`
            (``hosts_file`` is for ``horovodrun`` scripts and refused here).
        utilisation: what samples this rank's GPU utilisation and memory over each epoch (default a
            :class:`~hetero_plugins.telemetry.UtilisationSampler` on the strategy's CUDA device, a no-op on CPU).
        **options: the same options as keywords (``allocator="lbb"``, ``policy="auto"``, ``min_batch_size=8``,
            ...), as an alternative to ``balancing``.

    Attributes:
        options: the :class:`~hetero_plugins.balancing.options.BalancingOptions` in force.
        planner: the :class:`~hetero_plugins.balancing.planner.BalancePlanner` (``None`` before training).
        timer: this rank's :class:`~hetero_plugins.telemetry.StepTimer`.
        backlog_fn: set by an aggregation mode that carries samples between steps (``"deadline"``): called with
            the steps left in the epoch, returns each rank's backlog per step (the same on every rank), which
            mid-epoch plans route around.
        batch_plan: the current per-rank batch sizes in global-rank order (``None`` before training).
        plan_history: one dict per epoch: ``epoch``, ``batch_sizes``, ``throughput`` (per rank, samples/s of
            compute), ``straggler_level``, ``idle_fraction``, ``predicted_epoch_time``,
            ``measured_epoch_time``, ``samples_per_s``, ``next_batch_sizes``, ``plan_applied``, and per rank
            ``cpu_percent``, ``gpu_util`` and ``gpu_mem_used`` (means over the epoch from NVML readings; ``None``
            where there is no GPU).
            ``plan_applied`` is ``False`` for an epoch that ran the loader's own equal batches: the first epoch
            beside a stock strategy, or every epoch of a loader the balancer cannot split (a custom sampler such
            as ``WeightedRandomSampler``, or an ``IterableDataset``); ``batch_sizes`` are then those batches and,
            for a loader that cannot be split, ``next_batch_sizes`` and ``batch_plan`` stay equal too.

    Example::

        >>> BatchBalancer(allocator="lbb", min_batch_size=8).options.min_batch_size
        8
    """

    #: registers the weighted DDP comm hook (one per model: see ``check_one_weighting``)
    registers_weighted_hook = True

    def __init__(self, balancing: BalancingOptions | None = None, *, utilisation: UtilisationSampler | None = None,
                 **options: Any) -> None:
        if utilisation is not None and not isinstance(utilisation, UtilisationSampler):
            raise TypeError(f"`utilisation` must be a UtilisationSampler or None, got {type(utilisation).__name__}. "
                            "HINT: leave it out for NVML readings on the strategy's CUDA device.")
        opts = BalancingOptions.from_kwargs(balancing, options)
        check_keywords("BatchBalancer", options, _OPTION_NAMES,
                       "hetero_plugins.balancing.BalancingOptions (and `policy`)")
        opts.refuse("BatchBalancer", {"hosts_file": "it is rewritten by elastic horovodrun scripts "
                                                    "(hetero_plugins.horovod.HeteroBatchSampler) only."})
        self.options = opts
        self.allocator = get_allocator(opts.allocator)
        self.cluster = resolve_cluster_source(opts.cluster)
        self._advisor = ClusterAdvisor(self.cluster, opts.relocation) if self.cluster is not None else None
        self.loaders = BalancedLoaders(self)
        self.planner: BalancePlanner | None = None
        self.timer = StepTimer()
        self.backlog_fn: Any = None
        self._coordinator: PlanCoordinator | None = None
        self._resumed_relocation: dict[str, Any] | None = None
        self._cursor = 0
        self._plan_changes: list[dict[str, Any]] = []
        self._start_plan: list[int] | None = None
        self._applied = False
        self._epoch: int | None = None  # the epoch whose records are being kept
        self._hook_state: WeightedAllreduceState | None = None
        self._hooked: weakref.ref[torch.nn.parallel.DistributedDataParallel] | None = None  # the DDP with the hook
        self._external_weighting: Any = None
        self._pending_state: dict[str, Any] | None = None
        self._epoch_start: float | None = None
        self._epoch_end: float | None = None
        self._warned: set[str] = set()
        self._system: SystemMonitor | None = None
        self._sampler: UtilisationSampler | None = utilisation
        self._resume_position: dict[str, Any] | None = None  # the checkpointed epoch's plan (see state_dict)
        self._resumed_at: tuple[int, bool] | None = None  # (step, plan installed) of a stock strategy's resume
        self._fetches = FetchTimer()  # the train loop's batch fetches (a step's data time)
        self._step_fetch: float | None = None  # seconds fetching the step in progress's batch (None: unseen)

    # ------------------------------------------------------------------ public surface
    @property
    def batch_plan(self) -> list[int] | None:
        return None if self.planner is None else list(self.planner.plan)

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        return [] if self.planner is None else list(self.planner.history)

    @property
    def state_key(self) -> str:
        return "BatchBalancer"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_hooked"] = None  # a weak reference does not pickle (ddp_spawn pickles the callbacks)
        return state

    @property
    def hook_state(self) -> WeightedAllreduceState | None:
        """The weighted comm hook's state once registered (its ``bytes`` count what the hook sent)."""
        return self._hook_state

    def own_batch_sampler(self, trainer: pl.Trainer) -> HeteroBatchSampler | None:
        """The train loader's ``HeteroBatchSampler`` (installed by the strategy or passed by the user)."""
        return self.loaders.own_batch_sampler(trainer)


    def attach_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel, world_size: int) -> None:
        """Register the sample-weighted all-reduce hook on ``ddp_model`` (once per DDP wrapper: a second ``fit``
        wraps the module again, and the new wrapper needs the hook too)."""
        if self._hooked is not None and self._hooked() is ddp_model:
            return
        if self._hook_state is None:
            self._hook_state = WeightedAllreduceState(1.0 / world_size, timer=self.timer)
        ddp_model.register_comm_hook(self._hook_state, weighted_allreduce_hook)
        self._hooked = weakref.ref(ddp_model)

    def attach_weighting(self, weighting: Any) -> None:
        """Use an external gradient weighting (an object with ``set_weight(float)``), e.g. Horovod's."""
        self._external_weighting = weighting

    def prepare_dataloader(self, dataloader: object, trainer: pl.Trainer) -> object:
        """Install per-rank batch sizes in a loader Lightning prepared (called by ``HeteroDDPStrategy``)."""
        return self.loaders.prepare(dataloader, trainer)

    def spec_path(self, trainer: pl.Trainer) -> str:
        """Where the restart spec goes: ``restart_spec``, or ``<default_root_dir>/hetero_restart.json``."""
        return spec_path(self.options, trainer)

    def resumed_relocation(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The restart spec this fit resumes from (its checkpoint is ``trainer.ckpt_path``), else ``None``."""
        return resumed_relocation(self.options, trainer)

    def due_relocation(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The restart spec this torchrun attempt restarts into, known before ``Trainer.fit`` restores the
        checkpoint (``trainer.ckpt_path`` is unset until then), else ``None``."""
        return due_relocation(self.options, trainer)

    def ensure_planner(self, trainer: pl.Trainer, dl: object = None) -> BalancePlanner | None:
        """The planner, made on first use from the train loader's batch size and dataset (``None``: no loader
        to balance); a checkpointed planner state is loaded into it."""
        if self.planner is not None:
            return self.planner
        dl = trainer.train_dataloader if dl is None else dl
        if not isinstance(dl, DataLoader) or dl.batch_sampler is None:
            self._warn_once("loader", "BatchBalancer: the train dataloader is not a single batched DataLoader; "
                            "batch sizes stay as they are.")
            return None
        world = trainer.world_size
        found = loader_plan(dl, world)
        if found is None:
            return None
        plan, n = found
        global_batch = sum(plan)
        if n is None:
            self.loaders.warn_once("unsized", UNSIZED)  # the time models still learn; no plan is applied
        elif n < global_batch:
            raise ValueError(
                f"the training dataset has {n} samples, fewer than one global batch of {global_batch} "
                f"(batch_size {plan[0]} x {world} ranks). HINT: lower the DataLoader's batch_size to at most "
                f"{max(1, n // world)}."
            )
        self.planner = self.options.planner(world, global_batch, plan, allocator=self.allocator)
        if self._pending_state and "planner" in self._pending_state:
            self.planner.load_state_dict(self._pending_state["planner"], resize=True)  # another world: re-seeded
            self._pending_state = None
        return self.planner

    def state_dict(self) -> dict[str, Any]:
        if self.planner is not None:
            # ``position``: the epoch in progress and whether it runs the plan (one plan for the whole epoch beside
            # a stock strategy), so a fit resumed from a mid-epoch checkpoint can run the epoch's remaining steps.
            return {"planner": self.planner.state_dict(),
                    "position": {"epoch": self._epoch, "plan": self._start_plan, "applied": self._applied}}
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_position = state_dict.get("position")
        self._pending_state = dict(state_dict)
        if self.planner is not None and "planner" in state_dict:
            self.planner.load_state_dict(state_dict["planner"], resize=True)
            self._pending_state = None

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_one_weighting(trainer.callbacks, self)
        unshare_module_memory(pl_module)  # ranks from a fork server (HeteroDDPStrategy bundles this callback too)
        norms = [m for m in pl_module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if norms and not any(isinstance(m, torch.nn.SyncBatchNorm) for m in norms) and self.options.min_batch_size < 8:
            rank_zero_warn(
                f"BatchBalancer: the model has {len(norms)} BatchNorm layer(s) and a rank may get as few as "
                f"{self.options.min_batch_size} sample(s) per step, which makes BatchNorm statistics noisy. HINT: "
                "use `Trainer(sync_batchnorm=True)` or raise `min_batch_size` (e.g. 8).",
                category=RuntimeWarning,
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        release_process_group_at_exit()
        # On a GPU the compute times come from CUDA events: the host only queues the GPU's work.
        self.timer.set_device(trainer.strategy.root_device)
        self._fetches.attach(trainer)
        position, self._resume_position = self._resume_position, None
        install_resume(self, trainer, position)
        if self._advisor is not None:
            comm = StrategyCollectives(trainer.strategy)
            start_advisor(self._advisor, comm, trainer.current_epoch, trainer.world_size)
            # Rank 0 reads the spec inside a collective: a broken one must stop every rank alike, not rank 0 alone.
            found: tuple[str | None, dict[str, Any] | None] = (None, None)
            if trainer.is_global_zero:
                try:
                    found = (None, self.resumed_relocation(trainer))
                except ValueError as err:
                    found = (str(err), None)
            problem, self._resumed_relocation = comm.broadcast_object(found, name="hetero_plugins.resumed")
            if problem is not None:
                raise ValueError(problem)
        if self._external_weighting is not None:
            return
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.attach_ddp(model, trainer.world_size)  # a wrapper the strategy hooked already is left as it is
        elif trainer.world_size > 1:
            raise RuntimeError(
                f"BatchBalancer needs gradients it can weight, but the strategy {type(trainer.strategy).__name__} "
                "does not wrap the model in DistributedDataParallel. HINT: use strategy='ddp', 'ddp_spawn', "
                "'hetero_ddp' or 'hetero_horovod'."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = trainer.train_dataloader
        if isinstance(loaders, (list, tuple, dict)) and len(loaders) > 1:
            # Each loader got the first one's plan and the epoch's record cannot hold two: stop before a step.
            raise ValueError(
                f"BatchBalancer balances one train DataLoader; this fit has {len(loaders)}. HINT: combine them into "
                "one dataset (e.g. torch.utils.data.ConcatDataset) in a single DataLoader, or train without the "
                "balancer (strategy='ddp' and no BatchBalancer)."
            )
        # A fit resumed from a mid-epoch checkpoint continues that epoch without an epoch start: the balanced
        # sampler restored its plans and position; the epoch's record starts from them.
        resumed_at, self._resumed_at = self._resumed_at, None
        if not trainer.fit_loop.restarted_mid_epoch:
            return
        self._utilisation(trainer).start()
        planner = self.ensure_planner(trainer)
        own = self.own_batch_sampler(trainer)
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        if resumed_at is not None and resumed_at[0] != done:
            self._warn_once("resume-step", (
                f"BatchBalancer: the resumed epoch skipped {resumed_at[0]} steps of the train loader, but Lightning "
                f"resumes it after {done}: some of the epoch's samples may run twice or not at all. HINT: resume "
                "from a checkpoint saved by ModelCheckpoint, or from an end-of-epoch checkpoint."))
        if own is not None and planner is not None:
            changes = [{"step": k, "batch_sizes": list(p)} for k, p in own.plan_changes]
            self._begin_epoch(trainer, planner, list(own.sampler.plan), changes, applied=True)
        else:
            applied = resumed_at is not None and resumed_at[1] and planner is not None
            start = list(planner.plan) if applied else self.loaders.loader_batch_sizes(trainer)  # type: ignore[union-attr]
            self._begin_epoch(trainer, planner, start, [], applied=applied)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        planner = self.ensure_planner(trainer)
        self._utilisation(trainer).start()
        if self._resumed_relocation is not None and planner is not None:
            adopt_relocation(trainer, self._coordinate(trainer), self._resumed_relocation)
            self._resumed_relocation = None
        if self.options.balance_eval and planner is not None and getattr(trainer.strategy, "balancer", None) is self:
            # Lightning prepares the validation loaders once, at the first validation (under an equal plan):
            # every epoch hands them the current plan's shares. Only under a balanced strategy: a stock strategy
            # averages the summed batch sizes of sample-weighted metrics as an integer (truncated), which uneven
            # per-rank validation batches make odd, so validation beside it keeps Lightning's equal batches.
            vals = trainer.val_dataloaders
            for val in vals.values() if isinstance(vals, dict) else vals if isinstance(vals, (list, tuple)) else [vals]:
                if isinstance(val, DataLoader):
                    self.loaders.install(val, trainer, train=False)
        dl = trainer.train_dataloader
        own = self.own_batch_sampler(trainer)
        applied = False
        if own is not None and planner is not None:
            own.set_plan(planner.plan)  # the next epoch's plan, from step 0
            own.set_epoch(trainer.current_epoch)
            applied = True
        elif isinstance(dl, DataLoader) and trainer.current_epoch > 0:
            applied = self.loaders.install(dl, trainer, train=True)
            if self.loaders.train_sampler is not None:
                self.loaders.train_sampler.set_epoch(trainer.current_epoch)
        start = (list(planner.plan) if applied else self.loaders.loader_batch_sizes(trainer)) if planner else None
        self._begin_epoch(trainer, planner, start, [], applied)

    def _begin_epoch(self, trainer: pl.Trainer, planner: BalancePlanner | None, start_plan: list[int] | None,
                     changes: list[dict[str, Any]], applied: bool) -> None:
        """Reset the epoch's records: it runs ``start_plan`` (the loader's own batches unless ``applied``)."""
        self.timer.pop_records()
        self.timer.reset_data_clock()
        self._epoch_start = self._epoch_end = None
        self._cursor = 0
        if planner is not None:
            self._coordinate(trainer).begin_epoch()
        self._plan_changes = changes
        self._start_plan = start_plan
        self._applied = applied
        self._epoch = trainer.current_epoch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        end_quiet(self)  # Lightning's "not resumable" check of a resumed epoch is behind us
        counts = self.loaders.step_counts(trainer, batch_idx)
        if counts is not None:
            local, total = counts[trainer.global_rank], sum(counts)
        else:
            local, total = self._batch_size(batch), 0
        weight = local / total if total else 1.0 / trainer.world_size
        if self._hook_state is not None:
            self._rescale_window(trainer, pl_module, batch_idx, weight)
            self._hook_state.weight = weight
        if self._external_weighting is not None:
            self._external_weighting.set_weight(weight)
        now = time.perf_counter()
        if self._epoch_start is None:
            self._epoch_start = now
        self.timer.start_step(local)
        self._step_fetch = self._fetches.take()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.mark_backward_end()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        rec = self.timer.end_step()
        if rec is not None and self._step_fetch is not None and self._step_fetch < rec.data_time:
            # The gap since the last step also holds the wait for the other ranks in Lightning's per-batch
            # collective (its SIGTERM broadcast): under gradient accumulation a fast rank waits there for the slow
            # one at every micro-batch. Only the time spent fetching the batch is data loading.
            self.timer.set_data_time(self._step_fetch)  # keeps a step timed by device events unread
        self._epoch_end = time.perf_counter()
        own = self.own_batch_sampler(trainer)
        if own is None or self.planner is None or own.sampler.locality:
            return
        replan_every = self.options.replan_every
        if not replan_every and self.backlog_fn is None:
            return
        done = batch_idx + 1
        # Batches already drawn by the loader (Lightning prefetches one; workers prefetch more) keep their
        # plan: a change applies from the first step no rank has drawn yet. Every input to this decision is
        # the same on every rank, so all ranks enter the collectives below together.
        dl = trainer.train_dataloader
        lookahead = 2 + (dl.num_workers * (dl.prefetch_factor or 2) if dl.num_workers else 0)
        if done + lookahead >= len(own):
            return
        if replan_every and done % replan_every == 0:
            self._coordinate(trainer).replan(self._new_records())
        # A backlog (``aggregation="deadline"``) is known identically on every rank, so the re-routed plan
        # needs no collective and is revisited after every step.
        backlog = self.backlog_fn(len(own) - done - lookahead) if self.backlog_fn is not None else None
        plan = self.planner.plan_with_backlog(backlog) if backlog else list(self.planner.plan)
        # Under gradient accumulation the hook weights a window's summed gradient once, by the rank's share: every
        # micro-batch of a window must run the same plan, so a change starts at a window's first step.
        window = max(1, int(trainer.accumulate_grad_batches))
        start = -(-(done + lookahead) // window) * window
        if start < len(own) and tuple(plan) != tuple(own.plan_at(start)):
            own.set_plan(plan, from_step=start)
            self._plan_changes = [c for c in self._plan_changes if c["step"] < start]
            self._plan_changes.append({"step": start, "batch_sizes": plan})
            if trainer.is_global_zero:
                log.info(f"BatchBalancer: epoch {trainer.current_epoch} step {start}: new plan {plan}")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        planner = self.ensure_planner(trainer)
        if planner is None:
            return
        if self._fetches.missing():
            self._warn_once("fetch", FETCH_MISSING)
        records = self._new_records()
        self.timer.pop_records()
        self._cursor = 0
        elapsed = (self._epoch_end - self._epoch_start) if self._epoch_start and self._epoch_end else 0.0
        cap = self._local_memory_cap(trainer)
        stats = self._epoch_stats(trainer)
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1 << 20
        coordinator = self._coordinate(trainer)
        entry = coordinator.end_epoch(
            trainer.current_epoch, records, elapsed,
            local_extra=[float(stats.get(k, -1.0)) for k in EPOCH_STATS], memory_cap=None if cap < 0 else cap,
            start_plan=self._start_plan, annotations={"plan_changes": list(self._plan_changes)},
            epochs_left=max_epochs - trainer.current_epoch - 1,
            write_relocation=functools.partial(write_torchrun_relocation, trainer, self.options, self._warn_once),
        )
        assert entry is not None  # records are padded, so every epoch gets an entry
        entry["plan_applied"] = self._applied
        if not self.loaders.can_balance(trainer.train_dataloader):
            # The loader keeps its own batches (a sampler or dataset the balancer cannot split): report the
            # batches it will run, not a plan that would never be applied.
            used = self.loaders.loader_batch_sizes(trainer)
            planner.plan = list(used)
            planner.predicted_step_time = planner.predict_step_time(used)
            entry.update(next_batch_sizes=list(used), plan_changed=False, predicted_gain=0.0)
        if entry.get("relocation") and entry["relocation"].get("checkpoint"):
            restart_for_relocation(trainer, entry["relocation"])
        for col, key in enumerate(EPOCH_STATS):
            entry[key] = [None if v < 0 else float(v) for v in coordinator.extras[:, col]]
        if self.options.log_metrics:
            metrics = {f"hetero/batch_size/rank_{r}": float(b) for r, b in enumerate(entry["batch_sizes"])}
            for key in ("gpu_util", "cpu_percent"):
                metrics.update({f"hetero/{key}/rank_{r}": v for r, v in enumerate(entry[key]) if v is not None})
            metrics["hetero/plan_applied"] = float(entry["plan_applied"])
            metrics["hetero/straggler_level"] = float(entry["straggler_level"])
            metrics["hetero/idle_fraction"] = float(entry["idle_fraction"])
            if entry["samples_per_s"] is not None:
                metrics["hetero/samples_per_s"] = float(entry["samples_per_s"])
            pl_module.log_dict(metrics, sync_dist=True)  # equal on every rank; the sync only silences a warning

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        FetchTimer.detach(trainer)
        uninstall_resume(trainer.strategy)  # a resume wrapper no train loader reached
        end_quiet(self)
        self._fetches.reset()
        self._step_fetch = None

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank's predictions, concatenated in rank order, which is dataset order."""
        self.loaders.gather_predictions(trainer)

    # ------------------------------------------------------------------ internals
    def _rescale_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int,
                        weight: float) -> None:
        """Under gradient accumulation the comm hook weights a window's summed gradient once, by the weight of the
        window's last micro-batch. A window whose micro-batches have different shares (the epoch's last, partial
        step among full ones) keeps the gradient accumulated so far as sum_j (w_j / w) g_j for the new weight w,
        so the hook's w gives sum_j w_j g_j: each micro-batch weighted by its own share, as one process on the
        union of each micro-batch's samples."""
        state = self._hook_state
        window = max(1, int(trainer.accumulate_grad_batches))
        ddp = trainer.strategy.model
        if (state is None or window == 1 or batch_idx % window == 0 or weight <= 0 or state.weight == weight
                or self._hooked is None or self._hooked() is not ddp):
            return
        ratio = state.weight / weight
        with torch.no_grad():
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(ratio)

    def _coordinate(self, trainer: pl.Trainer) -> PlanCoordinator:
        """The coordinator of this planner over this trainer's strategy (made again if either changed)."""
        assert self.planner is not None
        c = self._coordinator
        if c is None or c.planner is not self.planner or c.comm.strategy is not trainer.strategy:  # type: ignore[attr-defined]
            c = PlanCoordinator(self.planner, StrategyCollectives(trainer.strategy), self._advisor,
                                label="BatchBalancer", logger=log)
            self._coordinator = c
        return c

    def _new_records(self) -> np.ndarray:
        """This rank's step records since the last exchange, rows of (batch size, compute s, data s)."""
        new = self.timer.records[self._cursor :]
        self._cursor += len(new)
        return np.array([r.as_tuple() for r in new], dtype=np.float64).reshape(-1, 3)

    @staticmethod
    def _batch_size(batch: Any) -> int:
        try:
            return int(extract_batch_size(batch))
        except Exception:
            return 0

    def _utilisation(self, trainer: pl.Trainer) -> UtilisationSampler:
        """Epoch means of GPU utilisation and memory from NVML readings on a light thread (a no-op without a GPU)."""
        if self._sampler is None:
            device = trainer.strategy.root_device
            self._sampler = UtilisationSampler(device.index if device.type == "cuda" else None)
        return self._sampler

    def _epoch_stats(self, trainer: pl.Trainer) -> dict[str, float]:
        """This rank's readings for the epoch's history entry: GPU utilisation and memory averaged over the epoch
        where NVML reads them (a single reading at the epoch end says little: the GPU idles while ranks
        synchronise), CPU load since the last reading."""
        return epoch_stats(self._utilisation(trainer), self._monitor(trainer))

    def _monitor(self, trainer: pl.Trainer) -> SystemMonitor:
        if self._system is None:
            device = trainer.strategy.root_device
            self._system = SystemMonitor(device.index if device.type == "cuda" else None)
        return self._system

    def _local_memory_cap(self, trainer: pl.Trainer) -> int:
        device = trainer.strategy.root_device
        if device.type != "cuda" or self.planner is None:
            return -1
        peak = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        return memory_cap(self.planner.plan[trainer.global_rank], peak, baseline, total, self.options.memory_headroom)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)


def _option(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}`` (read-only).")


# The options were attributes of the callback before they were grouped in ``options``; they stay readable.
for _name in ("min_batch_size", "max_batch_size", "min_gain", "half_life", "locality", "balance_eval",
              "memory_headroom", "log_metrics", "replan_every", "restart_spec", "apply_relocation"):
    setattr(BatchBalancer, _name, _option(_name))
del _name
