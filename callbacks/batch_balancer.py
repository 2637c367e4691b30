"""``BatchBalancer``: per-rank batch sizes rebalanced every epoch, with sample-weighted gradients.

Drop it beside the stock ``"ddp"`` / ``"ddp_spawn"`` strategy::

    trainer = Trainer(strategy="ddp", devices=4, callbacks=[BatchBalancer()])

Every epoch each rank times its steps (from batch start until its gradients are ready, before waiting for
the others), the ranks all-gather the records, rank 0's planner decides the next plan, the plan is broadcast
and applied at the next epoch start. The global batch, ``batch_size x world_size`` of the user's
``DataLoader``, never changes. Gradients are combined as sum_i (b_i / B) g_i through a DDP comm hook that the
callback registers itself (Lightning ignores ``ddp_comm_hook=`` on CPU).

The callback swaps the sampler inside the train loader's ``BatchSampler`` (the ``DistributedSampler`` that
Lightning injected) for a :class:`~hetero_plugins.balancing.sampler.HeteroDistributedSampler` and sets the
``BatchSampler``'s ``batch_size``; both are public attributes of torch's samplers. The first epoch runs with
Lightning's own sampler (its iterator already exists when callbacks first see the loader); with
``HeteroDDPStrategy`` the balanced sampler is in place from the start, for validation too.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size

from hetero_plugins._validation import check_bool, check_float, check_int, check_path
from hetero_plugins.balancing.allocators import Allocator, Bounds, largest_remainder
from hetero_plugins.callbacks.comm_hook import WeightedAllreduceState, weighted_allreduce_hook
from hetero_plugins.callbacks.straggler_monitor import _gather, gather_records
from hetero_plugins.cluster import ClusterSource, ClusterView, resolve_cluster_source
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor, data_times
from hetero_plugins.balancing.sampler import HeteroBatchSampler, HeteroDistributedSampler, HeteroInferenceBatchSampler
from hetero_plugins.telemetry import StepTimer, SystemMonitor, memory_cap

log = logging.getLogger(__name__)

__all__ = ["BatchBalancer", "RelocationRestart", "resolve_policy"]


def resolve_policy(allocator: str | Allocator | None, policy: str | Allocator | None) -> str | Allocator:
    """``allocator`` and its alias ``policy``: the one given (default ``"equal_finish"``); both must agree."""
    if allocator is not None and policy is not None and allocator != policy:
        raise ValueError(
            f"`allocator`={allocator!r} and `policy`={policy!r} disagree; `policy` is an alias of `allocator`. "
            "HINT: give only one of them."
        )
    chosen = policy if policy is not None else allocator
    return "equal_finish" if chosen is None else chosen


class BatchBalancer(Callback):
    """Rebalances per-rank batch sizes every epoch and weights gradients by each rank's samples.

    Args:
        allocator: ``"equal_finish"`` (default), ``"lbb"``, ``"proportional"``, ``"static"``, the learned
            ``"dqn"`` / ``"auto"``, or an :class:`~hetero_plugins.balancing.allocators.Allocator`.
        policy: alias of ``allocator`` (the learned scheduler's name for it, e.g. ``policy="auto"``); giving
            both with different values is an error.
        min_batch_size: smallest local batch a rank may get (raise it for BatchNorm models).
        max_batch_size: largest local batch a rank may get; ``None`` for no cap besides measured GPU memory.
        min_gain: a new plan must be predicted this much faster (relative) to replace the current one.
        half_life: forgetting of the per-rank time models, in steps.
        locality: keep each rank's shard of the data across epochs and plan changes (LOFT); by default
            every step's samples over all ranks are exactly those stock DDP's sampler would give.
        balance_eval: give validation/test/predict loaders per-rank batch sizes too (strategy only).
        memory_headroom: fraction of GPU memory the memory cap allows a rank to use.
        log_metrics: log ``hetero/*`` metrics through the LightningModule's logger.
        replan_every: within an epoch, every this many steps the ranks exchange their latest step times and
            rank 0 may change the plan for the rest of the epoch (a rank that slows down is rebalanced within
            about ten steps; the step unions stay those of the epoch's order). Needs the strategy (or a
            user-supplied ``HeteroBatchSampler``) and ``locality=False``; ``None`` plans at epoch ends only.
        cluster: where the cluster manager says what runs where (stage 2 of the learned scheduler): the path
            of a JSON file re-read at every epoch boundary, or a callable ``epoch -> dict`` (picklable under
            ``ddp_spawn``); default the file named by ``HETERO_PLUGINS_CLUSTER``, else none. Format in
            :mod:`hetero_plugins.cluster`: each rank's device type and co-runner for the epoch, and free slots.
            Rank 0 reads it: allocators with ``set_context`` (``"dqn"``, ``"auto"``) get the co-runner changes
            and the measured data times before each epoch-end decision.
        relocation: with free slots in the cluster description, rank 0 decides at every epoch end whether
            moving ranks to them pays for a restart (:class:`~hetero_plugins.scheduler.relocation.Relocator`;
            ``True``: defaults, 60 s per restart; ``False``: off). A gaining relocation is logged, added to
            ``plan_history`` as ``relocation`` and written as a restart spec, with a ``RuntimeWarning`` naming
            the gain; the run itself continues in place.
        restart_spec: where the restart spec goes (default ``<default_root_dir>/hetero_restart.json``).
        apply_relocation: under torchrun with restarts left (``--max-restarts``), apply a relocation whose
            moves stay on their hosts: every rank saves a checkpoint beside the spec and stops with
            :class:`RelocationRestart`; torchrun starts the workers again, ``Trainer.fit(...,
            ckpt_path=resume_checkpoint(spec))`` resumes, each moved rank runs on its slot's ``index`` (with
            ``HeteroDDPStrategy``) and starts from the NCF-predicted time line of the slot. Needs
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment (PyTorch issue #135712: with the
            agent's shared store, restarted workers can read stale addresses); without it, and in plain runs,
            for moves across hosts or with no restarts left, the spec is only written.

    Attributes:
        batch_plan: the current per-rank batch sizes in global-rank order (``None`` before training).
        plan_history: one dict per epoch: ``epoch``, ``batch_sizes``, ``throughput`` (per rank, samples/s of
            compute), ``straggler_level``, ``idle_fraction``, ``predicted_epoch_time``,
            ``measured_epoch_time``, ``samples_per_s``, ``next_batch_sizes``, and per rank ``cpu_percent``,
            ``gpu_util`` and ``gpu_mem_used`` (``None`` where there is no GPU).
    """

    def __init__(
        self,
        allocator: str | Allocator | None = None,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        min_gain: float = 0.03,
        half_life: float = 6.0,
        locality: bool = False,
        balance_eval: bool = True,
        memory_headroom: float = 0.9,
        log_metrics: bool = True,
        replan_every: int | None = 5,
        policy: str | Allocator | None = None,
        cluster: ClusterSource | None = None,
        relocation: bool | Any = True,
        restart_spec: str | os.PathLike[str] | None = None,
        apply_relocation: bool = True,
    ) -> None:
        allocator = resolve_policy(allocator, policy)
        # Validate every option now, in the launching process, before any rank starts.
        probe = BalancePlanner(
            world_size=1, global_batch=max(min_batch_size, 1) if isinstance(min_batch_size, int) else 1,
            allocator=allocator, min_batch_size=min_batch_size, max_batch_size=max_batch_size,
            min_gain=min_gain, half_life=half_life,
        )
        self.allocator = probe.allocator
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.min_gain = min_gain
        self.half_life = half_life
        self.locality = bool(locality)
        self.balance_eval = bool(balance_eval)
        self.memory_headroom = check_float("memory_headroom", memory_headroom, minimum=0.0, maximum=1.0, strict_minimum=True)
        self.log_metrics = bool(log_metrics)
        if replan_every is not None:
            check_int("replan_every", replan_every, minimum=1, hint="use None to replan only at epoch ends")
        self.replan_every = replan_every
        self.cluster = resolve_cluster_source(cluster)
        ClusterAdvisor.check_relocation(relocation)
        self._advisor = ClusterAdvisor(self.cluster, relocation) if self.cluster is not None else None
        self.restart_spec = check_path("restart_spec", restart_spec, hint="e.g. 'runs/hetero_restart.json', or None")
        self.apply_relocation = check_bool("apply_relocation", apply_relocation,
                                           hint="False writes relocations as a restart spec only")
        self._resumed_relocation: dict[str, Any] | None = None
        self._cursor = 0
        self._epoch_parts: list[np.ndarray] = []
        self._plan_changes: list[dict[str, Any]] = []
        self._start_plan: list[int] | None = None
        self.planner: BalancePlanner | None = None
        self.timer = StepTimer()
        self._hook_state: WeightedAllreduceState | None = None
        self._external_weighting: Any = None
        self._pending_state: dict[str, Any] | None = None
        self._train_sampler: HeteroDistributedSampler | HeteroBatchSampler | None = None
        self._epoch_start: float | None = None
        self._epoch_end: float | None = None
        self._warned: set[str] = set()
        self._predict_ordered = False
        self._system: SystemMonitor | None = None
        #: Set by an aggregation mode that carries samples between steps (``"deadline"``): called with the steps
        #: left in the epoch, returns each rank's backlog per step (the same on every rank), which mid-epoch
        #: plans route around.
        self.backlog_fn: Any = None

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

    def attach_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel, world_size: int) -> None:
        """Register the sample-weighted all-reduce hook on ``ddp_model`` (once)."""
        if self._hook_state is not None:
            return
        self._hook_state = WeightedAllreduceState(1.0 / world_size, timer=self.timer)
        ddp_model.register_comm_hook(self._hook_state, weighted_allreduce_hook)

    def attach_weighting(self, weighting: Any) -> None:
        """Use an external gradient weighting (an object with ``set_weight(float)``), e.g. Horovod's."""
        self._external_weighting = weighting

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        norms = [m for m in pl_module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if norms and not any(isinstance(m, torch.nn.SyncBatchNorm) for m in norms) and self.min_batch_size < 8:
            rank_zero_warn(
                f"BatchBalancer: the model has {len(norms)} BatchNorm layer(s) and a rank may get as few as "
                f"{self.min_batch_size} sample(s) per step, which makes BatchNorm statistics noisy. HINT: use "
                "`Trainer(sync_batchnorm=True)` or raise `min_batch_size` (e.g. 8).",
                category=RuntimeWarning,
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.cluster is not None:
            # Rank 0 reads the description; every rank learns whether it is valid, so a bad file stops all
            # ranks with the same error instead of leaving the others waiting in a collective.
            problem, resumed = None, None
            if trainer.is_global_zero:
                try:
                    self._advisor.start(trainer.current_epoch, trainer.world_size)  # type: ignore[union-attr]
                except ValueError as err:
                    problem = str(err)
                resumed = self.resumed_relocation(trainer)
            problem, resumed = trainer.strategy.broadcast((problem, resumed), src=0)
            if problem:
                raise ValueError(problem)
            self._resumed_relocation = resumed
        if self._external_weighting is not None or self._hook_state is not None:
            return
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.attach_ddp(model, trainer.world_size)
        elif trainer.world_size > 1:
            raise RuntimeError(
                f"BatchBalancer needs gradients it can weight, but the strategy {type(trainer.strategy).__name__} "
                "does not wrap the model in DistributedDataParallel. HINT: use strategy='ddp', 'ddp_spawn', "
                "'hetero_ddp' or 'hetero_horovod'."
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        planner = self._ensure_planner(trainer)
        if self._resumed_relocation is not None and planner is not None:
            self._adopt_relocation(trainer, planner, self._resumed_relocation)
            self._resumed_relocation = None
        dl = trainer.train_dataloader
        own = self._own_batch_sampler(trainer)
        if own is not None and planner is not None:
            own.set_plan(planner.plan)  # the next epoch's plan, from step 0
            own.set_epoch(trainer.current_epoch)
        elif isinstance(dl, DataLoader) and trainer.current_epoch > 0:
            self._install(dl, trainer, train=True)
            if self._train_sampler is not None:
                self._train_sampler.set_epoch(trainer.current_epoch)
        self.timer.pop_records()
        self.timer.reset_data_clock()
        self._epoch_start = self._epoch_end = None
        self._cursor = 0
        self._epoch_parts = []
        self._plan_changes = []
        self._start_plan = None if planner is None else list(planner.plan)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        counts = self._step_counts(trainer, batch_idx)
        if counts is not None:
            local, total = counts[trainer.global_rank], sum(counts)
        else:
            local, total = self._batch_size(batch), 0
        weight = local / total if total else 1.0 / trainer.world_size
        if self._hook_state is not None:
            self._hook_state.weight = weight
        if self._external_weighting is not None:
            self._external_weighting.set_weight(weight)
        now = time.perf_counter()
        if self._epoch_start is None:
            self._epoch_start = now
        self.timer.start_step(local)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.mark_backward_end()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.timer.end_step()
        self._epoch_end = time.perf_counter()
        own = self._own_batch_sampler(trainer)
        if own is None or self.planner is None or own.sampler.locality:
            return
        if not self.replan_every and self.backlog_fn is None:
            return
        done = batch_idx + 1
        # Batches already drawn by the loader (Lightning prefetches one; workers prefetch more) keep their
        # plan: a change applies from the first step no rank has drawn yet. Every input to this decision is
        # the same on every rank, so all ranks enter the collectives below together.
        dl = trainer.train_dataloader
        lookahead = 2 + (dl.num_workers * (dl.prefetch_factor or 2) if dl.num_workers else 0)
        if done + lookahead >= len(own):
            return
        if self.replan_every and done % self.replan_every == 0:
            fresh = self._gather_new_records(trainer)
            self.planner.replan(fresh)
            base = trainer.strategy.broadcast(list(self.planner.plan), src=0)
            self.planner.plan = [int(b) for b in base]
        # A backlog (``aggregation="deadline"``) is known identically on every rank, so the re-routed plan
        # needs no collective and is revisited after every step.
        backlog = self.backlog_fn(len(own) - done - lookahead) if self.backlog_fn is not None else None
        plan = self.planner.plan_with_backlog(backlog) if backlog else list(self.planner.plan)
        start = done + lookahead
        if tuple(plan) != tuple(own.plan_at(start)):
            own.set_plan(plan, from_step=start)
            self._plan_changes = [c for c in self._plan_changes if c["step"] < start]
            self._plan_changes.append({"step": start, "batch_sizes": plan})
            if trainer.is_global_zero:
                log.info(f"BatchBalancer: epoch {trainer.current_epoch} step {start}: new plan {plan}")

    def _gather_new_records(self, trainer: pl.Trainer) -> np.ndarray:
        """All ranks' step records since the last exchange, shape (world, steps, 3); kept for the epoch."""
        new = self.timer.records[self._cursor :]
        self._cursor += len(new)
        local = np.array([r.as_tuple() for r in new], dtype=np.float64).reshape(-1, 3)
        gathered, _ = gather_records(trainer.strategy, local)
        self._epoch_parts.append(gathered)
        return gathered

    def _own_batch_sampler(self, trainer: pl.Trainer) -> HeteroBatchSampler | None:
        """The train loader's ``HeteroBatchSampler`` (installed by the strategy or passed by the user)."""
        dl = trainer.train_dataloader
        bs = dl.batch_sampler if isinstance(dl, DataLoader) else None
        return bs if isinstance(bs, HeteroBatchSampler) else None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        planner = self._ensure_planner(trainer)
        if planner is None:
            return
        strategy = trainer.strategy
        new = self.timer.records[self._cursor :]
        self.timer.pop_records()
        records = np.array([r.as_tuple() for r in new], dtype=np.float64).reshape(-1, 3)
        elapsed = (self._epoch_end - self._epoch_start) if self._epoch_start and self._epoch_end else 0.0
        cap = self._local_memory_cap(trainer)
        stats = self._monitor(trainer).read()
        # Steps per rank are equal under DDP, but pad defensively so the gather never mismatches.
        gathered, elapsed_all = gather_records(strategy, records, extra=elapsed)
        observed = sum(p.shape[1] for p in self._epoch_parts)
        if self._epoch_parts:
            gathered = np.concatenate(self._epoch_parts + [gathered], axis=1)
        local = [float(cap)] + [float(stats.get(k, -1.0)) for k in ("cpu_percent", "gpu_util", "gpu_mem_used")]
        table = _gather(strategy, torch.tensor(local, dtype=torch.float64)).reshape(-1, 4).tolist()
        caps = [None if row[0] < 0 else int(row[0]) for row in table]
        data = data_times(gathered) if self._advisor is not None and trainer.is_global_zero else []
        upcoming = self._set_cluster_context(trainer, planner, data)
        entry = planner.end_epoch(
            trainer.current_epoch, gathered, epoch_time=float(elapsed_all.max()), memory_caps=caps,
            observed_steps=observed, start_plan=self._start_plan,
        )
        entry["plan_changes"] = list(self._plan_changes)
        self._epoch_parts, self._cursor = [], 0
        # Rank 0 decides (it alone may hold the cluster context): every rank adopts its plan and its record of it.
        decided = strategy.broadcast({"plan": list(planner.plan), "predicted_gain": entry.get("predicted_gain"),
                                      "plan_changed": entry.get("plan_changed"),
                                      "predicted_step_time": planner.predicted_step_time}, src=0)
        planner.plan = [int(b) for b in decided["plan"]]
        entry["next_batch_sizes"] = list(planner.plan)
        entry["predicted_gain"], entry["plan_changed"] = decided["predicted_gain"], decided["plan_changed"]
        planner.predicted_step_time = decided["predicted_step_time"]
        if self.cluster is not None:
            entry["relocation"] = strategy.broadcast(
                self._relocate(trainer, planner, int(gathered.shape[1]), data, upcoming), src=0)
            if entry["relocation"] and entry["relocation"].get("checkpoint"):
                self._restart_for_relocation(trainer, entry["relocation"])
        for col, key in ((1, "cpu_percent"), (2, "gpu_util"), (3, "gpu_mem_used")):
            values = [None if row[col] < 0 else row[col] for row in table]
            entry[key] = values
        if self.log_metrics:
            metrics = {f"hetero/batch_size/rank_{r}": float(b) for r, b in enumerate(entry["batch_sizes"])}
            metrics["hetero/straggler_level"] = float(entry["straggler_level"])
            metrics["hetero/idle_fraction"] = float(entry["idle_fraction"])
            if entry["samples_per_s"] is not None:
                metrics["hetero/samples_per_s"] = float(entry["samples_per_s"])
            pl_module.log_dict(metrics, sync_dist=True)  # equal on every rank; the sync only silences a warning
        if trainer.is_global_zero:
            log.info(
                f"BatchBalancer: epoch {entry['epoch']} batch sizes {entry['batch_sizes']} straggler level "
                f"{entry['straggler_level']:.3f}; next {entry['next_batch_sizes']}"
            )

    # ------------------------------------------------------------------ stage 2: cluster context, relocation
    def _set_cluster_context(self, trainer: pl.Trainer, planner: BalancePlanner, data: list[float]) -> ClusterView | None:
        """Rank 0: read the next epoch's placement and hand the allocator what changes (before it decides)."""
        if self._advisor is None or not trainer.is_global_zero:
            return None
        return self._advisor.before_decision(trainer.current_epoch, trainer.world_size, planner.allocator, data)

    def _relocate(self, trainer: pl.Trainer, planner: BalancePlanner, steps: int, data: list[float],
                  upcoming: ClusterView | None) -> dict[str, Any] | None:
        """Rank 0: would moving ranks to free slots pay for a restart? Write the restart spec if so."""
        if self._advisor is None or not trainer.is_global_zero:
            return None
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1 << 20
        out = self._advisor.relocate(upcoming, planner, steps, max_epochs - trainer.current_epoch - 1, data)
        if out is None:
            return None
        decision, new = out
        info = self._advisor.info(trainer.current_epoch + 1, decision)
        if new and upcoming is not None:
            from hetero_plugins.scheduler.relocation import torchelastic_restarts, write_relocation_spec

            path = self.spec_path(trainer)
            extra: dict[str, Any] = {}
            elastic = torchelastic_restarts()
            places = upcoming.places
            same_host = all(places[r].get("host") is None or upcoming.free_slots[k].get("host") is None
                            or places[r]["host"] == upcoming.free_slots[k]["host"] for r, k in decision.moves)
            restarts_left = elastic is not None and elastic[1] < elastic[2]
            if self.apply_relocation and restarts_left and same_host and \
                    os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                self._warn_once("shared-store", (
                    "BatchBalancer: not restarting to apply the relocation: torchrun shares its rendezvous store "
                    "with the workers, and restarted workers can then read the previous attempt's addresses and "
                    "fail to connect (PyTorch issue #135712). HINT: launch torchrun with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to let relocations restart the workers."))
            elif self.apply_relocation and restarts_left and same_host:
                extra = {"checkpoint": os.path.join(os.path.dirname(os.path.abspath(path)), "hetero_relocation.ckpt"),
                         "run_id": elastic[0], "restart_count": elastic[1]}  # type: ignore[index]
            elif self.apply_relocation and elastic is not None and not same_host:
                log.warning("BatchBalancer: the relocation moves ranks across hosts, which a torchrun restart "
                            "cannot do; the spec is written for the launcher.")
            info["spec"] = str(write_relocation_spec(path, decision, places, upcoming.free_slots,
                                                     epoch=trainer.current_epoch + 1, extra=extra))
            info["checkpoint"] = extra.get("checkpoint")
            log.warning("BatchBalancer: relocation %s predicted %.1f%% faster; spec %s", decision.moves,
                        100 * decision.predicted_gain, info["spec"])
        return info

    def spec_path(self, trainer: pl.Trainer) -> str:
        """Where the restart spec goes: ``restart_spec``, or ``<default_root_dir>/hetero_restart.json``."""
        return str(self.restart_spec or os.path.join(trainer.default_root_dir, "hetero_restart.json"))

    def resumed_relocation(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The restart spec this fit resumes from (its checkpoint is ``trainer.ckpt_path``), else ``None``."""
        from hetero_plugins.scheduler.relocation import read_relocation_spec

        spec = read_relocation_spec(self.spec_path(trainer))
        ckpt = trainer.ckpt_path
        if spec is None or not spec.get("checkpoint") or not ckpt:
            return None
        return spec if os.path.abspath(str(ckpt)) == os.path.abspath(spec["checkpoint"]) else None

    def _restart_for_relocation(self, trainer: pl.Trainer, info: dict[str, Any]) -> None:
        """Every rank: checkpoint, then stop so that torchrun restarts the workers on the new placement."""
        trainer.save_checkpoint(info["checkpoint"])
        trainer.strategy.barrier("hetero_relocation")
        raise RelocationRestart(
            f"hetero_plugins: stopping the workers to apply the relocation {info['moves']} (rank, free slot), "
            f"predicted {100 * info['predicted_gain']:.1f}% faster steps; torchrun restarts them, and "
            f"Trainer.fit(..., ckpt_path=resume_checkpoint({info['spec']!r})) resumes from {info['checkpoint']!r}.")

    def _adopt_relocation(self, trainer: pl.Trainer, planner: BalancePlanner, spec: dict[str, Any]) -> None:
        """After a relocation restart: moved ranks start from their slot's predicted line; plan again."""
        moved = {int(m["rank"]) for m in spec.get("moves", [])}
        for entry in spec.get("ranks", []):
            r = int(entry["rank"])
            if r in moved and r < planner.world_size and entry.get("line"):
                planner.seed_model(r, entry["line"])
        planner.replan()
        plan = trainer.strategy.broadcast(list(planner.plan), src=0)
        planner.plan = [int(b) for b in plan]
        if trainer.is_global_zero:
            log.info("BatchBalancer: resumed after relocating rank(s) %s; plan %s", sorted(moved), planner.plan)

    def state_dict(self) -> dict[str, Any]:
        if self.planner is not None:
            return {"planner": self.planner.state_dict()}
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = dict(state_dict)
        if self.planner is not None and "planner" in state_dict:
            self.planner.load_state_dict(state_dict["planner"])
            self._pending_state = None

    # ------------------------------------------------------------------ data loaders
    def prepare_dataloader(self, dataloader: object, trainer: pl.Trainer) -> object:
        """Install per-rank batch sizes in a loader Lightning prepared (called by ``HeteroDDPStrategy``)."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        stage = trainer.state.stage
        if stage == RunningStage.TRAINING:
            return self._train_loader(dataloader, trainer)
        elif stage == RunningStage.PREDICTING and self.balance_eval:
            return self._predict_loader(dataloader, trainer)
        elif self.balance_eval and stage is not None:
            self._install(dataloader, trainer, train=False)
        return dataloader

    def _train_loader(self, dl: DataLoader, trainer: pl.Trainer) -> DataLoader:
        """The train loader with a :class:`HeteroBatchSampler` in place of Lightning's ``DistributedSampler``:
        same dataset, seed, shuffling and ``drop_last``; batches drawn step by step, so plans can change
        mid-epoch."""
        bs = dl.batch_sampler
        if type(bs) is not BatchSampler or type(bs.sampler) is not DistributedSampler:
            self._install(dl, trainer, train=True)  # a user HeteroBatchSampler, or a warning
            return dl
        inner = bs.sampler
        planner = self._ensure_planner(trainer, dl)
        if planner is None:
            return dl
        hb = HeteroBatchSampler(
            len(inner.dataset), planner.plan, trainer.global_rank, shuffle=inner.shuffle, seed=inner.seed,  # type: ignore[arg-type]
            drop_last=bool(inner.drop_last or bs.drop_last), locality=self.locality,
        )
        hb.set_epoch(trainer.current_epoch)
        self._train_sampler = hb  # type: ignore[assignment]
        return _loader_like(dl, hb)

    def _predict_loader(self, dl: DataLoader, trainer: pl.Trainer) -> DataLoader:
        """A loader over this rank's contiguous slice of the prediction order, in batches of its planned size.

        Lightning's prediction sampler hands out every world-size-th sample with equal counts; the order it
        would visit is kept (its ``dataset`` maps positions to indices), cut into contiguous per-rank slices
        sized by the plan, so that concatenating all ranks' outputs restores the dataset order.
        """
        inner = getattr(dl.batch_sampler, "sampler", None)
        local = getattr(dl.batch_sampler, "batch_size", None)
        if not isinstance(inner, DistributedSampler) or not isinstance(local, int):
            self._warn_once("predict", "BatchBalancer: the predict loader is not a batched DataLoader with "
                            "Lightning's distributed sampler; predictions keep equal batches and rank order.")
            return dl
        positions = inner.dataset  # Lightning's wrapper: position -> index of the user's sampler order
        order = [int(positions[p]) for p in range(len(positions))]  # type: ignore[arg-type]
        plan = self._plan_for(trainer, False, local, trainer.world_size)
        self._predict_ordered = True
        return _loader_like(dl, HeteroInferenceBatchSampler(order, plan, trainer.global_rank))

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank's predictions, concatenated in rank order, which is dataset order (see ``_predict_loader``)."""
        if not self._predict_ordered or trainer.world_size == 1:
            return
        predictions = trainer.predict_loop.predictions
        if not isinstance(predictions, list) or (predictions and isinstance(predictions[0], list)):
            return  # several predict loaders: left as Lightning returns them
        gathered: list[Any] = []
        for src in range(trainer.world_size):
            gathered += trainer.strategy.broadcast(list(predictions) if trainer.global_rank == src else None, src=src)
        predictions[:] = gathered

    def _ensure_planner(self, trainer: pl.Trainer, dl: object = None) -> BalancePlanner | None:
        if self.planner is not None:
            return self.planner
        dl = trainer.train_dataloader if dl is None else dl
        if not isinstance(dl, DataLoader) or dl.batch_sampler is None:
            self._warn_once("loader", "BatchBalancer: the train dataloader is not a single batched DataLoader; "
                            "batch sizes stay as they are.")
            return None
        bs = dl.batch_sampler
        world = trainer.world_size
        if isinstance(bs, HeteroBatchSampler):
            plan, n = list(bs.plan), bs.sampler.num_samples
        else:
            inner = getattr(bs, "sampler", None)
            if isinstance(inner, HeteroDistributedSampler):
                plan, n = list(inner.plan), inner.num_samples
            else:
                local = getattr(bs, "batch_size", None)
                if not isinstance(local, int):
                    return None
                plan = [local] * world
                n = len(inner.dataset) if isinstance(inner, DistributedSampler) else len(dl.dataset)  # type: ignore[arg-type]
        global_batch = sum(plan)
        if n < global_batch:
            raise ValueError(
                f"the training dataset has {n} samples, fewer than one global batch of {global_batch} "
                f"(batch_size {plan[0]} x {world} ranks). HINT: lower the DataLoader's batch_size to at most "
                f"{max(1, n // world)}."
            )
        self.planner = BalancePlanner(
            world_size=world, global_batch=global_batch, allocator=self.allocator,
            min_batch_size=self.min_batch_size, max_batch_size=self.max_batch_size,
            min_gain=self.min_gain, half_life=self.half_life, initial_plan=plan,
        )
        if self._pending_state and "planner" in self._pending_state:
            self.planner.load_state_dict(self._pending_state["planner"])
            self._pending_state = None
        return self.planner

    def _install(self, dl: DataLoader, trainer: pl.Trainer, train: bool) -> bool:
        bs = dl.batch_sampler
        rank, world = trainer.global_rank, trainer.world_size
        if isinstance(bs, HeteroBatchSampler):
            sampler: HeteroDistributedSampler = bs.sampler
            local_batch = None
        elif type(bs) is BatchSampler and isinstance(bs.sampler, (HeteroDistributedSampler, DistributedSampler)):
            sampler = bs.sampler  # type: ignore[assignment]
            local_batch = bs.batch_size
        else:
            kind = type(getattr(bs, "sampler", bs)).__name__
            self._warn_once(
                f"sampler-{kind}",
                f"BatchBalancer: cannot rebalance a loader whose sampler is {kind}; its batches stay equal. "
                "HINT: let Lightning inject its DistributedSampler (use_distributed_sampler=True) or pass a "
                "hetero_plugins.HeteroBatchSampler as batch_sampler.",
            )
            return False
        if isinstance(sampler, DistributedSampler) and not isinstance(sampler, HeteroDistributedSampler):
            if type(sampler) is not DistributedSampler:
                self._warn_once("dsw", f"BatchBalancer: cannot rebalance {type(sampler).__name__}; batches stay equal.")
                return False
            n = len(sampler.dataset)  # type: ignore[arg-type]
            drop_last = bool(sampler.drop_last or bs.drop_last)  # type: ignore[union-attr]
            plan = self._plan_for(trainer, train, int(local_batch), world, dl=dl)  # type: ignore[arg-type]
            sampler = HeteroDistributedSampler(
                n, plan, rank, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=drop_last,
                locality=self.locality, pad_to_world_size=train,
            )
            sampler.set_epoch(trainer.current_epoch)
            bs.sampler = sampler  # type: ignore[union-attr]
        else:
            local = sampler.batch_size if local_batch is None else int(local_batch)
            plan = self._plan_for(trainer, train, local, world, current=sampler.plan, dl=dl)
            if isinstance(bs, HeteroBatchSampler):
                bs.set_plan(plan)
            else:
                sampler.set_plan(plan)
        if isinstance(bs, BatchSampler):
            bs.batch_size = plan[rank]
        if train:
            self._train_sampler = bs if isinstance(bs, HeteroBatchSampler) else sampler  # type: ignore[assignment]
        return True

    def _plan_for(
        self, trainer: pl.Trainer, train: bool, local_batch: int, world: int,
        current: Sequence[int] | None = None,
        dl: object = None,
    ) -> list[int]:
        planner = self._ensure_planner(trainer, dl) if train else self.planner
        if train and planner is not None:
            return list(planner.plan)
        if current is not None and not train and planner is None:
            return list(current)
        # Evaluation: same global eval batch, shared in proportion to the training plan.
        global_eval = local_batch * world if current is None else sum(current)
        shares = [1.0 / world] * world if planner is None else [b / planner.global_batch for b in planner.plan]
        return largest_remainder([s * global_eval for s in shares], global_eval, Bounds.uniform(world, 1))

    def _step_counts(self, trainer: pl.Trainer, batch_idx: int) -> tuple[int, ...] | None:
        s = self._train_sampler
        dl = trainer.train_dataloader
        if s is None or not isinstance(dl, DataLoader):
            return None
        if dl.batch_sampler is not s and getattr(dl.batch_sampler, "sampler", None) is not s:
            return None
        try:
            return s.step_counts(batch_idx)
        except IndexError:
            return None

    @staticmethod
    def _batch_size(batch: Any) -> int:
        try:
            return int(extract_batch_size(batch))
        except Exception:
            return 0

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
        return memory_cap(self.planner.plan[trainer.global_rank], peak, baseline, total, self.memory_headroom)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)


class RelocationRestart(RuntimeError):
    """Raised on every rank to stop the workers so that torchrun restarts them with a relocation applied."""


def _loader_like(dl: DataLoader, batch_sampler: Any) -> DataLoader:
    """A ``DataLoader`` over ``dl``'s dataset with ``dl``'s loading options and another batch sampler."""
    return DataLoader(
        dl.dataset,
        batch_sampler=batch_sampler,
        num_workers=dl.num_workers,
        collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory,
        timeout=dl.timeout,
        worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context,
        prefetch_factor=dl.prefetch_factor,
        persistent_workers=dl.persistent_workers,
        generator=dl.generator,
    )
