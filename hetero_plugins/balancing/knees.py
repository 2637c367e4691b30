"""Where each rank's fitted line stops being trusted: the knee past which the planner prices a step in proportion
to the batch (``BalancePlanner(extrapolate="proportional")``), and how far it moves out where the line held."""

from __future__ import annotations

import math

import numpy as np

from hetero_plugins.balancing.lines import TimeModelLines
from hetero_plugins.balancing.time_bank import TimeModelBank

__all__ = ["KneeTrust"]


class KneeTrust:
    """Per rank, the knee of its step-time curve: ``factor`` times the largest batch its time model has measured,
    times a trust that doubles each time the rank ran past that size and its line held (the measured time nearer
    the line's than the proportional model's, geometrically; at most ``top``), and falls back to 1 when it did not.

    Example::

        >>> bank = TimeModelBank(1)
        >>> bank.observe(np.array([[16.0, 32.0] * 4]), np.array([[0.1, 0.1008] * 4]))  # flat: a plateau
        >>> knees = KneeTrust(1)
        >>> knee, beyond = knees.knees(bank, bank.lines())
        >>> int(knee[0]), round(float(beyond[0]) * 64, 4)  # past 32 samples: the time at 32, in proportion
        (32, 0.2016)
    """

    def __init__(self, world_size: int, factor: float = 1.0, top: float = 8.0) -> None:
        self.factor = float(factor)
        self.top = float(top)
        self.trust = np.ones(world_size)
        #: rank -> (the batch past its measured sizes the plan gave it, its line's time there, the proportional one)
        self.probes: dict[int, tuple[float, float, float]] = {}

    def knees(self, bank: TimeModelBank, lines: TimeModelLines) -> tuple[np.ndarray, np.ndarray]:
        """Per rank, the knee (``inf``: none, where the line has no fixed cost or no measurement) and the seconds
        per sample past it (the line's time at the knee over the knee)."""
        big = bank.measured_max()
        trust = self.trust if len(self.trust) == len(big) else 1.0
        big = np.floor(big * self.factor * trust)
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = lines.known & (big > 0) & (lines.intercept > 0)
            per = np.where(ok, (lines.intercept + lines.slope * big) / np.where(ok, big, 1.0), lines.slope)
        return np.where(ok, big, np.inf), np.where(ok, per, 1.0)

    def set_probes(self, bank: TimeModelBank, plan: list[int]) -> None:
        """Remember, for each rank ``plan`` takes past the largest batch it has measured, what its line and the
        proportional model predict there; its next measurement at that batch says which held."""
        self.probes = {}
        lines = bank.lines()
        big = bank.measured_max()
        for r, b in enumerate(plan):
            if lines.known[r] and big[r] > 0 and b > big[r] and lines.intercept[r] > 0:
                at_k = float(lines.intercept[r] + lines.slope[r] * big[r])
                self.probes[r] = (float(b), float(lines.intercept[r] + lines.slope[r] * b), at_k * b / float(big[r]))

    def check(self, records: np.ndarray) -> None:
        """Score the probes on step ``records`` (``(ranks, steps, >= 2)``: batch, compute seconds)."""
        if not self.probes or len(self.trust) != records.shape[0]:
            return
        for r in list(self.probes):
            b, line, prop = self.probes[r]
            sel = records[r, :, 0] == b
            if not sel.any():
                continue
            held = float(np.median(records[r, sel, 1])) <= math.sqrt(max(line, 1e-12) * max(prop, 1e-12))
            self.trust[r] = min(self.trust[r] * 2.0, self.top) if held else 1.0
            del self.probes[r]
