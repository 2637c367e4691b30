"""The two-stage scheduler's allocators: ``"dqn"`` (exact split on NCF-corrected lines) and ``"auto"`` (the safe one).

Both are :class:`~hetero_plugins.balancing.allocators.Allocator` subclasses that this module registers
(:func:`~hetero_plugins.balancing.allocators.register_allocator`) when it is imported; ``import hetero_plugins``
imports it, so every integration takes them by name::

    Trainer(strategy=HeteroDDPStrategy(allocator="auto"), devices=4)

Zhang, Geng, Ma, "Learning-Driven Interference-Aware Workload Parallelization for Streaming Applications in
Heterogeneous Cluster", IEEE TPDS 2021: LDWP (stage 1) places work on execution nodes; IAWP (stage 2) predicts
the interference of co-located jobs with NCF. For linear step times the makespan-optimal batch split has an
exact solution (:func:`~hetero_plugins.balancing.allocators.min_makespan_split`), which a learned splitter can
only tie, so here the split under any placement is always the exact one; what is learned is (a) the slowdown a
co-runner will cause (the NCF: when the context says a rank's co-runner changes at this epoch boundary, its
fitted line, measured beside the old co-runner, is scaled by the predicted ratio new / old before the split,
so the plan does not wait one epoch for the measurements) and (b) where ranks run, which the placement
Q-network decides (``LearnedRelocator``, passed to the simulator or the integrations as their relocation).

:class:`AutoAllocator` applies (a) only when the models agree and are confident (see its docstring) and
otherwise returns ``equal_finish``'s plan unchanged; :meth:`AutoAllocator.guard` gates (b) the same way.
The planner runs the allocators on every rank with identical inputs; rank 0's plan is broadcast (BatchBalancer).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_plugins._validation import check_bool, check_float, check_int
from hetero_plugins.balancing.allocators import Allocator, fitted_models, register_allocator
from hetero_plugins.balancing.lines import data_seconds
from hetero_plugins.balancing.time_model import TimeModelParams
from hetero_plugins.scheduler.hedge import corunner_groups
from hetero_plugins.scheduler.interference import interference_correction
from hetero_plugins.scheduler.removed_options import refuse_removed
from hetero_plugins.scheduler.dqn_allocator import DQNAllocator, line_arrays
from hetero_plugins.scheduler.safety import GuardedRelocator

log = logging.getLogger(__name__)

__all__ = ["AutoAllocator", "DQNAllocator", "GuardedRelocator"]

class AutoAllocator(Allocator):
    """The safe scheduler: the exact split on lines corrected for announced co-runner changes, and relocations kept
    only while its models are trusted (:meth:`guard`).

    Without a co-runner change in the context the plan is ``equal_finish``'s. With one, each rank whose co-runner
    changes is corrected by the NCF's slowdown ratio (``last_choice`` is ``"ncf"`` when any rank is corrected,
    else ``"equal_finish"``; ``last_reason`` says why, for logs; ``sources`` counts which evidence was used),
    unless ``reference`` (a second predictor, e.g. an additive baseline, where given) disagrees by more than
    ``agreement`` or ``trust_unverified=False`` refuses a prediction nothing has checked; such a rank is left as
    ``equal_finish`` sees it (``partial=False``: the whole decision falls back).

    Whatever ``measured_ratios``, a change whose every one of at least ``contradicted`` (4) measurements lies
    beyond ``agreement`` of the NCF on one side is corrected by their median (:meth:`contradicting_ratio`): noise
    scatters them on both sides, a co-runner the NCF misjudges in this cluster shifts them one way (figures in
    docs/scheduler.md, "Known gaps").

    Two more checks are off by default (``gate_split``'s are always on for relocations):

    - ``measured_ratios``: a change this run measured before (the ratio of a rank's fitted line after a co-runner change
      to its line before it, per device type, old and new co-runner) is corrected by the median measured ratio instead
      of the NCF's, and the guard vetoes moving to a slot whose measured slowdown disagrees with the NCF. (A change the
      NCF has no prediction for, a co-runner name it does not know, is corrected by its measured ratio either way: then
      it is the only evidence.) Off by default: those ratios are differences of fitted lines across a boundary, and on
      the family's validation split they erred far more than the NCF (truth 1.01, measured 0.50-1.72 on one cluster at
      10% step noise), so substituting them cost 3% on average and up to 16% on a cluster (120 clusters, 3 seeds:
      ``auto`` 1.206x / 1.194x the best analytic allocator on the two halves with them and the split gate below, 1.245x
      / 1.235x without; worst 0.997x / 0.990x against 0.992x / 0.989x; re-planning every 5 steps, first 30 clusters,
      1.179x -> 1.205x ``equal_finish``, worst 1.023x -> 1.018x).
    - ``gate_split``: the whole decision falls back to ``equal_finish`` when the NCF's *track record* fails (every
      measured change also scores the NCF's prediction of it; once ``min_record`` changes are scored, their median
      relative error must be at most ``max_ncf_error``) or the fitted lines of ranks whose co-runner did not
      change predicted this epoch's times worse than ``max_noise`` (robust spread of the log residuals over the
      last three decisions). For the split both judge the NCF by the same noisy measured ratios, and dropping an
      announced change's correction leaves the split as wrong as the whole slowdown; :meth:`trusted` (the
      relocation guard) keeps both, since a wrong move costs a restart.

    What is learned online: the measured ratios, the NCF's errors and the residuals, from every epoch boundary
    the allocator sees with a context (:meth:`set_context`; calls without one, e.g. mid-epoch re-plans, are
    not scored). :meth:`guard` wraps a relocator so that its moves are kept only under the relocation checks.

    Args:
        interference, unseen_device, hedge, peer_lines: the NCF, its hedge and the device-peer check of flat
            lines, as for :class:`DQNAllocator` (``interference=False``: always ``equal_finish``, its lines checked).
        agreement: relative disagreement tolerated between the NCF's ratio and a measured (or ``reference``)
            ratio, in (0, 1].
        max_ncf_error: the NCF's largest tolerated median relative error on this run's measured changes, > 0
            (relocations; the split too with ``gate_split``).
        min_record: measured changes before the track record is judged, >= 1.
        max_noise: largest tolerated robust spread of the time models' log residuals, > 0 (relocations; the split
            too with ``gate_split``).
        trust_unverified: correct changes nothing has checked yet on the NCF's word (default ``True``; validation,
            measured ratios first: ``False`` min 0.955 / mean 1.02 of the best analytic, ``True`` 1.004 / 1.157).
        partial: with unverified changes, correct the verified ranks only (``True``) or none (``False``).
        reference: ``None``, or a second predictor (anything with ``predict(workload, device, corunner)``, or
            an ``InterferenceCorrection``) the NCF must agree with.
        measured_ratios: correct a change measured before in this run by the measured ratio, not the NCF's, and
            veto moves to slots whose measured slowdown disagrees with the NCF (default ``False``: only changes
            the NCF cannot predict are corrected by their measured ratios; see above).
        gate_split: fall back to ``equal_finish`` for the split too when the NCF's track record or the residual
            spread fails (default ``False``, see above).
        contradicted: measurements of a change, all contradicting the NCF on one side, after which their median
            corrects it instead (default 4; 0: never, the NCF's word for every change as before session 21).

    Example::

        >>> from hetero_plugins.balancing.allocators import Bounds
        >>> from hetero_plugins.balancing.time_model import TimeModelParams as P
        >>> auto = AutoAllocator()
        >>> auto.allocate([P(0.0, 0.001), P(0.0, 0.003)], 400, Bounds.uniform(2)), auto.last_choice
        ([300, 100], 'equal_finish')
    """

    name = "auto"
    reads_knees = True

    def __init__(self, interference: Any = True, agreement: float = 0.15, max_ncf_error: float = 0.15,
                 min_record: int = 2, max_noise: float = 0.08, trust_unverified: bool = True, partial: bool = True,
                 reference: Any = None, unseen_device: str = "mean", measured_ratios: bool = False,
                 gate_split: bool = False, contradicted: int = 4, hedge: float = 0.25, peer_lines: bool = True,
                 **removed: Any) -> None:
        refuse_removed(type(self).__name__, removed)
        self.dqn = DQNAllocator(interference=interference, unseen_device=unseen_device, hedge=hedge,
                                peer_lines=peer_lines)
        self.agreement = check_float("agreement", agreement, minimum=0.0,
                                     hint="a relative tolerance such as 0.15")
        if not 0.0 < self.agreement <= 1.0:
            raise ValueError(f"`agreement`={agreement!r} must be in (0, 1]. HINT: a relative tolerance such as 0.15.")
        self.max_ncf_error = check_float("max_ncf_error", max_ncf_error, minimum=0.0, hint="e.g. 0.15")
        if self.max_ncf_error <= 0:
            raise ValueError(f"`max_ncf_error`={max_ncf_error!r} must be > 0. HINT: e.g. 0.15.")
        self.min_record = check_int("min_record", min_record, minimum=1)
        self.max_noise = check_float("max_noise", max_noise, minimum=0.0, hint="e.g. 0.08")
        if self.max_noise <= 0:
            raise ValueError(f"`max_noise`={max_noise!r} must be > 0. HINT: e.g. 0.08.")
        self.trust_unverified = check_bool("trust_unverified", trust_unverified)
        self.partial = check_bool("partial", partial)
        self.measured_ratios = check_bool("measured_ratios", measured_ratios)
        self.gate_split = check_bool("gate_split", gate_split)
        self.contradicted = check_int("contradicted", contradicted, minimum=0,
                                      hint="e.g. 4 (measurements that all contradict the NCF), or 0 for never")
        if reference is not None and not (hasattr(reference, "predict") or hasattr(reference, "slowdown")):
            raise ValueError(f"`reference`={reference!r} is not a predictor. HINT: pass None or an object with "
                             "predict(workload, device, corunner) (e.g. an InterferencePredictor).")
        self.reference = None if reference is None else interference_correction(reference)
        self.last_choice: str | None = None  #: ``"ncf"`` or ``"equal_finish"`` (last decision)
        self.last_reason: str = ""  #: why, in words
        self.choices = {"ncf": 0, "equal_finish": 0}  #: decisions with a co-runner change, by outcome
        #: changed ranks corrected by a ratio measured in this run / by the NCF's prediction
        self.sources = {"measured": 0, "ncf": 0}
        self.disagreements = 0  #: changes where the NCF disagreed with the measured ratio (the measured one was used)
        self.contradictions = 0  #: changes corrected by their measured ratios because every one contradicted the NCF
        #: per (workload, device, old, new): log slowdown ratios measured in this run
        self.measured: dict[tuple[str, str, str | None, str | None], list[float]] = {}
        self.ncf_errors: list[float] = []  #: log(NCF ratio / measured ratio) of every measured change
        #: log(predicted / measured) line of every rank a guarded relocation moved, one epoch after the move
        self.move_errors: list[float] = []
        self._residuals: deque[np.ndarray] = deque(maxlen=3)
        self._prev: dict[str, Any] | None = None
        self._after_move: list[int] | None = None
        #: rank -> boundaries left before its lines count as measured at its place again (set by a relocation)
        self._settling: dict[int, int] = {}

    # ---------------------------------------------------------------- the shared context
    def set_context(self, **context: Any) -> None:
        """Forwarded to :meth:`DQNAllocator.set_context`."""
        self.dqn.set_context(**context)

    @property
    def correction(self) -> Any:
        """The NCF correction (``None`` when ``interference=False``)."""
        return self.dqn.correction

    @property
    def changed_ranks(self) -> list[int]:  # type: ignore[override]
        """Ranks whose co-runner changes in the last decision's context."""
        return self.dqn.changed_ranks

    def predict_makespan(self, models: Sequence[TimeModelParams], plan: Sequence[int]) -> float:
        return self.dqn.predict_makespan(models, plan)

    def lines(self, models: Sequence[TimeModelParams], world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Intercepts and slopes of ``models`` as the last decision used them (its corrections applied); the
        planner places the samples it moves when it clips a plan on these."""
        return self.dqn.lines(models, world_size)

    # ---------------------------------------------------------------- what the run measured
    def noise(self) -> float | None:
        """Robust spread (1.4826 x median absolute log residual) of the fitted lines' predictions of the
        epochs just measured, over ranks whose co-runner did not change (``None`` before any)."""
        if not self._residuals:
            return None
        r = np.concatenate(list(self._residuals))
        return float(1.4826 * np.median(np.abs(r))) if r.size else None

    def ncf_error(self) -> float | None:
        """Median relative error of the NCF on this run's measured changes (``None`` below ``min_record``)."""
        if len(self.ncf_errors) < self.min_record:
            return None
        return float(math.expm1(np.median(np.abs(self.ncf_errors))))

    def measured_ratio(self, workload: str, device: str, old: str | None, new: str | None) -> float | None:
        """The median slowdown ratio new / old measured in this run on ``device`` (``None``: never measured)."""
        v = self.measured.get((workload, device, old, new))
        if v:
            return math.exp(statistics.median(v))  # short lists: statistics is ~20x faster than numpy here
        v = self.measured.get((workload, device, new, old))
        return math.exp(-statistics.median(v)) if v else None

    def contradicting_ratio(self, workload: str, device: str, old: str | None, new: str | None,
                            ncf: float) -> float | None:
        """The median measured ratio of a change when at least ``contradicted`` measurements of it (either way)
        all lie beyond ``agreement`` of the NCF's ratio ``ncf`` on one side, else ``None``."""
        logs = self.measured.get((workload, device, old, new), []) + \
            [-x for x in self.measured.get((workload, device, new, old), [])]
        if not self.contradicted or len(logs) < self.contradicted:
            return None
        tol, q = math.log1p(self.agreement), math.log(ncf)
        if all(x - q > tol for x in logs) or all(x - q < -tol for x in logs):
            return math.exp(statistics.median(logs))
        return None

    def _learn(self, models: Sequence[TimeModelParams], n: int, current: Sequence[int] | None) -> None:
        """Compare the previous boundary's lines with the lines measured since: the residuals of ranks that stayed
        put, the slowdown ratios of ranks whose co-runner changed, and the NCF's errors on both those and the
        lines it predicted for relocated ranks."""
        prev = self._prev
        if prev is None or prev["n"] != n:
            return
        plan = np.asarray(current if current is not None and len(current) == n else prev["plan"], dtype=np.float64)
        a, s = line_arrays(models)
        t_obs = a + s * plan
        t_raw = prev["a"] + prev["s"] * plan
        ok = (t_obs > 0) & (t_raw > 0)
        ratio = np.log(np.where(ok, t_obs, 1.0) / np.where(ok, t_raw, 1.0))
        c_obs, c_raw = t_obs - data_seconds(models, n), t_raw - prev["d"]  # a co-runner slows the compute alone
        c_ok = (c_obs > 0) & (c_raw > 0)
        slowdown = np.log(np.where(c_ok, c_obs, 1.0) / np.where(c_ok, c_raw, 1.0))
        ctx = prev["ctx"]
        other = np.zeros(n, dtype=bool)
        for i in prev["moved"]:
            if ok[i]:
                self.move_errors.append(float(-ratio[i]))  # the NCF-priced line of its new place vs measured
            other[i] = True
        # A moved rank's line one boundary after the move is still fitted from its first epoch at the new place
        # (and what its model was seeded with): a slowdown or residual measured against it says more about that
        # fit than about the co-runner (a co-runner arriving there measured as a 2x speed-up on one cluster).
        for i in list(self._settling):
            if 0 <= i < n:
                other[i] = True
            self._settling[i] -= 1
            if self._settling[i] <= 0:
                del self._settling[i]
        if ctx is not None:
            workload, devices, old, new = ctx
            for i in range(n):
                if old[i] == new[i] or not c_ok[i] or other[i]:
                    continue
                other[i] = True
                self.measured.setdefault((workload, devices[i], old[i], new[i]), []).append(float(slowdown[i]))
                f = prev["ncf"][i]
                if f is not None:
                    self.ncf_errors.append(float(math.log(f) - slowdown[i]))
        self._residuals.append(ratio[ok & ~other])

    def moved(self, ranks: Sequence[int]) -> None:
        """Tell the allocator that ``ranks`` were relocated (their lines are now predicted, not measured): the
        next decision is a re-plan at the same boundary, and the next boundary scores those predictions."""
        self._after_move = [int(r) for r in ranks]
        for r in self._after_move:
            self._settling[r] = 2  # the boundary scoring the move, and the next one

    # ---------------------------------------------------------------- the gate
    def _noise_reason(self) -> str:
        """Why the time models are too noisy to correct anything (``""``: they are not)."""
        sigma = self.noise()
        if sigma is not None and sigma > self.max_noise:
            return f"time models' residual spread {100 * sigma:.1f}% > max_noise {100 * self.max_noise:.0f}%"
        return ""

    def _record_reason(self) -> str:
        """Why the NCF's track record in this run disqualifies it (``""``: too short to judge, or good)."""
        err = self.ncf_error()
        if err is not None and err > self.max_ncf_error:
            return (f"NCF median error {100 * err:.0f}% on {len(self.ncf_errors)} measured changes > "
                    f"max_ncf_error {100 * self.max_ncf_error:.0f}%")
        return ""

    def _gate(self, ctx: tuple[str, list[str], list[str | None], list[str | None]], factors: np.ndarray,
              predicted: Sequence[float | None] | None = None) -> str:
        """Sets each changed rank's correction in ``factors`` (rank by rank) and returns ``""``, or the reason the
        whole decision falls back to ``equal_finish``.

        With ``measured_ratios``, a change this run measured before is corrected by the median measured ratio
        (where the NCF disagrees with it the disagreement is logged); without, only a change the NCF has no
        prediction for (``predicted[i] is None``: a device or co-runner it does not know) is. Otherwise the NCF's
        ratio is used when (with ``gate_split``) its track record passes, the ``reference`` agrees (where given) and
        ``trust_unverified`` allows an unchecked prediction; else the rank stays as ``equal_finish`` sees it
        (``partial=False``: the whole decision falls back). With ``gate_split`` a residual spread above
        ``max_noise`` makes the whole decision fall back."""
        workload, devices, old, new = ctx
        noisy = self._noise_reason() if self.gate_split else ""
        if noisy:
            return noisy
        record = self._record_reason() if self.gate_split else ""  # "": the NCF's track record holds (or is not asked)
        tol = math.log1p(self.agreement)
        left: list[str] = []  # why changed ranks were left uncorrected
        for i in range(len(devices)):
            d, c0, c1 = devices[i], old[i], new[i]
            if c0 == c1:
                continue
            q = float(factors[i])
            unknown = predicted is not None and predicted[i] is None
            m = self.measured_ratio(workload, d, c0, c1) if self.measured_ratios or unknown else None
            refuted = m is None and q != 1.0 and (m := self.contradicting_ratio(workload, d, c0, c1, q)) is not None
            if m is not None:
                if refuted:  # every measurement of this change contradicts the NCF
                    self.contradictions += 1
                    log.info("auto allocator: every measured ratio of (%s, %s -> %s) contradicts the NCF's %.2f; "
                             "their median %.2f is used on rank %d", d, c0, c1, q, m, i)
                elif q != 1.0 and abs(math.log(q / m)) > tol:
                    self.disagreements += 1
                    log.info("auto allocator: NCF ratio %.2f disagrees with the measured %.2f on rank %d "
                             "(%s, %s -> %s); the measured one is used", q, m, i, d, c0, c1)
                factors[i] = m
                self.sources["measured"] += 1
                continue
            if q == 1.0:
                continue  # no NCF prediction for this change
            why, checked = record, False
            if not why and self.reference is not None:
                r0, r1 = self.reference.slowdown(workload, d, c0), self.reference.slowdown(workload, d, c1)
                checked = r0 is not None and r1 is not None and r0 > 0
                if checked and abs(math.log(q * r0 / r1)) > tol:
                    why = (f"NCF ratio {q:.2f} disagrees with the reference predictor's {r1 / r0:.2f} on rank {i} "
                           f"({d}, {c0} -> {c1})")
            if not why and not checked and not self.trust_unverified:
                why = f"rank {i} ({d}, {c0} -> {c1}) is unverified and trust_unverified=False"
            if why:
                factors[i] = 1.0  # left as equal_finish sees it
                left.append(why)
            else:
                self.sources["ncf"] += 1
        if left and not self.partial:
            return left[0]
        if np.all(factors == 1.0):
            return left[0] if left else "no co-runner change with a prediction or a measurement"
        return ""

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        n = bounds.world_size
        self.dqn.at_plan(current)
        ctx = self.dqn.take_context(n)
        fitted = fitted_models(models)
        if fitted is None:
            self._prev = None
            self.dqn._factors = None  # noqa: SLF001 - its own helper's state
            self.last_choice, self.last_reason = "equal_finish", "no fitted line for every rank"
            return self._keep_or_equal(global_batch, bounds, current)
        after_move, self._after_move = self._after_move, None
        if ctx is not None and after_move is None:
            self._learn(models, n, current)
        ncf = self.dqn.ncf_ratios(ctx, n)
        factors = self.dqn.ncf_factors(ctx, n, ncf)
        if ctx is None or self.correction is None or all(o == w for o, w in zip(ctx[2], ctx[3])):
            reason, use = "no co-runner change", None
        else:
            factors = factors.copy()
            reason = self._gate(ctx, factors, ncf)  # may reset unverified ranks to 1 (partial)
            use = None if reason else factors
            self.choices["ncf" if use is not None else "equal_finish"] += 1
            if reason:
                log.info("auto allocator: equal_finish (%s)", reason)
        plan = self.dqn.split(models, global_batch, bounds, use, corunner_groups(ctx))
        a, s = line_arrays(models)
        lines = {"a": a.copy(), "s": s.copy(), "d": data_seconds(models, n), "plan": list(plan)}
        if after_move is not None and self._prev is not None and self._prev["n"] == n:
            # The re-plan after a relocation: the boundary's co-runner changes stay; movers are scored separately.
            self._prev.update(lines, moved=set(after_move))
        elif ctx is not None:  # a call without context (a mid-epoch re-plan) does not score the lines after it
            self._prev = {"n": n, **lines, "ctx": ctx, "ncf": ncf, "moved": set()}
        self.last_choice = "ncf" if use is not None else "equal_finish"
        self.last_reason = reason or "models agree"
        return plan

    # ---------------------------------------------------------------- relocation under the same checks
    def trusted(self) -> str:
        """``""`` when relocations may go ahead, else why not (the NCF's record, the residuals, the last decision).
        Before any residual is measured (the first boundary) the guard asks for a larger predicted gain instead."""
        why = self._record_reason() or self._noise_reason()
        if why:
            return why
        if self.last_choice == "equal_finish" and "disagrees" in self.last_reason:  # with the reference predictor
            return self.last_reason
        return ""

    def guard(self, relocator: Any, noise_margin: float = 1.0, min_gain: float = 0.05,
              payback: float = 1.0) -> GuardedRelocator:
        """``relocator`` (anything with the ``Relocator.propose`` keywords) whose moves are kept only when
        :meth:`trusted` (the NCF's track record and the time models' residuals), the lines of earlier moves were
        right and no measured slowdown of a target slot contradicts the NCF, the predicted saving over the next
        (at most three) epochs is at least ``payback`` times the restart cost and the predicted gain exceeds
        ``noise_margin`` residual spreads and ``min_gain``. Defaults chosen on the family's validation split
        (20 clusters, 3 seeds; ``auto`` with the learned relocator, relative to the best analytic allocator):
        ``1 / 0.05 / 1`` scored min 1.004 / mean 1.154; ``0 / 0 / 0`` (leaving payback and size to the relocator)
        min 0.989 / mean 1.173; ``2 / 0.2 / 2`` min 1.004 / mean 1.139; no relocation min 0.991 / mean 1.132."""
        return GuardedRelocator(relocator, self, noise_margin, min_gain, payback)


register_allocator("dqn", DQNAllocator)
register_allocator("auto", AutoAllocator)
