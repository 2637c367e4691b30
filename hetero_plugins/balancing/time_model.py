"""Per-rank step-time models t_i(b) = a_i + beta_i * b, fitted online and robustly, with change points.

A rank's compute time per step grows about linearly with its local batch: a fixed cost a (kernel launches,
optimizer, Python) plus a per-sample cost beta. LBB fits exactly this line for online coordination (Yao et
al. 2024), DBS/DLB use its special case a = 0 (speed = samples / time; Ye et al. 2020, 2022).

Robustness and forgetting: each batch size seen keeps a recency-weighted level (weights halve every
``half_life`` observations) of the step times measured at that size, and the line is a weighted least-squares
fit through the levels, made only when the batch sizes differ enough to tell a fixed cost from a per-sample
cost. What the line contributes is its fixed cost in samples, ``kappa = a / beta``: it does not change when
the rank slows down or speeds up as a whole (another job on its GPU scales both), so the prediction is the
level of the size that dominates the recent past, extended by ``kappa`` (``kappa = 0``, DBS's proportional
model, before any line).

Change points (in the spirit of the run-length test of Greyhound's Bayesian online change-point detection,
Adams & MacKay 2007): every step is compared with the model's *own* prediction at that step's batch size,
whether or not that size was seen before. The prediction is an interval: where ``kappa`` is known it is the
line (widened by what a few percent of noise in the levels allows ``kappa`` to be), where it is not, anything
between the proportional and the constant extrapolation from the current level. A step more than half of
``change_threshold`` outside it deviates and is held back from the model; when ``change_steps`` consecutive
steps deviate the same way and their median is more than ``change_threshold`` outside, the rank's speed has
changed: the model forgets the old regime and restarts from those steps alone (``kappa`` kept for the
prediction, replaced by the new regime's first line, and not relied on by the change test until then). A shorter run
(a transient stall) is then added with each step clipped to ``change_threshold`` outside the interval, so a
stall moves the model little.

:class:`TimeModelBank` holds the models of many ranks in arrays and updates them all at once (a planner for
1024 ranks learns an epoch in a few vectorised passes per step); :class:`LinearTimeModel` is one rank's
model, standalone or a view of one row of a bank.
"""


from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_plugins.balancing.lines import TimeModelLines, TimeModelParams
from hetero_plugins.balancing.time_bank import TimeModelBank

__all__ = ["LinearTimeModel", "TimeModelBank", "TimeModelLines", "TimeModelParams"]


class LinearTimeModel:
    """Online, noise-robust fit of one rank's compute time per step against its local batch size.

    One rank's row of a :class:`TimeModelBank` (its own, or a planner's: ``planner.models[r]``); a deep copy
    is a standalone model.

    Args:
        half_life: number of observations after which an observation's weight has halved (forgetting).
        window: observations after which a batch size not measured again is forgotten.
        min_group_weight: recency weight a batch size's level needs to count in the line fit.
        min_relative_spread: the line is fitted only when the batch sizes differ by at least this fraction.
        change_steps: a speed change is declared after this many consecutive steps deviate from the model's
            prediction the same way, at any batch size (0 disables); the model then keeps only those steps.
        change_threshold: relative deviation of the run's median step from the predicted interval that counts
            (0.15: 15% slower, or 1/1.15 faster; each step must deviate by half of it).

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
        change_threshold: float = 0.15,
    ) -> None:
        self._bank = TimeModelBank(1, half_life, window, min_group_weight, min_relative_spread, change_steps,
                                   change_threshold)
        self._row = 0

    @classmethod
    def _view(cls, bank: TimeModelBank, row: int) -> LinearTimeModel:
        view = cls.__new__(cls)
        view._bank, view._row = bank, int(row)
        return view

    def __deepcopy__(self, memo: dict[int, Any]) -> LinearTimeModel:
        bank = TimeModelBank(1, float(self.half_life), **self._bank.options())
        bank.copy_row(self._bank, self._row, 0)
        return LinearTimeModel._view(bank, 0)

    def __copy__(self) -> LinearTimeModel:
        return self.__deepcopy__({})

    @property
    def half_life(self) -> float:
        return float(self._bank.half_life[self._row])

    @property
    def window(self) -> int:
        return self._bank.window

    @property
    def change_steps(self) -> int:
        return self._bank.change_steps

    @property
    def change_threshold(self) -> float:
        return self._bank.change_threshold

    @property
    def min_group_weight(self) -> float:
        return self._bank.min_group_weight

    @property
    def min_relative_spread(self) -> float:
        return self._bank.min_relative_spread

    @property
    def change_points(self) -> int:
        """Speed changes declared so far."""
        return int(self._bank._changes[self._row])

    def __len__(self) -> int:
        """Observations of the current regime taken into the model (held-back steps included)."""
        return int(self._bank._nobs[self._row] + self._bank._np[self._row])

    @classmethod
    def from_params(cls, params: TimeModelParams, batch_size: int, **kwargs: Any) -> LinearTimeModel:
        """A model that starts from a predicted line, for a rank with no history (a new node, a relocated rank).

        The line enters as four noise-free observations at ``batch_size`` and at 60% of it, so it has the
        weight of a few steps: measured steps replace it within a half-life, and a prediction more than
        ``change_threshold`` off is dropped after ``change_steps`` steps by the change-point test. Its fixed cost
        (the intercept-to-slope ratio) is held only as firmly as one fit of measured levels
        (:meth:`TimeModelBank.mark_predicted`), so a prediction off by less than the threshold is reshaped by the
        rank's own measurements instead of being kept for good.

        Example::

            >>> m = LinearTimeModel.from_params(TimeModelParams(0.01, 0.002), 32)
            >>> round(m.predict(64), 6)
            0.138
        """
        model = cls(**kwargs)
        hi = max(2, int(batch_size))
        lo = max(1, min(hi - 1, int(round(0.6 * hi))))
        sizes = np.array([lo, hi] * 4, dtype=np.float64)
        model._bank.observe(sizes[None, :], np.array([params.predict(b) for b in sizes])[None, :])
        model._bank.mark_predicted([model._row])
        return model

    def observe(self, batch_size: float, seconds: float) -> None:
        """Record that a step with ``batch_size`` local samples took ``seconds`` of compute."""
        self._bank.observe(np.array([float(batch_size)]), np.array([float(seconds)]), rows=[self._row])

    def params(self) -> TimeModelParams | None:
        """The fitted line, or ``None`` before the first observation."""
        return self._bank.lines()[self._row]

    def predict(self, batch_size: float) -> float:
        """Predicted compute seconds for a step of ``batch_size`` samples (``nan`` without data)."""
        p = self.params()
        return float("nan") if p is None else p.predict(batch_size)

    def state_dict(self) -> dict[str, Any]:
        return self._bank.row_state(self._row)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bank.load_row(self._row, state)


def _bank_of(models: Sequence[LinearTimeModel], template: TimeModelBank | None = None) -> TimeModelBank:
    """A new bank holding copies of ``models`` (the options of the first, or of ``template``)."""
    opts = (template or (models[0]._bank if models else TimeModelBank(0))).options()
    half = float(models[0].half_life) if models else 6.0
    bank = TimeModelBank(len(models), half, **opts)
    for i, m in enumerate(models):
        bank.copy_row(m._bank, m._row, i)
    return bank


class ModelList(list):  # type: ignore[type-arg]
    """A planner's per-rank models: views of its bank; assigning a model to an entry copies it in."""

    def __init__(self, bank: TimeModelBank) -> None:
        super().__init__(LinearTimeModel._view(bank, i) for i in range(bank.size))
        self._bank = bank

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelList:
        # Views of the copied bank (the same copy as the planner's own, through ``memo``): copying each view
        # would give every rank a standalone model that the copy's observations never reach.
        out = ModelList(copy.deepcopy(self._bank, memo))
        memo[id(self)] = out
        return out

    def __setitem__(self, i: Any, model: Any) -> None:
        if isinstance(i, slice):
            raise TypeError("assign the planner's models one rank at a time, or set `planner.models` to a new list")
        if not isinstance(model, LinearTimeModel):
            raise ValueError(f"`models[{i}]` must be a LinearTimeModel, got {type(model).__name__}. HINT: use "
                             "LinearTimeModel(...) or BalancePlanner.seed_model.")
        row = range(self._bank.size)[i]
        snapshot = copy.deepcopy(model)
        self._bank.copy_row(snapshot._bank, 0, row)
        super().__setitem__(row, LinearTimeModel._view(self._bank, row))

