"""The self-planning sampler for ``horovodrun`` scripts: per-rank batch sizes planned at every epoch."""


from __future__ import annotations

import collections
import logging
import math
import os
import socket
import sys
import time
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler, default_collate

from hetero_plugins._validation import check_choice, check_int, check_path
from hetero_plugins.aggregation.options import AGGREGATION_MODES, AggregationOptions, resolve_aggregation
from hetero_plugins.aggregation.grad_sync import flat_gradients, set_flat_gradients, sync_sample_weighted, trainable
from hetero_plugins.aggregation.local_sgd import LocalSGDSchedule, weighted_average_
from hetero_plugins.aggregation.microbatch import (
    CarryQueue,
    ClaimKeys,
    DeadlineRule,
    StepClaims,
    batch_length,
    micro_batch_sizes,
    open_claim_store,
    unit_indices,
)
from hetero_plugins.aggregation.pseudo_sync import DelayedExchange, PseudoSyncCorrector
from hetero_plugins.aggregation.work_sharing import deadline_micro_batches, wbsp_micro_batches
from hetero_plugins.balancing.allocators import Allocator
from hetero_plugins.cluster import ClusterSource, resolve_cluster_source
from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor, data_times
from hetero_plugins.balancing.partition import EpochLayout, epoch_layout, epoch_shards
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.telemetry import StepTimer
from hetero_plugins.balancing.partition import resplit_unprocessed, segment_layout, segment_shards, unprocessed_indices
from hetero_plugins.horovod._hvd import hvd as _hvd
from hetero_plugins.horovod.elastic import move_host_slots, register_state_handler
from hetero_plugins.horovod.exchange import get_exchange

log = logging.getLogger(__name__)

__all__ = ["HeteroBatchSampler"]


class HeteroBatchSampler(Sampler[list[int]]):
    """This rank's batches under a plan of per-rank batch sizes that is remade every epoch (Horovod).

    Pass it as ``DataLoader(dataset, batch_sampler=sampler)`` and give it to :func:`DistributedOptimizer`,
    which reports the step timings and weights the gradients. Every rank runs the same number of steps;
    every sample is visited exactly once per epoch over all ranks (a last global batch shorter than the
    world size borrows padding, as ``DistributedSampler`` does; ``drop_last=True`` drops it instead).

    Args:
        num_samples: length of the dataset.
        batch_size: every rank's batch size at the start; the global batch ``batch_size * world_size``
            stays fixed, also when an elastic job changes its world size.
        shuffle: shuffle with a seeded, epoch-dependent order.
        seed: shared by all ranks.
        drop_last: drop the last partial global batch of each epoch.
        locality: keep each rank's shard across epochs and plan changes (LOFT); by default the step
            unions are exactly DistributedSampler's.
        allocator: ``"equal_finish"`` (default), ``"lbb"``, ``"proportional"``, ``"static"`` or an
            :class:`~hetero_plugins.balancing.allocators.Allocator`.
        min_batch_size: smallest local batch a rank may get.
        max_batch_size: largest local batch a rank may get (``None``: unbounded).
        min_gain: predicted relative speed-up a new plan needs before it replaces the current one.
        half_life: forgetting of the per-rank time models, in steps.
        exchange: ``"auto"``, ``"horovod"`` or ``"mpi"`` (see :func:`get_exchange`).
        cluster: the cluster description (stage 2 of the learned scheduler): a JSON file re-read at every
            ``set_epoch``, or a callable ``epoch -> dict`` (see :mod:`hetero_plugins.cluster`); default the file
            named by ``HETERO_PLUGINS_CLUSTER``, else none. Rank 0 reads it: learned allocators (``"dqn"``,
            ``"auto"``) get co-runner changes before deciding, and free slots make rank 0 plan relocations.
        relocation: ``True`` (default :class:`~hetero_plugins.scheduler.relocation.Relocator`), ``False`` or a
            ``Relocator``. A gaining relocation is written to ``restart_spec`` with a ``RuntimeWarning`` naming
            the gain, and recorded in ``plan_history`` as ``relocation``; restarting the job on the new
            placement is left to the launcher.
        restart_spec: path of the restart spec (default ``hetero_restart.json`` in the working directory).
        hosts_file: for elastic Horovod: the file the job's ``--host-discovery-script`` prints (``host:slots``
            lines). Rank 0 applies a relocation whose slots name their ``host`` by rewriting it: one slot
            fewer on the moved rank's host, one more on the free slot's. Horovod then stops the worker on the
            old host and starts one on the new; after the reset each rank's time model follows its host, and
            the new worker starts from the NCF-predicted line of its slot (from the restart spec).

    Attributes:
        planner: the :class:`~hetero_plugins.balancing.planner.BalancePlanner` (identical on every rank).
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
        locality: bool = False,
        allocator: str | Allocator = "equal_finish",
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        min_gain: float = 0.03,
        half_life: float = 6.0,
        exchange: str = "auto",
        cluster: ClusterSource | None = None,
        relocation: bool | Any = True,
        restart_spec: str | os.PathLike[str] | None = None,
        hosts_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.local_batch_size = check_int("batch_size", batch_size, minimum=1, hint="the per-rank batch size at the start")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.locality = bool(locality)
        self._planner_kwargs = dict(
            allocator=allocator, min_batch_size=min_batch_size, max_batch_size=max_batch_size,
            min_gain=min_gain, half_life=half_life,
        )
        self.exchange = get_exchange(exchange)
        world = self.exchange.size()
        self.global_batch = self.local_batch_size * world
        if self.global_batch > num_samples:
            raise ValueError(
                f"`batch_size`={batch_size} x {world} ranks = {self.global_batch} exceeds the dataset's "
                f"{num_samples} samples. HINT: use batch_size <= {max(1, num_samples // world)}."
            )
        self.planner = self._new_planner(world)
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
        source = resolve_cluster_source(cluster)
        ClusterAdvisor.check_relocation(relocation)
        self._advisor = ClusterAdvisor(source, relocation) if source is not None else None
        self.restart_spec = check_path("restart_spec", restart_spec, hint="e.g. 'hetero_restart.json'") or "hetero_restart.json"
        self.hosts_file = check_path("hosts_file", hosts_file, must_exist=True,
                                     hint="pass the file your --host-discovery-script prints (host:slots lines), or None")
        self._hosts: list[str] | None = None  # each rank's slot ("host[local rank]") at the last boundary
        if self._advisor is not None:
            # Rank 0 reads the description; every rank learns its verdict, so a bad one stops them all alike.
            # Not in an elastic job: a worker that joins later builds its sampler alone, so no collective here
            # (rank 0 validates, and its error ends the job).
            problem = None
            if self.exchange.rank() == 0:
                try:
                    self._advisor.start(0, world)
                except ValueError as err:
                    problem = str(err)
            if os.environ.get("HOROVOD_ELASTIC") != "1":
                problem = self.exchange.broadcast_object(problem, name="hetero_plugins.cluster")
            if problem:
                raise ValueError(problem)
        register_state_handler(HeteroBatchSampler)

    # ------------------------------------------------------------------ public surface
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
        self._reconcile_world()
        self._reconcile_hosts()
        started = self._steps_done > 0 or self._order is not None
        if epoch == self._epoch and started and not self._exhausted:
            return  # resuming the interrupted epoch (elastic reset): its plan and progress stay
        self._plan_from_records()
        self._epoch = epoch
        self._start_segment(None)

    def step_counts(self, step: int) -> tuple[int, ...]:
        """All ranks' sample counts of step ``step`` of the current epoch (segment)."""
        return self._segment()[2].step_counts(step)

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
            self._on_yield(b)
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
            self._reconcile_world()
        except ValueError:  # Horovod is between shutdown and init (elastic restore); done at sync/set_epoch
            pass

    # ------------------------------------------------------------------ hooks for DistributedOptimizer
    def _on_yield(self, batch_size: int) -> None:
        if self._epoch_start is None:
            self._epoch_start = time.perf_counter()
        if self._open:
            self._pending.append(batch_size)  # a DataLoader with workers draws batches ahead
        else:
            self.timer.start_step(batch_size)
            self._open = True

    def _on_backward_end(self) -> None:
        self.timer.mark_backward_end()
        self._steps_done += 1

    def _on_step_end(self) -> None:
        if self._open:
            self.timer.end_step()
            self._epoch_end = time.perf_counter()
            self._open = False
        if self._pending:
            self.timer.start_step(self._pending.popleft())
            self._open = True

    # ------------------------------------------------------------------ internals
    def _new_planner(self, world: int) -> BalancePlanner:
        if self.global_batch < world:
            raise ValueError(
                f"the global batch {self.global_batch} cannot give each of {world} ranks a sample. "
                "HINT: start with a larger batch_size or use fewer workers (--max-np)."
            )
        return BalancePlanner(world_size=world, global_batch=self.global_batch, **self._planner_kwargs)

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
        """All-gather last epoch's step records, plan on every rank, broadcast rank 0's plan."""
        records = np.array([r.as_tuple() for r in self.timer.pop_records()], dtype=np.float64).reshape(-1, 3)
        elapsed = (self._epoch_end - self._epoch_start) if self._epoch_start and self._epoch_end else 0.0
        self._epoch_start = self._epoch_end = None
        world = self.exchange.size()
        headers = self.exchange.allgather(np.array([len(records), elapsed]), name="hetero_plugins.header")
        steps = int(headers[:, 0].min())
        if steps == 0:
            if headers[:, 0].max() > 0:
                self._warn_once("uneven", "HeteroBatchSampler: some ranks recorded no steps; plan unchanged.")
            return
        mine = records[-steps:]  # equal on all ranks; the tail if a rank saw more
        gathered = self.exchange.allgather(mine, name="hetero_plugins.records").reshape(world, steps, 3)
        lead = self.exchange.rank() == 0 and self._advisor is not None
        hosts = None if self._hosts is None else [k.rsplit("[", 1)[0] for k in self._hosts]
        data = data_times(gathered) if lead else []
        upcoming = (self._advisor.before_decision(self._epoch, world, self.planner.allocator,  # type: ignore[union-attr]
                                                  data, hosts) if lead else None)
        entry = self.planner.end_epoch(self._epoch, gathered, epoch_time=float(headers[:, 1].max()))
        relocation = self._relocate(upcoming, steps, data) if lead else None
        # Rank 0 decides (it alone may hold the cluster context): every rank adopts its plan and its record.
        decided = self.exchange.broadcast_object(
            {"plan": list(self.planner.plan), "predicted_gain": entry.get("predicted_gain"),
             "plan_changed": entry.get("plan_changed"),
             "predicted_step_time": self.planner.predicted_step_time, "relocation": relocation}, name="hetero_plugins.plan")
        self.planner.plan = [int(b) for b in decided["plan"]]
        entry["next_batch_sizes"] = list(self.planner.plan)
        entry["predicted_gain"], entry["plan_changed"] = decided["predicted_gain"], decided["plan_changed"]
        self.planner.predicted_step_time = decided["predicted_step_time"]
        if self._advisor is not None:
            entry["relocation"] = decided["relocation"]
        if self.exchange.rank() == 0:
            log.info("HeteroBatchSampler: epoch %d batch sizes %s straggler level %.3f; next %s",
                     entry["epoch"], entry["batch_sizes"], entry["straggler_level"], entry["next_batch_sizes"])

    def _relocate(self, upcoming: Any, steps: int, data: list[float]) -> dict[str, Any] | None:
        """Rank 0: would moving ranks to free slots pay for a restart? Write the restart spec if so."""
        out = self._advisor.relocate(upcoming, self.planner, steps, 1 << 20, data)  # type: ignore[union-attr]
        if out is None:
            return None
        decision, new = out
        info = ClusterAdvisor.info(self._epoch + 1, decision)
        if new:
            from hetero_plugins.scheduler.relocation import write_relocation_spec

            places = upcoming.places
            moves = [(places[r].get("host"), upcoming.free_slots[k].get("host")) for r, k in decision.moves]
            apply = self.hosts_file is not None and all(a and b for a, b in moves)
            info["spec"] = str(write_relocation_spec(
                self.restart_spec, decision, places, upcoming.free_slots, epoch=self._epoch + 1,
                extra={"hosts_file": self.hosts_file} if apply else None))
            if apply:
                move_host_slots(self.hosts_file, moves)  # type: ignore[arg-type]
                info["applied"] = "hosts_file"
            log.warning("HeteroBatchSampler: relocation %s predicted %.1f%% faster; spec %s%s", decision.moves,
                        100 * decision.predicted_gain, info["spec"],
                        f"; {self.hosts_file} rewritten, Horovod will reset onto the new hosts" if apply else "")
        return info

    def _reconcile_hosts(self) -> None:
        """With a cluster description: follow each rank's slot across elastic resets (collective).

        Ranks are renumbered when Horovod replaces a worker (a relocation through ``hosts_file``, a lost
        host). Time models belong to slots, so after a reset each rank takes the model of its slot; a slot
        with no model (the new worker of a relocation) starts from the restart spec's predicted line for its
        host, and the unprocessed samples of the epoch in progress are re-split under a new plan.
        """
        if self._advisor is None:
            return
        me = f"{os.environ.get('HOROVOD_HOSTNAME') or socket.gethostname()}[{os.environ.get('HOROVOD_LOCAL_RANK', '0')}]"
        hosts = self.exchange.allgather_object(me, name="hetero_plugins.hosts")
        before, self._hosts = self._hosts, hosts
        if before is None or before == hosts or len(before) != len(hosts) or len(hosts) != self.planner.world_size:
            return
        predicted = None
        if self.exchange.rank() == 0:
            from hetero_plugins.scheduler.relocation import read_relocation_spec

            spec = read_relocation_spec(self.restart_spec) or {}
            predicted = {r.get("host"): r.get("line") for r in spec.get("ranks", []) if r.get("host") and r.get("line")}
        predicted = self.exchange.broadcast_object(predicted, name="hetero_plugins.predicted")
        from hetero_plugins.balancing.time_model import LinearTimeModel

        old = dict(zip(before, self.planner.models))
        fresh = [LinearTimeModel(half_life=m.half_life) for m in self.planner.models]
        self.planner.models = [old.get(key, fresh[i]) for i, key in enumerate(hosts)]
        for i, key in enumerate(hosts):
            line = None if key in old else predicted.get(key.rsplit("[", 1)[0])
            if line:
                self.planner.seed_model(i, line)
        self.planner.replan()
        self.planner.plan = [int(b) for b in self.exchange.broadcast_object(
            list(self.planner.plan), name="hetero_plugins.replan")]
        log.info("HeteroBatchSampler: slots %s -> %s; plan %s", before, hosts, self.planner.plan)
        if self._steps_done > 0 or self._order is not None:
            remaining = self._unprocessed()
            self.timer.pop_records()
            self._start_segment(remaining)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
