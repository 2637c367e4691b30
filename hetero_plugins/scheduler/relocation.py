"""Stage 2 applied: move ranks to other slots when the predicted gain pays for a restart.

Zhang, Geng, Ma, "Learning-Driven Interference-Aware Workload Parallelization for Streaming Applications in
Heterogeneous Cluster" (IEEE TPDS 2021), IAWP: the NCF predicts how much a co-located job slows this workload
on a device, so ranks can be placed on the slots that run it fastest. :class:`Relocator` is what a scheduler
can decide at an epoch boundary from what it knows there:

- each rank's fitted time line, measured beside its co-runner of the epoch just run, scaled to the co-runner
  placed beside it for the next epoch (``NCF(next) / NCF(measured)``, as :class:`InterferenceCorrection`);
- a solo line per device type, from the ranks of that type with their co-runner's predicted slowdown divided
  out (the median over those ranks): the time model of a rank on a slot it has never run on;
- the free slots (device type and co-runner).

It picks the placement with the shortest predicted equal-finish step time (:func:`hetero_plugins.scheduler.sim.best_placement`)
and moves ranks only when the seconds saved over the next ``horizon_epochs`` epochs exceed ``restart_cost``
and the step time drops by at least ``min_gain``. The decision is framework-free; the simulator applies it
(``simulate(..., relocation=True)``) and :class:`~hetero_plugins.callbacks.BatchBalancer` writes it as a
restart spec (:func:`~hetero_plugins.scheduler.ncf.write_restart_spec`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.balancing.allocators import equal_finish_time

__all__ = ["Relocation", "Relocator", "read_relocation_spec", "resume_checkpoint", "torchelastic_restarts",
           "write_relocation_spec"]


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
    """

    targets: list[int | None]
    lines: list[tuple[float, float]]
    current_step_time: float
    step_time: float
    saved_seconds: float = 0.0
    considered: int = 0
    unknown_slots: list[int] = field(default_factory=list)

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
        from hetero_plugins.scheduler.policy import InterferenceCorrection, _interference

        self.correction: InterferenceCorrection = _interference(True if predictor is None else predictor)  # type: ignore[assignment]
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
        """
        from hetero_plugins.scheduler.sim import best_placement

        n = len(devices)
        if not (len(corunners) == len(next_corunners) == len(lines) == n) or (data is not None and len(data) != n):
            raise ValueError(f"`devices`, `corunners`, `next_corunners`, `lines` (and `data`) need one entry per rank; "
                             f"got lengths {len(devices)}, {len(corunners)}, {len(next_corunners)}, {len(lines)}"
                             f"{'' if data is None else f', {len(data)}'}. HINT: pass one entry per rank in each.")
        self.decisions += 1
        data_v = np.zeros(n) if data is None else np.asarray(data, dtype=np.float64)
        # A rank's own place for the next epoch: its line scaled to the co-runner placed beside it then.
        factors = self.correction.factors(workload or self.workload, devices, corunners, next_corunners)
        own = [{"intercept": float(a * f), "slope": float(b * f), "data": float(d), "rank": i}
               for i, ((a, b), f, d) in enumerate(zip(lines, factors, data_v))]
        solo = self.solo_lines(devices, corunners, lines, workload)
        candidates = list(own)
        slot_of: list[int | None] = [None] * n
        unknown = []
        for k, slot in enumerate(free_slots):
            d, c = slot.get("device"), slot.get("corunner")
            s = self.slowdown(d, c, workload) if d in solo else None  # type: ignore[arg-type]
            if s is None:
                unknown.append(k)
                continue
            a, b = solo[d]  # type: ignore[index]
            candidates.append({"intercept": a * s, "slope": b * s, "data": float(slot.get("data", 0.0) or 0.0),
                               "rank": None, "free_slot": k})
            slot_of.append(k)
        keep_lines = [(x["intercept"], x["slope"]) for x in own]
        fixed = np.array([x["intercept"] + x["data"] for x in own])
        slope = np.maximum(np.array([x["slope"] for x in own]), 1e-12)
        t_cur = equal_finish_time(fixed, slope, global_batch)
        stay = Relocation([None] * n, keep_lines, t_cur, t_cur, 0.0, len(candidates) - n, unknown)
        if len(candidates) == n:
            return stay
        # A free slot must beat a rank's own place by min_gain to be chosen, so a restart never moves a rank
        # to a slot of the same kind on fitting noise; the gain is then measured on the unpenalised lines.
        penalised = [dict(c, intercept=c["intercept"] * (1 + self.min_gain), slope=c["slope"] * (1 + self.min_gain))
                     if c["rank"] is None else c for c in candidates]
        chosen = best_placement(penalised, n, global_batch)
        c_fixed = np.array([candidates[k]["intercept"] + candidates[k]["data"] for k in chosen])
        c_slope = np.maximum(np.array([candidates[k]["slope"] for k in chosen]), 1e-12)
        t_new = equal_finish_time(c_fixed, c_slope, global_batch)
        horizon = min(int(epochs_left), self.horizon_epochs) * int(steps_per_epoch)
        saved = (t_cur - t_new) * horizon - self.restart_cost
        if t_cur / t_new - 1.0 < self.min_gain or saved <= 0:
            return stay
        incoming = [k for k in chosen if k >= n]
        targets: list[int | None] = [None] * n
        new_lines = list(keep_lines)
        for i in range(n):
            if i not in chosen:
                k = incoming.pop(0)
                targets[i] = slot_of[k]
                new_lines[i] = (candidates[k]["intercept"], candidates[k]["slope"])
        self.relocations += 1
        return Relocation(targets, new_lines, t_cur, t_new, float(saved), len(candidates) - n, unknown)


def torchelastic_restarts() -> tuple[str, int, int] | None:
    """``(run id, restart count, max restarts)`` when this process was started by torchrun, else ``None``."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    return run, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def write_relocation_spec(path: str | Path, decision: Relocation, places: Sequence[Mapping[str, Any]],
                          free_slots: Sequence[Mapping[str, Any]], epoch: int | None = None,
                          extra: Mapping[str, Any] | None = None) -> Path | None:
    """Write a relocation as a JSON restart spec and warn naming the predicted gain.

    The spec lists every rank's place after the move (its ``device``, ``corunner`` and, where the cluster
    description gives them, ``host`` and ``index``; ``from`` is ``"own"`` or ``"free_slots[k]"``) with its
    predicted time line, the moves, the predicted step times and the seconds saved over the horizon, plus
    ``extra`` (e.g. the checkpoint of a relocation restart). The file is replaced atomically. Returns the path,
    or ``None`` when nobody moves.
    """
    if not decision.moves:
        return None
    path = Path(path)
    ranks = []
    for r, target in enumerate(decision.targets):
        place = dict(places[r]) if target is None else dict(free_slots[target])
        place.pop("data", None)
        ranks.append({"rank": r, **place, "from": "own" if target is None else f"free_slots[{target}]",
                      "line": list(decision.lines[r])})
    spec = {"epoch": epoch, "predicted_gain": decision.predicted_gain,
            "current_step_time_s": decision.current_step_time, "predicted_step_time_s": decision.step_time,
            "saved_seconds": decision.saved_seconds, "ranks": ranks,
            "moves": [{"rank": r, "to_free_slot": k} for r, k in decision.moves], **dict(extra or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(spec, indent=2))
    tmp.replace(path)
    action = ("the workers restart with it now" if spec.get("checkpoint")
              else "restart the job with that placement to apply it")
    warnings.warn(
        f"hetero_plugins: moving rank(s) {[r for r, _ in decision.moves]} to free slot(s) "
        f"{[k for _, k in decision.moves]} is predicted to make steps {100 * decision.predicted_gain:.1f}% faster "
        f"({decision.saved_seconds:.1f} s saved over the next epochs, restart included); restart spec written to "
        f"{str(path)!r}; {action}.",
        RuntimeWarning, stacklevel=2,
    )
    return path


def read_relocation_spec(path: str | Path) -> dict[str, Any] | None:
    """The restart spec at ``path`` (``None`` if there is none or it is unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def resume_checkpoint(path: str | Path = "hetero_restart.json") -> str | None:
    """The checkpoint to resume from after a relocation restart, else ``None``.

    Under torchrun, a relocation that the balancer applies saves a checkpoint, records it in the restart spec
    with torchrun's run id and restart count, and stops the workers; torchrun starts them again. Pass this to
    ``Trainer.fit(..., ckpt_path=resume_checkpoint(spec))`` (``spec``: the strategy's ``restart_spec``, default
    ``<default_root_dir>/hetero_restart.json``): it returns the checkpoint only in a later restart of the same
    torchrun run, so a fresh run or a stale spec starts from scratch.
    """
    elastic = torchelastic_restarts()
    spec = read_relocation_spec(path)
    if elastic is None or spec is None or not spec.get("checkpoint"):
        return None
    run, count, _ = elastic
    if spec.get("run_id") != run or count <= int(spec.get("restart_count", count)):
        return None
    return str(spec["checkpoint"]) if Path(spec["checkpoint"]).is_file() else None
