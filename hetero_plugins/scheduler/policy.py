"""The learned allocators: ``"dqn"`` (stage-1 DQN chunk assignment) and ``"auto"`` (DQN with a safety net).

Both are :class:`~hetero_plugins.balancing.allocators.Allocator` subclasses that this module registers
(:func:`~hetero_plugins.balancing.allocators.register_allocator`) when it is imported; ``import hetero_plugins``
imports it, so every integration takes them by name::

    Trainer(strategy=HeteroDDPStrategy(allocator="auto"), devices=4)

The planner runs them on every rank with identical inputs; rank 0's plan is broadcast (BatchBalancer).
Zhang, Geng, Ma, "Learning-Driven Interference-Aware Workload Parallelization for Streaming Applications in
Heterogeneous Cluster", IEEE TPDS 2021: LDWP (stage 1) splits the work; IAWP (stage 2) predicts the
interference of co-located jobs with NCF. Here stage 2 feeds stage 1: when the context says a rank's
co-runner changes at this epoch boundary (:meth:`DQNAllocator.set_context`), the rank's fitted time line,
measured beside the old co-runner, is scaled by the NCF's predicted slowdown ratio new / old before the
split is decided, so the plan does not wait one epoch for the measurements to catch up.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.balancing.allocators import Allocator, Bounds, fitted_models, register_allocator
from hetero_plugins.balancing.time_model import TimeModelParams
from hetero_plugins.scheduler.dqn import DQNTrainer, QNetwork, assign
from hetero_plugins.scheduler.features import DecisionContext
from hetero_plugins.scheduler.interference import interference_correction
from hetero_plugins.scheduler.placement import equal_finish_plan
from hetero_plugins.scheduler.problem import DecisionProblem

log = logging.getLogger(__name__)

__all__ = ["AutoAllocator", "DQNAllocator"]


class DQNAllocator(Allocator):
    """Per-rank batch sizes from the pre-trained DQN's greedy chunk assignment.

    Args:
        model: a model file from ``hetero-plugins pretrain``/``transfer``, a :class:`QNetwork`, or ``None``
            for the shipped default (feature schema checked on load).
        chunks_per_rank: coarse chunks per rank (finer = slower decisions, same final precision).
        parallel: at most ``N // parallel`` ranks get a chunk per scoring round (1 = exact greedy).
        online: learn online from the measured epochs: at every decision, the previous decision's state and
            the time lines measured since become one more training problem (a small replay keeps the last 64),
            and ``online_updates`` Double-DQN updates run (clusters of at most ``online_max_ranks`` ranks).
        online_updates, online_lr, online_max_ranks, seed: online learning's budget per decision, learning
            rate, size limit and seed.
        interference: stage 2 (IAWP): ``True`` corrects the fitted lines of ranks whose co-runner changes
            with the shipped NCF (:class:`~hetero_plugins.scheduler.interference.InterferenceCorrection`),
            ``False`` turns it off; an ``InterferencePredictor`` or an NCF model file uses that predictor. It acts only when
            :meth:`set_context` names co-runners (the simulator does; Lightning runs do with ``cluster=``).

    Extra telemetry reaches the features through :meth:`set_context`; slopes are remembered between calls
    for the trend feature (one call per epoch under the planner).

    Example::

        >>> from hetero_plugins.balancing.allocators import Bounds
        >>> from hetero_plugins.balancing.time_model import TimeModelParams as P
        >>> plan = DQNAllocator().allocate([P(0.0, 0.001), P(0.0, 0.004)], 64, Bounds.uniform(2))
        >>> sum(plan), plan[0] > plan[1]
        (64, True)
    """

    name = "dqn"

    def __init__(self, model: str | Path | QNetwork | None = None, chunks_per_rank: int = 2, parallel: int = 4,
                 online: bool = False, online_updates: int = 16, online_lr: float = 3e-4,
                 online_max_ranks: int = 64, seed: int = 0, interference: Any = True) -> None:
        self.net = model if isinstance(model, QNetwork) else QNetwork.load(model)
        self.chunks_per_rank = check_int("chunks_per_rank", chunks_per_rank, minimum=1)
        self.parallel = check_int("parallel", parallel, minimum=1)
        self.online = bool(online)
        self.online_updates = check_int("online_updates", online_updates, minimum=1)
        self.online_lr = check_float("online_lr", online_lr, minimum=0.0)
        self.online_max_ranks = check_int("online_max_ranks", online_max_ranks, minimum=1)
        self.seed = int(seed)
        self.correction = interference_correction(interference)
        self._prev_slope: np.ndarray | None = None
        self._utilisation: np.ndarray | None = None
        self._data: np.ndarray | None = None
        self._corunner_ctx: tuple[str, list[str], list[str | None], list[str | None]] | None = None
        self._factors: np.ndarray | None = None
        self._last: dict[str, Any] | None = None
        self._problems: deque[DecisionProblem] = deque(maxlen=64)
        self._trainer: Any = None
        #: Online learning so far: decisions learned from, DQN updates, seconds spent.
        self.online_stats = {"decisions": 0, "updates": 0, "seconds": 0.0}

    def learn(self, problem: DecisionProblem, updates: int | None = None) -> int:
        """A few Double-DQN updates from one measured decision (its state, and the times measured after it).

        The problem joins a small replay of recent decisions; episodes run on it and on older ones until
        ``updates`` (default ``online_updates``) minibatch updates are done. Returns the updates made.
        """
        t0 = time.perf_counter()
        if self._trainer is None:
            self._trainer = DQNTrainer(net=self.net, lr=self.online_lr, gamma=0.3, batch_size=32, target_sync=50,
                                       eps_start=0.1, eps_end=0.05, eps_decay=50, chunks_per_rank=4, seed=self.seed)
        tr = self._trainer
        self._problems.append(problem)
        want = self.online_updates if updates is None else int(updates)
        start = tr.updates
        n = len(problem.slope)
        per_step = max(0.05, want / (2.0 * tr.chunks_per_rank * n))
        order = [len(self._problems) - 1] + list(tr.np_rng.permutation(len(self._problems)))
        for k, i in enumerate(order):
            if tr.updates - start >= want or k >= 8:
                break
            tr.run_episode(self._problems[i], updates_per_step=per_step)
        while tr.updates - start < want and len(tr.replay) >= tr.batch_size:
            tr.update()
        self.net = tr.network()
        self.online_stats["decisions"] += 1
        self.online_stats["updates"] += tr.updates - start
        self.online_stats["seconds"] += time.perf_counter() - t0
        return tr.updates - start

    def set_context(self, utilisation: Sequence[float] | None = None, data: Sequence[float] | None = None,
                    devices: Sequence[str] | None = None, corunners: Sequence[str | None] | None = None,
                    next_corunners: Sequence[str | None] | None = None, workload: str | None = None) -> None:
        """What is observable at this epoch boundary, for the next decision (every argument optional).

        Args:
            utilisation: per-rank share of the device used by other processes in the last epoch.
            data: per-rank seconds per step outside the measured compute window in the last epoch.
            devices: each rank's device type (the NCF's item, with the co-runner).
            corunners: the co-runner beside each rank during the last epoch (``None``: dedicated).
            next_corunners: the co-runner beside each rank in the next epoch.
            workload: this job's workload type (the NCF's user; default ``"training"``).

        Co-runners apply to the next :meth:`allocate` call only: a later call without a new context treats
        the change as measured already.
        """
        self._utilisation = None if utilisation is None else np.asarray(utilisation, dtype=np.float64)
        self._data = None if data is None else np.asarray(data, dtype=np.float64)
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

    def data_times(self, world_size: int) -> np.ndarray:
        d = self._data
        return d if d is not None and len(d) == world_size else np.zeros(world_size)

    def _take_factors(self, n: int) -> np.ndarray:
        """Stage-2 multipliers for this decision (consumes the co-runner context)."""
        ctx, self._corunner_ctx = self._corunner_ctx, None
        if self.correction is None or ctx is None or len(ctx[1]) != n:
            return np.ones(n)
        return self.correction.factors(*ctx)

    def lines(self, models: Sequence[TimeModelParams], world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Intercepts and slopes of ``models`` as used by the last decision (stage-2 corrections applied)."""
        a = np.fromiter((m.intercept for m in models), dtype=np.float64, count=world_size)
        beta = np.fromiter((m.slope for m in models), dtype=np.float64, count=world_size)
        f = self._factors
        if f is not None and len(f) == world_size:
            a, beta = a * f, beta * f
        return a, beta

    def predict_makespan(self, models: Sequence[TimeModelParams], plan: Sequence[int]) -> float:
        """The planner's damping gate: predicted compute time of ``plan``'s slowest rank on the corrected lines.

        The gate sees the stage-2 corrections (a co-runner change known at the boundary) but not the data
        times: those are as before, so without co-runner changes the gate is the stock planner's (fits from
        few batch sizes under drifting speeds are noisy, and the gate keeps plans from chasing them).
        """
        n = len(plan)
        a, beta = self.lines(models, n)
        return float(np.max(a + beta * np.asarray(plan, dtype=np.float64)))

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        fitted = fitted_models(models)
        n = bounds.world_size
        self._factors = self._take_factors(n)
        if fitted is None:
            return self._keep_or_equal(global_batch, bounds, current)
        intercept, slope = self.lines(fitted, n)
        prev = self._prev_slope if self._prev_slope is not None and len(self._prev_slope) == n else None
        util = self._utilisation if self._utilisation is not None and len(self._utilisation) == n else None
        caps = np.minimum(np.asarray(bounds.max_batch, dtype=np.float64), global_batch)
        data = self.data_times(n)
        last = self._last
        if self.online and last is not None and last["n"] == n and last["global_batch"] == global_batch \
                and n <= self.online_max_ranks:
            # What the previous decision saw, and what was measured afterwards: the fitted lines now.
            raw_a, raw_b = (np.fromiter((getattr(m, k) for m in fitted), dtype=np.float64, count=n)
                            for k in ("intercept", "slope"))
            self.learn(DecisionProblem(
                intercept=last["intercept"], slope=last["slope"], prev_slope=last["prev_slope"],
                utilisation=last["utilisation"], data=last["data"], true_intercept=raw_a, true_slope=raw_b,
                true_data=data, global_batch=global_batch, max_batch=last["max_batch"]))
        ctx = DecisionContext(intercept, slope, global_batch, caps, prev_slope=prev, utilisation=util, data=data)
        if self.online:
            self._last = {"n": n, "global_batch": global_batch, "intercept": intercept, "slope": slope,
                          "prev_slope": slope if prev is None else prev,
                          "utilisation": np.zeros(n) if util is None else util, "data": data, "max_batch": caps}
        self._prev_slope = slope
        return assign(self.net, ctx, bounds.min_batch, self.chunks_per_rank, self.parallel)


class AutoAllocator(Allocator):
    """The DQN's plan, unless the closed-form equal-finish split is predicted faster: then that one.

    Both plans come from the same time lines (the fitted ones with the stage-2 co-runner corrections of
    :class:`DQNAllocator`) and are scored by the same prediction, max_i(a_i + beta_i b_i + data_i) with the
    data times known through :meth:`set_context`; the DQN's plan is kept when its predicted step time is at
    most ``(1 + tolerance)`` times the equal-finish plan's
    (:func:`~hetero_plugins.scheduler.placement.equal_finish_plan`, the objective of ``equal_finish``,
    vectorised). ``last_choice`` says which won. Without co-runner context the fallback is
    ``equal_finish``'s plan on the fitted lines (same makespan).

    Args:
        model: as for :class:`DQNAllocator`.
        tolerance: how much worse (relative) the DQN's predicted step time may be and still be used.
        score_data: also add the known data times when scoring the two plans. Off by default: the DQN's
            data-aware moves change batch sizes under drifting speeds, where lines fitted from few batch sizes
            go wrong (on the ``dynamic`` scenario this cost 18%, see docs/scheduler.md); off, the DQN's plan is
            used only when it is predicted faster on the compute lines alone.
        **kwargs: passed to :class:`DQNAllocator` (e.g. ``interference=False``).
    """

    name = "auto"

    def __init__(self, model: str | Path | QNetwork | None = None, tolerance: float = 0.0, score_data: bool = False,
                 **kwargs: Any) -> None:
        self.dqn = DQNAllocator(model, **kwargs)
        self.tolerance = check_float("tolerance", tolerance, minimum=0.0)
        if not isinstance(score_data, bool):
            raise ValueError(f"`score_data` must be True or False, got {score_data!r}. HINT: score_data=False "
                             "(default) scores plans on the compute lines only.")
        self.score_data = score_data
        self.last_choice: str | None = None

    def set_context(self, **context: Any) -> None:
        """Forwarded to :meth:`DQNAllocator.set_context`."""
        self.dqn.set_context(**context)

    def predict_makespan(self, models: Sequence[TimeModelParams], plan: Sequence[int]) -> float:
        return self.dqn.predict_makespan(models, plan)

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        proposal = self.dqn.allocate(models, global_batch, bounds, current)
        fitted = fitted_models(models)
        if fitted is None:
            self.last_choice = "equal_finish"
            return proposal  # both keep the current plan or split equally
        n = bounds.world_size
        a, beta = self.dqn.lines(fitted, n)
        safe = equal_finish_plan(a, beta, global_batch, np.asarray(bounds.min_batch), np.asarray(bounds.max_batch))
        data = self.dqn.data_times(n) if self.score_data else np.zeros(n)
        t_dqn = float(np.max(a + beta * np.asarray(proposal, dtype=np.float64) + data))
        t_safe = float(np.max(a + beta * safe + data))
        if t_dqn <= t_safe * (1.0 + self.tolerance):
            self.last_choice = "dqn"
            return proposal
        log.info("auto allocator: DQN plan predicted %.1f%% slower than equal_finish; using equal_finish",
                 100 * (t_dqn / t_safe - 1))
        self.last_choice = "equal_finish"
        return [int(v) for v in safe]

    def predicted_step_time(self, models: Sequence[TimeModelParams], plan: Sequence[int], bounds: Bounds) -> float:
        """Kept for compatibility: :meth:`predict_makespan`."""
        return self.predict_makespan(models, plan)


register_allocator("dqn", DQNAllocator)
register_allocator("auto", AutoAllocator)
