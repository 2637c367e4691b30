"""The planner in the simulated loop: :func:`simulate`, the :func:`oracle`, and :func:`decision_problems` for
pre-training the DQN."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_int
from hetero_plugins.balancing.allocators import Allocator, Bounds, EqualFinishAllocator, get_allocator
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.time_model import TimeModelParams
from hetero_plugins.metrics import straggler_level
from hetero_plugins.scheduler.placement import best_placement
from hetero_plugins.scheduler.problem import DecisionProblem
from hetero_plugins.scheduler.relocation import Relocator
from hetero_plugins.scheduler.sim.cluster import ClusterSim, min_makespan_curves
from hetero_plugins.scheduler.sim.scenario import Scenario

log = logging.getLogger(__name__)

__all__ = ["SimulationRun", "decision_problems", "oracle", "simulate"]


def simulate(
    scenario: Scenario | str | Path | Mapping[str, Any],
    allocator: str | Allocator = "equal_finish",
    epochs: int | None = None,
    seed: int | None = None,
    min_gain: float = 0.03,
    telemetry: bool = True,
    relocation: Any = None,
    replan_every: int | None = None,
) -> dict[str, Any]:
    """Run the balancing loop (:class:`~hetero_plugins.balancing.planner.BalancePlanner`) against the simulated cluster.

    Every epoch runs ``steps_per_epoch`` steps under the current plan; the planner observes the measured
    compute times (data time is outside its window, as in :class:`~hetero_plugins.callbacks.BatchBalancer`)
    and plans the next epoch. With ``telemetry``, allocators with a ``set_context`` method also get, before
    each decision, what a real scheduler can observe at that epoch boundary: per-rank ``utilisation`` by other
    processes and ``data`` seconds per step (both measured in the epoch just run), each rank's ``devices``
    type, the ``corunners`` it ran beside in that epoch and the ``next_corunners`` placed beside it for the
    next epoch (co-runner *identities*, as a cluster manager knows them; never their slowdowns, which stay
    hidden in the scenario's ``interference`` table). ``telemetry=False`` simulates a run that passes none.

    ``relocation`` (stage 2 applied; ``True`` for a default
    :class:`~hetero_plugins.scheduler.relocation.Relocator` with the scenario's ``restart_cost``, or a
    ``Relocator``): at each epoch boundary the relocator may move ranks to free places (the free slots, and
    places that relocated ranks left); the moved ranks start the next epoch from the NCF-predicted time line
    of their new place, that epoch pays ``restart_cost`` seconds, and a rank that joins starts from the
    NCF-predicted line of its device instead of a survivor's. Events (co-runners, speed changes, ramps) belong
    to places: a rank that leaves a place leaves its co-runner behind.

    Ranks lost or added by events restart the planner at the epoch boundary (survivors keep their time
    models). Every step also pays the scenario's ring all-reduce time. The planner's damping gate
    (``min_gain``) uses the allocator's ``predict_makespan`` where it has one (see
    :meth:`~hetero_plugins.balancing.planner.BalancePlanner.predict_step_time`).

    ``replan_every`` (``None``: plans at epoch ends only): within an epoch, every this many steps the planner
    learns from the steps since its last decision and may change the plan for the rest of the epoch, as the
    Lightning integrations do with their ``replan_every`` option (default 5 there); the allocator gets no
    context at those calls, as there. ``plans`` holds each epoch's starting plan.

    Returns:
        dict with ``epoch_times`` (seconds), ``total_time``, ``samples_per_s``, ``steady_samples_per_s``
        (epochs after the first), ``plans``, ``straggler_level`` per epoch, ``busy_fraction`` per epoch (seconds of
        computation over ranks x seconds: the simulated accelerators' utilisation) and ``steady_busy_fraction``
        (after the first epoch), ``world_sizes``, ``restarts``,
        ``relocations`` (per relocation: epoch and moves), ``placements`` (each rank's place per epoch) and
        ``decision_ms`` (mean wall time of one planning call).
    """
    run = SimulationRun(ClusterSim(scenario, seed=seed), allocator, epochs, min_gain, telemetry, relocation,
                        replan_every=replan_every)
    for e in range(run.epochs):
        run.epoch(e)
    return run.result()


class SimulationRun:
    """The state of one :func:`simulate` run, advanced one epoch at a time (``run.epoch(e)`` for each epoch, then
    ``run.result()``); :func:`simulate` is this, run to the end. While a relocator decides, :meth:`branch` plays a
    candidate move forward in a copy of the run (placement pre-training reads realised returns from it).

    Ranks run on *places*: place ``r < world_size`` is rank r's own, the others the scenario's free slots.
    """

    def __init__(self, sim: ClusterSim, allocator: str | Allocator, epochs: int | None, min_gain: float,
                 telemetry: bool, relocation: Any, replan_every: int | None = None) -> None:
        if replan_every is not None:
            check_int("replan_every", replan_every, minimum=1, hint="use None to plan at epoch ends only")
        self.replan_every = replan_every
        self.sim = sim
        self.sc = sc = sim.scenario
        self.epochs = _checked_epochs(sim, epochs)
        self.min_gain = min_gain
        if relocation is not None and not isinstance(relocation, bool) and not hasattr(relocation, "propose"):
            raise ValueError(f"`relocation`={relocation!r} is not a relocator. HINT: pass True (the greedy rule), a "
                             "relocator such as make_relocator('planned_critic', scenario), or None.")
        self.alloc = alloc = get_allocator(allocator) if isinstance(allocator, str) else allocator
        self.context = telemetry and hasattr(alloc, "set_context")
        self.relocator: Any = relocation
        if relocation is True:
            self.relocator = Relocator(workload=sc.workload, restart_cost=sc.restart_cost)
        elif relocation is False:
            self.relocator = None
        self.pdev, self.pcaps = sim.place_devices(), sim.place_caps()
        self.where: dict[int, int] = {}  # rank -> place
        self.planner: BalancePlanner | None = None
        self.members: np.ndarray | None = None
        self.measured_co: dict[int, str | None] = {}  # co-runner under which each rank's time model was measured
        self.measured_data: dict[int, float] = {}
        self.epoch_times: list[float] = []
        self.plans: list[list[int]] = []
        self.levels: list[float] = []
        self.busy: list[float] = []
        self.decide: list[float] = []
        self.worlds: list[int] = []
        self.placements: list[list[int]] = []
        self.moves_log: list[dict[str, Any]] = []
        self.restarts = 0
        self.pending_cost = 0.0
        self.boundary: tuple[Any, ...] | None = None  # the relocate() arguments while a relocator decides

    def set_context(self, **context: Any) -> None:
        """Pass what is observable at this boundary to the allocator (when it takes context and telemetry is on)."""
        if self.context:
            self.alloc.set_context(workload=self.sc.workload, **context)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- one epoch
    def epoch(self, e: int) -> None:
        """Membership, the epoch's steps, the planner's decision, then relocation for the next epoch."""
        act = self.sim.active(e)
        if self.members is None or not np.array_equal(act, self.members):
            self.planner, self.members = self.restart(e, act), act
        here = np.array([self.where[int(r)] for r in act], dtype=np.int64)
        total, records, d_p, observed = self.run_steps(e, act, here)
        co_now, co_next = self.sim.place_corunners(e), self.sim.place_corunners(e + 1)
        self.measured_co = {int(r): co_now[p] for r, p in zip(act, here)}
        self.measured_data = {int(r): float(d) for r, d in zip(act, records[:, :, 2].mean(axis=1))}
        mult = self.sim.place_multipliers(e)[here] if self.context else None
        self.set_context(utilisation=None if mult is None else list(1.0 - 1.0 / mult),
                         data=list(records[:, :, 2].mean(axis=1)), devices=[self.pdev[p] for p in here],
                         corunners=[co_now[p] for p in here], next_corunners=[co_next[p] for p in here])
        assert self.planner is not None
        t0 = time.perf_counter()
        self.planner.end_epoch(e, records, epoch_time=total, memory_caps=[self.pcaps[p] for p in here],
                               observed_steps=observed, start_plan=self.plans[-1])
        self.decide.append(time.perf_counter() - t0)
        if self.relocator is not None and e + 1 < self.epochs and np.array_equal(self.sim.active(e + 1), act) \
                and all(p is not None for p in self.planner.model_params()):
            self.relocate(e, act, here, records, d_p, co_now, co_next)

    def run_steps(self, e: int, act: np.ndarray, here: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, int]:
        """The epoch's steps under the current plan: its seconds, the step records, the places' data times and
        the leading steps mid-epoch re-plans have already fed the planner."""
        sim, sc = self.sim, self.sc
        assert self.planner is not None
        comm = sim.allreduce_time(len(act))
        plan = list(self.planner.plan)
        self.plans.append(plan)
        self.worlds.append(len(act))
        self.placements.append([int(p) for p in here])
        a_p, b_p, d_p = sim.place_params(e)
        records = np.zeros((len(act), sc.steps_per_epoch, 3))
        total, self.pending_cost = self.pending_cost, 0.0
        planv = np.asarray(plan, dtype=np.float64)
        busy = 0.0
        work = sim.work(planv, here)
        observed = 0
        for s in range(sc.steps_per_epoch):
            if self.replan_every and s and s % self.replan_every == 0:  # a mid-epoch re-plan
                self.planner.replan(records[:, observed:s])
                observed = s
                planv = np.asarray(self.planner.plan, dtype=np.float64)
                work = sim.work(planv, here)
            compute = (a_p[here] + b_p[here] * work) * sim.place_noise(e, s)[here]
            data = d_p[here]
            records[:, s, 0] = planv
            records[:, s, 1] = compute
            records[:, s, 2] = data
            total += float(np.max(compute + data)) + comm
            busy += float(compute.sum())
        self.epoch_times.append(total)
        self.busy.append(busy / (len(act) * total) if total > 0 else 0.0)
        self.levels.append(straggler_level(records[:, :, 1].mean(axis=1) + records[:, :, 2].mean(axis=1)))
        return total, records, d_p, observed

    # ---------------------------------------------------------------- membership changes
    def restart(self, e: int, act: np.ndarray) -> BalancePlanner:
        """A rank was lost or added (or the run starts): an elastic restart at the epoch boundary.

        Survivors keep their time models and places; a new rank takes its own place and starts from the
        NCF-predicted line of it (with a relocator) or a survivor's of the same device type, and the first
        plan is decided from those models when every rank has one.
        """
        new = BalancePlanner(len(act), self.sc.global_batch, allocator=self.alloc, min_gain=self.min_gain)
        for r in act:
            self.where.setdefault(int(r), int(r))
        if self.planner is None or self.members is None:
            return new
        self.restarts += 1
        source = self.seed_models(new, e, act)
        new.memory_caps = [self.pcaps[self.where[int(r)]] for r in act]
        data = self.measured_data  # each rank's, else that of the rank its model came from
        new.data_time = [data.get(int(r), data.get(q, 0.0) if q is not None else 0.0) for r, q in zip(act, source)]
        new.skip_warmup()
        if all(p is not None for p in new.model_params()):
            nxt = self.sim.place_corunners(e) if self.context else None
            self.set_context(
                utilisation=None,
                data=new.data_time,
                devices=[self.pdev[self.where[int(r)]] for r in act],
                corunners=[self.measured_co.get(q) if q is not None else None for q in source],
                next_corunners=None if nxt is None else [nxt[self.where[int(r)]] for r in act])
            new.replan()
        return new

    def seed_models(self, new: BalancePlanner, e: int, act: np.ndarray) -> list[int | None]:
        """Give ``new`` each rank's time model; returns the rank whose measurements each model came from."""
        assert self.planner is not None and self.members is not None
        old = {int(r): m for r, m in zip(self.members, self.planner.models)}
        source: list[int | None] = []
        for i, r in enumerate(act):
            r = int(r)
            if r in old:
                q: int | None = r
            else:
                predicted = self.predicted_line(self.where[r], e)
                if predicted is not None:
                    new.seed_model(i, predicted, self.sc.global_batch // len(act))
                    self.measured_co[r] = self.sim.place_corunners(e)[self.where[r]]
                    source.append(r)
                    continue
                q = next((q for q in old if self.pdev[self.where[q]] == self.pdev[self.where[r]]), None)
            source.append(q)
            if q is not None:
                new.models[i] = copy.deepcopy(old[q])
        return source

    def predicted_line(self, place: int, epoch: int) -> tuple[float, float] | None:
        """A new rank's time line: the NCF-predicted line of its place (None: unknown)."""
        relocator, planner, members = self.relocator, self.planner, self.members
        if relocator is None or planner is None or members is None:
            return None
        known = [(int(r), m) for r, m in zip(members, planner.model_params()) if m is not None]  # one step: none yet
        solo = relocator.solo_lines([self.pdev[self.where[r]] for r, _ in known],
                                    [self.measured_co.get(r) for r, _ in known],
                                    [(m.intercept, m.slope) for _, m in known], self.sc.workload)
        s = relocator.slowdown(self.pdev[place], self.sim.place_corunners(epoch)[place], self.sc.workload)
        if self.pdev[place] not in solo or s is None:
            return None
        a, b = solo[self.pdev[place]]
        return a * s, b * s

    # ---------------------------------------------------------------- relocation
    def relocate(self, e: int, act: np.ndarray, here: np.ndarray, records: np.ndarray, d_p: np.ndarray,
                 co_now: list[str | None], co_next: list[str | None]) -> None:
        """Stage 2 at the end of epoch ``e``: the relocator may move ranks to free places for epoch ``e + 1``."""
        sim, planner = self.sim, self.planner
        assert planner is not None
        taken = set(self.where[int(r)] for r in act)
        alive = set(int(r) for r in act)
        other = sim.place_taken(e + 1)  # free slots another job holds in the next epoch
        free = [p for p in range(sim.places)
                if p not in taken and not other[p] and (p >= sim.world_size or p in alive)]
        if not free:
            return
        t0 = time.perf_counter()
        self.boundary = (e, act, here, records, d_p, co_now, co_next)
        # A relocator that tracks places across calls (``observes_places``, e.g. the learned one) also gets
        # each rank's place and home place, the epoch and the restart cost; every free slot names its place.
        extra: dict[str, Any] = {}
        if getattr(self.relocator, "observes_places", False):
            extra = {"places": [int(p) for p in here], "homes": [int(r) for r in act], "epoch": int(e),
                     "restart_cost": float(self.sc.restart_cost)}
        if getattr(self.relocator, "observes_planner", False):  # a model-based relocator rolls a copy forward
            extra["planner"] = planner
        decision = self.relocator.propose(
            devices=[self.pdev[p] for p in here], corunners=[co_now[p] for p in here],
            next_corunners=[co_next[p] for p in here],
            lines=[(m.intercept, m.slope) for m in planner.model_params()],
            free_slots=[{"device": self.pdev[p], "corunner": co_next[p], "data": float(d_p[p]), "place": int(p)}
                        for p in free],
            global_batch=self.sc.global_batch, steps_per_epoch=self.sc.steps_per_epoch, epochs_left=self.epochs - e - 1,
            data=list(records[:, :, 2].mean(axis=1)), workload=self.sc.workload, **extra)
        self.boundary = None
        if decision.moves:
            where = [int(p) for p in here]
            for i, k in decision.moves:
                where[i] = free[k]
            caps = [self.sc.global_batch if self.pcaps[p] is None else int(self.pcaps[p]) for p in where]
            if sum(caps) < self.sc.global_batch:  # the slots' memory could not hold the global batch: stay
                log.info("simulator: relocation %s ignored: the memory caps %s hold less than the global batch %d",
                         decision.moves, caps, self.sc.global_batch)
                return
            for i, k in decision.moves:
                r, p = int(act[i]), free[k]
                self.where[r] = p
                known = decision.batches[i] if i < len(decision.batches) else None
                planner.seed_model(i, decision.lines[i], batch_size=known, data_time=float(d_p[p]))
                self.measured_co[r] = co_next[p]
            here = np.array([self.where[int(r)] for r in act], dtype=np.int64)
            planner.memory_caps = [self.pcaps[p] for p in here]
            self.set_context(utilisation=None, data=[float(d_p[p]) for p in here], devices=[self.pdev[p] for p in here],
                             corunners=[co_next[p] for p in here], next_corunners=[co_next[p] for p in here])
            planner.replan()
            self.pending_cost = self.sc.restart_cost
            self.moves_log.append({"epoch": e + 1, "moves": [(int(act[i]), int(free[k])) for i, k in decision.moves],
                                   "predicted_gain": decision.predicted_gain})
        self.decide[-1] += time.perf_counter() - t0

    def branch(self, decision: Any, horizon: int, seed: int | None = None, known_future: bool = True,
               believed: tuple[Sequence[float], Sequence[float]] | None = None) -> float:
        """The seconds of :meth:`branch_epochs` summed."""
        return float(sum(self.branch_epochs(decision, horizon, seed, known_future, believed)))

    def branch_epochs(self, decision: Any, horizon: int, seed: int | None = None, known_future: bool = True,
                      believed: tuple[Sequence[float], Sequence[float]] | None = None,
                      continuation: Any = None) -> list[float]:
        """Seconds each of the next ``horizon`` epochs takes (restart cost included) if ``decision`` (a
        :class:`~hetero_plugins.scheduler.relocation.Relocation`, ``None``: stay) is applied at the boundary being
        decided and nobody moves after: a forked copy of the run, this run untouched. Only while a relocator
        decides (placement pre-training reads realised returns from it).

        Args:
            decision: the relocation applied in the fork (``None``: stay).
            horizon: epochs played forward (fewer when the run ends sooner).
            seed: the fork's noise seed (``None``: the run's own, so the fork replays the run's noise; another
                value gives independent noise, to tell what a choice owes to knowing the noise).
            known_future: ``False`` drops the co-runner, speed, ramp and slot events after the next epoch from
                the fork, as if what is announced at this boundary lasted (rank arrivals and losses stay): the
                fork then knows the cluster's true step-time curves and interference but not its future.
            believed: per place (the ranks' own, then the free slots), the ``(intercepts, slopes)`` of a
                belief about the cluster, e.g. a scheduler's fitted lines and NCF-priced slots: the fork's steps
                take these linear times for every epoch it plays instead of the true curves (data times and noise
                stay the cluster's), so a choice can be judged on what the scheduler knows.
            continuation: a relocator (copied per fork) that decides at the fork's later boundaries instead of
                nobody: the decision's value under the policy that follows it.
        """
        if continuation is not None and not hasattr(continuation, "propose"):
            raise ValueError(f"`continuation`={continuation!r} is not a relocator. HINT: pass one, or None.")
        if self.boundary is None:
            raise RuntimeError("branch() is only available while a relocator decides (inside its propose call).")
        check_int("horizon", horizon, minimum=1, hint="e.g. 4")
        relocator, self.relocator = self.relocator, None
        try:
            fork = copy.deepcopy(self)
        finally:
            self.relocator = relocator
        e, *args = fork.boundary
        fork.boundary = None
        if seed is not None:
            fork.sim.seed = int(seed)
        if not known_future:
            sc = fork.sim.scenario
            fork.sim.scenario = fork.sc = dataclasses.replace(
                sc, events=tuple(ev for ev in sc.events if ev["epoch"] <= e + 1),
                slot_events=tuple(ev for ev in sc.slot_events if ev["epoch"] <= e + 1))
        if decision is not None and decision.moves:
            fork.relocator = _Decided(decision)
            fork.relocate(e, *args)
        fork.relocator = copy.deepcopy(continuation)  # None: nobody moves in the fork
        if believed is not None:
            a, b = (np.asarray(x, dtype=np.float64) for x in believed)
            if a.shape != (fork.sim.places,) or b.shape != (fork.sim.places,):
                raise ValueError(f"`believed` needs one intercept and one slope per place ({fork.sim.places}), got "
                                 f"{a.shape} and {b.shape}. HINT: the ranks' own places first, then the free slots.")
            fork.sim = _BelievedCluster(fork.sim, a, b)  # type: ignore[assignment]
        done = len(fork.epoch_times)
        for k in range(e + 1, min(e + 1 + int(horizon), fork.epochs)):
            fork.epoch(k)
        return [float(t) for t in fork.epoch_times[done:]]

    def result(self) -> dict[str, Any]:
        sc, epoch_times = self.sc, self.epoch_times
        samples = sc.global_batch * sc.steps_per_epoch * self.epochs
        return {
            "scenario": sc.name, "allocator": getattr(self.alloc, "name", type(self.alloc).__name__),
            "steady_samples_per_s": _steady(sc, epoch_times), "world_size": sc.world_size, "world_sizes": self.worlds,
            "restarts": self.restarts, "relocations": self.moves_log, "placements": self.placements,
            "epochs": self.epochs, "epoch_times": epoch_times, "total_time": float(sum(epoch_times)),
            "samples_per_s": samples / float(sum(epoch_times)),
            "straggler_level": self.levels,
            "busy_fraction": self.busy,
            "steady_busy_fraction": _steady_busy(epoch_times, self.busy),
            "plans": self.plans,
            "decision_ms": 1000.0 * float(np.mean(self.decide)),
        }


class _BelievedCluster:
    """A cluster whose places run believed linear lines (a branch's ``believed``); all else is the cluster's."""

    def __init__(self, sim: ClusterSim, intercept: np.ndarray, slope: np.ndarray) -> None:
        self._sim, self._a, self._b = sim, intercept, slope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sim, name)

    def place_params(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._a, self._b, self._sim.place_params(epoch)[2]

    def work(self, plan: Sequence[int] | np.ndarray, places: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        return np.asarray(plan, dtype=np.float64)


def _checked_epochs(sim: ClusterSim, epochs: int | None) -> int:
    """``epochs`` (default the scenario's), checked: an int >= 1 at every epoch of which, beyond the scenario's
    own, some rank is left and the ranks' memory holds the global batch (the scenario checked its own epochs)."""
    sc = sim.scenario
    if epochs is None:
        return sc.epochs
    epochs = check_int("epochs", epochs, minimum=1, hint="the number of epochs to simulate, e.g. 10")
    for e in range(sc.epochs, epochs):
        act = sim.active(e)
        caps = [sc.max_batch[int(r)] for r in act]
        if not len(act) or (all(c is not None for c in caps) and sum(caps) < sc.global_batch):  # type: ignore[misc]
            raise ValueError(f"`epochs`={epochs} runs scenario {sc.name!r} past its {sc.epochs} epochs, where at epoch "
                             f"{e} {'no rank is left' if not len(act) else 'the ranks cannot hold the global batch'}. "
                             f"HINT: use epochs <= {e}, or extend the scenario's own `epochs`.")
    return epochs


class _Decided:
    """A relocator that returns one given decision (a branch of the run applies it)."""

    def __init__(self, decision: Any) -> None:
        self.decision = decision

    def propose(self, **_: Any) -> Any:
        return self.decision


def _steady_busy(epoch_times: Sequence[float], busy: Sequence[float]) -> float:
    """The accelerators' busy fraction after the first epoch: seconds of computation over ranks x seconds, the
    simulator's counterpart of the GPU utilisation that NVML measures (LBB reports it beside throughput)."""
    t = np.asarray(epoch_times[1:] or epoch_times, dtype=np.float64)
    b = np.asarray(busy[1:] or busy, dtype=np.float64)
    return float((t * b).sum() / t.sum()) if t.sum() > 0 else 0.0


def _steady(sc: Scenario, epoch_times: Sequence[float]) -> float:
    """Samples per second after the first epoch (the one every policy spends measuring an equal split)."""
    rest = list(epoch_times[1:]) or list(epoch_times)
    return sc.global_batch * sc.steps_per_epoch * len(rest) / float(sum(rest))


def oracle(
    scenario: Scenario | str | Path | Mapping[str, Any],
    epochs: int | None = None,
    seed: int | None = None,
    placement: bool = True,
) -> dict[str, Any]:
    """The oracle: every epoch, the best placement (over the ranks' own and the free slots) and the
    makespan-optimal split on the *true* times (data time included, memory caps respected), run under the same
    noise as :func:`simulate`. Linear step times are split by the equal-finish allocator; nonlinear curves
    (saturation, memory cliffs) by the exact integer solver
    :func:`~hetero_plugins.scheduler.sim.cluster.min_makespan_curves`, so the split is the exact min-makespan one
    either way. A free slot taken by another job is not used, except
    one the oracle held in the epoch before. Returns ``epoch_times``, ``total_time``, ``samples_per_s``, ``plans``,
    ``placements`` (slot descriptions per epoch) and the busy fractions as :func:`simulate` does."""
    sim = ClusterSim(scenario, seed=seed)
    sc = sim.scenario
    epochs = _checked_epochs(sim, epochs)
    ef = EqualFinishAllocator()
    times, plans, placements, busy = [], [], [], []
    held: set[int] = set()
    memo: dict[tuple[Any, ...], list[int]] = {}  # the placement of the same slots (epochs without events) is the same

    def true_lines(chosen: list[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The true ``(intercept, slope, data)`` of ``chosen`` places and their place ids (for their curves)."""
        a, beta, data = (np.array([x[k] for x in chosen]) for k in ("intercept", "slope", "data"))
        where = np.array([x["rank"] if x["rank"] is not None else sim.world_size + x["free_slot"] for x in chosen],
                         dtype=np.int64)
        return a, beta, data, where

    def split(chosen: list[Mapping[str, Any]]) -> tuple[float, np.ndarray] | None:
        """The noise-free step of the exact min-makespan split over ``chosen`` places, and that split (``None``:
        their memory caps cannot hold the global batch)."""
        caps = [sc.global_batch if x["max_batch"] is None else int(x["max_batch"]) for x in chosen]
        if sum(caps) < sc.global_batch:
            return None
        a, beta, data, where = true_lines(chosen)
        n = len(chosen)
        if sc.linear:
            models = [TimeModelParams(x["intercept"] + x["data"], x["slope"]) for x in chosen]
            plan = np.asarray(ef.allocate(models, sc.global_batch, Bounds((1,) * n, tuple(caps))), dtype=np.float64)
        else:
            plan = min_makespan_curves(lambda b: a + beta * sim.work(b, where) + data, sc.global_batch,
                                       np.ones(n, dtype=np.int64), np.asarray(caps, dtype=np.int64)).astype(np.float64)
        return float(np.max(a + beta * sim.work(plan, where) + data)), plan

    for e in range(epochs):
        slots = [x for x in sim.slots(e) if not x.get("taken") or x.get("free_slot") in held]
        n = len(sim.active(e))
        own = [k for k, x in enumerate(slots) if x["rank"] is not None][:n]
        pick, solved = own, None
        if placement and len(slots) > n:
            key = (n, *((x["intercept"], x["slope"], x["data"], x["rank"], x.get("free_slot")) for x in slots))
            if key not in memo:
                # The search ranks places by their lines; the true split of what it finds (memory caps, saturation,
                # cliffs) must beat the places held now, or the oracle keeps those (it is a bound on staying too).
                found = (best_placement if sc.linear else _swap_placement)(slots, n, sc.global_batch)
                tried = [(p, r) for p in (found, own) if (r := split([slots[k] for k in p])) is not None]
                memo[key] = min(tried, key=lambda t: t[1][0], default=(own, None))  # a tie keeps the search's
            pick, solved = memo[key]
        chosen = [slots[k] for k in pick]
        held = {int(x["free_slot"]) for x in chosen if x.get("free_slot") is not None}
        solved = solved or split(chosen)
        if solved is None:
            raise ValueError(f"oracle: the places of epoch {e} cannot hold the global batch {sc.global_batch} within "
                             "their memory caps. HINT: raise `memory_samples` or lower `global_batch` in the scenario.")
        plan = solved[1]
        a, beta, data, where = true_lines(chosen)
        work = sim.work(plan, where)
        comm = sim.allreduce_time(n)
        compute = [(a + beta * work) * sim.slot_noise(e, s, chosen) for s in range(sc.steps_per_epoch)]
        total = sum(float(np.max(c + data)) + comm for c in compute)
        times.append(total)
        busy.append(float(sum(c.sum() for c in compute)) / (n * total) if total > 0 else 0.0)
        plans.append([int(b) for b in plan])
        placements.append([{"device": x["device"], "corunner": x["corunner"], "rank": x["rank"],
                            "free_slot": x.get("free_slot")} for x in chosen])
    samples = sc.global_batch * sc.steps_per_epoch * epochs
    return {"scenario": sc.name, "allocator": "oracle", "epochs": epochs, "epoch_times": times,
            "steady_samples_per_s": _steady(sc, times),
            "total_time": float(sum(times)), "samples_per_s": samples / float(sum(times)), "plans": plans,
            "placements": placements, "busy_fraction": busy, "steady_busy_fraction": _steady_busy(times, busy)}


def _swap_placement(slots: Sequence[Mapping[str, Any]], n: int, global_batch: int) -> list[int]:
    """:func:`~hetero_plugins.scheduler.placement.best_placement`'s search, vectorised: the same greedy start on
    speed, then the best single swap of all (chosen, unchosen) pairs at a time, by the continuous equal-finish
    time ``(B + sum c/s) / sum 1/s``, while it improves."""
    c = np.array([float(x["intercept"]) + float(x["data"]) for x in slots])
    sl = np.array([float(x["slope"]) for x in slots])
    order = sorted(range(len(slots)), key=lambda k: (sl[k], slots[k].get("rank") is None, k))
    chosen, rest = np.array(order[:n]), np.array(order[n:])
    u, v = c / sl, 1.0 / sl  # the chosen set's time is max((B + sum u) / sum v, max(c + s)): equal_finish_time
    floor = c + sl
    for _ in range(4 * len(slots)):
        if not len(rest):
            break
        su, sv = float(u[chosen].sum()), float(v[chosen].sum())
        t = (global_batch + su - u[chosen][:, None] + u[rest][None, :]) / (sv - v[chosen][:, None] + v[rest][None, :])
        fc = floor[chosen]
        top = int(np.argmax(fc))
        others = np.full(len(chosen), fc[top])  # the largest floor among the chosen but i
        if len(chosen) > 1:
            others[top] = np.max(np.delete(fc, top))
        else:
            others[top] = -np.inf
        t = np.maximum(t, np.maximum(others[:, None], floor[rest][None, :]))
        i, j = np.unravel_index(int(np.argmin(t)), t.shape)
        if not t[i, j] < max((global_batch + su) / sv, float(fc.max())) * (1 - 1e-9):
            break
        chosen[i], rest[j] = rest[j], chosen[i]
    return sorted(int(k) for k in chosen)


def decision_problems(
    scenario: Scenario | str | Path | Mapping[str, Any],
    rng: np.random.Generator,
    fit_noise: float = 0.03,
) -> list[DecisionProblem]:
    """One :class:`DecisionProblem` per epoch boundary of a scenario (epoch e observed, epoch e+1 true)."""
    sim = ClusterSim(scenario)
    sc = sim.scenario
    all_caps = np.array([c if c is not None else sc.global_batch for c in sc.max_batch], dtype=np.float64)
    out = []
    prev_beta = None
    for e in range(sc.epochs - 1):
        act = sim.active(e)
        if not np.array_equal(act, sim.active(e + 1)):  # membership changes: a restart, no decision to learn
            prev_beta = None
            continue
        a, beta, data = (x[act] for x in sim.params(e))
        a2, beta2, data2 = (x[act] for x in sim.params(e + 1))
        m = sim.multipliers(e)[act]
        caps = all_caps[act]
        jitter = np.exp(rng.normal(0.0, fit_noise, len(act)))
        obs_beta = beta * jitter
        if prev_beta is not None and len(prev_beta) != len(obs_beta):
            prev_beta = None
        out.append(DecisionProblem(
            intercept=a * jitter, slope=obs_beta, prev_slope=obs_beta if prev_beta is None else prev_beta,
            utilisation=1.0 - 1.0 / m, data=data, true_intercept=a2, true_slope=beta2, true_data=data2,
            global_batch=sc.global_batch, max_batch=caps,
        ))
        prev_beta = obs_beta
    return out
