"""The learned allocators: ``"dqn"`` (stage-1 DQN chunk assignment) and ``"auto"`` (DQN with a safety net).

Both are :class:`~hetero_plugins.allocators.Allocator` subclasses, registered in
:data:`~hetero_plugins.allocators.ALLOCATORS`, so every integration takes them by name::

    Trainer(strategy=HeteroDDPStrategy(allocator="auto"), devices=4)

The planner runs them on every rank with identical inputs; rank 0's plan is broadcast (BatchBalancer).
Zhang, Geng, Ma, "Learning-Driven Interference-Aware Workload Parallelization for Streaming Applications in
Heterogeneous Cluster", IEEE TPDS 2021 (LDWP stage).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.allocators import ALLOCATORS, Allocator, Bounds, EqualFinishAllocator, _fallback_models
from hetero_plugins.scheduler.dqn import QNetwork, assign
from hetero_plugins.scheduler.features import DecisionContext
from hetero_plugins.sim import DecisionProblem
from hetero_plugins.time_model import TimeModelParams

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

    Extra telemetry reaches the features through :meth:`set_context`; slopes are remembered between calls
    for the trend feature (one call per epoch under the planner).

    Example::

        >>> from hetero_plugins.allocators import Bounds
        >>> from hetero_plugins.time_model import TimeModelParams as P
        >>> plan = DQNAllocator().allocate([P(0.0, 0.001), P(0.0, 0.004)], 64, Bounds.uniform(2))
        >>> sum(plan), plan[0] > plan[1]
        (64, True)
    """

    name = "dqn"

    def __init__(self, model: str | Path | QNetwork | None = None, chunks_per_rank: int = 2, parallel: int = 4,
                 online: bool = False, online_updates: int = 16, online_lr: float = 3e-4,
                 online_max_ranks: int = 64, seed: int = 0) -> None:
        self.net = model if isinstance(model, QNetwork) else QNetwork.load(model)
        self.chunks_per_rank = check_int("chunks_per_rank", chunks_per_rank, minimum=1)
        self.parallel = check_int("parallel", parallel, minimum=1)
        self.online = bool(online)
        self.online_updates = check_int("online_updates", online_updates, minimum=1)
        self.online_lr = check_float("online_lr", online_lr, minimum=0.0)
        self.online_max_ranks = check_int("online_max_ranks", online_max_ranks, minimum=1)
        self.seed = int(seed)
        self._prev_slope: np.ndarray | None = None
        self._utilisation: np.ndarray | None = None
        self._data: np.ndarray | None = None
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
        import time

        t0 = time.perf_counter()
        if self._trainer is None:
            from hetero_plugins.scheduler.dqn import DQNTrainer

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

    def set_context(self, utilisation: Sequence[float] | None = None, data: Sequence[float] | None = None) -> None:
        """Per-rank telemetry for the next decision: utilisation by other processes, data seconds per step."""
        self._utilisation = None if utilisation is None else np.asarray(utilisation, dtype=np.float64)
        self._data = None if data is None else np.asarray(data, dtype=np.float64)

    def data_times(self, world_size: int) -> np.ndarray:
        d = self._data
        return d if d is not None and len(d) == world_size else np.zeros(world_size)

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        bounds.check_feasible(global_batch)
        fitted = _fallback_models(models)
        if fitted is None:
            return self._keep_or_equal(global_batch, bounds, current)
        n = bounds.world_size
        slope = np.array([m.slope for m in fitted])
        prev = self._prev_slope if self._prev_slope is not None and len(self._prev_slope) == n else None
        util = self._utilisation if self._utilisation is not None and len(self._utilisation) == n else None
        intercept = np.array([m.intercept for m in fitted])
        caps = np.minimum(np.asarray(bounds.max_batch, dtype=np.float64), global_batch)
        data = self.data_times(n)
        last = self._last
        if self.online and last is not None and last["n"] == n and last["global_batch"] == global_batch \
                and n <= self.online_max_ranks:
            # What the previous decision saw, and what was measured afterwards: the fitted lines now.
            self.learn(DecisionProblem(
                intercept=last["intercept"], slope=last["slope"], prev_slope=last["prev_slope"],
                utilisation=last["utilisation"], data=last["data"], true_intercept=intercept, true_slope=slope,
                true_data=data, global_batch=global_batch, max_batch=last["max_batch"]))
        ctx = DecisionContext(intercept, slope, global_batch, caps, prev_slope=prev, utilisation=util, data=data)
        if self.online:
            self._last = {"n": n, "global_batch": global_batch, "intercept": intercept, "slope": slope,
                          "prev_slope": slope if prev is None else prev,
                          "utilisation": np.zeros(n) if util is None else util, "data": data, "max_batch": caps}
        self._prev_slope = slope
        return assign(self.net, ctx, bounds.min_batch, self.chunks_per_rank, self.parallel)


class AutoAllocator(Allocator):
    """The DQN's plan, unless ``equal_finish``'s is predicted faster: then ``equal_finish``'s.

    Both plans are scored by the same prediction, max_i(a_i + beta_i b_i + data_i) from the fitted time
    lines and the data times known through :meth:`set_context`; the DQN's plan is kept when its predicted
    step time is at most ``(1 + tolerance)`` times ``equal_finish``'s. ``last_choice`` says which won.

    Args:
        model: as for :class:`DQNAllocator`.
        tolerance: how much worse (relative) the DQN's predicted step time may be and still be used.
    """

    name = "auto"

    def __init__(self, model: str | Path | QNetwork | None = None, tolerance: float = 0.0, **kwargs: Any) -> None:
        self.dqn = DQNAllocator(model, **kwargs)
        self.fallback = EqualFinishAllocator()
        self.tolerance = check_float("tolerance", tolerance, minimum=0.0)
        self.last_choice: str | None = None

    def set_context(self, utilisation: Sequence[float] | None = None, data: Sequence[float] | None = None) -> None:
        self.dqn.set_context(utilisation=utilisation, data=data)

    def allocate(self, models, global_batch, bounds, current=None):  # type: ignore[no-untyped-def]
        proposal = self.dqn.allocate(models, global_batch, bounds, current)
        safe = self.fallback.allocate(models, global_batch, bounds, current)
        fitted = _fallback_models(models)
        if fitted is None:
            self.last_choice = "equal_finish"
            return safe
        t_dqn = self.predicted_step_time(fitted, proposal, bounds)
        t_safe = self.predicted_step_time(fitted, safe, bounds)
        if t_dqn <= t_safe * (1.0 + self.tolerance):
            self.last_choice = "dqn"
            return proposal
        log.info("auto allocator: DQN plan predicted %.1f%% slower than equal_finish; using equal_finish",
                 100 * (t_dqn / t_safe - 1))
        self.last_choice = "equal_finish"
        return safe

    def predicted_step_time(self, models: Sequence[TimeModelParams], plan: Sequence[int], bounds: Bounds) -> float:
        data = self.dqn.data_times(bounds.world_size)
        return float(max(m.predict(b) + d for m, b, d in zip(models, plan, data)))


ALLOCATORS.setdefault("dqn", DQNAllocator)
ALLOCATORS.setdefault("auto", AutoAllocator)
