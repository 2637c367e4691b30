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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.allocators import ALLOCATORS, Allocator, Bounds, EqualFinishAllocator, _fallback_models
from hetero_plugins.scheduler.dqn import QNetwork, assign
from hetero_plugins.scheduler.features import DecisionContext
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

    def __init__(self, model: str | Path | QNetwork | None = None, chunks_per_rank: int = 2, parallel: int = 4) -> None:
        self.net = model if isinstance(model, QNetwork) else QNetwork.load(model)
        self.chunks_per_rank = check_int("chunks_per_rank", chunks_per_rank, minimum=1)
        self.parallel = check_int("parallel", parallel, minimum=1)
        self._prev_slope: np.ndarray | None = None
        self._utilisation: np.ndarray | None = None
        self._data: np.ndarray | None = None

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
        ctx = DecisionContext(
            np.array([m.intercept for m in fitted]), slope, global_batch,
            np.minimum(np.asarray(bounds.max_batch, dtype=np.float64), global_batch),
            prev_slope=prev, utilisation=util, data=self.data_times(n),
        )
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
