"""The ``"dqn"`` allocator: the exact split on fitted lines, corrected by the NCF for announced co-runners.

:class:`DQNAllocator` is registered under ``"dqn"`` by :mod:`hetero_plugins.scheduler.policy` (which also holds
``"auto"``, the safe scheduler built on it); see that module for the two-stage design (Zhang, Geng, Ma, TPDS 2021).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_plugins._validation import check_bool, check_float
from hetero_plugins.balancing.allocators import Allocator, fitted_models, knee_arrays, min_makespan_split
from hetero_plugins.balancing.lines import curve_times, data_seconds
from hetero_plugins.balancing.time_model import TimeModelParams
from hetero_plugins.scheduler.hedge import corunner_groups, hedged_factors, throughput_shares
from hetero_plugins.scheduler.interference import interference_correction
from hetero_plugins.scheduler.peer_lines import peer_fixed_costs
from hetero_plugins.scheduler.removed_options import refuse_removed

log = logging.getLogger(__name__)

__all__ = ["DQNAllocator", "line_arrays"]


def line_arrays(models: Sequence[TimeModelParams]) -> tuple[np.ndarray, np.ndarray]:
    """Intercepts and slopes of ``models`` (a :class:`~hetero_plugins.balancing.lines.TimeModelLines` or a
    sequence of :class:`~hetero_plugins.balancing.time_model.TimeModelParams`) as float64 arrays."""
    n = len(models)
    a = getattr(models, "intercept", None)
    s = getattr(models, "slope", None)
    if isinstance(a, np.ndarray) and isinstance(s, np.ndarray):  # TimeModelLines: read the arrays
        return a.astype(np.float64), s.astype(np.float64)
    return (np.fromiter((m.intercept for m in models), dtype=np.float64, count=n),
            np.fromiter((m.slope for m in models), dtype=np.float64, count=n))


class DQNAllocator(Allocator):
    """Stage 1 as rebuilt: the exact split on the fitted lines, corrected by the NCF for announced co-runners.

    The batch split is always :func:`~hetero_plugins.balancing.allocators.min_makespan_split` with the
    per-rank bounds (what ``equal_finish`` computes), on each rank's fitted line; a rank whose co-runner
    changes at this epoch boundary (:meth:`set_context`) has its line scaled by the NCF's predicted slowdown
    ratio first (:class:`~hetero_plugins.scheduler.interference.InterferenceCorrection`), always, without any
    check. The learned part of stage 1 is the placement (which rank runs where, when to move): the placement
    Q-network (``hetero_plugins.scheduler.placement_policy.LearnedRelocator``) is given as the relocation of a
    run, beside this allocator (``simulate(sc, "dqn", relocation=LearnedRelocator(...))``). Without co-runner
    context the plan is ``equal_finish``'s.

    Args:
        interference: stage 2 (IAWP): ``True`` corrects with the shipped NCF, ``False`` turns the correction
            off (then this is ``equal_finish``); an ``InterferencePredictor``, an ``InterferenceCorrection`` or
            an NCF model file uses that predictor. It acts only when :meth:`set_context` names co-runners (the
            simulator does; Lightning runs do with ``cluster=``).
        unseen_device: what a device type the NCF was not trained on gets: ``"mean"`` (default) the mean of
            the NCF's predictions over the device types it knows (the co-runner's typical slowdown; needs a
            predictor with a ``devices`` vocabulary), ``"skip"`` no correction for that rank. A given
            ``InterferenceCorrection`` keeps its own.
        hedge: the NCF ratio's log error, per unit of ``|log ratio|``: a corrected rank is planned at the quantile
            of its time that minimises the expected makespan (:mod:`hetero_plugins.scheduler.hedge`; a small rank
            slower than the point ratio). ``0``: the point ratio. Default chosen on validation (docs/scheduler.md).
        peer_lines: a rank's nearly flat line (a fixed cost above every batch it measured, as a load ramping
            between two plan changes leaves it) is replaced for the split by its device peers' fixed cost through
            its latest level, when ranks of the same device type run as few samples on steep lines
            (:mod:`hetero_plugins.scheduler.peer_lines`; needs the context's ``devices``). ``peer_refuted``
            names the ranks of the last decision. Default ``True`` (session 36; ``False``: the lines as fitted).

    The options of the former chunk-assignment network (``model``, ``chunks_per_rank``, ``parallel``,
    ``online*``, ``seed``) are refused with a ``ValueError`` that says why.

    Example::

        >>> from hetero_plugins.balancing.allocators import Bounds
        >>> from hetero_plugins.balancing.time_model import TimeModelParams as P
        >>> DQNAllocator().allocate([P(0.0, 0.001), P(0.0, 0.003)], 400, Bounds.uniform(2))
        [300, 100]
    """

    name = "dqn"
    reads_knees = True

    def __init__(self, interference: Any = True, unseen_device: str = "mean", hedge: float = 0.25,
                 peer_lines: bool = True, **removed: Any) -> None:
        refuse_removed(type(self).__name__, removed)
        if unseen_device not in ("mean", "skip"):
            raise ValueError(f"`unseen_device`={unseen_device!r} is not an option. HINT: use 'mean' or 'skip'.")
        self.unseen_device = unseen_device
        self.correction = interference_correction(interference, unseen_device)
        self._corunner_ctx: tuple[str, list[str], list[str | None], list[str | None]] | None = None
        self._factors: np.ndarray | None = None
        self.hedge = check_float("hedge", hedge, minimum=0.0, hint="e.g. 0.25 (the NCF's log error per unit of log "
                                 "ratio), or 0 to plan on the point correction")
        self.changed_ranks: list[int] = []  #: ranks whose co-runner changes in the last decision's context
        self.peer_lines = check_bool("peer_lines", peer_lines)
        self.peer_refuted: list[int] = []  #: ranks whose flat lines the last decision replaced (``peer_lines``)
        self._devices: list[str] | None = None  # each rank's device type, from the latest context
        self._current: list[int] | None = None  # the plan in force at the decision (each rank's latest level)
        self._peer_memo: tuple[Any, np.ndarray, np.ndarray, list[int]] | None = None  # the last peer check

    def set_context(self, utilisation: Sequence[float] | None = None, data: Sequence[float] | None = None,
                    devices: Sequence[str] | None = None, corunners: Sequence[str | None] | None = None,
                    next_corunners: Sequence[str | None] | None = None, workload: str | None = None) -> None:
        """What is observable at this epoch boundary, for the next decision (every argument optional).

        Args:
            utilisation: per-rank share of the device used by other processes in the last epoch (accepted for
                the common context of the integrations; the split does not use it).
            data: per-rank seconds per step outside the measured compute window (accepted, not used: the split
                is ``equal_finish``'s objective on the compute lines).
            devices: each rank's device type (the NCF's item, with the co-runner).
            corunners: the co-runner beside each rank during the last epoch (``None``: dedicated).
            next_corunners: the co-runner beside each rank in the next epoch.
            workload: this job's workload type (the NCF's user; default ``"training"``).

        Co-runners apply to the next :meth:`allocate` call only: a later call without a new context treats
        the change as measured already.
        """
        given = [x is not None for x in (devices, corunners, next_corunners)]
        if any(given) and not all(given):
            raise ValueError("`devices`, `corunners` and `next_corunners` go together, got "
                             f"devices={devices!r}, corunners={corunners!r}, next_corunners={next_corunners!r}. "
                             "HINT: pass all three (one entry per rank) or none.")
        if all(given):
            lengths = {len(devices), len(corunners), len(next_corunners)}  # type: ignore[arg-type]
            if len(lengths) != 1:
                raise ValueError(f"`devices`, `corunners`, `next_corunners` have lengths {sorted(lengths)}. "
                                 "HINT: give one entry per rank in each.")
            self._corunner_ctx = (workload or "training", list(devices), list(corunners),  # type: ignore[arg-type]
                                  list(next_corunners))  # type: ignore[arg-type]
        else:
            self._corunner_ctx = None

    def take_context(self, n: int) -> tuple[str, list[str], list[str | None], list[str | None]] | None:
        """The co-runner context for a decision over ``n`` ranks (consumed: ``None`` afterwards)."""
        ctx, self._corunner_ctx = self._corunner_ctx, None
        ctx = ctx if ctx is not None and len(ctx[1]) == n else None
        if ctx is not None or (self._devices is not None and len(self._devices) != n):
            self._devices = None if ctx is None else list(ctx[1])  # kept for later calls without context
        self.changed_ranks = [] if ctx is None else [i for i in range(n) if ctx[2][i] != ctx[3][i]]
        return ctx

    def at_plan(self, current: Sequence[int] | None) -> None:
        """The plan in force for the next decision (where each rank's latest level was measured; ``peer_lines``)."""
        self._current = None if current is None else [int(b) for b in current]
        self.peer_refuted = []

    def slowdown(self, workload: str, device: str, corunner: str | None) -> float | None:
        """The NCF's slowdown of ``workload`` on ``device`` beside ``corunner`` (1 without one; a device type it
        does not know is handled by the correction's ``unseen_device``); ``None``: unknown."""
        return None if self.correction is None else self.correction.slowdown(workload, device, corunner)

    def ncf_ratios(self, ctx: tuple[str, list[str], list[str | None], list[str | None]] | None,
                   n: int) -> list[float | None]:
        """Per rank, the NCF's slowdown ratio ``NCF(next) / NCF(measured)`` for ``ctx`` (``None`` where nothing
        changes, a name is unknown, or there is no correction or context)."""
        out: list[float | None] = [None] * n
        if self.correction is None or ctx is None:
            return out
        workload, devices, old, new = ctx
        for i in range(n):
            if old[i] != new[i]:
                s0, s1 = (self.slowdown(workload, devices[i], c) for c in (old[i], new[i]))
                out[i] = s1 / s0 if s0 is not None and s1 is not None and s0 > 0 else None
        return out

    def ncf_factors(self, ctx: tuple[str, list[str], list[str | None], list[str | None]] | None, n: int,
                    ratios: Sequence[float | None] | None = None) -> np.ndarray:
        """Per-rank NCF multipliers of the fitted lines: ``ratios`` (default :meth:`ncf_ratios`), 1 where none."""
        ratios = self.ncf_ratios(ctx, n) if ratios is None else ratios
        if self.correction is not None:
            self.correction.corrections += sum(r is not None for r in ratios)
        return np.array([1.0 if r is None else r for r in ratios], dtype=np.float64)

    def lines(self, models: Sequence[TimeModelParams], world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Intercepts and slopes of ``models`` as used by the last decision (its corrections applied: a co-runner
        slows the compute, so the seconds of each intercept that are the wait for data are not scaled)."""
        a, beta = line_arrays(models)
        d = data_seconds(models, world_size)
        if self.peer_lines and self._devices is not None and self._current is not None:
            a, beta = self._peer_checked(a, beta, d, knee_arrays(models)[0], self._devices, self._current)
        f = self._factors
        if f is not None and len(f) == world_size:
            a, beta = (a - d) * f + d, beta * f
        return a, beta

    def _peer_checked(self, a: np.ndarray, beta: np.ndarray, data: np.ndarray, measured: np.ndarray | None,
                      devices: list[str], current: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """:func:`peer_fixed_costs` on these lines, computed once for the same lines, devices and plan: one decision
        asks for its lines several times (the split, the hedge's second split, the planner's gate and clipping)."""
        key = (a.tobytes(), beta.tobytes(), data.tobytes(), None if measured is None else measured.tobytes(),
               tuple(devices), tuple(current))
        if self._peer_memo is None or self._peer_memo[0] != key:
            self._peer_memo = (key, *peer_fixed_costs(a, beta, data, measured, devices, current))
        _, a2, beta2, refuted = self._peer_memo
        self.peer_refuted = list(refuted)
        return a2.copy(), beta2.copy()

    def knees(self, models: Sequence[TimeModelParams], world_size: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``models``' knees and the slopes past them (the planner's ``extrapolate="proportional"``) as the last
        decision's corrections scale them; ``(None, None)`` without knees."""
        knee, beyond = knee_arrays(models)
        f = self._factors
        if beyond is not None and f is not None and len(f) == world_size:
            beyond = beyond * f
        return knee, beyond

    def predict_makespan(self, models: Sequence[TimeModelParams], plan: Sequence[int]) -> float:
        """The planner's damping gate: predicted compute time of ``plan``'s slowest rank on the lines of the
        last decision (so a plan decided on a known co-runner change is not vetoed by the stale lines)."""
        n = len(plan)
        a, beta = self.lines(models, n)
        return float(np.max(curve_times(a, beta, np.asarray(plan, dtype=np.float64), *self.knees(models, n))))

    def split(self, models: Sequence[TimeModelParams], global_batch: int, bounds: Any, factors: np.ndarray | None,
              groups: Sequence[Any] | None = None) -> list[int]:
        """The exact split of ``global_batch`` on ``models`` scaled by ``factors`` (remembered for the gate); with
        ``hedge`` > 0 the factors are first moved to their hedged quantiles at the shares of this split
        (:func:`~hetero_plugins.scheduler.hedge.hedged_factors`; ``groups``: per rank, a key of ranks that err
        together), and the split is made again on them."""
        n = bounds.world_size
        self._factors = None if factors is None or np.all(factors == 1.0) else np.asarray(factors, dtype=np.float64)
        for hedged in (False, True):
            a, beta = self.lines(models, n)
            knees = self.knees(models, n)
            plan = min_makespan_split(a, beta, global_batch, bounds.min_batch, bounds.max_batch, *knees)
            if hedged or self.hedge == 0 or self._factors is None:
                break
            shares = throughput_shares(plan, curve_times(a, beta, plan.astype(np.float64), *knees))
            self._factors = hedged_factors(self._factors, shares, groups, self.hedge)
        return plan.tolist()

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        n = bounds.world_size
        self.at_plan(current)
        ctx = self.take_context(n)
        fitted = fitted_models(models)
        if fitted is None:
            self._factors = None
            return self._keep_or_equal(global_batch, bounds, current)
        return self.split(models, global_batch, bounds, self.ncf_factors(ctx, n), corunner_groups(ctx))
