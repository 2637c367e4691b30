"""The per-epoch balancing decision, free of any framework: measurements in, next plan out.

One :class:`BalancePlanner` holds a time model per rank, an allocator and the damping rule. Integrations
(Lightning callback/strategy, Horovod hooks) gather every rank's step records at the end of an epoch, feed
them to the planner on every rank (the models stay identical everywhere, so any rank's checkpoint holds
them all), let rank 0's decision win by broadcasting it, and apply it at the next epoch start.

Damping, against noise and against wrong models:

- a new plan replaces the current one only when its predicted step makespan is at least ``min_gain``
  (default 3%) shorter, so noise does not make plans flap (AdaptDL's speedup threshold; LBB's hysteresis);
- a re-plan moves each rank's batch by at most a factor ``max_change_factor`` (default 8, more than the
  first re-plan from an equal split needs on a CPU-GPU mix) up or down, and a rank whose batch moves back the
  way it came by a quarter or more has its factor square-rooted (in log terms, halved) until it moves the
  same way twice: LB-BSP's oscillation damping ("once a part moves back the way it came, every part
  moves half as far", Chen et al. SoCC'18). A single bad fit (a speed change hidden by a plan change, say)
  then costs one epoch at most a factor off, not a plan swinging between extremes.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetero_plugins._validation import check_bool, check_float, check_int
from hetero_plugins.balancing.allocators import (Allocator, Bounds, get_allocator, largest_remainder,
                                                  min_makespan_split, reroute_backlog)
from hetero_plugins.balancing.cliffs import CliffMemory, row_medians
from hetero_plugins.balancing.damping import MoveDamping
from hetero_plugins.balancing.epoch_stats import epoch_entry
from hetero_plugins.balancing.lines import proportional_knees
from hetero_plugins.balancing.time_model import (LinearTimeModel, ModelList, TimeModelBank, TimeModelLines,
                                                  TimeModelParams)

log = logging.getLogger(__name__)

__all__ = ["BalancePlanner"]


class BalancePlanner:
    """Per-epoch planner of per-rank batch sizes for a fixed global batch.

    Args:
        world_size: number of ranks.
        global_batch: samples per optimizer step over all ranks; never changed by the planner.
        allocator: ``"static"``, ``"proportional"``, ``"equal_finish"`` (default), ``"lbb"`` or an
            :class:`~hetero_plugins.balancing.allocators.Allocator`.
        min_batch_size: smallest local batch any rank may get.
        max_batch_size: largest local batch any rank may get (``None``: unbounded); per-rank memory caps
            passed to :meth:`end_epoch` tighten it.
        min_gain: relative predicted speed-up a new plan needs before it is adopted.
        half_life: forgetting of the time models, in observed steps.
        warmup_steps: first observed steps of the run that are ignored (lazy initialisation).
        initial_plan: the plan of the first epoch; default an equal split.
        max_change_factor: a re-plan moves a rank's batch by at most this factor up or down (at least one
            sample), square-rooted for a rank whose moves reverse; ``None``: no limit. The allocator's plan is
            kept where it stays within the factor; ranks beyond it are clipped and the samples this frees or
            takes are placed where the fitted lines predict the shortest step.
        extrapolation_tolerance: a re-plan takes a rank beyond the largest batch its time model has measured only as
            far as its line and the proportional model through that size disagree by at most this fraction
            (:meth:`~hetero_plugins.balancing.time_bank.TimeModelBank.extrapolation_limits`; a plateau's flat
            line prices any batch as almost free); ranks beyond it are clipped as for ``max_change_factor``.
            ``None`` (default): no limit (validation: docs/scheduler.md, "Known gaps").
        extrapolate: how a rank's step time is priced beyond the largest batch size its time model has measured
            (in its current regime): ``"line"`` by the fitted line; ``"proportional"`` in proportion to the
            batch from the line's time there (no fixed cost, so no economy of scale, beyond what was measured).
            A plateau's flat line prices any batch as almost free; ``"proportional"`` keeps it where it was measured,
            a convex curve on which the split stays exact (:mod:`hetero_plugins.balancing.splits`); the knee moves
            out as new sizes are measured. For allocators that split on knees (``reads_knees``: ``"equal_finish"``,
            ``"dqn"``, ``"auto"``); ``"lbb"``, ``"proportional"`` and ``"static"`` use the plain lines.
        knee_factor: with ``extrapolate="proportional"``, the fitted line is trusted up to this multiple of the
            largest measured batch before the proportional pricing starts (>= 1; default 1, the most cautious).
        cliff_epochs: epochs each rank's median compute time at every batch is kept (default 4; 0: off) to price a
            batch past the current one along the chord to a larger batch that ran ``cliff_tolerance`` (0.1) slower
            than predicted: a memory cliff (:mod:`hetero_plugins.balancing.cliffs`; allocators with knees only).
        noise_margin: standard errors of each rank's predicted step time by which a new plan must still be
            ``min_gain`` faster (0: compare the point predictions only). Waived, for the next decision, on a rank
            whose last steps ran ``min_gain`` and 2.5 standard errors off the level measured at their batch size (a
            load ramping: :meth:`~hetero_plugins.balancing.time_bank.TimeModelBank.drift`): its noise estimate then
            holds the drift, and the margin would keep the plan in force while that rank grows slower.
        count_data_time: add each rank's measured data-loading seconds per step (the records' third column:
            the wait for its next batch, median over the last observed steps) to its predicted step time, so
            that a rank whose input pipeline stalls it gets fewer samples (``False``: split on compute alone).
            The fitted lines (:meth:`model_params`) stay compute-only; :meth:`decision_lines` adds the data.
        regime_reset: forget the measured levels (the fixed cost stays) of the ranks whose speed the allocator's
            context says changes at this decision (:attr:`~hetero_plugins.balancing.allocators.Allocator.
            changed_ranks`: a co-runner arriving or leaving at the epoch boundary) before learning from their next
            steps. A line fitted through steps of both regimes is neither's: a rank measured at 64 samples alone
            and at 21 beside a co-runner that doubles its time fits a near-flat line, and is handed more samples
            the slower it got. ``False``: fit across announced changes (the change test still finds them, later).

    Example::

        >>> p = BalancePlanner(world_size=2, global_batch=64)
        >>> p.plan
        [32, 32]
        >>> rec = np.array([[[32, 0.032, 0.0]] * 5, [[32, 0.128, 0.0]] * 5])  # rank 1 is 4x slower
        >>> entry = p.end_epoch(0, rec, epoch_time=0.64)
        >>> p.plan  # 0.052 s per step; [51, 13] would take as long
        [52, 12]
    """

    def __init__(
        self,
        world_size: int,
        global_batch: int,
        allocator: str | Allocator = "equal_finish",
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        min_gain: float = 0.03,
        half_life: float = 6.0,
        warmup_steps: int = 1,
        initial_plan: Sequence[int] | None = None,
        max_change_factor: float | None = 8.0,
        noise_margin: float = 1.0,
        count_data_time: bool = True,
        extrapolation_tolerance: float | None = None,
        extrapolate: str = "proportional",
        knee_factor: float = 1.0,
        cliff_epochs: int = 4,
        cliff_tolerance: float = 0.1,
        regime_reset: bool = True,
    ) -> None:
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.global_batch = check_int("global_batch", global_batch, minimum=1)
        self.allocator = get_allocator(allocator)
        self.min_batch_size = check_int(
            "min_batch_size", min_batch_size, minimum=1, hint="every rank needs at least one sample per step"
        )
        if max_batch_size is not None:
            max_batch_size = check_int("max_batch_size", max_batch_size, minimum=self.min_batch_size,
                                       hint="the largest local batch a rank may get (>= min_batch_size), or None")
        self.max_batch_size = max_batch_size
        self.min_gain = check_float("min_gain", min_gain, minimum=0.0, maximum=1.0,
                                    hint="the predicted gain a new plan must bring, e.g. 0.02 (2%)")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0,
                                      hint="steps whose times are not learned from, e.g. 1 (0: learn from every step)")
        if max_change_factor is not None:
            check_float("max_change_factor", max_change_factor, minimum=1.0, strict_minimum=True,
                        hint="e.g. 4.0 (a batch at most quadruples or quarters per re-plan), or None for no limit")
        self.max_change_factor = max_change_factor
        if extrapolation_tolerance is not None:
            check_float("extrapolation_tolerance", extrapolation_tolerance, minimum=0.0,
                        hint="e.g. 1.0 (a flat line at most doubles a rank's batch beyond what it has run at), or "
                             "None for no limit")
        self.extrapolation_tolerance = extrapolation_tolerance
        if extrapolate not in ("line", "proportional"):
            raise ValueError(f"`extrapolate`={extrapolate!r} is not an option. HINT: use 'line' (the fitted line "
                             "everywhere) or 'proportional' (no economy of scale beyond the measured batch sizes).")
        self.extrapolate = extrapolate
        self.knee_factor = check_float("knee_factor", knee_factor, minimum=1.0,
                                       hint="e.g. 1.0 (proportional right past the largest measured batch) or 2.0")
        self.noise_margin = check_float("noise_margin", noise_margin, minimum=0.0,
                                        hint="e.g. 1.0 (one standard error), or 0 to compare point predictions")
        self.count_data_time = bool(count_data_time)
        self.regime_reset = check_bool("regime_reset", regime_reset, hint="True, or False to fit across changes")
        self._regime: set[int] = set()  # ranks whose levels go before the next observation (announced changes)
        self._drift = np.zeros(world_size, dtype=np.int64)  # per rank: the last steps ran off their level (+-1)
        self._data = np.zeros(world_size)  # per rank: data-loading seconds per step (last observed median)
        self._bank = TimeModelBank(world_size, half_life=half_life)
        self._cliffs = CliffMemory(world_size, cliff_epochs, cliff_tolerance, prefix="cliff_")
        self.cliff_epochs = self._cliffs.epochs  #: as built (setting it later changes nothing)
        self._models = ModelList(self._bank)
        self.damping = MoveDamping(world_size, max_change_factor)  #: per-rank move limits (LB-BSP damping)
        self.memory_caps: list[int | None] = [None] * world_size
        self.bounds.check_feasible(global_batch)
        if initial_plan is None:
            self.plan = largest_remainder([global_batch / world_size] * world_size, global_batch, self.bounds)
        else:
            self.plan = self._checked_plan(initial_plan)
        self.history: list[dict[str, Any]] = []
        self._predicted_step_time: float | None = None
        self._observed_steps = 0

    @property
    def models(self) -> list[LinearTimeModel]:
        """Each rank's time model (views of the planner's vectorised models; assigning a model to an entry,
        or a new list to this attribute, copies the models in)."""
        return self._models

    @models.setter
    def models(self, models: Sequence[LinearTimeModel]) -> None:
        if len(models) != self.world_size:
            raise ValueError(f"`models` must hold {self.world_size} time models (one per rank), got {len(models)}.")
        bank = TimeModelBank(self.world_size, float(self._bank.half_life[0]) if self.world_size else 6.0,
                             **self._bank.options())
        for i, m in enumerate(models):
            if not isinstance(m, LinearTimeModel):
                raise ValueError(f"`models[{i}]` must be a LinearTimeModel, got {type(m).__name__}.")
            bank.copy_row(m._bank, m._row, i)
        self._bank, self._models = bank, ModelList(bank)

    @property
    def bounds(self) -> Bounds:
        return self._bounds_under(self.memory_caps)

    def _bounds_under(self, memory_caps: Sequence[int | None]) -> Bounds:
        """Per-rank batch bounds: ``min_batch_size`` to ``max_batch_size`` (else the global batch), within each
        rank's memory cap (``None``: no cap)."""
        hi = self.max_batch_size if self.max_batch_size is not None else self.global_batch
        caps = [hi if c is None else max(self.min_batch_size, min(hi, c)) for c in memory_caps]
        return Bounds((self.min_batch_size,) * self.world_size, tuple(caps))

    def _checked_plan(self, plan: Sequence[int]) -> list[int]:
        plan = [int(b) for b in plan]
        hi = max(self._bounds_under([None] * self.world_size).max_batch)  # the largest batch a rank may get
        if len(plan) != self.world_size or sum(plan) != self.global_batch or min(plan) < self.min_batch_size \
                or max(plan) > hi:
            raise ValueError(
                f"`initial_plan`={plan} must have {self.world_size} entries between {self.min_batch_size} and "
                f"{hi} (`min_batch_size`, `max_batch_size`) summing to the global batch {self.global_batch}."
            )
        return plan

    def _checked_caps(self, memory_caps: Sequence[int | None]) -> list[int | None]:
        """``memory_caps`` as a list of ints >= 1 or ``None``, one per rank, that can hold the global batch; else
        a ``ValueError`` naming it (checked before anything is learned, so a bad value changes nothing)."""
        caps = list(memory_caps)
        if len(caps) != self.world_size:
            raise ValueError(f"`memory_caps` has {len(caps)} entries for {self.world_size} ranks. HINT: give one "
                             "per rank, None where a rank has no cap.")
        out = [None if c is None else check_int(f"memory_caps[{i}]", c, minimum=1,
                                                   hint="the largest local batch that fits, or None for no cap")
               for i, c in enumerate(caps)]
        room = sum(self._bounds_under(out).max_batch)
        if room < self.global_batch:
            raise ValueError(f"`memory_caps`={out} hold {room} samples, fewer than the global batch "
                             f"{self.global_batch}. HINT: lower the global batch or add ranks.")
        return out

    @property
    def predicted_step_time(self) -> float | None:
        """The predicted step time of the current plan (``None`` before the first decision); the deciding rank's,
        set on the others with the plan, so every rank's history holds the same ``predicted_epoch_time``."""
        return self._predicted_step_time

    @predicted_step_time.setter
    def predicted_step_time(self, value: float | None) -> None:
        self._predicted_step_time = None if value is None else float(value)

    @property
    def pending_reset(self) -> list[int]:
        """Ranks whose levels go before the next observation (``regime_reset``); rank 0's is set on all ranks."""
        return sorted(self._regime)

    @pending_reset.setter
    def pending_reset(self, ranks: Sequence[int]) -> None:
        out = {check_int("pending_reset", r, minimum=0) for r in ranks}
        if any(r >= self.world_size for r in out):
            raise ValueError(f"`pending_reset`={sorted(out)} names a rank >= world_size {self.world_size}. HINT: "
                             "pass ranks in 0..world_size-1.")
        self._regime = out

    def seed_model(self, rank: int, line: Sequence[float], batch_size: int | None = None,
                   data_time: float | None = None) -> None:
        """Start ``rank``'s time model from a predicted ``(intercept, slope)`` line: a rank with no history (a new
        node, a relocated rank), whose measured steps replace the prediction (:meth:`LinearTimeModel.from_params`;
        ``batch_size`` defaults to its current batch; ``data_time``: its data seconds per step there, if known)."""
        rank = check_int("rank", rank, minimum=0, hint=f"a rank in 0..{self.world_size - 1}")
        if rank >= self.world_size:
            raise ValueError(f"`rank`={rank} is not a rank of this planner. HINT: use 0..{self.world_size - 1}.")
        size = self.plan[rank] if batch_size is None else batch_size
        self._cliffs.forget(rank)
        self.damping.release(rank)  # undamped until measured: its past was elsewhere
        if data_time is not None:
            self._data[rank] = check_float("data_time", data_time, minimum=0.0)
        opts = {k: v for k, v in self._bank.options().items() if k != "groups"}
        self.models[rank] = LinearTimeModel.from_params(TimeModelParams(*(float(x) for x in line)), max(1, int(size)),
                                                        half_life=self.models[rank].half_life, **opts)

    def follow_ranks(self, old: Sequence[int]) -> None:
        """Rank i takes what rank ``old[i]`` learned (time model, data wait, memory cap, damping, cliff memory); -1: a
        new rank, started afresh. For ranks renumbered (an elastic reset); the plan is kept (decide to re-split)."""
        idx = np.asarray([check_int(f"old[{i}]", o, minimum=-1) for i, o in enumerate(old)], dtype=np.int64)
        if len(idx) != self.world_size or (idx >= self.world_size).any() or len(set(idx[idx >= 0])) < (idx >= 0).sum():
            raise ValueError(f"`old`={list(old)} must give each of the {self.world_size} ranks a distinct earlier rank "
                             f"in 0..{self.world_size - 1}, or -1 for a new one. HINT: one entry per rank.")
        new, src = idx < 0, np.maximum(idx, 0)
        self.models = [LinearTimeModel(half_life=m.half_life) if n else self.models[j]
                       for n, j, m in zip(new, src, self.models)]
        self._data = np.where(new, 0.0, self._data[src])
        self.memory_caps = [None if n else self.memory_caps[j] for n, j in zip(new, src)]
        self.damping.follow(new, src)
        self._drift = np.where(new, 0, self._drift[src])
        self._cliffs.follow(idx)
        self._regime = {i for i, j in enumerate(idx.tolist()) if j >= 0 and j in self._regime}

    def model_params(self) -> TimeModelLines:
        """Every rank's fitted line of compute seconds: a sequence of :class:`TimeModelParams` (``None`` where a
        rank has no model yet) backed by arrays."""
        return self._bank.lines()

    @property
    def data_time(self) -> list[float]:
        """Each rank's data-loading seconds per step as the planner counts it (0 before any is measured)."""
        return self._data.tolist()

    @data_time.setter
    def data_time(self, value: Sequence[float]) -> None:
        v = np.asarray(value, dtype=np.float64)
        if v.shape != (self.world_size,) or not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"`data_time` must hold {self.world_size} finite seconds >= 0 (one per rank), got "
                             f"{list(value)}. HINT: pass the measured data-loading seconds per step of each rank.")
        self._data = v

    def decision_lines(self) -> TimeModelLines:
        """The lines the plan is decided on: :meth:`model_params` with each rank's data-loading seconds per step added
        to its intercept (``count_data_time``; ``data`` says how much): a step takes ``max_i (data_i + compute_i)``."""
        lines = self._bank.lines()
        knee = beyond = None
        reads = getattr(self.allocator, "reads_knees", False)
        if self.extrapolate == "proportional" and reads:
            knee, beyond = proportional_knees(lines, self._bank.measured_max(), self.knee_factor)
        if reads and self._cliffs.epochs:  # memory cliffs: steeper past the plan where a larger batch ran slow
            k, c = self._cliffs.knees(lines.intercept, lines.slope, self.plan, *((np.full(self.world_size, np.inf),
                                      np.ones(self.world_size)) if knee is None else (knee, beyond)))
            knee, beyond = (k, c) if np.isfinite(k).any() else (knee, beyond)
        if (not self.count_data_time or not self._data.any()) and knee is None:
            return lines
        data = self._data if self.count_data_time else np.zeros(self.world_size)
        return TimeModelLines(lines.intercept + data, lines.slope, lines.known, knee, beyond, data)

    def predict_step_time(self, plan: Sequence[int], shift: np.ndarray | float = 0.0) -> float:
        """Predicted makespan (slowest rank's compute plus data-loading seconds, :meth:`decision_lines`) of one
        step under ``plan``; nan if unknown.

        An allocator that predicts step times itself (``allocator.predict_makespan(models, plan)``, e.g. the
        learned ones, whose lines include co-runner changes known at the epoch boundary) is asked instead, so
        the damping gate does not veto a plan decided on what the fitted lines do not know yet.

        ``shift`` scales each rank's predicted time by ``1 + shift`` (the damping gate's pessimistic
        comparison; an allocator's own prediction is asked on the lines scaled so).
        """
        params = self.decision_lines()
        if not params.known.all():
            return float("nan")
        predict = getattr(self.allocator, "predict_makespan", None)
        if predict is not None:
            return float(predict(params.scaled(1.0 + np.asarray(shift, dtype=np.float64)), plan))
        t = params.times(np.asarray(plan, dtype=np.float64))
        return float(np.max(t * (1.0 + shift)))

    def rates(self, plan: Sequence[int]) -> list[float | None]:
        """Each rank's predicted samples per second at its batch in ``plan`` (``None`` without a time model).

        Example::

            >>> p = BalancePlanner(world_size=2, global_batch=8)
            >>> p.observe(np.array([[[4, 0.04, 0.0]] * 3, [[4, 0.16, 0.0]] * 3]))
            >>> [round(r) for r in p.rates([4, 4])]
            [100, 25]
        """
        lines = self.model_params()
        b = np.asarray(plan, dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            seconds = np.where(lines.known & (b > 0), lines.intercept + lines.slope * b, np.nan)
            return [float(r) if math.isfinite(r) and s > 0 else None for r, s in zip(b / seconds, seconds)]

    def plan_with_backlog(self, backlog: Sequence[float]) -> list[int]:
        """The current plan re-routed so that ranks with a backlog get fewer new samples per step
        (:func:`~hetero_plugins.balancing.allocators.reroute_backlog`, within this planner's bounds).

        ``backlog[r]`` is the work (in samples per step) rank r must do on top of its new samples, e.g. the
        micro-batches that missed a deadline spread over the next steps (``aggregation="deadline"``). The time
        models are not consulted: the steps that made the backlog are the ones they describe worst.
        """
        return reroute_backlog(self.plan, backlog, self.bounds, self.global_batch)

    def skip_warmup(self) -> None:
        """Treat the run's warm-up as done: for a planner taking over from an earlier one of the same run (an
        elastic restart), whose first steps are not the run's first (``warmup_steps``)."""
        self._observed_steps = max(self._observed_steps, self.warmup_steps)

    def observe(self, records: np.ndarray) -> None:
        """Feed step records, shape ``(world_size, steps, 3)``: batch size, compute s, data s."""
        records = np.asarray(records, dtype=np.float64)
        if records.ndim != 3 or records.shape[0] != self.world_size or records.shape[2] < 2:
            raise ValueError(f"`records` must have shape ({self.world_size} ranks, steps, 3), got {records.shape}.")
        skip = max(0, self.warmup_steps - self._observed_steps)
        if records.shape[1] > skip:
            if self._regime:
                self._bank.forget_levels(sorted(self._regime))
                self._regime.clear()
            self._drift = self._bank.drift(records[:, skip:, 0], records[:, skip:, 1], self.min_gain)
            changes = self._bank.change_points if self._cliffs.epochs else None
            self._bank.observe(records[:, skip:, 0], records[:, skip:, 1])
            got = np.isfinite(records[:, skip:, 1]).any(axis=1)  # a seeded rank, once measured, is damped again
            self.damping.measured(got)
            if changes is not None:
                self._cliffs.record(records[:, skip:, 0], records[:, skip:, 1], self._bank.change_points != changes)
            if records.shape[2] >= 3:
                b, d = records[:, skip:, 0], records[:, skip:, 2]
                ok = (b > 0) & np.isfinite(d) & (d >= 0)
                seen = ok.any(axis=1)
                if seen.any():
                    rows = np.where(ok, d, np.nan)[seen]
                    self._data[seen] = row_medians(rows) if ok[seen].all() else np.nanmedian(rows, axis=1)
        self._observed_steps += records.shape[1]

    def replan(self, records: np.ndarray | None = None) -> dict[str, Any]:
        """Mid-epoch: learn from ``records`` (if given) and decide; no history entry is written."""
        if records is not None and np.asarray(records).shape[1] > 0:
            self.observe(records)
        return self._decide()

    def end_epoch(
        self,
        epoch: int,
        records: np.ndarray,
        epoch_time: float | None = None,
        memory_caps: Sequence[int | None] | None = None,
        observed_steps: int = 0,
        start_plan: Sequence[int] | None = None,
        system: Sequence[Mapping[str, float] | None] | None = None,
    ) -> dict[str, Any]:
        """Learn from an epoch, decide the next plan, and return this epoch's history entry.

        Args:
            records: the whole epoch's step records, shape ``(world_size, steps, 3)``.
            epoch_time: measured training seconds of the epoch.
            memory_caps: per-rank largest batch that fits in memory (``None`` entries: no cap).
            observed_steps: leading steps already fed through :meth:`replan` during the epoch.
            start_plan: the plan the epoch started with (default: the current plan).
            system: per-rank means over the epoch of the system readings (``gpu_util`` %, ``gpu_mem_used``
                bytes, ... from :meth:`~hetero_plugins.telemetry.UtilisationSampler.epoch_means`; ``None``
                entries: not measured); stored as the history entry's ``system``.
        """
        records = np.asarray(records, dtype=np.float64)
        caps = None if memory_caps is None else self._checked_caps(memory_caps)
        steps = records.shape[1] if records.ndim == 3 else 0
        if check_int("observed_steps", observed_steps, minimum=0) > steps:
            raise ValueError(f"`observed_steps`={observed_steps} exceeds the epoch's {steps} steps. HINT: pass how "
                             "many of this epoch's leading steps were already fed through replan().")
        self.observe(records[:, observed_steps:])
        if caps is not None:
            self.memory_caps = caps
        used = list(start_plan) if start_plan is not None else list(self.plan)
        entry = epoch_entry(epoch, records, used, epoch_time, self._predicted_step_time, system)
        self._cliffs.end_epoch()
        entry.update(self._decide())
        self.history.append(entry)
        return entry

    def _extrapolation_bounds(self, bounds: Bounds, current: Sequence[int]) -> Bounds:
        """``bounds`` with each rank's upper end lowered to its extrapolation limit (never below its current
        batch or its lower end; unchanged where that would leave the global batch no room)."""
        if self.extrapolation_tolerance is None:
            return bounds
        limit = self._bank.extrapolation_limits(self.extrapolation_tolerance)
        lo, hi = np.asarray(bounds.min_batch, dtype=np.float64), np.asarray(bounds.max_batch, dtype=np.float64)
        cur = np.asarray(current, dtype=np.float64)
        top = np.maximum(lo, np.minimum(hi, np.maximum(limit, cur)))
        if np.array_equal(top, hi) or top.sum() < self.global_batch:
            return bounds
        return Bounds(bounds.min_batch, tuple(int(x) for x in top))

    def _damp(self, proposal: list[int], trust: Bounds) -> list[int]:
        """``proposal`` with every rank's batch clipped into ``trust``, the samples this adds or removes moved
        where the fitted lines say the step is shortest (the lines as the allocator corrected them, where it has
        a ``lines(models, world_size)`` method; equal split of them without lines)."""
        p = np.asarray(proposal, dtype=np.float64)
        lo, hi = np.asarray(trust.min_batch, dtype=np.float64), np.asarray(trust.max_batch, dtype=np.float64)
        if np.all((p >= lo) & (p <= hi)):
            return proposal
        q = np.clip(p, lo, hi)
        missing = self.global_batch - int(q.sum())
        lines = self.decision_lines()
        if lines.known.all() and np.all(lines.slope > 0) and np.all(np.isfinite(lines.intercept)):
            low, high = (q, hi) if missing >= 0 else (lo, q)
            a, s, beyond = lines.intercept, lines.slope, lines.beyond
            corrected = getattr(self.allocator, "lines", None)  # an allocator's own corrections (co-runner changes)
            if callable(corrected):
                fixed, per_sample = (np.asarray(x, dtype=np.float64) for x in corrected(lines, self.world_size))
                if fixed.shape == a.shape and np.all(per_sample > 0) and np.all(np.isfinite(fixed)):
                    if beyond is not None:
                        beyond = beyond * (per_sample / s)  # the correction scales the whole curve
                    a, s = fixed, per_sample
            return min_makespan_split(a, s, self.global_batch, low, high, lines.knee, beyond).tolist()
        return largest_remainder((q + missing * q / q.sum()).tolist(), self.global_batch, trust)

    def _decide(self) -> dict[str, Any]:
        self._bank.settle()  # a change that began in the last few steps counts for this decision
        bounds = self.bounds
        current = list(self.plan)
        proposal = self.allocator.allocate(self.decision_lines(), self.global_batch, bounds, current=current)
        if self.regime_reset:
            self._regime.update(int(r) for r in self.allocator.changed_ranks)
        trust = self._extrapolation_bounds(self.damping.bounds(bounds, current), current)  # damping, extrapolation
        proposal = self._damp([int(b) for b in proposal], trust)
        t_cur, t_new = self.predict_step_time(current), self.predict_step_time(proposal)
        out_of_bounds = not bounds.admits(current)
        gain = (t_cur - t_new) / t_cur if math.isfinite(t_cur) and t_cur > 0 and math.isfinite(t_new) else 0.0
        sure = gain
        if self.noise_margin > 0 and gain > self.min_gain:
            se = np.where(self._drift != 0, 0.0, self.noise_margin * self._bank.uncertainty())  # drift: no margin
            lo_cur, hi_new = self.predict_step_time(current, -se), self.predict_step_time(proposal, se)
            sure = (lo_cur - hi_new) / lo_cur if lo_cur > 0 else 0.0
        adopt = proposal != current and (out_of_bounds or (gain > self.min_gain and sure > self.min_gain))
        if adopt:
            log.info("BalancePlanner: new plan (predicted gain %.1f%%)", 100 * gain)
            self.damping.record(current, proposal)
            self.plan = list(proposal)
        self._predicted_step_time = self.predict_step_time(self.plan)
        return {"next_batch_sizes": list(self.plan), "predicted_gain": gain, "plan_changed": adopt}

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "plan": list(self.plan),
            "models": [m.state_dict() for m in self.models],
            "memory_caps": list(self.memory_caps),
            **self.damping.state_dict(),
            "drift": self._drift.tolist(),
            "history": list(self.history),
            "predicted_step_time": self._predicted_step_time,
            "observed_steps": self._observed_steps,
            "data_time": self._data.tolist(),
            "cliffs": self._cliffs.state_dict(),
            "regime_reset": sorted(self._regime),
        }

    def load_state_dict(self, state: dict[str, Any], resize: bool = False) -> None:
        """Restore a :meth:`state_dict`; with ``resize``, a state of another world size or global batch re-seeds
        this planner instead of being refused.

        Re-seeding (a run resumed on another number of ranks, or another global batch): rank i < min(saved, new)
        ranks keeps the saved time model of rank i (its measured line: the rank is assumed to run on the same
        device as before), a rank the saved run did not have starts without one, and the plan is decided again
        from these models (an equal split until every rank has a line); the history is kept. A
        ``RuntimeWarning`` says so.
        """
        saved_world, saved_batch = int(state["world_size"]), int(state["global_batch"])
        resized = (saved_world, saved_batch) != (self.world_size, self.global_batch)
        if resized and not resize:
            raise ValueError(
                f"checkpointed plan is for world_size={saved_world}, global_batch={saved_batch}, but this run has "
                f"world_size={self.world_size}, global_batch={self.global_batch}. HINT: resume with the same number "
                "of ranks and batch size, or pass resize=True to re-seed the plan and time models from it."
            )
        kept = min(saved_world, self.world_size) if resized else self.world_size
        caps = (list(state.get("memory_caps", [None] * saved_world)) + [None] * self.world_size)[: self.world_size]
        dropped = False
        if resized:  # checked before any state changes: caps that cannot hold the new global batch are dropped
            try:
                caps = self._checked_caps(caps)
            except ValueError:
                caps, dropped = [None] * self.world_size, True
        for m, s in zip(self.models[:kept], state["models"]):
            m.load_state_dict(s)
        self.memory_caps = caps
        if "change_factor" in state and not resized:  # a resized run starts its damping afresh
            self.damping.load_state_dict(state)
            self._drift = np.asarray(state.get("drift", self._drift), dtype=np.int64)
        data = list(state.get("data_time", []))[:kept]
        self._data[: len(data)] = data
        self.history = list(state["history"])
        if "cliffs" in state and not resized:
            self._cliffs.load_state_dict(state["cliffs"])
        self._regime = set() if resized else {int(r) for r in state.get("regime_reset", [])}
        self._observed_steps = int(state.get("observed_steps", self.warmup_steps))
        if not resized:
            self.plan = [int(b) for b in state["plan"]]
            self._predicted_step_time = state.get("predicted_step_time")
            return
        self._decide()
        fresh = list(range(kept, self.world_size))
        warnings.warn(
            f"BalancePlanner: the checkpoint is for {saved_world} ranks and a global batch of {saved_batch}; this run "
            f"has {self.world_size} ranks and {self.global_batch}. Ranks {list(range(kept))} keep their time models"
            f"{f', ranks {fresh} start without one (an equal share until measured)' if fresh else ''}; the plan is "
            f"decided again: {self.plan}."
            f"{' The saved memory caps cannot hold this global batch and were dropped.' if dropped else ''}",
            RuntimeWarning, stacklevel=2,
        )
