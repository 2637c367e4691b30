"""Where each rank's fitted line stops being trusted: the knee past which the planner prices a step in proportion
to the batch (``BalancePlanner(extrapolate="proportional")``)."""

from __future__ import annotations

import numpy as np

from hetero_plugins.balancing.lines import TimeModelLines
from hetero_plugins.balancing.time_bank import TimeModelBank

__all__ = ["KneeModel"]


class KneeModel:
    """Per rank, the knee of its step-time curve: ``factor`` times the largest batch its time model has measured
    (in its current regime), and past it the line's time there in proportion to the batch.

    Example::

        >>> bank = TimeModelBank(1)
        >>> bank.observe(np.array([[16.0, 32.0] * 4]), np.array([[0.1, 0.1008] * 4]))  # flat: a plateau
        >>> knees = KneeModel()
        >>> knee, beyond = knees.knees(bank, bank.lines())
        >>> int(knee[0]), round(float(beyond[0]) * 64, 4)  # past 32 samples: the time at 32, in proportion
        (32, 0.2016)
    """

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = float(factor)

    def knees(self, bank: TimeModelBank, lines: TimeModelLines) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, the knee (``inf``: none, where the line has no fixed cost or no measurement) and the seconds
        per sample past it (the line's time at the knee over the knee)."""
        big = np.floor(bank.measured_max() * self.factor)
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = lines.known & (big > 0) & (lines.intercept > 0)
            per = np.where(ok, (lines.intercept + lines.slope * big) / np.where(ok, big, 1.0), lines.slope)
        return np.where(ok, big, np.inf), np.where(ok, per, 1.0)
