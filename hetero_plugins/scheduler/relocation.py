"""Stage 2 applied: move ranks to other slots when the predicted gain pays for a restart.

Zhang, Geng, Ma, "Learning-Driven Interference-Aware Workload Parallelization for Streaming Applications in
Heterogeneous Cluster" (IEEE TPDS 2021), IAWP: the NCF predicts how much a co-located job slows this workload
on a device, so ranks can be placed on the slots that run it fastest. :class:`Relocator` is what a scheduler
can decide at an epoch boundary from what it knows there:

- each rank's fitted time line, measured beside its co-runner of the epoch just run, scaled to the co-runner
  placed beside it for the next epoch (``NCF(next) / NCF(measured)``, as
  :class:`~hetero_plugins.scheduler.interference.InterferenceCorrection`);
- a solo line per device type, from the ranks of that type with their co-runner's predicted slowdown divided
  out (the median over those ranks): the time model of a rank on a slot it has never run on;
- the free slots (device type and co-runner).

It picks the placement with the shortest predicted equal-finish step time
(:func:`~hetero_plugins.scheduler.placement.best_placement`) and moves ranks only when the seconds saved over
the next ``horizon_epochs`` epochs exceed ``restart_cost`` and the step time drops by at least ``min_gain``.
The decision is framework-free; the simulator applies it (``simulate(..., relocation=True)``) and the
integrations write it as a restart spec, which they read back after a restart
(:mod:`~hetero_plugins.scheduler.restart_spec`: :func:`write_relocation_spec`, :func:`read_relocation_spec`,
:func:`check_relocation_spec`, :func:`resume_checkpoint`, :func:`torchelastic_restarts`; re-exported here).

This is the only relocation planner and the only spec format. :func:`plan_relocation`,
:class:`RelocationPlan` and :func:`write_restart_spec` are the older entry points over one list of slots with
known solo times per device type; they are kept as thin functions over :class:`Relocator` and
:func:`write_relocation_spec`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_bool, check_float, check_int
from hetero_plugins.balancing.allocators import equal_finish_time
from hetero_plugins.scheduler.interference import InterferenceCorrection, interference_correction
from hetero_plugins.scheduler.ncf import InterferencePredictor
from hetero_plugins.scheduler.placement import best_placement
from hetero_plugins.scheduler.restart_spec import (
    check_relocation_spec,
    read_relocation_spec,
    resume_checkpoint,
    torchelastic_restarts,
    write_relocation_spec,
)

__all__ = ["Relocation", "RelocationPlan", "Relocator", "check_relocation_spec", "plan_relocation",
           "read_relocation_spec", "resume_checkpoint", "torchelastic_restarts", "write_relocation_spec",
           "write_restart_spec"]


@dataclass(frozen=True)
class Relocation:
    """A relocation decision (possibly "stay").

    Attributes:
        targets: per rank, the index into ``free_slots`` it moves to, or ``None`` (it stays).
        lines: per rank, the predicted ``(intercept, slope)`` for the next epoch where it will run.
        current_step_time: predicted equal-finish step time if nobody moves (seconds, data time included).
        step_time: predicted step time after the moves (equal to ``current_step_time`` when nobody moves).
        saved_seconds: predicted seconds saved over the horizon, restart cost deducted (``<= 0``: stay).
        considered: placements compared (0 when no free slot could be evaluated).
        unknown_slots: the free slots that could not be priced.
        batches: per rank that moves, the batch size its predicted line stands for (``None``, or no entry: its
            current batch); see :meth:`Relocator.price_places`.
    """

    targets: list[int | None]
    lines: list[tuple[float, float]]
    current_step_time: float
    step_time: float
    saved_seconds: float = 0.0
    considered: int = 0
    unknown_slots: list[int] = field(default_factory=list)
    batches: list[int | None] = field(default_factory=list)

    @property
    def moves(self) -> list[tuple[int, int]]:
        """``(rank, free slot index)`` of each rank that moves."""
        return [(r, s) for r, s in enumerate(self.targets) if s is not None]

    @property
    def predicted_gain(self) -> float:
        """Relative step-time gain (``0.25``: steps 25% faster)."""
        return self.current_step_time / self.step_time - 1.0 if self.step_time > 0 else 0.0


class Relocator:
    """Decide at an epoch boundary which ranks to move to free slots (stage 2, IAWP).

    Args:
        predictor: the NCF: ``None``/``True`` for the shipped model, an
            :class:`~hetero_plugins.scheduler.ncf.InterferencePredictor`, or a model file.
        workload: this job's workload type (the NCF's user).
        min_gain: smallest relative step-time gain worth a restart.
        restart_cost: seconds a restart costs (checkpoint, relaunch, reload); a move must save more over the
            horizon.
        horizon_epochs: epochs a move is assumed to pay off over (co-runners come and go; the rest of the run
            when fewer epochs are left).

    Example::

        >>> r = Relocator(restart_cost=0.0)
        >>> d = r.propose(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, "video"],
        ...               lines=[(0.005, 0.0005), (0.006, 0.0012)], free_slots=[{"device": "v100"}],
        ...               global_batch=512, steps_per_epoch=20, epochs_left=5)
        >>> d.moves, d.predicted_gain > 0.2
        ([(1, 0)], True)
    """

    def __init__(self, predictor: Any = None, workload: str = "training", min_gain: float = 0.05,
                 restart_cost: float = 60.0, horizon_epochs: int = 3) -> None:
        if predictor is False:
            raise ValueError("`predictor`=False is not usable: the relocator prices slots with the NCF. HINT: pass "
                             "None/True (the shipped model), an InterferencePredictor or a model file.")
        self.correction: InterferenceCorrection = interference_correction(  # type: ignore[assignment]
            True if predictor is None else predictor)
        if not isinstance(workload, str) or not workload:
            raise ValueError(f"`workload`={workload!r} is invalid. HINT: use a workload name such as 'training'.")
        self.workload = workload
        self.min_gain = check_float("min_gain", min_gain, minimum=0.0)
        self.restart_cost = check_float("restart_cost", restart_cost, minimum=0.0)
        self.horizon_epochs = check_int("horizon_epochs", horizon_epochs, minimum=1)
        self.decisions = 0  #: calls to :meth:`propose`
        self.relocations = 0  #: decisions that moved at least one rank

    def slowdown(self, device: str, corunner: str | None, workload: str | None = None) -> float | None:
        """The NCF's predicted slowdown of the workload on ``device`` beside ``corunner`` (``None``: unknown)."""
        return self.correction.slowdown(workload or self.workload, device, corunner)

    def known_names(self) -> dict[str, list[str]] | None:
        """The names the relocator's NCF knows, ``{"workload": [...], "device": [...], "corunner": [...]}``
        (co-runners without ``"none"``, which stands for no co-runner); ``None`` for a predictor without a
        vocabulary (see :meth:`~hetero_plugins.scheduler.interference.InterferenceCorrection.known_names`)."""
        return self.correction.known_names()

    def solo_lines(self, devices: Sequence[str], corunners: Sequence[str | None],
                   lines: Sequence[tuple[float, float]], workload: str | None = None) -> dict[str, tuple[float, float]]:
        """Per device type, the median line of its ranks with their co-runner's predicted slowdown divided out."""
        groups: dict[str, list[tuple[float, float]]] = {}
        for d, c, (a, b) in zip(devices, corunners, lines):
            s = self.slowdown(d, c, workload)
            if s is not None and s > 0 and b > 0:
                groups.setdefault(d, []).append((a / s, b / s))
        return {d: (float(np.median([x[0] for x in v])), float(np.median([x[1] for x in v])))
                for d, v in groups.items()}

    def device_floors(self, devices: Sequence[str], corunners: Sequence[str | None],
                      lines: Sequence[tuple[float, float]], batches: Sequence[float], workload: str | None = None,
                      solo: Mapping[str, tuple[float, float]] | None = None, excess: float = 0.5,
                      ) -> dict[str, float]:
        """Per device type, the solo step time its ranks' small batches were measured at, where that stands above
        the device's line: a saturation plateau, below which a step takes no less time however few its samples.

        A device's median line (:meth:`solo_lines`) comes from the ranks that carry most of the batch; a slot
        priced from it at a few samples is predicted far faster than a plateau lets it run (the rank that moves
        there is cut to a few samples, then sets every step). The ranks of that device holding at most half its
        median batch tell the plateau: when at least two hold so few, and the lower median of their fitted times
        at their batches (the co-runner's predicted slowdown divided out) exceeds the device line at their median
        batch by more than ``excess``, that time is the device's floor (one rank whose load ramps never decides).
        """
        if solo is None:
            solo = self.solo_lines(devices, corunners, lines, workload)
        groups: dict[str, list[tuple[float, float]]] = {}
        for d, c, (a, b), p in zip(devices, corunners, lines, batches):
            s = self.slowdown(d, c, workload)
            if s is not None and s > 0 and p >= 1:
                groups.setdefault(d, []).append((float(p), (a + b * p) / s))
        floors: dict[str, float] = {}
        for d, v in groups.items():
            if d not in solo:
                continue
            half = 0.5 * float(np.median([p for p, _ in v]))
            small = [(p, t) for p, t in v if p <= half]
            if len(small) < 2:
                continue
            t_small = sorted(t for _, t in small)[(len(small) - 1) // 2]  # the lower median: one rank never decides
            a, b = solo[d]
            if t_small > (1.0 + excess) * (a + b * float(np.median([p for p, _ in small]))):
                floors[d] = t_small
        return floors

    @staticmethod
    def check_lengths(devices: Sequence[Any], corunners: Sequence[Any], next_corunners: Sequence[Any],
                      lines: Sequence[Any], data: Sequence[float] | None) -> None:
        """``ValueError`` unless every per-rank argument of :meth:`propose` has one entry per rank."""
        n = len(devices)
        if not (len(corunners) == len(next_corunners) == len(lines) == n) or (data is not None and len(data) != n):
            raise ValueError(f"`devices`, `corunners`, `next_corunners`, `lines` (and `data`) need one entry per rank; "
                             f"got lengths {len(devices)}, {len(corunners)}, {len(next_corunners)}, {len(lines)}"
                             f"{'' if data is None else f', {len(data)}'}. HINT: pass one entry per rank in each.")

    def propose(
        self,
        *,
        devices: Sequence[str],
        corunners: Sequence[str | None],
        next_corunners: Sequence[str | None],
        lines: Sequence[tuple[float, float]],
        free_slots: Sequence[Mapping[str, Any]],
        global_batch: int,
        steps_per_epoch: int,
        epochs_left: int,
        data: Sequence[float] | None = None,
        workload: str | None = None,
        solo: Mapping[str, tuple[float, float]] | None = None,
    ) -> Relocation:
        """The best placement of the ranks over their own and the free slots, or "stay".

        Args:
            devices: each rank's device type.
            corunners: the co-runner each rank's line was measured beside (``None``: dedicated).
            next_corunners: the co-runner beside each rank's current slot in the next epoch.
            lines: each rank's fitted ``(intercept, slope)`` (compute seconds per step).
            free_slots: idle places, each ``{"device", "corunner" (optional), "data" (optional seconds)}``.
            global_batch: samples per step.
            steps_per_epoch: steps in an epoch (the horizon's unit).
            epochs_left: epochs left in the run.
            data: each rank's measured data seconds per step outside the compute window (stays with the slot).
            workload: overrides the relocator's workload.
            solo: per device type, the solo ``(intercept, slope)`` free slots are priced from; default
                :meth:`solo_lines` of the ranks (then a device type no rank runs on is unknown).
        """
        self.check_lengths(devices, corunners, next_corunners, lines, data)
        self.decisions += 1
        own, incoming, unknown, _ = self.price_places(devices, corunners, next_corunners, lines, free_slots, data,
                                                      workload, solo)
        horizon = min(int(epochs_left), self.horizon_epochs) * int(steps_per_epoch)
        return self._choose(own, incoming, unknown, global_batch, horizon)

    def price_places(self, devices: Sequence[str], corunners: Sequence[str | None],
                     next_corunners: Sequence[str | None], lines: Sequence[tuple[float, float]],
                     free_slots: Sequence[Mapping[str, Any]], data: Sequence[float] | None, workload: str | None,
                     solo: Mapping[str, tuple[float, float]] | None, batches: Sequence[float] | None = None,
                     floors: bool = True, peer_batches: bool = True,
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int],
                                Mapping[str, tuple[float, float]]]:
        """What every relocator prices its placements with (arguments as :meth:`propose`): each rank's own place
        next epoch ``{"intercept", "slope", "data", "rank"}`` (its line scaled by the NCF to the co-runner placed
        beside it then), the priced free slots and the indices of those that cannot be priced, and the solo lines
        they were priced from. With each rank's current ``batches``, a slot on a device whose ranks show a
        plateau (:meth:`device_floors`) also carries ``"floor"``: the least compute seconds a step takes there,
        and every other slot ``"batch"``: the median batch of the ranks on its device type, the batches its line
        was fitted at (a rank that moves there starts its time model as measured up to that batch, not its own).
        ``floors=False`` leaves out the floors (every slot is then priced by its line, and gets a batch), and
        ``peer_batches=False`` the batches."""
        data_v = np.zeros(len(devices)) if data is None else np.asarray(data, dtype=np.float64)
        factors = self.correction.factors(workload or self.workload, devices, corunners, next_corunners)
        own = [{"intercept": float(a * f), "slope": float(b * f), "data": float(d), "rank": i}
               for i, ((a, b), f, d) in enumerate(zip(lines, factors, data_v))]
        if solo is None:
            solo = self.solo_lines(devices, corunners, lines, workload)
        read_floors = batches is not None and check_bool("floors", floors)
        device_floors = self.device_floors(devices, corunners, lines, batches, workload, solo) if read_floors else {}
        incoming, unknown = self._free_places(free_slots, solo, workload, device_floors)
        if batches is not None and check_bool("peer_batches", peer_batches):
            by_device: dict[str, list[float]] = {}
            for d, p in zip(devices, batches):
                by_device.setdefault(d, []).append(float(p))
            for slot in incoming:
                d = free_slots[slot["free_slot"]].get("device")
                if d in by_device and "floor" not in slot:  # on a plateau the line holds at no batch
                    slot["batch"] = max(1, int(np.median(by_device[d])))
        return own, incoming, unknown, solo

    @staticmethod
    def check_places(n: int, places: Sequence[Any] | None, homes: Sequence[Any] | None) -> None:
        """``ValueError`` unless ``places`` and ``homes`` (place ids, optional) have one entry per rank."""
        for name, v in (("places", places), ("homes", homes)):
            if v is not None and len(v) != n:
                raise ValueError(f"`{name}` has {len(v)} entries for {n} ranks. HINT: give one place id per rank.")

    def _free_places(self, free_slots: Sequence[Mapping[str, Any]], solo: Mapping[str, tuple[float, float]],
                     workload: str | None, floors: Mapping[str, float] | None = None,
                     ) -> tuple[list[dict[str, Any]], list[int]]:
        """The free slots priced from the solo lines (each with its ``free_slot`` index; ``"floor"`` where its
        device has one in ``floors``), and those that cannot be."""
        priced, unknown = [], []
        for k, slot in enumerate(free_slots):
            d, c = slot.get("device"), slot.get("corunner")
            s = self.slowdown(d, c, workload) if d in solo else None  # type: ignore[arg-type]
            if s is None:
                unknown.append(k)
                continue
            a, b = solo[d]  # type: ignore[index]
            priced.append({"intercept": a * s, "slope": b * s, "data": float(slot.get("data", 0.0) or 0.0),
                           "rank": None, "free_slot": k})
            if floors and d in floors:
                priced[-1]["floor"] = floors[d] * s  # type: ignore[index]
        return priced, unknown

    def _choose(self, own: list[dict[str, Any]], incoming: list[dict[str, Any]], unknown: list[int],
                global_batch: int, horizon: int) -> Relocation:
        """The decision over the ranks' own places and the priced free ones (``horizon``: steps a move pays over)."""
        n = len(own)
        candidates = own + incoming
        keep_lines = [(x["intercept"], x["slope"]) for x in own]
        fixed = np.array([x["intercept"] + x["data"] for x in own])
        slope = np.maximum(np.array([x["slope"] for x in own]), 1e-12)
        t_cur = equal_finish_time(fixed, slope, global_batch)
        stay = Relocation([None] * n, keep_lines, t_cur, t_cur, 0.0, len(incoming), unknown)
        if not incoming:
            return stay
        # A free slot must beat a rank's own place by min_gain to be chosen, so a restart never moves a rank
        # to a slot of the same kind on fitting noise; the gain is then measured on the unpenalised lines.
        penalised = [dict(c, intercept=c["intercept"] * (1 + self.min_gain), slope=c["slope"] * (1 + self.min_gain))
                     if c["rank"] is None else c for c in candidates]
        chosen = best_placement(penalised, n, global_batch)
        c_fixed = np.array([candidates[k]["intercept"] + candidates[k]["data"] for k in chosen])
        c_slope = np.maximum(np.array([candidates[k]["slope"] for k in chosen]), 1e-12)
        t_new = equal_finish_time(c_fixed, c_slope, global_batch)
        saved = (t_cur - t_new) * horizon - self.restart_cost
        if t_cur / t_new - 1.0 < self.min_gain or saved <= 0:
            return stay
        movers = [candidates[k] for k in chosen if k >= n]
        targets: list[int | None] = [None] * n
        new_lines = list(keep_lines)
        for i in range(n):
            if i not in chosen:
                slot = movers.pop(0)
                targets[i] = slot["free_slot"]
                new_lines[i] = (slot["intercept"], slot["slope"])
        self.relocations += 1
        return Relocation(targets, new_lines, t_cur, t_new, float(saved), len(incoming), unknown)


@dataclass(frozen=True)
class RelocationPlan:
    """:func:`plan_relocation`'s result: a :class:`Relocation` over one list of slots, read as rank -> slot.

    Attributes:
        decision: the :class:`Relocator`'s decision; its free-slot indices count the entries of ``free``.
        current: each rank's slot before.
        free: the slots no rank held, in order.
    """

    decision: Relocation
    current: list[int]
    free: list[int]

    @property
    def mapping(self) -> list[int]:
        """Each rank's slot after the decision."""
        return [c if t is None else self.free[t] for c, t in zip(self.current, self.decision.targets)]

    @property
    def current_step_time(self) -> float:
        """Predicted equal-finish step time of the current placement (seconds)."""
        return self.decision.current_step_time

    @property
    def predicted_step_time(self) -> float:
        """Predicted equal-finish step time after the moves (seconds)."""
        return self.decision.step_time

    @property
    def predicted_gain(self) -> float:
        """Relative predicted speed-up of relocating (0: keep the placement)."""
        return self.decision.predicted_gain

    @property
    def moves(self) -> list[tuple[int, int]]:
        """``(rank, slot)`` of each rank that changes slot."""
        return [(r, s) for r, (s, c) in enumerate(zip(self.mapping, self.current)) if s != c]


def plan_relocation(
    predictor: InterferencePredictor | str | Path | None,
    workload: str,
    slots: Sequence[Mapping[str, Any]],
    world_size: int,
    global_batch: int,
    device_times: Mapping[str, tuple[float, float]],
    current: Sequence[int] | None = None,
    min_gain: float = 0.05,
) -> RelocationPlan:
    """Choose a slot per rank minimising the predicted equal-finish step time, with no restart cost.

    A thin function over :meth:`Relocator.propose` for callers that know each device type's solo time line
    and hold every place in one list: each rank's line is its slot's solo line times the NCF's predicted
    slowdown beside the slot's co-runner, the slots no rank holds are the free ones, and a move pays when the
    predicted step time drops by at least ``min_gain`` (a free slot must beat a rank's own place by
    ``min_gain``, as in the :class:`Relocator`). A slot's optional ``data`` (seconds per step outside the
    compute window) counts as in the :class:`Relocator`.

    Args:
        predictor: the stage-2 interference model (or a model file; ``None``: the shipped one).
        workload: this job's workload type.
        slots: candidate places, each ``{"device": type, "corunner": name or None}``; at least ``world_size``.
        world_size: ranks to place.
        global_batch: samples per step.
        device_times: solo ``(intercept, slope)`` of the workload per device type.
        current: each rank's current slot (default rank r on slot r).
        min_gain: a relocation predicted to gain less than this keeps the current placement.

    Raises:
        ValueError: too few slots, a bad ``current``, a device without solo times, or a name the predictor
            does not know.
    """
    check_int("world_size", world_size, minimum=1)
    if len(slots) < world_size:
        raise ValueError(f"`slots` has {len(slots)} entries for world_size={world_size}. "
                         "HINT: give at least one slot per rank.")
    if current is not None and (isinstance(current, (str, bytes, Mapping)) or not hasattr(current, "__iter__")
                                or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                                           for s in list(current))):
        raise ValueError(f"`current`={current!r} must be a list of slot indices (ints). "
                         "HINT: give each rank's slot index, or leave it None (rank r on slot r).")
    current = list(range(world_size)) if current is None else [int(s) for s in current]
    if len(current) != world_size or len(set(current)) != world_size or not all(0 <= s < len(slots) for s in current):
        raise ValueError(f"`current`={current} must name {world_size} distinct slots in [0, {len(slots) - 1}]. "
                         "HINT: give each rank's slot index, or leave it None (rank r on slot r).")
    for s in slots:
        if s.get("device") not in device_times:
            raise ValueError(f"slot {dict(s)} names a device without solo times; `device_times` has "
                             f"{sorted(device_times)}. HINT: add its (intercept, slope).")
    relocator = Relocator(predictor, workload=workload, min_gain=min_gain, restart_cost=0.0, horizon_epochs=1)
    slowdown: list[float] = []
    for s in slots:
        f = relocator.slowdown(s["device"], s.get("corunner"))
        if f is None:
            raise ValueError(f"the predictor does not know slot {dict(s)} (workload {workload!r}). "
                             "HINT: extend it to new names with transfer_ncf (hetero_plugins.scheduler.transfer).")
        slowdown.append(f)
    free = [k for k in range(len(slots)) if k not in set(current)]
    mine = [slots[k] for k in current]
    corunners = [s.get("corunner") for s in mine]
    decision = relocator.propose(
        devices=[s["device"] for s in mine], corunners=corunners, next_corunners=corunners,
        lines=[(device_times[s["device"]][0] * slowdown[k], device_times[s["device"]][1] * slowdown[k])
               for s, k in zip(mine, current)],
        free_slots=[slots[k] for k in free], global_batch=global_batch, steps_per_epoch=1, epochs_left=1,
        data=[float(s.get("data", 0.0) or 0.0) for s in mine], solo=device_times)
    return RelocationPlan(decision, current, free)


def write_restart_spec(path: str | Path, plan: RelocationPlan, slots: Sequence[Mapping[str, Any]]) -> Path | None:
    """Write a :func:`plan_relocation` result as a restart spec; warn naming the predicted gain.

    A thin function over :func:`write_relocation_spec` (the one spec format, the one the integrations read):
    the ranks' own places are their current ``slots``, the free slots the others. Returns the path, or
    ``None`` when the plan keeps every rank in place.
    """
    return write_relocation_spec(path, plan.decision, [slots[k] for k in plan.current], [slots[k] for k in plan.free])
