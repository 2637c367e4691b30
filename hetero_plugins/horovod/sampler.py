"""The self-planning sampler for ``horovodrun`` scripts: per-rank batch sizes planned at every epoch.

:class:`HeteroBatchSampler` yields this rank's batches under a plan of per-rank batch sizes, times each step
through the hooks :func:`~hetero_plugins.horovod.DistributedOptimizer` calls (:meth:`~HeteroBatchSampler.batch_drawn`,
:meth:`~HeteroBatchSampler.backward_done`, :meth:`~HeteroBatchSampler.step_done`), and at every ``set_epoch``
plans the next epoch through a :class:`~hetero_plugins.balancing.coordinator.PlanCoordinator` over Horovod's
(or ``mpi4py``'s) collectives. Elastic world and host changes are reconciled with
:mod:`hetero_plugins.horovod.elastic`.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from hetero_plugins._validation import check_bool, check_int
from hetero_plugins.balancing.coordinator import PlanCoordinator, start_advisor
from hetero_plugins.balancing.options import BalancingOptions
from hetero_plugins.balancing.partition import EpochLayout, segment_layout, segment_shards, unprocessed_indices
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.cluster import resolve_cluster_source
from hetero_plugins.horovod.elastic import (
    follow_slots,
    predicted_lines,
    register_state_handler,
    relocate_by_hosts_file,
    slot_name,
    slots_moved,
)
from hetero_plugins.horovod.exchange import get_exchange
from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor
from hetero_plugins.telemetry import EPOCH_STATS, StepTimer, SystemMonitor, UtilisationSampler, epoch_stats

log = logging.getLogger(__name__)

__all__ = ["HeteroBatchSampler"]


class HeteroBatchSampler(Sampler[list[int]]):
    """The self-planning sampler for ``horovodrun`` scripts: this rank's batches under a plan of per-rank batch
    sizes that is remade every epoch.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler)`` and give it to :func:`DistributedOptimizer`,
    which reports the step timings and weights the gradients. Every rank runs the same number of steps, and
    over all ranks every sample is visited once per epoch, but for padding: as ``DistributedSampler`` does, the
    epoch's order is padded with samples from its start to a multiple of the world size (a little further if
    the last step would leave a rank without a sample), so when ``num_samples`` is not a multiple of the world
    size a few samples are visited twice. ``drop_last=True`` drops the last, partial global batch.

    Args:
        num_samples: length of the dataset.
        batch_size: every rank's batch size at the start; the global batch ``batch_size * world_size``
            stays fixed, also when an elastic job changes its world size.
        shuffle: shuffle with a seeded, epoch-dependent order.
        seed: shared by all ranks.
        drop_last: drop the last partial global batch of each epoch.
        balancing: the balancing options, see :class:`~hetero_plugins.balancing.options.BalancingOptions`.
            This sampler plans at ``set_epoch`` only: ``allocator``, ``min_batch_size``, ``max_batch_size``,
            ``min_gain``, ``half_life``, ``warmup_steps``, ``locality``, ``cluster``, ``relocation``,
            ``restart_spec`` (default ``hetero_restart.json`` in the working directory) and ``hosts_file`` apply;
            the Lightning options ``balance_eval``, ``memory_headroom``, ``log_metrics``, ``apply_relocation``
            and a mid-epoch ``replan_every`` are refused. Relocations are written to ``restart_spec``; with
            ``hosts_file``, rank 0 applies one by rewriting that file and Horovod resets onto the new hosts.
        exchange: ``"auto"``, ``"horovod"`` or ``"mpi"`` (see :func:`get_exchange`).
        utilisation: what samples this rank's GPU utilisation and memory over each epoch (means stored per rank
            in ``plan_history`` as ``gpu_util`` and ``gpu_mem_used``, beside ``cpu_percent``); default a
            :class:`~hetero_plugins.telemetry.UtilisationSampler` on the current CUDA device (read at the first
            batch, after ``torch.cuda.set_device``), a no-op without a GPU.
        **options: the balancing options as keywords (``allocator="lbb"``, ``min_batch_size=8``, ...).

    Attributes:
        options: the :class:`~hetero_plugins.balancing.options.BalancingOptions` in force.
        planner: the :class:`~hetero_plugins.balancing.planner.BalancePlanner` (identical on every rank).
        coordinator: the :class:`~hetero_plugins.balancing.coordinator.PlanCoordinator` that plans every epoch.
        timer: this rank's :class:`~hetero_plugins.telemetry.StepTimer`.

    Example::

        hvd.init()
        sampler = hh.HeteroBatchSampler(len(train_set), batch_size=32, seed=0)
        loader = DataLoader(train_set, batch_sampler=sampler)
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        balancing: BalancingOptions | None = None,
        exchange: str = "auto",
        utilisation: UtilisationSampler | None = None,
        **options: Any,
    ) -> None:
        if utilisation is not None and not isinstance(utilisation, UtilisationSampler):
            raise TypeError(f"`utilisation` must be a UtilisationSampler or None, got {type(utilisation).__name__}. "
                            "HINT: leave it out for NVML readings on the current CUDA device.")
        self._utilisation = utilisation
        self._monitor: SystemMonitor | None = None
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.local_batch_size = check_int("batch_size", batch_size, minimum=1, hint="the per-rank batch size at the start")
        asked = options.get("replan_every")  # the default (5, for Lightning) cannot tell an explicit 5 from none
        if asked is not None:
            raise ValueError(f"`replan_every`={asked!r} does not apply to hetero_plugins.horovod.HeteroBatchSampler: "
                             "this sampler plans at set_epoch only. HINT: leave `replan_every` out.")
        opts = BalancingOptions.from_kwargs(balancing, options)
        if options:
            raise TypeError(f"HeteroBatchSampler got unexpected keyword argument(s) {sorted(options)}. HINT: the "
                            "options are those of hetero_plugins.balancing.BalancingOptions.")
        lightning_only = "it is an option of the Lightning integration; this sampler plans at set_epoch only."
        opts.refuse("hetero_plugins.horovod.HeteroBatchSampler",
                    {"balance_eval": "this sampler serves the training loader only.",
                     "replan_every": "this sampler plans at set_epoch only (use None or leave it out).",
                     "memory_headroom": lightning_only, "log_metrics": lightning_only,
                     "apply_relocation": "relocations are applied through `hosts_file` here."},
                    allowed={"replan_every": (None,)})
        self.options = opts
        self.shuffle = check_bool("shuffle", shuffle, hint="False keeps the dataset's order")
        self.seed = check_int("seed", seed, minimum=0, hint="the shuffling seed every rank shares, e.g. 0")
        self.drop_last = check_bool("drop_last", drop_last, hint="True drops the epoch's last, partial step")
        self.locality = opts.locality
        self.exchange = get_exchange(exchange)
        world = self.exchange.size()
        self.global_batch = self.local_batch_size * world
        if self.global_batch > num_samples:
            raise ValueError(
                f"`batch_size`={batch_size} x {world} ranks = {self.global_batch} exceeds the dataset's "
                f"{num_samples} samples. HINT: use batch_size <= {max(1, num_samples // world)}."
            )
        source = resolve_cluster_source(opts.cluster)
        self._advisor = ClusterAdvisor(source, opts.relocation) if source is not None else None
        self.coordinator = PlanCoordinator(self._new_planner(world), self.exchange, self._advisor, align="tail",
                                           label="HeteroBatchSampler", logger=log)
        self.timer = StepTimer()
        self._epoch = 0
        self._steps_done = 0
        self._order: np.ndarray | None = None  # None: the whole epoch; else the remainder being resumed
        self._seg_plan: tuple[int, ...] = tuple(self.planner.plan)
        self._exhausted = False
        self._cache: tuple[Any, list[np.ndarray], EpochLayout] | None = None
        self._open = False
        self._pending: collections.deque[int] = collections.deque()
        self._epoch_start: float | None = None
        self._epoch_end: float | None = None
        self._warned: set[str] = set()
        self.restart_spec = opts.restart_spec or "hetero_restart.json"
        self.hosts_file = opts.hosts_file
        self._hosts: list[str] | None = None  # each rank's slot ("host[local rank]") at the last boundary
        if self._advisor is not None:
            # Not collective in an elastic job: a worker that joins later builds its sampler alone (rank 0
            # validates, and its error ends the job).
            start_advisor(self._advisor, self.exchange, 0, world,
                          collective=os.environ.get("HOROVOD_ELASTIC") != "1")
        register_state_handler(HeteroBatchSampler)

    # ------------------------------------------------------------------ public surface
    @property
    def planner(self) -> BalancePlanner:
        """The planner (identical on every rank); the coordinator plans with it."""
        return self.coordinator.planner

    @planner.setter
    def planner(self, planner: BalancePlanner) -> None:
        self.coordinator.planner = planner

    @property
    def plan(self) -> list[int]:
        """Per-rank batch sizes of the current epoch (segment), global-rank order."""
        return list(self._seg_plan)

    @property
    def rank(self) -> int:
        return self.exchange.rank()

    @property
    def world_size(self) -> int:
        return len(self._seg_plan)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def steps_done(self) -> int:
        """Steps of the current epoch (segment) whose backward pass completed."""
        return self._steps_done

    @property
    def batch_size(self) -> int:
        """This rank's local batch size under the current plan."""
        return self._seg_plan[self.rank]

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """One dict per observed epoch (see :class:`~hetero_plugins.callbacks.BatchBalancer`)."""
        return list(self.planner.history)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` under the plan made from the last epoch's timings. Collective.

        Every rank must call it before iterating the loader. Calling it again for the epoch in progress
        (as an elastic ``train`` function does after a reset) resumes that epoch where it stopped.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        self._check_agreement()
        self._reconcile_world()
        self._reconcile_hosts()
        started = self._steps_done > 0 or self._order is not None
        if epoch == self._epoch and started and not self._exhausted:
            return  # resuming the interrupted epoch (elastic reset): its plan and progress stay
        self._plan_from_records()
        self._epoch = epoch
        self._start_segment(None)

    def segment(self) -> EpochLayout:
        """The layout of the current epoch (segment): its steps and every rank's sample count per step."""
        return self._segment()[2]

    def step_counts(self, step: int) -> tuple[int, ...]:
        """All ranks' sample counts of step ``step`` of the current epoch (segment)."""
        return self.segment().step_counts(step)

    def batch_indices(self, step: int, rank: int | None = None) -> list[int]:
        """The sample indices of ``rank``'s batch at step ``step`` of the current epoch (segment).

        Any rank can compute any other rank's batch (the ``wbsp`` aggregation loads micro-batches of a slower
        rank's share this way); ``rank`` defaults to this rank.

        Example::

            sampler.batch_indices(3, rank=1)   # what rank 1's loader yields at step 3
        """
        _, shards, layout = self._segment()
        rank = self.rank if rank is None else check_int("rank", rank, minimum=0)
        if rank >= len(shards):
            raise ValueError(f"`rank`={rank} is out of range for {len(shards)} ranks.")
        check_int("step", step, minimum=0)
        if step >= layout.steps:
            raise ValueError(f"`step`={step} is out of range for an epoch (segment) of {layout.steps} steps.")
        start = step * layout.plan[rank]  # every step before the last holds the plan's counts
        return shards[rank][start : start + layout.step_counts(step)[rank]].tolist()

    def current_weight(self) -> float:
        """This rank's share b_i / B of the samples of the step in progress (1 / world size past the end)."""
        layout = self._segment()[2]
        if self._steps_done >= layout.steps:
            self._warn_once("past-end", "HeteroBatchSampler: more backward passes than batches this epoch; "
                            "weighting them equally. HINT: call sampler.set_epoch(epoch) every epoch.")
            return 1.0 / self.world_size
        counts = layout.step_counts(self._steps_done)
        return counts[self.rank] / sum(counts)

    def __iter__(self) -> Iterator[list[int]]:
        self._reconcile_world()
        if self._exhausted:
            self._warn_once("no-set-epoch", "HeteroBatchSampler: iterated again without set_epoch(); repeating "
                            "the epoch under the same plan. HINT: call sampler.set_epoch(epoch) every epoch.")
            self._start_segment(self._order)
        shards, layout = self._segment()[1], self._segment()[2]
        rank = self.rank
        shard = shards[rank]
        self._open = False
        self._pending.clear()
        self.timer.reset_data_clock()
        start = sum(layout.step_counts(s)[rank] for s in range(min(self._steps_done, layout.steps)))
        for step in range(self._steps_done, layout.steps):
            b = layout.step_counts(step)[rank]
            self.batch_drawn(b)
            yield shard[start : start + b].tolist()
            start += b
        self._exhausted = True

    def __len__(self) -> int:
        """Batches left in the current epoch (segment); equal on every rank."""
        return max(0, self._segment()[2].steps - (0 if self._exhausted else self._steps_done))

    def state_dict(self) -> dict[str, Any]:
        """Epoch, progress and planner: what ``hvd.elastic.TorchState`` commits and a checkpoint keeps."""
        return {
            "epoch": self._epoch,
            "steps_done": self._steps_done,
            "order": None if self._order is None else self._order.tolist(),
            "seg_plan": list(self._seg_plan),
            "planner": self.planner.state_dict(),
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
            "hosts": self._hosts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a different world size re-splits the epoch's unprocessed samples."""
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"the sampler state is for num_samples={state['num_samples']}, but this sampler has "
                f"num_samples={self.num_samples}. HINT: restore into a sampler built on the same dataset."
            )
        # The global batch is the run's constant (set where the job started); a worker that joins later
        # computed its own from the world size it saw, so it adopts the committed one.
        self.global_batch = int(state["global_batch"])
        saved_planner = state["planner"]
        self.planner = self._new_planner(int(saved_planner["world_size"]))
        self.planner.load_state_dict(saved_planner)
        self._epoch = int(state["epoch"])
        self._steps_done = int(state["steps_done"])
        self._order = None if state["order"] is None else np.asarray(state["order"], dtype=np.int64)
        self._seg_plan = tuple(int(b) for b in state["seg_plan"])
        self._hosts = state.get("hosts")
        self._cache = None
        self._exhausted = False
        self._open = False
        self._pending.clear()
        self.timer.pop_records()  # timings of rolled-back or other-world steps would mislead the planner
        self._epoch_start = self._epoch_end = None
        try:
            self.exchange.size()
        except ValueError:  # Horovod is between shutdown and init (elastic restore): done at sync / set_epoch
            return
        self._reconcile_world()  # its own errors (a global batch too small for the world...) surface here

    # ------------------------------------------------------------------ step hooks (DistributedOptimizer calls them)
    def batch_drawn(self, batch_size: int) -> None:
        """The loader drew a batch of ``batch_size`` samples: its step's time starts now (or when the step
        before it ends, if the loader draws ahead)."""
        if self._epoch_start is None:
            self._epoch_start = time.perf_counter()
            self._telemetry()[0].start()
        if self._open:
            self._pending.append(batch_size)  # a DataLoader with workers draws batches ahead
        else:
            self.timer.start_step(batch_size)
            self._open = True

    def backward_done(self) -> None:
        """This rank's gradients of the step are ready (before the all-reduce waits for the others)."""
        self.timer.mark_backward_end()
        self._steps_done += 1

    def step_done(self) -> None:
        """The optimizer step (or an accumulated micro-batch) ended: close the step's timing."""
        if self._open:
            self.timer.end_step()
            self._epoch_end = time.perf_counter()
            self._open = False
        if self._pending:
            self.timer.start_step(self._pending.popleft())
            self._open = True

    # ------------------------------------------------------------------ internals
    def _check_agreement(self) -> None:
        """Every rank built this sampler alike, or every rank raises naming the ranks that differ and how
        (collective; one bounded ``allgather_object``). Ranks that disagree would otherwise lay out different
        epochs and wait for each other in collectives that never match, or, on ``locality`` (which cuts the
        shards differently but keeps the steps), silently visit some samples twice and others never.

        It runs at every ``set_epoch``, not only the first: a worker that joins an elastic job checks along
        with the others. It compares the global batch (``batch_size`` x world size at the start, which such a
        worker adopts from the committed state), not each rank's ``batch_size``.
        """
        mine = {"num_samples": self.num_samples, "batch_size": self.local_batch_size, "global": self.global_batch,
                "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last, "locality": self.locality}
        everyone = self.exchange.allgather_object(mine, name="hetero_plugins.sampler.arguments")
        first = everyone[0]
        problems = []
        for r, theirs in enumerate(everyone[1:], start=1):
            for key in ("num_samples", "global", "shuffle", "seed", "drop_last", "locality"):
                if theirs.get(key) == first.get(key):
                    continue
                if key == "global":
                    problems.append(f"rank {r} has batch_size={theirs['batch_size']} (global batch {theirs['global']}) "
                                    f"but rank 0 has batch_size={first['batch_size']} (global batch {first['global']})")
                else:
                    problems.append(f"rank {r} has {key}={theirs.get(key)!r} but rank 0 has {key}={first.get(key)!r}")
        if problems:
            raise ValueError(
                "hh.HeteroBatchSampler is built differently on different ranks: " + "; ".join(problems) + ". "
                "HINT: build it with the same num_samples (len of the same dataset), batch_size, shuffle, seed, "
                "drop_last and locality on every rank."
            )

    def _new_planner(self, world: int) -> BalancePlanner:
        if self.global_batch < world:
            raise ValueError(
                f"the global batch {self.global_batch} cannot give each of {world} ranks a sample. "
                "HINT: start with a larger batch_size or use fewer workers (--max-np)."
            )
        return self.options.planner(world, self.global_batch)

    def _segment(self) -> tuple[Any, list[np.ndarray], EpochLayout]:
        key = (self._epoch, self._seg_plan, None if self._order is None else id(self._order))
        if self._cache is None or self._cache[0] != key:
            layout = segment_layout(self.num_samples, self._seg_plan, self._order, self.drop_last)
            shards = segment_shards(
                self.num_samples, self._seg_plan, self._order, self._epoch, self.seed, self.shuffle,
                self.drop_last, self.locality,
            )
            self._cache = (key, shards, layout)
        return self._cache

    def _start_segment(self, order: np.ndarray | None) -> None:
        self._order = order
        self._seg_plan = tuple(self.planner.plan)
        self._steps_done = 0
        self._exhausted = False
        self._cache = None

    def _unprocessed(self) -> np.ndarray:
        """The samples of the current segment that no committed step has processed yet."""
        _, shards, layout = self._segment()
        return unprocessed_indices(shards, layout, min(self._steps_done, layout.steps))

    def _reconcile_world(self) -> None:
        """After an elastic reset to another world size: re-split the unprocessed samples, new plan."""
        world = self.exchange.size()
        if world == len(self._seg_plan):
            return
        remaining = self._unprocessed()
        history = list(self.planner.history)
        old = list(self._seg_plan)
        self.planner = self._new_planner(world)
        self.planner.history = history
        log.info("HeteroBatchSampler: world size %d -> %d; %d samples of epoch %d left, plan %s -> %s",
                 len(old), world, len(remaining), self._epoch, old, self.planner.plan)
        self.timer.pop_records()
        self._start_segment(remaining)

    def _plan_from_records(self) -> None:
        """Plan the next epoch from the last one's step records (collective; rank 0 decides, all adopt)."""
        records = np.array([r.as_tuple() for r in self.timer.pop_records()], dtype=np.float64).reshape(-1, 3)
        elapsed = (self._epoch_end - self._epoch_start) if self._epoch_start and self._epoch_end else 0.0
        self._epoch_start = self._epoch_end = None
        hosts = None if self._hosts is None else [k.rsplit("[", 1)[0] for k in self._hosts]
        stats = epoch_stats(*self._telemetry())
        entry = self.coordinator.end_epoch(self._epoch, records, elapsed, hosts=hosts,
                                           local_extra=[float(stats.get(k, -1.0)) for k in EPOCH_STATS],
                                           write_relocation=functools.partial(relocate_by_hosts_file,
                                                                              self.restart_spec, self.hosts_file))
        if entry is not None:
            for col, key in enumerate(EPOCH_STATS):
                entry[key] = [None if v < 0 else float(v) for v in self.coordinator.extras[:, col]]

    def _telemetry(self) -> tuple[UtilisationSampler, SystemMonitor]:
        """This rank's epoch sampler and CPU monitor, on the current CUDA device where torch sees one."""
        if self._utilisation is None or self._monitor is None:
            gpu = None
            try:
                import torch

                gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
            except Exception:  # no driver or a broken CUDA install: CPU readings only
                gpu = None
            if self._utilisation is None:
                self._utilisation = UtilisationSampler(gpu)
            self._monitor = SystemMonitor(gpu)
            if gpu is not None:  # compute times from CUDA events: the host only queues the GPU's work
                self.timer.set_device(f"cuda:{gpu}")
        return self._utilisation, self._monitor

    def _reconcile_hosts(self) -> None:
        """With a cluster description: follow each rank's slot across elastic resets (collective).

        Ranks are renumbered when Horovod replaces a worker (a relocation through ``hosts_file``, a lost
        host). Time models belong to slots, so after a reset each rank takes the model of its slot; a slot
        with no model (the new worker of a relocation) starts from the restart spec's predicted line for its
        host, and the unprocessed samples of the epoch in progress are re-split under a new plan.
        """
        if self._advisor is None:
            return
        hosts = self.exchange.allgather_object(slot_name(), name="hetero_plugins.hosts")
        before, self._hosts = self._hosts, hosts
        if not slots_moved(before, hosts, self.planner.world_size):
            return
        predicted = predicted_lines(self.restart_spec) if self.exchange.rank() == 0 else None
        predicted = self.exchange.broadcast_object(predicted, name="hetero_plugins.predicted")
        follow_slots(self.planner, before, hosts, predicted)  # type: ignore[arg-type]
        self.coordinator.replan()
        log.info("HeteroBatchSampler: slots %s -> %s; plan %s", before, hosts, self.planner.plan)
        if self._steps_done > 0 or self._order is not None:
            remaining = self._unprocessed()
            self.timer.pop_records()
            self._start_segment(remaining)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
