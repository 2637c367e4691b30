"""``PlanCoordinator``: one rank decides, every rank adopts, at epoch ends and mid-epoch, over any transport.

At an epoch boundary every rank brings its step records (batch size, compute seconds, data seconds per
step) and its elapsed training time. The coordinator all-gathers them, feeds the same records to every rank's
:class:`~hetero_plugins.balancing.planner.BalancePlanner` (so the time models stay identical everywhere and any
rank's checkpoint holds them all), lets rank 0 alone consult the cluster context (an :class:`EpochAdvisor`)
and decide, broadcasts rank 0's decision and has every rank adopt it. The same protocol serves the Lightning
callback and the ``horovodrun`` sampler; only the :class:`~hetero_plugins.collectives.Collectives` differs.
The shape follows AdaptDL's batch-size decision (rank 0 decides and broadcasts, ``adaptdl/torch/data.py``)
and keeps the core free of any training framework, as Lightning's ``Throughput`` is of its callback.

Example (one process; a transport with more ranks behaves alike)::

    >>> import numpy as np
    >>> from hetero_plugins.balancing.planner import BalancePlanner
    >>> class Alone:
    ...     def rank(self): return 0
    ...     def size(self): return 1
    ...     def allgather(self, array, name): return np.asarray(array, dtype=np.float64)[None]
    ...     def broadcast_object(self, obj, name, root=0): return obj
    >>> coord = PlanCoordinator(BalancePlanner(world_size=1, global_batch=8), Alone())
    >>> entry = coord.end_epoch(0, np.array([[8, 0.1, 0.0]] * 3), elapsed=0.3)
    >>> entry["batch_sizes"], entry["next_batch_sizes"], entry["samples"]
    ([8], [8], 24)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hetero_plugins._validation import check_choice
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.collectives import Collectives

log = logging.getLogger(__name__)

__all__ = ["EpochAdvisor", "PlanCoordinator", "RelocationWriter", "data_times", "gather_records", "start_advisor"]

#: Called on rank 0 for a relocation whose moves are new: ``(info, decision, upcoming)``. It acts on the
#: decision (writes the restart spec, rewrites a hosts file...) and records what it did in ``info`` (the
#: ``relocation`` record of the history entry: ``spec``, ``checkpoint``, ``applied``).
RelocationWriter = Callable[[dict[str, Any], Any, Any], None]


@runtime_checkable
class EpochAdvisor(Protocol):
    """Rank 0's stage-2 advice at an epoch boundary: cluster context for the allocator, relocation decisions.

    :class:`hetero_plugins.scheduler.cluster_advisor.ClusterAdvisor` implements it; the glue injects it, so the
    balancing package never imports the scheduler. Its methods run on rank 0 only and hold no collective.
    """

    def start(self, epoch: int, world_size: int, hosts: Sequence[str] | None = None) -> None:
        """Read the placement of the run's first epoch; ``ValueError`` on an unusable description."""
        ...

    def before_decision(self, epoch: int, world_size: int, allocator: Any, data: Sequence[float],
                        hosts: Sequence[str] | None = None) -> Any:
        """Before the decision at the end of ``epoch``: hand ``allocator`` what changes; the upcoming placement."""
        ...

    def relocate(self, upcoming: Any, planner: Any, steps_per_epoch: int, epochs_left: int,
                 data: Sequence[float]) -> tuple[Any, bool] | None:
        """After it: ``(decision, new)`` if moving ranks to free slots is considered, else ``None``."""
        ...

    def info(self, epoch: int, decision: Any) -> dict[str, Any]:
        """The ``relocation`` record of a history entry for ``decision`` (taking effect at ``epoch``)."""
        ...


def data_times(records: np.ndarray) -> list[float]:
    """Each rank's mean data seconds per step from step records ``(world, steps, 3)`` (steps with samples only).

    Example::

        >>> data_times(np.array([[[4, 0.1, 0.02], [0, 0.0, 0.0]], [[4, 0.2, 0.01], [4, 0.2, 0.03]]]))
        [0.02, 0.02]
    """
    out = []
    for r in range(records.shape[0]):
        rows = records[r, records[r, :, 0] > 0, 2]
        out.append(float(rows.mean()) if rows.size else 0.0)
    return out


def gather_records(
    comm: Collectives, records: np.ndarray, header: Sequence[float] = (), align: str = "pad",
    name: str = "hetero_plugins",
) -> tuple[np.ndarray | None, np.ndarray]:
    """All-gather every rank's ``(steps, 3)`` step records and a few scalars of its own (collective).

    Args:
        comm: the transport.
        records: this rank's step records, rows of (batch size, compute s, data s).
        header: scalars every rank sends along (the same number on every rank).
        align: when ranks recorded different numbers of steps: ``"pad"`` pads the shorter ones with empty
            steps (batch size 0, which the planner skips); ``"tail"`` keeps the last steps every rank has (an
            elastic worker that joined late), and returns no records if a rank has none.
        name: prefix of the collectives' names (Horovod matches collectives by name).

    Returns:
        ``(records of shape (world, steps, 3) or None, headers of shape (world, 1 + len(header)))``; column 0 of
        the headers is each rank's number of records.
    """
    records = np.asarray(records, dtype=np.float64).reshape(-1, 3)
    headers = comm.allgather(np.array([float(len(records)), *(float(h) for h in header)]), name=f"{name}.header")
    if align == "pad":
        steps = int(headers[:, 0].max())
        local = np.zeros((steps, 3))
        local[: len(records)] = records
    else:
        steps = int(headers[:, 0].min())
        if steps == 0:
            return None, headers
        local = records[-steps:]  # equal on all ranks; the tail if a rank saw more
    gathered = comm.allgather(local, name=f"{name}.records").reshape(comm.size(), steps, 3)
    return gathered, headers


def start_advisor(advisor: EpochAdvisor, comm: Collectives, epoch: int, world_size: int,
                  collective: bool = True) -> None:
    """Rank 0 reads the run's first placement; every rank raises its ``ValueError`` (collective by default).

    Every rank learning rank 0's verdict makes a bad description stop all ranks with the same error instead of
    leaving the others waiting in a collective. ``collective=False`` is for a process that may be alone in
    starting (a worker joining an elastic job): only rank 0 checks, and its error ends the job.
    """
    problem = None
    if comm.rank() == 0:
        try:
            advisor.start(epoch, world_size)
        except ValueError as err:
            problem = str(err)
    if collective:
        problem = comm.broadcast_object(problem, name="hetero_plugins.cluster")
    if problem:
        raise ValueError(problem)


class PlanCoordinator:
    """One rank decides, every rank adopts: epoch ends and mid-epoch replans, over any :class:`Collectives`.

    Args:
        planner: this rank's planner (identical on every rank); the glue may replace it (``coord.planner = p``).
        comm: the transport.
        advisor: rank 0's cluster context and relocation decisions (``None``: none).
        align: how uneven step counts are gathered (see :func:`gather_records`): ``"pad"`` (every epoch gets
            a history entry) or ``"tail"`` (an epoch with a rank that recorded nothing keeps the plan and gets
            no entry).
        label: the name the log lines start with.
        logger: where the per-epoch log line goes (default this module's logger).

    Attributes:
        extras: the ``local_extra`` values of the last :meth:`end_epoch`, one row per rank.
    """

    def __init__(self, planner: BalancePlanner, comm: Collectives, advisor: EpochAdvisor | None = None, *,
                 align: str = "pad", label: str = "hetero_plugins", logger: logging.Logger | None = None) -> None:
        self.planner = planner
        self.comm = comm
        self.advisor = advisor
        self.align = check_choice("align", align, ("pad", "tail"))
        self.label = label
        self.log = logger or log
        self.extras = np.zeros((0, 0))
        self._parts: list[np.ndarray] = []
        self._warned: set[str] = set()

    def begin_epoch(self) -> None:
        """Forget the records gathered by mid-epoch replans of an epoch that did not end (an epoch start)."""
        self._parts = []

    def replan(self, records: np.ndarray | None = None) -> list[int]:
        """Decide again mid-epoch (collective): no history entry; the records are kept for :meth:`end_epoch`.

        Args:
            records: this rank's step records since the last exchange; ``None`` decides on what the planner
                already knows (e.g. after seeding a relocated rank's time model).

        Returns:
            The plan every rank adopted (rank 0's).
        """
        gathered = None
        if records is not None:
            gathered, _ = gather_records(self.comm, records, align=self.align)
            if gathered is not None:
                self._parts.append(gathered)
        planner = self.planner
        planner.replan(gathered)
        self.adopt(self.comm.broadcast_object(
            {"plan": list(planner.plan), "predicted_step_time": planner.predicted_step_time,
             "pending_reset": planner.pending_reset, "damping": planner.damping.state_dict()},
            name="hetero_plugins.replan"))
        return list(planner.plan)

    def end_epoch(
        self,
        epoch: int,
        records: np.ndarray,
        elapsed: float,
        *,
        local_extra: Sequence[float] = (),
        memory_cap: int | None = None,
        start_plan: Sequence[int] | None = None,
        annotations: Mapping[str, Any] | None = None,
        epochs_left: int = 1 << 20,
        hosts: Sequence[str] | None = None,
        write_relocation: RelocationWriter | None = None,
    ) -> dict[str, Any] | None:
        """Learn from epoch ``epoch`` and decide the next plan (collective); returns its history entry.

        Args:
            epoch: the epoch that ended.
            records: this rank's step records since the last mid-epoch exchange, rows of (batch size, compute s,
                data s).
            elapsed: this rank's seconds from its first batch to its last step end (0 if unknown); the epoch
                time is the longest.
            local_extra: this rank's scalars to gather along (the same number on every rank), left in
                :attr:`extras`.
            memory_cap: the largest local batch that fits this rank's memory (``None``: no cap).
            start_plan: the plan the epoch started with (default the current plan).
            annotations: keys the glue adds to the entry before the decision is adopted (e.g. ``plan_changes``).
            epochs_left: epochs of the run after this one (the relocation's pay-back horizon).
            hosts: each rank's host, for a cluster description that names hosts.
            write_relocation: rank 0's action on a new gaining relocation (see :data:`RelocationWriter`).

        Returns:
            The entry appended to ``planner.history`` (with ``next_batch_sizes``, ``predicted_gain`` and
            ``plan_changed`` as rank 0 decided, and ``relocation`` when there is an advisor), or ``None`` under
            ``align="tail"`` when a rank recorded no steps (the plan stays).
        """
        comm, planner = self.comm, self.planner
        cap = -1.0 if memory_cap is None else float(memory_cap)
        gathered, headers = gather_records(comm, records, header=[elapsed, cap, *local_extra], align=self.align)
        parts, self._parts = self._parts, []
        self.extras = headers[:, 3:]
        if gathered is None:
            if headers[:, 0].max() > 0:
                self._warn_once("uneven", f"{self.label}: some ranks recorded no steps; plan unchanged.")
            return None
        observed = sum(p.shape[1] for p in parts)
        if parts:
            gathered = np.concatenate(parts + [gathered], axis=1)
        if comm.rank() == 0:
            self._warn_untimed(epoch, gathered)
        lead = comm.rank() == 0 and self.advisor is not None
        data = data_times(gathered) if lead else []
        upcoming = (self.advisor.before_decision(epoch, comm.size(), planner.allocator, data, hosts)  # type: ignore[union-attr]
                    if lead else None)
        entry = planner.end_epoch(
            epoch, gathered, epoch_time=float(headers[:, 1].max()),
            memory_caps=[None if c < 0 else int(c) for c in headers[:, 2]],
            observed_steps=observed, start_plan=start_plan,
        )
        entry.update(annotations or {})
        relocation = (self._relocate(epoch, upcoming, int(gathered.shape[1]), epochs_left, data, write_relocation)
                      if lead else None)
        # Rank 0 decides (it alone may hold the cluster context): every rank adopts its plan and its record of it.
        decided = comm.broadcast_object(
            {"plan": list(planner.plan), "predicted_gain": entry.get("predicted_gain"),
             "plan_changed": entry.get("plan_changed"), "predicted_step_time": planner.predicted_step_time,
             "pending_reset": planner.pending_reset, "damping": planner.damping.state_dict(),
             "relocation": relocation}, name="hetero_plugins.plan")
        self.adopt(decided, entry)
        if self.advisor is not None:
            entry["relocation"] = decided["relocation"]
        if comm.rank() == 0:
            self.log.info("%s: epoch %d batch sizes %s straggler level %.3f; next %s", self.label, entry["epoch"],
                          entry["batch_sizes"], entry["straggler_level"], entry["next_batch_sizes"])
        return entry

    def adopt(self, decided: Mapping[str, Any], entry: dict[str, Any] | None = None) -> None:
        """Take rank 0's decision (``plan``, ``predicted_step_time``, ``pending_reset``, ``damping``,
        ``predicted_gain``, ``plan_changed``) as this rank's, in the planner and in ``entry``: only rank 0 may hold
        the cluster context that announces a change, so its pending level resets keep every rank's time models
        alike, and its move limits every rank's checkpoint."""
        self.planner.plan = [int(b) for b in decided["plan"]]
        self.planner.predicted_step_time = decided["predicted_step_time"]
        self.planner.pending_reset = decided["pending_reset"]
        self.planner.damping.load_state_dict(decided["damping"])
        if entry is not None:
            entry["next_batch_sizes"] = list(self.planner.plan)
            entry["predicted_gain"], entry["plan_changed"] = decided["predicted_gain"], decided["plan_changed"]

    def _relocate(self, epoch: int, upcoming: Any, steps: int, epochs_left: int, data: list[float],
                  write: RelocationWriter | None) -> dict[str, Any] | None:
        """Rank 0: would moving ranks to free slots pay for a restart? Let the glue act on a new one."""
        assert self.advisor is not None
        out = self.advisor.relocate(upcoming, self.planner, steps, epochs_left, data)
        if out is None:
            return None
        decision, new = out
        info = self.advisor.info(epoch + 1, decision)
        if new and upcoming is not None and write is not None:
            write(info, decision, upcoming)
        return info

    def _warn_untimed(self, epoch: int, records: np.ndarray) -> None:
        """Warn once per rank that ran steps and reported 0 s of compute in every one: its time model learns
        nothing, so its batch never moves (the step timing did not run there)."""
        b, t = records[:, :, 0], records[:, :, 1]
        ran = (b > 0).any(axis=1)
        untimed = ran & np.where(b > 0, t == 0, True).all(axis=1)
        for r in np.flatnonzero(untimed):
            self._warn_once(f"untimed{r}", (
                f"{self.label}: rank {r} reported 0 s of compute in every step of epoch {epoch}, so its time model "
                f"learns nothing and its batch stays {self.planner.plan[r]}. HINT: the rank's step timing did not "
                "run: in a horovodrun script give hh.DistributedOptimizer the sampler (batch_sampler=...) or call "
                "its batch_drawn/backward_done/step_done hooks each step; under Lightning, run the step's forward "
                "and backward in training_step."))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
