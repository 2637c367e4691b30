"""The record of one planning decision: what the planner saw at an epoch boundary, and the truth after it.

The simulator draws these (:func:`hetero_plugins.scheduler.sim.decision_problems`) to pre-train and evaluate
the DQN; :class:`~hetero_plugins.scheduler.policy.DQNAllocator` builds one from every measured epoch when it
learns online.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DecisionProblem"]


@dataclass(frozen=True)
class DecisionProblem:
    """One planning decision for pre-training: what the planner would see, and what the next epoch will be.

    Attributes:
        intercept, slope: observed per-rank time lines (the current epoch's, with fitting noise).
        prev_slope: the slopes observed one decision earlier (for the trend feature).
        utilisation: per-rank utilisation by other processes in the current epoch.
        data: per-rank data seconds per step (outside the compute window).
        true_intercept, true_slope, true_data: the next epoch's noise-free parameters (the reward's truth).
        global_batch: samples to split.
        max_batch: per-rank caps.
    """

    intercept: np.ndarray
    slope: np.ndarray
    prev_slope: np.ndarray
    utilisation: np.ndarray
    data: np.ndarray
    true_intercept: np.ndarray
    true_slope: np.ndarray
    true_data: np.ndarray
    global_batch: int
    max_batch: np.ndarray

    def true_step_time(self, plan: Sequence[float]) -> float:
        """The next epoch's true step time (slowest rank, data time included) under ``plan``."""
        return float(np.max(self.true_intercept + self.true_slope * np.asarray(plan, dtype=np.float64) + self.true_data))
