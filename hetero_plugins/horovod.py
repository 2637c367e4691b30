"""Hooks for plain ``horovodrun`` scripts: per-rank batch sizes, sample-weighted gradients, elastic epochs.

The contract (see ``docs/horovod.md`` and ``examples/horovod_train.py``)::

    import horovod.torch as hvd
    import hetero_plugins.horovod as hh

    hvd.init()
    sampler = hh.HeteroBatchSampler(len(dataset), batch_size=32, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    optimizer = hh.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)   # collective: applies the plan made from the last epoch's timings
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

``batch_size`` is each rank's batch at the start; the global batch ``batch_size * hvd.size()`` never changes.
Rank i's gradient is scaled by its share b_i / B of the step's samples before Horovod sums (``op=hvd.Sum``),
so the update equals one process stepping on the union of the step's samples (LBB, Yao et al. 2024, and DBS,
Ye et al. 2020, aggregate exactly so; Horovod's default ``op=hvd.Average`` would weight every rank equally).
Each rank's compute time per step is measured from the moment its batch is drawn until its last gradient
is ready, before the all-reduce makes it wait for the others; at ``set_epoch`` the ranks all-gather these
records (``hvd.allgather``; ``mpi4py`` under a plain ``mpirun`` launch), every rank feeds them to its
:class:`~hetero_plugins.planner.BalancePlanner`, and rank 0's plan is broadcast (``hvd.broadcast_object``).

``DistributedOptimizer(..., aggregation=...)`` chooses how a step's work becomes one update (see
:mod:`hetero_plugins.aggregation`): ``"weighted"`` (the default, above), or ``"deadline"``, ``"wbsp"``,
``"pseudo_sync"``, ``"local_sgd"``, which return an :class:`AggregatingOptimizer` that exchanges through
``hvd.allreduce`` itself. ``"deadline"`` and ``"wbsp"`` cut each step into micro-batches handed out by
``optimizer.micro_batches(batch)`` (in the other modes it yields the batch once, so one loop serves all)::

    for batch in loader:
        optimizer.zero_grad()
        for x, y in optimizer.micro_batches(batch):
            loss_fn(model(x), y).backward()
        optimizer.step()
    optimizer.flush()   # after training: pseudo_sync applies its last gradient, still in flight

Elastic Horovod: the sampler's :meth:`HeteroBatchSampler.state_dict` holds the epoch, the steps done and
the planner, and the sampler registers itself with ``hvd.elastic.TorchState`` (pass it as a keyword
argument, e.g. ``TorchState(model, optimizer, sampler=sampler)``). After a reset with another world size the
samples of the interrupted epoch that no committed step processed are re-split over the new ranks under a
fresh plan for the same global batch, so none is lost or repeated (see :func:`unprocessed_indices`).

Horovod 0.28.1 needs a one-line C++17 patch to build against torch >= 2.1 (horovod#3996); ``make horovod``
builds and caches it. ``import hetero_plugins.horovod`` works without Horovod; using it needs Horovod.
"""

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
from hetero_plugins.aggregation import AGGREGATION_MODES, AggregationOptions, resolve_aggregation
from hetero_plugins.grad_sync import flat_gradients, set_flat_gradients, sync_sample_weighted, trainable
from hetero_plugins.local_sgd import LocalSGDSchedule, weighted_average_
from hetero_plugins.microbatch import (
    CarryQueue,
    ClaimKeys,
    DeadlineRule,
    StepClaims,
    batch_length,
    micro_batch_sizes,
    open_claim_store,
    unit_indices,
)
from hetero_plugins.pseudo_sync import DelayedExchange, PseudoSyncCorrector
from hetero_plugins.work_sharing import deadline_micro_batches, wbsp_micro_batches
from hetero_plugins.allocators import Allocator
from hetero_plugins.cluster import ClusterSource, resolve_cluster_source
from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor, data_times
from hetero_plugins.partition import EpochLayout, epoch_layout, epoch_shards
from hetero_plugins.planner import BalancePlanner
from hetero_plugins.telemetry import StepTimer

log = logging.getLogger(__name__)

__all__ = [
    "AggregatingOptimizer",
    "DistributedOptimizer",
    "GradientWeighting",
    "HeteroBatchSampler",
    "HorovodExchange",
    "MPIExchange",
    "get_exchange",
    "resplit_unprocessed",
    "segment_layout",
    "segment_shards",
    "unprocessed_indices",
]

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def _hvd() -> Any:
    """``horovod.torch``, or a ``ValueError`` that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"hetero_plugins.horovod needs Horovod with PyTorch support ({err}). HINT: run `make horovod` "
            "(builds Horovod 0.28.1 patched for torch 2.x, horovod#3996) or see docs/horovod.md."
        ) from err
    return hvd


# ---------------------------------------------------------------------------------------------- exchange
class HorovodExchange:
    """Collectives for the epoch-end statistics through Horovod (``hvd.allgather``, ``hvd.broadcast_object``).

    Every call names its tensors explicitly: Horovod matches collectives by name, and
    ``hvd.broadcast_object``'s default name (the object's type) differs between ranks whenever the root
    passes an object and the others ``None`` - a silent hang.
    """

    kind = "horovod"

    def rank(self) -> int:
        return int(_hvd().rank())

    def size(self) -> int:
        return int(_hvd().size())

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Stack every rank's ``array`` (same shape on all ranks) along a new leading rank axis."""
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64)).unsqueeze(0)
        return _hvd().allgather(t, name=name).numpy()

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        return _hvd().broadcast_object(obj, root_rank=root, name=name)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        return list(_hvd().allgather_object(obj, name=name))


class MPIExchange:
    """The same collectives through ``mpi4py`` (for ``mpirun`` launches, where Horovod runs on MPI)."""

    kind = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD

    def rank(self) -> int:
        return int(self.comm.Get_rank())

    def size(self) -> int:
        return int(self.comm.Get_size())

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return np.stack(self.comm.allgather(np.asarray(array, dtype=np.float64)))

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return list(self.comm.allgather(obj))


def get_exchange(kind: str = "auto") -> HorovodExchange | MPIExchange:
    """The collective backend for epoch statistics.

    Args:
        kind: ``"horovod"``, ``"mpi"`` (``mpi4py``) or ``"auto"``: Horovod under ``horovodrun`` (which sets
            ``HOROVOD_*`` variables), ``mpi4py`` under a bare ``mpirun`` when it is installed, else Horovod.

    Example::

        >>> get_exchange("horovod").kind
        'horovod'
    """
    check_choice("exchange", kind, ("auto", "horovod", "mpi"))
    if kind == "auto":
        under_horovodrun = any(k.startswith("HOROVOD_") for k in os.environ)
        under_mpirun = any(k in os.environ for k in _MPI_RANK_VARS)
        kind = "horovod"
        if under_mpirun and not under_horovodrun:
            try:
                import mpi4py  # noqa: F401

                kind = "mpi"
            except ImportError:
                kind = "horovod"
    return MPIExchange() if kind == "mpi" else HorovodExchange()


# ----------------------------------------------------------------------------------- epoch segments (pure)
def segment_layout(num_samples: int, plan: Sequence[int], order: Sequence[int] | None, drop_last: bool) -> EpochLayout:
    """Layout of an epoch (``order is None``) or of a resumed remainder of one (``order``: its indices).

    A resumed remainder never drops samples: it holds exactly what the interrupted epoch still owed.
    """
    if order is None:
        return epoch_layout(num_samples, plan, drop_last)
    plan = tuple(int(b) for b in plan)
    if len(order) == 0:
        return EpochLayout(plan, 0, (), 0)
    layout = epoch_layout(len(order), plan, drop_last=False, pad_to_world_size=False)
    if layout.padding and layout.full_steps >= 1:
        # A remainder shorter than the new world size joins the last full step (one slightly larger global
        # batch, still exactly weighted) instead of borrowing repeated samples: an elastic resize then
        # never repeats a sample, whatever the step at which it happened.
        rest = len(order) - layout.full_steps * sum(plan)
        exact = [rest * b / sum(plan) for b in plan]
        extra = [int(x) for x in exact]
        for i in sorted(range(len(plan)), key=lambda k: (-(exact[k] - extra[k]), k))[: rest - sum(extra)]:
            extra[i] += 1
        last = tuple(b + e for b, e in zip(plan, extra))
        return EpochLayout(plan, layout.full_steps - 1, last, 0)
    return layout


def segment_shards(
    num_samples: int,
    plan: Sequence[int],
    order: Sequence[int] | None = None,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    locality: bool = False,
) -> list[np.ndarray]:
    """Every rank's indices of an epoch (``order is None``, as :func:`~hetero_plugins.epoch_shards`) or of a
    resumed remainder ``order``, cut into contiguous per-rank shards under ``plan``.

    Example::

        >>> [s.tolist() for s in segment_shards(10, [2, 1], order=[9, 8, 7, 6, 5])]
        [[9, 8, 7], [6, 5]]
    """
    if order is None:
        return epoch_shards(num_samples, plan, epoch, seed, shuffle, drop_last, locality)
    base = np.asarray(order, dtype=np.int64)
    if base.size == 0:
        return [np.zeros(0, dtype=np.int64) for _ in plan]
    layout = segment_layout(num_samples, plan, base, drop_last)
    if layout.padding:
        base = np.concatenate([base, np.resize(base, layout.padding)])
    bounds = np.concatenate([[0], np.cumsum(layout.shard_sizes())])
    return [base[bounds[r] : bounds[r + 1]].copy() for r in range(len(plan))]


def unprocessed_indices(shards: Sequence[np.ndarray], layout: EpochLayout, steps_done: int) -> np.ndarray:
    """The samples of a segment that its first ``steps_done`` steps did not process, without duplicates.

    Rank i processed the first ``sum(layout.step_counts(s)[i] for s < steps_done)`` entries of its shard.
    Padding (the duplicates a short last step borrows) is never counted twice.

    Example::

        >>> from hetero_plugins.partition import epoch_layout
        >>> shards = [np.arange(0, 6), np.arange(6, 8)]         # plan [3, 1]: two steps
        >>> unprocessed_indices(shards, epoch_layout(8, [3, 1]), steps_done=1).tolist()
        [3, 4, 5, 7]
    """
    check_int("steps_done", steps_done, minimum=0)
    if steps_done > layout.steps:
        raise ValueError(f"`steps_done`={steps_done} exceeds the segment's {layout.steps} steps.")
    consumed = [0] * len(shards)
    for s in range(steps_done):
        for r, c in enumerate(layout.step_counts(s)):
            consumed[r] += c
    done = set()
    for r, shard in enumerate(shards):
        done.update(shard[: consumed[r]].tolist())
    out: list[int] = []
    seen: set[int] = set()
    for r, shard in enumerate(shards):
        for i in shard[consumed[r] :].tolist():
            if i not in done and i not in seen:
                seen.add(i)
                out.append(i)
    return np.asarray(out, dtype=np.int64)


def resplit_unprocessed(
    shards: Sequence[np.ndarray], layout: EpochLayout, steps_done: int, new_plan: Sequence[int]
) -> list[np.ndarray]:
    """Re-split what an interrupted segment still owes over a new set of ranks (elastic Horovod).

    Args:
        shards: every old rank's indices of the interrupted segment (:func:`segment_shards`).
        layout: that segment's layout (:func:`segment_layout`).
        steps_done: committed steps of the segment; their samples are done.
        new_plan: per-rank batch sizes of the new world, any length.

    Returns:
        The new ranks' shards: together they hold every unprocessed sample exactly once (plus the padding
        a last step shorter than the world size borrows, as ``DistributedSampler`` pads).

    Example::

        >>> from hetero_plugins.partition import epoch_layout
        >>> shards = [np.arange(0, 6), np.arange(6, 8)]
        >>> [s.tolist() for s in resplit_unprocessed(shards, epoch_layout(8, [3, 1]), 1, [4])]
        [[3, 4, 5, 7]]
    """
    remaining = unprocessed_indices(shards, layout, steps_done)
    return segment_shards(len(remaining), new_plan, order=remaining)


# --------------------------------------------------------------------------------------------- sampler
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
            :class:`~hetero_plugins.allocators.Allocator`.
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
        planner: the :class:`~hetero_plugins.planner.BalancePlanner` (identical on every rank).
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
        _register_elastic_handler()

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
        from hetero_plugins.time_model import LinearTimeModel

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


def move_host_slots(path: str, moves: Sequence[tuple[str, str]]) -> None:
    """Rewrite a host-discovery file (``host:slots`` lines): one slot fewer on each ``from`` host, one more on
    each ``to`` host (appended if new); hosts left with no slot are dropped. Replaced atomically."""
    order: list[str] = []
    slots: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            host, _, n = line.partition(":")
            if host not in slots:
                order.append(host)
                slots[host] = 0
            slots[host] += int(n or 1)
    for src, dst in moves:
        if slots.get(src, 0) > 0:
            slots[src] -= 1
        if dst not in slots:
            order.append(dst)
            slots[dst] = 0
        slots[dst] += 1
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{h}:{slots[h]}\n" for h in order if slots[h] > 0))
    os.replace(tmp, path)


_ELASTIC_REGISTERED = False


def _register_elastic_handler() -> None:
    """Let ``hvd.elastic.TorchState`` commit, restore and sync a :class:`HeteroBatchSampler` (idempotent)."""
    global _ELASTIC_REGISTERED
    if _ELASTIC_REGISTERED:
        return
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:  # pragma: no cover - Horovod without elastic support
        return
    registry = elastic_state.get_handler_registry()
    if not any(t is HeteroBatchSampler for t, _ in registry):
        # Horovod's SamplerStateHandler deep-copies state_dict() on commit, loads it on restore, and
        # broadcasts rank 0's on sync; load_state_dict re-splits the epoch for a new world size.
        elastic_state.set_handler_registry([(HeteroBatchSampler, elastic_state.SamplerStateHandler), *registry])
    _ELASTIC_REGISTERED = True


# ------------------------------------------------------------------------------------- gradient weighting
class GradientWeighting:
    """Scales every parameter's incoming gradient by this rank's share of the step and time-stamps it.

    Registered as tensor hooks, which run before the gradient is accumulated into ``.grad`` and before
    Horovod's own hook launches the all-reduce, so each backward pass (also each accumulated micro-batch)
    contributes ``weight * grad``; summed over ranks (``op=hvd.Sum``) this is sum_i (b_i / B) g_i.

    Args:
        params: the parameters whose gradients are weighted.
        timer: notified (``mark_gradients_ready``) at every gradient; the last one of a step counts.
        weight_fn: called at the first gradient of each backward pass for the weight (else :meth:`set_weight`).
        on_backward_end: called once at the end of each backward pass.

    Example::

        >>> p = torch.ones(2, requires_grad=True)
        >>> w = GradientWeighting([p]); w.set_weight(0.25)
        >>> (3 * p).sum().backward(); p.grad.tolist()
        [0.75, 0.75]
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        timer: StepTimer | None = None,
        weight_fn: Any = None,
        on_backward_end: Any = None,
    ) -> None:
        self.weight = 1.0
        self.timer = timer
        self.weight_fn = weight_fn
        self.on_backward_end = on_backward_end
        self._in_backward = False
        self._handles = [p.register_hook(self._hook) for p in params if p.requires_grad]

    def set_weight(self, weight: float) -> None:
        """This rank's share b_i / B of the coming backward pass's samples (``BatchBalancer`` calls it)."""
        self.weight = float(weight)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._in_backward:
            self._in_backward = True
            if self.weight_fn is not None:
                self.weight = float(self.weight_fn())
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self.timer is not None:
            self.timer.mark_gradients_ready()
        return grad * self.weight

    def _backward_done(self) -> None:
        self._in_backward = False
        if self.on_backward_end is not None:
            self.on_backward_end()


# ------------------------------------------------------------------------------------------- the optimizer
#: ``hvd.DistributedOptimizer`` keyword arguments that only the ``"weighted"`` mode (Horovod's own
#: per-gradient all-reduce) can use.
_HOROVOD_ONLY = ("compression", "groups", "sparse_as_dense", "process_set", "num_groups")


def DistributedOptimizer(  # noqa: N802 - mirrors hvd.DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    batch_sampler: HeteroBatchSampler | None = None,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    backward_passes_per_step: int = 1,
    aggregation: str | AggregationOptions = "weighted",
    dataset: Any = None,
    collate_fn: Any = None,
    model: torch.nn.Module | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Drop-in for ``hvd.DistributedOptimizer`` that sums sample-weighted gradients and times each step.

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: as for Horovod (``model.named_parameters()``).
        batch_sampler: the :class:`HeteroBatchSampler` feeding this rank; required.
        op: ``None`` or ``hvd.Sum``; the weighting needs a sum (``hvd.Average`` and ``hvd.Adasum`` are
            rejected).
        gradient_predivide_factor: must stay 1.0 (Horovod allows it with ``op=hvd.Average`` only).
        backward_passes_per_step: accumulate this many backward passes (each weighted by its own step's
            shares; divide the loss by it as with stock Horovod) before reducing. ``"weighted"`` only.
        aggregation: ``"weighted"`` (default), ``"deadline"``, ``"wbsp"``, ``"pseudo_sync"``, ``"local_sgd"``
            or an :class:`~hetero_plugins.aggregation.AggregationOptions` (see :mod:`hetero_plugins.aggregation`
            and :class:`AggregatingOptimizer`).
        dataset: ``"wbsp"``: the training dataset (``dataset[i]`` is sample i), to load micro-batches taken
            from other ranks' shares; required there, ignored elsewhere.
        collate_fn: ``"wbsp"``: how the loader collates samples (default ``torch.utils.data.default_collate``).
        model: ``"local_sgd"``: also average this module's floating buffers (e.g. BatchNorm statistics).
        **kwargs: passed to ``hvd.DistributedOptimizer`` (``compression``, ``groups``, ``sparse_as_dense``,
            ``process_set``...); ``"weighted"`` only.

    Returns:
        ``"weighted"``: Horovod's distributed optimizer, whose ``step`` also reports the step's end to the
        sampler. Any other mode: an :class:`AggregatingOptimizer`. Both have ``micro_batches(batch)``,
        ``flush()``, ``communication_bytes``, ``communication_rounds``, ``carried_samples`` and
        ``stolen_samples``, so one training loop serves every mode.

    Example::

        optimizer = hh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), batch_sampler=sampler)
    """
    hvd = _hvd()
    if isinstance(aggregation, str) and aggregation not in AGGREGATION_MODES:
        raise ValueError(
            f"`aggregation` must be one of {list(AGGREGATION_MODES)}, got {aggregation!r}. HINT: e.g. "
            "aggregation='deadline', or aggregation=AggregationOptions('deadline', deadline_slack=0.3)."
        )
    options = resolve_aggregation(aggregation)
    if not isinstance(batch_sampler, HeteroBatchSampler):
        raise ValueError(
            f"`batch_sampler` must be the hetero_plugins.horovod.HeteroBatchSampler that feeds this rank, got "
            f"{batch_sampler!r}. HINT: DistributedOptimizer(opt, named_parameters=..., batch_sampler=sampler)."
        )
    if op is not None and op != hvd.Sum:
        raise ValueError(
            f"`op`={op!r} cannot weight per-rank batch sizes: each rank's gradient is scaled by its share of "
            "the global batch and the ranks must be summed. HINT: leave `op` unset (or pass hvd.Sum)."
        )
    if gradient_predivide_factor != 1.0:
        raise ValueError(
            f"`gradient_predivide_factor`={gradient_predivide_factor} only applies to op=hvd.Average, which "
            "per-rank batch sizes cannot use. HINT: drop it; gradients are weighted by b_i / B instead."
        )
    check_int("backward_passes_per_step", backward_passes_per_step, minimum=1)
    if options.explicit_sync:
        return AggregatingOptimizer(
            optimizer, batch_sampler, options, dataset=dataset, collate_fn=collate_fn, model=model,
            backward_passes_per_step=backward_passes_per_step, **kwargs,
        )
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    dist_opt = hvd.DistributedOptimizer(
        optimizer, named_parameters=named_parameters, op=hvd.Sum,
        backward_passes_per_step=backward_passes_per_step, **kwargs,
    )
    sampler = batch_sampler
    passes = [0]

    def backward_end() -> None:
        sampler._on_backward_end()
        passes[0] += 1
        if passes[0] < dist_opt.backward_passes_per_step:
            sampler._on_step_end()  # an accumulated micro-batch: no collective waits before the next

    params = [p for group in dist_opt.param_groups for p in group["params"]]
    weighting = GradientWeighting(params, timer=sampler.timer, weight_fn=sampler.current_weight,
                                  on_backward_end=backward_end)
    horovod_step = dist_opt.step
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable(params))

    def step(self: Any, closure: Any = None) -> Any:
        out = horovod_step(closure)
        passes[0] = 0
        dist_opt.communication_bytes += grad_bytes  # type: ignore[attr-defined]
        dist_opt.communication_rounds += 1  # type: ignore[attr-defined]
        sampler._on_step_end()
        return out

    def micro_batches(batch: Any) -> Iterator[Any]:
        """``"weighted"``: the whole batch, once (the loop of the micro-batched modes works unchanged)."""
        yield batch

    dist_opt.step = types.MethodType(step, dist_opt)  # type: ignore[method-assign]  # bound: LR schedulers wrap it
    dist_opt.hetero_weighting = weighting  # type: ignore[attr-defined]
    dist_opt.hetero_sampler = sampler  # type: ignore[attr-defined]
    dist_opt.aggregation = options  # type: ignore[attr-defined]
    dist_opt.micro_batches = micro_batches  # type: ignore[attr-defined]
    dist_opt.flush = lambda: False  # type: ignore[attr-defined]
    dist_opt.communication_bytes = 0  # type: ignore[attr-defined]  (uncompressed gradient bytes reduced)
    dist_opt.communication_rounds = 0  # type: ignore[attr-defined]
    dist_opt.carried_samples = 0  # type: ignore[attr-defined]
    dist_opt.stolen_samples = 0  # type: ignore[attr-defined]
    return dist_opt


class _HorovodHandle:
    """``hvd.allreduce_async``'s handle as a :class:`~hetero_plugins.pseudo_sync.ReduceHandle`."""

    def __init__(self, hvd: Any, handle: Any) -> None:
        self._hvd, self._handle = hvd, handle

    def wait(self) -> torch.Tensor:
        return self._hvd.synchronize(self._handle)


def _called_by_horovod_broadcast() -> bool:
    """Whether ``step`` was called by ``hvd.broadcast_optimizer_state`` (to initialise the optimizer's state)."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the outermost frame
        return False
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "broadcast_optimizer_state" and str(frame.f_globals.get("__name__", "")).startswith(
            "horovod"
        ):
            return True
        frame = frame.f_back
    return False


def _device_of(batch: Any) -> torch.device | None:
    if isinstance(batch, torch.Tensor):
        return batch.device
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for v in batch:
            d = _device_of(v)
            if d is not None:
                return d
    return None


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class AggregatingOptimizer(torch.optim.Optimizer):
    """The optimizer :func:`DistributedOptimizer` returns for the explicit-exchange aggregation modes.

    It behaves like the wrapped torch optimizer (``param_groups``, ``state``, ``defaults``, ``zero_grad``,
    ``state_dict`` / ``load_state_dict`` all act on it; ``isinstance(opt, torch.optim.Optimizer)`` holds, so
    torch LR schedulers accept it), and its :meth:`step` exchanges what the mode exchanges through Horovod
    (``hvd.allreduce(op=hvd.Sum)``; ``hvd.allreduce_async`` + ``hvd.synchronize`` for ``pseudo_sync``) before
    stepping it. It keeps reporting step timings to the sampler, so per-epoch rebalancing keeps working.

    - ``"deadline"`` / ``"wbsp"`` run a step as micro-batches, so the training loop must let the optimizer
      hand them out::

          for batch in loader:
              optimizer.zero_grad()
              for x, y in optimizer.micro_batches(batch):
                  loss_fn(model(x), y).backward()
              optimizer.step()

      Each micro-batch's gradient is scaled by n_j / B (B the step's planned global batch) by tensor hooks;
      :meth:`step` sums the ranks' gradients and the samples actually processed in one all-reduce and rescales,
      so the update is the mean gradient over exactly the samples the step processed. ``deadline`` stops
      before the step's deadline (``AggregationOptions.deadline`` of the planner's predicted step time; none
      on the epoch's last step) and carries the rest into the next steps (first in line); ``wbsp`` claims
      its own micro-batches and then takes unclaimed ones of other ranks' shares (loaded from ``dataset``)
      through a ``torch.distributed.TCPStore`` served by rank 0.
    - ``"pseudo_sync"``: :meth:`step` launches the all-reduce of this step's weighted gradient and applies the
      previous step's reduced gradient, corrected by :class:`~hetero_plugins.pseudo_sync.PseudoSyncCorrector`;
      the first step only launches. Call :meth:`flush` after the last step to apply the gradient still in
      flight (and before saving a checkpoint).
    - ``"local_sgd"``: :meth:`step` is a local step on this rank's mean gradient; every ``local_steps`` steps
      and at every epoch's last step the parameters (and ``model``'s floating buffers) are averaged, weighted
      by the samples each rank processed since the last average.

    ``micro_batches(batch)`` yields ``batch`` once in the modes that do not cut steps, and :meth:`flush` does
    nothing outside ``pseudo_sync``, so one loop works for every mode.

    Attributes:
        optimizer: the wrapped torch optimizer.
        aggregation: the :class:`~hetero_plugins.aggregation.AggregationOptions` in force.
        communication_bytes: bytes this rank put into gradient / model exchanges.
        communication_rounds: number of those exchanges.
        carried_samples: samples that missed a deadline so far (``deadline``; each was processed later).
        stolen_samples: samples this rank processed from other ranks' shares (``wbsp``).
        last_step_samples: every rank's processed samples in the last ``deadline`` / ``wbsp`` step.
        backlogs: every rank's carried samples after the last ``deadline`` step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        batch_sampler: HeteroBatchSampler,
        aggregation: str | AggregationOptions,
        dataset: Any = None,
        collate_fn: Any = None,
        model: torch.nn.Module | None = None,
        backward_passes_per_step: int = 1,
        **kwargs: Any,
    ) -> None:
        # No Optimizer.__init__: the wrapped optimizer owns param_groups, state and the step hooks.
        options = resolve_aggregation(aggregation)
        mode = options.mode
        if not options.explicit_sync:
            raise ValueError(
                "AggregatingOptimizer serves the explicit-exchange modes, not aggregation='weighted'. "
                "HINT: use hetero_plugins.horovod.DistributedOptimizer(..., aggregation=...)."
            )
        if not isinstance(batch_sampler, HeteroBatchSampler):
            raise ValueError(
                f"`batch_sampler` must be the hetero_plugins.horovod.HeteroBatchSampler that feeds this rank, got "
                f"{batch_sampler!r}."
            )
        if backward_passes_per_step != 1:
            raise ValueError(
                f"`backward_passes_per_step`={backward_passes_per_step} does not combine with aggregation={mode!r} "
                "(the mode exchanges once per optimizer step). HINT: raise the sampler's batch_size instead, or use "
                "aggregation='weighted'."
            )
        for key in kwargs:
            if key in _HOROVOD_ONLY:
                raise ValueError(
                    f"`{key}` is an hvd.DistributedOptimizer option, which aggregation={mode!r} does not use: this "
                    f"mode exchanges gradients itself. HINT: drop `{key}`, or use aggregation='weighted'."
                )
            raise ValueError(
                f"`{key}` is not an option of hetero_plugins.horovod.DistributedOptimizer with aggregation={mode!r}. "
                "HINT: see help(hetero_plugins.horovod.DistributedOptimizer)."
            )
        if options.micro_batched and batch_sampler.locality:
            raise ValueError(
                f"aggregation={mode!r} moves samples between steps and ranks, which a HeteroBatchSampler with "
                "`locality=True` forbids (each rank keeps its shard). HINT: build the sampler with locality=False, "
                "or use aggregation='weighted'."
            )
        if mode == "wbsp" and dataset is None:
            raise ValueError(
                "aggregation='wbsp' loads micro-batches of other ranks' shares, so it needs `dataset` (got None). "
                "HINT: DistributedOptimizer(..., aggregation='wbsp', dataset=train_set, collate_fn=loader.collate_fn)."
            )
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError(f"`collate_fn` must be callable, got {collate_fn!r}. HINT: pass loader.collate_fn.")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
        hvd = _hvd()
        self.__dict__["optimizer"] = optimizer
        self._hvd = hvd
        self.aggregation = options
        self.hetero_sampler = batch_sampler
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self._model = model
        self._params = trainable([p for g in optimizer.param_groups for p in g["params"]])
        self.communication_bytes = 0
        self.communication_rounds = 0
        self.carried_samples = 0
        self.stolen_samples = 0
        self.last_step_samples: list[int] | None = None
        self.backlogs: list[int] | None = None
        self._steps = 0  # optimizer steps taken through this wrapper: equal on every rank
        self._carry = CarryQueue()
        self._mb: str | None = None  # the micro-batch loop of the step in progress: None, "running", "done"
        self._mb_samples = 0
        self._mb_planned = 0
        self._backward_step: int | None = None
        self._store: Any = None
        self._claim_keys = ClaimKeys(keep=2)  # a step's keys are dead once every rank passed its exchange
        self._corrector: PseudoSyncCorrector | None = None
        self._delayed: DelayedExchange | None = None
        self._local: LocalSGDSchedule | None = None
        sampler = batch_sampler
        if options.micro_batched:  # the weight n_j / B is set before every micro-batch; timing at the loop's end
            self.hetero_weighting = GradientWeighting(self._params)
        elif mode == "pseudo_sync":
            self.hetero_weighting = GradientWeighting(
                self._params, timer=sampler.timer, weight_fn=sampler.current_weight, on_backward_end=self._backward_end
            )
            self._corrector = PseudoSyncCorrector(
                smoothing=float(options.smoothing),  # type: ignore[arg-type]
                min_confidence=float(options.min_confidence),  # type: ignore[arg-type]
            )
            self._delayed = DelayedExchange(self._launch)
        else:  # local_sgd: local steps on this rank's own mean gradient (weight 1)
            self.hetero_weighting = GradientWeighting(
                self._params, timer=sampler.timer, on_backward_end=self._backward_end
            )
            self._local = LocalSGDSchedule(local_steps=options.local_steps)  # type: ignore[arg-type]
        if mode == "wbsp":
            self._start_claim_store()

    # ------------------------------------------------------------------ the wrapped optimizer
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.__dict__["optimizer"]

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "an AggregatingOptimizer cannot be pickled (it holds Horovod handles and a store connection). "
            "HINT: save optimizer.state_dict() instead."
        )

    def __repr__(self) -> str:
        return f"AggregatingOptimizer(aggregation={self.aggregation.mode!r}, optimizer={self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (``pseudo_sync``: :meth:`flush` first; nothing in flight is saved)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            f"aggregation={self.aggregation.mode!r} exchanges the parameters it saw when it was built. "
            "HINT: add the parameter group to the torch optimizer before hh.DistributedOptimizer wraps it."
        )

    # ------------------------------------------------------------------ the training loop's side
    def micro_batches(self, batch: Any) -> Iterator[Any]:
        """The pieces of ``batch`` (this rank's batch of the step) to back-propagate one after the other.

        ``deadline``: the micro-batches carried from earlier steps first, then this step's, until the
        deadline; ``wbsp``: this rank's unclaimed micro-batches, then other ranks' (loaded from ``dataset``).
        Other modes: ``batch`` once. Iterate it to the end, then call :meth:`step`.
        """
        options = self.aggregation
        if not options.micro_batched:
            yield batch
            return
        if self._mb is not None:
            raise RuntimeError(
                f"optimizer.micro_batches() was called again before optimizer.step() (aggregation={options.mode!r}). "
                "HINT: per batch: zero_grad(); for mb in optimizer.micro_batches(batch): backward; then step()."
            )
        sampler = self.hetero_sampler
        rank = sampler.rank
        step = sampler.steps_done
        layout = sampler._segment()[2]
        if step >= layout.steps:
            raise RuntimeError(
                f"step {step} is past the epoch's {layout.steps} steps (aggregation={options.mode!r}). "
                "HINT: call sampler.set_epoch(epoch) every epoch and micro_batches() once per batch of the loader."
            )
        counts = sampler.step_counts(step)
        planned = sum(counts)
        n = batch_length(batch)
        if n != counts[rank]:
            raise ValueError(
                f"micro_batches() got a batch of {n} samples, but this rank's batch of step {step} has "
                f"{counts[rank]} (aggregation={options.mode!r}). HINT: pass the batch the HeteroBatchSampler's "
                "loader yields, unchanged, once per step."
            )
        if step == 0 and len(self._carry):
            log.warning("aggregation='deadline': %d carried samples dropped at an epoch's start (the previous epoch "
                        "was cut short)", self._carry.clear())
        parts = int(options.micro_batches)  # type: ignore[arg-type]
        sizes = micro_batch_sizes(counts[rank], parts)
        weighting = self.hetero_weighting
        self._mb, self._mb_samples, self._mb_planned = "running", 0, planned
        if options.mode == "deadline":
            last = step + 1 >= layout.steps  # the epoch's last step has no deadline: the carry is flushed
            predicted = sampler.planner.predict_step_time(counts)
            rule = DeadlineRule(math.inf if last else options.deadline(predicted))
            before, from_carry = self._carry.samples, 0
            for mb in deadline_micro_batches(batch, sizes, rule, self._carry, rank, step):
                weighting.set_weight(mb.samples / planned)
                yield mb.data
                self._mb_samples += mb.samples
                from_carry += mb.samples if mb.step != step else 0
            self.carried_samples += self._carry.samples - (before - from_carry)  # newly carried this step
        else:  # wbsp
            prefix = f"hetero_plugins/{self._steps}"
            per_rank = [len(micro_batch_sizes(c, parts)) for c in counts]
            claims = StepClaims(self._store, prefix, per_rank)
            device = _device_of(batch)

            def load(owner: int, index: int) -> tuple[Any, int]:
                return self._load_micro_batch(step, owner, index, parts, device)

            for mb in wbsp_micro_batches(batch, counts, parts, rank, claims, load, sampler.planner.rates(counts)):
                weighting.set_weight(mb.samples / planned)
                yield mb.data
                self._mb_samples += mb.samples
                if mb.owner != rank:
                    self.stolen_samples += mb.samples
            self._claim_keys.forget(self._store, claims.keys(rank))
        timer = sampler.timer
        timer.set_samples(self._mb_samples)  # stolen samples count for this rank, missed ones do not
        timer.mark_gradients_ready()
        self._mb = "done"
        sampler._on_backward_end()

    def step(self, closure: Any = None) -> Any:
        """Exchange as the mode does, then step the wrapped optimizer (see the class doc)."""
        if _called_by_horovod_broadcast():  # hvd.broadcast_optimizer_state initialising the state
            return self.optimizer.step(closure)
        options = self.aggregation
        mode = options.mode
        sampler = self.hetero_sampler
        loss = None
        if options.micro_batched:
            if closure is not None:
                raise ValueError(
                    f"aggregation={mode!r} does not take a `closure`: the micro-batches are back-propagated by the "
                    "loop over optimizer.micro_batches(batch). HINT: call optimizer.step() without arguments."
                )
            if self._mb is None:
                raise RuntimeError(
                    f"aggregation={mode!r} runs each step as micro-batches, but optimizer.step() was called without "
                    "them. HINT: `for x, y in optimizer.micro_batches(batch): loss_fn(model(x), y).backward()` "
                    "before optimizer.step()."
                )
            if self._mb == "running":
                raise RuntimeError(
                    f"optimizer.step() was called before the loop over optimizer.micro_batches(batch) ended "
                    f"(aggregation={mode!r}); its remaining micro-batches would be lost. HINT: iterate "
                    "micro_batches(batch) to the end (no break) before optimizer.step()."
                )
            self._mb = None
            world = sampler.world_size
            counts, backlogs = sync_sample_weighted(
                self._params, self._mb_samples, self._mb_planned, sampler.rank, world, self._allreduce,
                backlog=self._carry.samples,
            )
            self._count(sum(p.numel() for p in self._params) + 2 * world)
            self.last_step_samples, self.backlogs = counts, backlogs
            self.optimizer.step()
        elif mode == "pseudo_sync":
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            assert self._delayed is not None and self._corrector is not None
            flat = flat_gradients(self._params)
            previous = self._delayed.exchange(flat)
            self._count(flat.numel())
            if previous is not None:  # the very first step only launches: there is no earlier gradient yet
                set_flat_gradients(self._params, self._corrector.combine(previous))
                self.optimizer.step()
        else:  # local_sgd
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self.optimizer.step()
            self._after_local_step()
        self._steps += 1
        self._backward_step = None
        sampler._on_step_end()
        return loss

    def flush(self) -> bool:
        """``pseudo_sync``: apply the last step's gradient, still in flight; call it after the last step.

        Returns whether a gradient was applied (always ``False`` in the other modes). Every rank must call it.
        """
        if self._delayed is None or self._corrector is None:
            return False
        last = self._delayed.flush()
        if last is None:
            return False
        set_flat_gradients(self._params, self._corrector.combine(last))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return True

    # ------------------------------------------------------------------ internals
    def _backward_end(self) -> None:
        self._backward_step = self.hetero_sampler.steps_done
        self.hetero_sampler._on_backward_end()

    def _count(self, elements: int) -> None:
        dtype = self._params[0].dtype if self._params and self._params[0].is_floating_point() else torch.float32
        self.communication_bytes += int(elements) * torch.tensor([], dtype=dtype).element_size()
        self.communication_rounds += 1

    def _allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._hvd.allreduce(tensor, op=self._hvd.Sum, name="hetero_plugins.aggregation.sync")

    def _launch(self, tensor: torch.Tensor) -> _HorovodHandle:
        assert self._delayed is not None
        name = f"hetero_plugins.aggregation.pseudo_sync.{self._delayed.launched % 2}"  # two may be in flight
        return _HorovodHandle(self._hvd, self._hvd.allreduce_async(tensor, op=self._hvd.Sum, name=name))

    def _after_local_step(self) -> None:
        assert self._local is not None
        sampler = self.hetero_sampler
        step = self._backward_step if self._backward_step is not None else max(0, sampler.steps_done - 1)
        layout = sampler._segment()[2]
        samples = layout.step_counts(min(step, layout.steps - 1))[sampler.rank]
        due = self._local.step_done(samples)
        if due or step + 1 >= layout.steps:  # also at the epoch's end: every epoch ends on one model
            tensors = list(self._params)
            if self._model is not None:
                seen = {id(t) for t in tensors}
                tensors += [b for b in self._model.buffers() if b.is_floating_point() and id(b) not in seen]
            info = weighted_average_(
                tensors, self._local.samples_since_average,
                lambda t: self._hvd.allreduce(t, op=self._hvd.Sum, name="hetero_plugins.aggregation.local_sgd"),
            )
            self.communication_bytes += int(info["bytes"])
            self.communication_rounds += 1
            self._local.averaged()

    def _start_claim_store(self) -> None:
        """``wbsp``: one TCP key-value store for the claim counters, served by rank 0. Collective."""
        self._store = open_claim_store(
            self._hvd.rank(), socket.gethostname(),
            lambda obj: self._hvd.broadcast_object(obj, root_rank=0, name="hetero_plugins.aggregation.store"),
            float(self.aggregation.claim_timeout),  # type: ignore[arg-type]
        )

    def _load_micro_batch(self, step: int, owner: int, index: int, parts: int, device: torch.device | None) -> tuple[Any, int]:
        """Micro-batch ``index`` of ``owner``'s share of ``step``, loaded from the dataset and collated."""
        chosen = unit_indices(self.hetero_sampler.batch_indices(step, owner), parts, index)
        data = self.collate_fn([self.dataset[i] for i in chosen])
        if device is not None:
            data = _to_device(data, device)
        return data, len(chosen)
