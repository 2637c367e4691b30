"""Per-rank step-time models t_i(b) = a_i + beta_i * b, fitted online and robustly.

A rank's compute time per step grows about linearly with its local batch: a fixed cost a (kernel launches,
optimizer, Python) plus a per-sample cost beta. LBB fits exactly this line for online coordination (Yao et
al. 2024), DBS/DLB use its special case a = 0 (speed = samples / time; Ye et al. 2020, 2022).

Robustness and forgetting: observations are grouped by batch size; each group is summarised by its
recency-weighted *median* time (a transient stall moves a median little), and the line is a weighted least
squares fit through the group medians, made only when the batch sizes seen differ enough to tell a fixed cost
from a per-sample cost. The prediction is anchored on the group that dominates the recent past, keeping the
fixed-cost share of the last valid line: weights halve every ``half_life`` observations, so a rank that slows
down dominates its own model again within about one half-life of steps, well inside an epoch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int

__all__ = ["LinearTimeModel", "TimeModelParams"]


@dataclass(frozen=True)
class TimeModelParams:
    """A fitted line: ``seconds(b) = intercept + slope * b``."""

    intercept: float
    slope: float

    def predict(self, batch_size: float) -> float:
        return self.intercept + self.slope * batch_size


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    return float(v[np.searchsorted(cum, 0.5 * cum[-1])])


class LinearTimeModel:
    """Online, noise-robust fit of one rank's compute time per step against its local batch size.

    Args:
        half_life: number of observations after which an observation's weight has halved (forgetting).
        window: most recent observations kept.
        min_group_weight: recency weight a batch size's group needs to count in the line fit.
        min_relative_spread: the line is fitted only when the batch sizes differ by at least this fraction.
        change_steps: a speed change is declared after this many consecutive steps deviate from the model
            the same way (0 disables); the model then keeps only those steps.
        change_threshold: relative deviation (e.g. 0.3 = 30% slower, or 1/1.3 faster) that counts.

    Example::

        >>> m = LinearTimeModel()
        >>> for b in (16, 32) * 8:
        ...     m.observe(b, 0.01 + 0.002 * b)
        >>> p = m.params()
        >>> round(p.intercept, 6), round(p.slope, 6)
        (0.01, 0.002)
    """

    def __init__(
        self,
        half_life: float = 6.0,
        window: int = 512,
        min_group_weight: float = 2.0,
        min_relative_spread: float = 0.15,
        change_steps: int = 4,
        change_threshold: float = 0.3,
    ) -> None:
        self.half_life = check_float("half_life", half_life, minimum=0.0, strict_minimum=True)
        self.window = check_int("window", window, minimum=2)
        self.min_group_weight = check_float("min_group_weight", min_group_weight, minimum=0.0)
        self.min_relative_spread = check_float("min_relative_spread", min_relative_spread, minimum=0.0, maximum=1.0)
        self.change_steps = check_int("change_steps", change_steps, minimum=0)
        self.change_threshold = check_float("change_threshold", change_threshold, minimum=0.0, strict_minimum=True)
        self._intercept_ratio: float | None = None
        self._obs: deque[tuple[float, float]] = deque(maxlen=self.window)
        self._cache: TimeModelParams | None = None
        self._ref: TimeModelParams | None = None
        self._ref_sizes: set[float] = set()
        self._since_ref = 0
        self._ratios: deque[float] = deque(maxlen=max(self.change_steps, 1))
        self.change_points = 0

    def __len__(self) -> int:
        return len(self._obs)

    @classmethod
    def from_params(cls, params: TimeModelParams, batch_size: int, **kwargs: Any) -> LinearTimeModel:
        """A model that starts from a predicted line, for a rank with no history (a new node, a relocated rank).

        The line enters as four noise-free observations at ``batch_size`` and at 60% of it, so it has the
        weight of a few steps: measured steps replace it within a half-life, and a prediction more than
        ``change_threshold`` off is dropped after ``change_steps`` steps by the change-point test.

        Example::

            >>> m = LinearTimeModel.from_params(TimeModelParams(0.01, 0.002), 32)
            >>> round(m.predict(64), 6)
            0.138
        """
        model = cls(**kwargs)
        hi = max(2, int(batch_size))
        lo = max(1, min(hi - 1, int(round(0.6 * hi))))
        for _ in range(4):
            for b in (lo, hi):
                model._obs.append((float(b), float(params.predict(b))))
        model._cache = None
        return model

    def observe(self, batch_size: float, seconds: float) -> None:
        """Record that a step with ``batch_size`` local samples took ``seconds`` of compute."""
        if batch_size <= 0 or not np.isfinite(seconds) or seconds < 0:
            return  # empty or unmeasured steps carry no information
        if self.change_steps and len(self._obs) >= self.change_steps:
            # Change-point test against a reference fit refreshed every `change_steps` observations: when the
            # last `change_steps` steps all deviate the same way by more than `change_threshold`, the rank's
            # speed has changed (another job took its GPU, or left): forget the old regime at once instead of
            # waiting for the half-life. A transient one-step stall never triggers it.
            if self._ref is None or self._since_ref >= self.change_steps:
                self._ref, self._since_ref = self.params(), 0
                self._ref_sizes = {b for b, _ in self._obs}
            self._since_ref += 1
            expected = self._ref.predict(batch_size) if self._ref is not None else 0.0
            # Only a batch size the reference has seen tests for a change: at a new size a deviation is the
            # model's extrapolation error (a fixed cost it has not learned yet), not a change of speed.
            if expected > 0 and float(batch_size) in self._ref_sizes:
                self._ratios.append(seconds / expected)
            else:
                self._ratios.clear()
        self._obs.append((float(batch_size), float(seconds)))
        self._cache = None
        r = self._ratios
        if self.change_steps and len(r) == self.change_steps and (
            min(r) > 1 + self.change_threshold or max(r) < 1 / (1 + self.change_threshold)
        ):
            recent = list(self._obs)[-self.change_steps :]
            self._obs = deque(recent, maxlen=self.window)
            self._ratios.clear()
            self._ref, self._cache = None, None
            self.change_points += 1

    def params(self) -> TimeModelParams | None:
        """The fitted line, or ``None`` before the first observation."""
        if not self._obs:
            return None
        if self._cache is None:
            self._cache = self._fit()
        return self._cache

    def predict(self, batch_size: float) -> float:
        """Predicted compute seconds for a step of ``batch_size`` samples (``nan`` without data)."""
        p = self.params()
        return float("nan") if p is None else p.predict(batch_size)

    def _fit(self) -> TimeModelParams:
        data = np.asarray(self._obs, dtype=np.float64)
        b, t = data[:, 0], data[:, 1]
        age = np.arange(len(b) - 1, -1, -1, dtype=np.float64)
        w = np.power(0.5, age / self.half_life)
        sizes = np.unique(b)
        med = np.array([_weighted_median(t[b == s], w[b == s]) for s in sizes])
        gw = np.array([w[b == s].sum() for s in sizes])
        current = int(np.argmax(gw))
        # Only groups with real weight inform the slope; a lone last (partial) step of a slightly smaller
        # batch would otherwise fit a wild line through two nearly equal batch sizes.
        solid = gw >= self.min_group_weight
        xs, ys, ws = sizes[solid], med[solid], gw[solid]
        line: TimeModelParams | None = None
        if len(xs) >= 2 and (xs.max() - xs.min()) >= self.min_relative_spread * xs.max():
            xm, ym = np.sum(ws * xs) / ws.sum(), np.sum(ws * ys) / ws.sum()
            sxx = np.sum(ws * (xs - xm) ** 2)
            slope = float(np.sum(ws * (xs - xm) * (ys - ym)) / sxx)
            intercept = float(ym - slope * xm)
            # A line that contradicts the physics (negative cost, or a fixed cost above the observed times)
            # means old groups disagree with recent ones: trust the recent group alone.
            if slope > 0 and 0 <= intercept <= ys.min():
                line = TimeModelParams(intercept, slope)
        b_cur, t_cur = float(sizes[current]), float(max(med[current], 1e-12))
        if line is not None:
            self._intercept_ratio = line.intercept / line.predict(b_cur)
        # Anchor on the group that dominates the recent past (a recent slow-down is reflected in full),
        # keeping the fixed-cost share learned from the last valid line (0 before any: DBS's proportional model).
        ratio = self._intercept_ratio or 0.0
        return TimeModelParams(float(ratio * t_cur), float((1.0 - ratio) * t_cur / b_cur))

    def state_dict(self) -> dict[str, Any]:
        return {
            "half_life": self.half_life,
            "window": self.window,
            "observations": list(self._obs),
            "intercept_ratio": self._intercept_ratio,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.half_life = float(state["half_life"])
        self.window = int(state["window"])
        self._obs = deque((tuple(o) for o in state["observations"]), maxlen=self.window)  # type: ignore[misc]
        self._ratios.clear()
        self._ref, self._since_ref = None, 0
        self._intercept_ratio = state.get("intercept_ratio")
        self._cache = None
