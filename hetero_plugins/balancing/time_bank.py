"""Every rank's online step-time model in arrays: recency-weighted levels per batch size, a pooled fixed cost,
and change points tested against the model's own prediction at any batch size (see
:mod:`hetero_plugins.balancing.time_model`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.balancing.lines import TimeModelLines
from hetero_plugins.balancing.time_block import BLOCK_STEPS, observe_block

__all__ = ["TimeModelBank"]

_MEDIAN_SE = float(np.sqrt(np.pi / 2))  # a median of n normal steps has sqrt(pi / 2) times the mean's standard error


def _pred(y: np.ndarray, b_cur: np.ndarray, kappa: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The level ``y`` at ``b_cur`` extended to ``b`` by the fixed cost ``kappa`` (in samples; inf: constant)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out = y * (kappa + b) / (kappa + b_cur)
    return np.where(np.isinf(kappa), y, out)


class TimeModelBank:
    """The step-time models of ``size`` ranks, updated together (see the module docstring for the model).

    Args:
        size: number of ranks.
        half_life: observations after which an observation's weight has halved (forgetting).
        window: observations after which a batch size's level, if not measured again, is forgotten.
        min_group_weight: recency weight a batch size's level needs to count in the line fit.
        min_relative_spread: the line is fitted only when the batch sizes differ by at least this fraction.
        change_steps: consecutive steps that must deviate the same way before a speed change is declared
            (0 disables the test: every step is added, unclipped).
        change_threshold: relative deviation from the predicted interval of the run's median step that counts
            (0.15: 15% slower, or 1/1.15 faster; each step of the run must deviate by half of it). A 1.3x
            slowdown is found within ``change_steps`` steps under 5% noise, and noise of that size is not
            mistaken for one.
        groups: batch sizes remembered per rank (the lightest is replaced by a new one).

    Example::

        >>> bank = TimeModelBank(2)
        >>> bank.observe(np.array([[32.0] * 4, [32.0] * 4]), np.array([[0.032] * 4, [0.128] * 4]))
        >>> [round(p.predict(64), 3) for p in bank.lines()]
        [0.064, 0.256]
    """

    def __init__(
        self,
        size: int,
        half_life: float = 6.0,
        window: int = 512,
        min_group_weight: float = 2.0,
        min_relative_spread: float = 0.15,
        change_steps: int = 4,
        change_threshold: float = 0.15,
        groups: int = 4,
    ) -> None:
        self.size = check_int("size", size, minimum=0)
        half_life = check_float("half_life", half_life, minimum=0.5,
                                hint="steps after which a measurement's weight halves, e.g. 6 (at least 0.5)")
        self.window = check_int("window", window, minimum=2)
        self.min_group_weight = check_float("min_group_weight", min_group_weight, minimum=0.0)
        self.min_relative_spread = check_float("min_relative_spread", min_relative_spread, minimum=0.0, maximum=1.0)
        self.change_steps = check_int("change_steps", change_steps, minimum=0)
        self.change_threshold = check_float("change_threshold", change_threshold, minimum=0.0, strict_minimum=True)
        self.groups = check_int("groups", groups, minimum=2, hint="a line needs two batch sizes")
        n, g, k = size, self.groups, max(self.change_steps, 1)
        self.half_life = np.full(n, half_life)
        self._lam = np.power(0.5, 1.0 / self.half_life)
        self._forget = np.power(0.5, self.window / self.half_life)
        self._gb = np.zeros((n, g))  # batch size of each level (0: empty)
        self._gy = np.zeros((n, g))  # level: recency-weighted mean of (clipped) step seconds
        self._gw = np.zeros((n, g))  # recency weight
        self._kappa = np.full(n, np.nan)  # fixed cost in samples of the last valid line
        self._klo = np.full(n, np.nan)
        self._khi = np.full(n, np.nan)
        self._kprec = np.zeros(n)  # precision of kappa (pooled over fits)
        self._kbmin = np.full(n, np.inf)  # batch sizes kappa was fitted on
        self._kbmax = np.full(n, -np.inf)
        self._ktick = np.zeros(n)  # observations seen when kappa was last fitted
        self._seen = np.zeros(n)  # observations taken into the model, ever
        self._var = np.full(n, np.nan)  # recency-weighted mean squared log deviation from the level (noise)
        self._nobs = np.zeros(n, dtype=np.int64)  # observations in the current regime
        self._changes = np.zeros(n, dtype=np.int64)
        self._pb = np.zeros((n, k))  # held-back deviating steps
        self._pt = np.zeros((n, k))
        self._np = np.zeros(n, dtype=np.int64)
        self._last_steps = np.zeros(n, dtype=np.int64)  # valid steps of each rank in the last observe call
        self._ps = np.zeros(n, dtype=np.int64)  # their direction (+1 slower, -1 faster)
        self._lines: TimeModelLines | None = None

    # -- options shared by the rows ---------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """The bank-wide options (``half_life`` is per rank)."""
        return {"window": self.window, "min_group_weight": self.min_group_weight,
                "min_relative_spread": self.min_relative_spread, "change_steps": self.change_steps,
                "change_threshold": self.change_threshold, "groups": self.groups}

    @property
    def change_points(self) -> np.ndarray:
        """Speed changes declared so far, per rank."""
        return self._changes.copy()

    # -- reading ---------------------------------------------------------------------------------------

    def _anchor(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per rank: the level and batch size of the dominant group, and whether the rank has any."""
        g = np.argmax(self._gw, axis=1)
        rows = np.arange(self.size)
        return self._gy[rows, g], self._gb[rows, g], self._gw[rows, g] > 0

    def lines(self) -> TimeModelLines:
        """Every rank's fitted line (cached until the next observation)."""
        if self._lines is None:
            y, b_cur, known = self._anchor()
            kappa = np.nan_to_num(self._kappa, nan=0.0)
            with np.errstate(invalid="ignore", divide="ignore"):
                slope = np.where(known, y / (kappa + b_cur), np.nan)
            self._lines = TimeModelLines(np.where(known, kappa * slope, np.nan), slope, known)
        return self._lines

    def measured_max(self) -> np.ndarray:
        """Per rank, the largest batch size its current regime's levels were measured at (0 where none)."""
        if not self.size:
            return np.zeros(0)
        return np.where(self._gw > 0, self._gb, 0.0).max(axis=1)

    def uncertainty(self) -> np.ndarray:
        """Per rank, the relative standard error of the predicted step time: the step-to-step noise (root mean
        squared log deviation from the level) over the square root of the level's recency weight (0 before
        any noise is measured)."""
        y, b_cur, known = self._anchor()
        w = self._gw[np.arange(self.size), np.argmax(self._gw, axis=1)]
        with np.errstate(invalid="ignore", divide="ignore"):
            se = np.sqrt(self._var) / np.sqrt(np.maximum(w, 1.0))
        return np.where(known & np.isfinite(se), se, 0.0)

    def extrapolation_limits(self, tolerance: float) -> np.ndarray:
        """Per rank, the largest batch size at which its fitted line and the proportional model through the level
        of the largest size it has measured (no fixed cost beyond it) disagree by at most ``tolerance`` (0.5:
        the proportional model predicts at most 1.5x the line's time); ``inf`` where that holds at every size or
        there is no line.

        Beyond the sizes it was measured at, a line's fixed cost is an economy of scale nobody has seen: a
        saturation plateau at small batches fits a nearly flat line, which prices any batch as almost free. With
        ``phi`` the fixed share of the step at the largest measured size ``b``, the two models disagree by
        ``g / (1 + (1 - phi) (g - 1))`` at ``g * b``, so the limit is ``b (1 + tol) phi / ((1 + tol) phi - tol)``
        where ``(1 + tol) phi > tol`` (a flat line: ``(1 + tol) b``).

        Example::

            >>> bank = TimeModelBank(1)
            >>> bank.observe(np.array([[16.0, 32.0] * 8]), np.array([[0.1, 0.1008] * 8]))  # flat: a plateau
            >>> int(bank.extrapolation_limits(0.5)[0])
            48
        """
        tol = check_float("tolerance", tolerance, minimum=0.0, hint="e.g. 1.0, or no limit")
        lines = self.lines()
        big = self.measured_max()
        ok = np.asarray(lines.known) & (big > 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            kappa = np.where(ok, lines.intercept / lines.slope, 0.0)
            phi = np.where(ok & np.isfinite(kappa), kappa / (kappa + big), 0.0)
            room = (1.0 + tol) * phi - tol
            factor = np.where(room > 0, (1.0 + tol) * phi / np.where(room > 0, room, 1.0), np.inf)
        return np.where(ok & np.isfinite(factor), np.floor(big * factor + 1e-9), np.inf)

    def _band(self, rows: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The interval of predicted seconds at batch ``b`` for ``rows`` (``nan`` without a model)."""
        g = np.argmax(self._gw[rows], axis=1)
        y, b_cur, w = self._gy[rows, g], self._gb[rows, g], self._gw[rows, g]
        known = ~np.isnan(self._klo[rows])
        klo = np.where(known, self._klo[rows], 0.0)
        khi = np.where(known, self._khi[rows], np.inf)
        if b.ndim == 2:
            y, b_cur, w, klo, khi = y[:, None], b_cur[:, None], w[:, None], klo[:, None], khi[:, None]
        p1, p2 = _pred(y, b_cur, klo, b), _pred(y, b_cur, khi, b)
        lo, hi = np.minimum(p1, p2), np.maximum(p1, p2)
        empty = w <= 0
        return np.where(empty, np.nan, lo), np.where(empty, np.nan, hi)

    # -- learning --------------------------------------------------------------------------------------

    def observe(self, batch_sizes: Any, seconds: Any, rows: Any = None) -> None:
        """Learn from steps: ``batch_sizes`` and ``seconds`` of shape ``(ranks, steps)`` (or ``(ranks,)`` for
        one step), for all ranks or for ``rows``. Steps with a batch size <= 0 or a time that is negative or
        not finite carry no information and are skipped."""
        rows_all = np.arange(self.size) if rows is None else self._rows("rows", rows)
        b = np.asarray(batch_sizes, dtype=np.float64)
        t = np.asarray(seconds, dtype=np.float64)
        if b.ndim == 1:
            b, t = b[:, None], t[:, None]
        if b.shape != t.shape or b.shape[0] != len(rows_all):
            raise ValueError(
                f"`batch_sizes` and `seconds` must both have shape (ranks={len(rows_all)}, steps), got {b.shape} and "
                f"{t.shape}. HINT: pass one row per rank."
            )
        with np.errstate(invalid="ignore"):
            valid = (b > 0) & np.isfinite(t) & (t >= 0)
        self._lam = np.power(0.5, 1.0 / self.half_life)  # per observation
        self._forget = np.power(0.5, self.window / self.half_life)
        self._last_steps[rows_all] = valid.sum(axis=1)
        if self.change_steps == 0 or b.shape[1] < 2:
            self._observe_steps(rows_all, b, t, valid)
            return
        for start in range(0, b.shape[1], BLOCK_STEPS):
            bb, tb, vb = (x[:, start:start + BLOCK_STEPS] for x in (b, t, valid))
            # One batch size (held-back steps included) and only valid steps: the block update; otherwise step
            # by step.
            held = np.arange(self._pb.shape[1])[None, :] < self._np[rows_all][:, None]
            block = vb.all(axis=1) & (bb == bb[:, :1]).all(axis=1) & (~held | (self._pb[rows_all] == bb[:, :1])).all(
                axis=1)
            if block.any():
                observe_block(self, rows_all[block], bb[block, 0], tb[block])
            if not block.all():
                rest = ~block
                self._observe_steps(rows_all[rest], bb[rest], tb[rest], vb[rest])

    def _observe_steps(self, rows_all: np.ndarray, b: np.ndarray, t: np.ndarray, valid: np.ndarray) -> None:
        """The step-by-step update (one step of every rank at a time)."""
        for j in range(b.shape[1]):
            ok = valid[:, j]
            if not ok.any():
                continue
            r = rows_all[ok]
            self._step(r, b[ok, j], t[ok, j])
            # Refit where two batch sizes are solid now: an older size's level fades within a few half-lives.
            solid = ((self._gw[r] >= max(self.min_group_weight, 1e-12)) & (self._gb[r] > 0)).sum(axis=1) >= 2
            if solid.any():
                self._refit(r[solid])
            self._lines = None

    def _step(self, rows: np.ndarray, b: np.ndarray, t: np.ndarray) -> None:
        k, tau = self.change_steps, self.change_threshold
        if k == 0:
            self._commit(rows, b, t, clip=False)
            return
        lo, hi = self._band(rows, b)
        half = 1 + tau / 2
        with np.errstate(invalid="ignore"):
            dev = np.where(t > hi * half, 1, np.where(t < lo / half, -1, 0))
        pend, sign = self._np[rows], self._ps[rows]
        flush = (pend > 0) & (dev != sign)  # the run is broken: its steps were transient
        if flush.any():
            self._flush(rows[flush])
        hold = dev != 0
        if hold.any():
            r = rows[hold]
            slot = self._np[r]
            self._pb[r, slot], self._pt[r, slot] = b[hold], t[hold]
            self._np[r] += 1
            self._ps[r] = dev[hold]
            full = r[self._np[r] >= k]
            if len(full):
                # A run of k steps each beyond the interval by half the threshold: a change when the median
                # step is beyond it by the whole threshold; otherwise the oldest step is let go (clipped).
                plo, phi = self._band(full, self._pb[full, :k])
                pt = self._pt[full, :k]
                ratio = np.where(self._ps[full][:, None] > 0, pt / phi, plo / pt)
                change = np.median(ratio, axis=1) > 1 + tau
                if change.any():
                    self._restart(full[change])
                slide = full[~change]
                if len(slide):
                    self._commit(slide, self._pb[slide, 0], self._pt[slide, 0], clip=True)
                    self._pb[slide, :-1], self._pt[slide, :-1] = self._pb[slide, 1:], self._pt[slide, 1:]
                    self._np[slide] -= 1
        if (~hold).any():
            self._commit(rows[~hold], b[~hold], t[~hold], clip=False)

    def _flush(self, rows: np.ndarray) -> None:
        """Add the held-back steps of ``rows`` (a broken run: transient), each clipped to the interval."""
        for j in range(int(self._np[rows].max())):
            r = rows[self._np[rows] > j]
            self._commit(r, self._pb[r, j], self._pt[r, j], clip=True)
        self._np[rows] = 0
        self._ps[rows] = 0

    def _commit(self, rows: np.ndarray, b: np.ndarray, t: np.ndarray, clip: bool) -> None:
        if clip:
            lo, hi = self._band(rows, b)
            tau = self.change_threshold
            t = np.where(np.isnan(lo), t, np.clip(t, lo / (1 + tau), hi * (1 + tau)))
        sel: Any = slice(None) if len(rows) == self.size else rows  # all ranks: views, no gathers
        lam = self._lam[sel]
        gw = self._gw[sel] * lam[:, None]
        gb = self._gb[sel]
        gy = self._gy[sel]
        match = (gb == b[:, None]) & (gb > 0)
        has = match.any(axis=1)
        slot = np.where(has, np.argmax(match, axis=1), np.argmin(np.where(gb > 0, gw, -1.0), axis=1))
        idx = np.arange(len(rows))
        if not has.all():
            new = ~has
            gw[idx[new], slot[new]] = 0.0
            gy[idx[new], slot[new]] = 0.0
            gb[idx[new], slot[new]] = b[new]
        w = gw[idx, slot]
        y = gy[idx, slot]
        seen = has & (w >= 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            r2 = np.log(t / y) ** 2
        r2 = np.where(seen & np.isfinite(r2), r2, np.nan)
        v = self._var[sel]
        self._var[sel] = np.where(np.isnan(r2), v, np.where(np.isnan(v), r2, lam * v + (1 - lam) * r2))
        gy[idx, slot] = (w * y + t) / (w + 1.0)
        gw[idx, slot] = w + 1.0
        gone = gw < self._forget[sel][:, None]
        if gone.any():
            gw[gone], gy[gone], gb[gone] = 0.0, 0.0, 0.0
        self._gb[sel], self._gy[sel], self._gw[sel] = gb, gy, gw
        self._nobs[sel] += 1
        self._seen[sel] += 1

    def settle(self, min_steps: int = 3) -> None:
        """At a decision boundary, take a held-back run of at least ``min_steps`` steps that spans every step of
        the last :meth:`observe` call (an epoch of fewer than ``change_steps + 1`` steps that deviated
        throughout) as a change now, so it counts for this decision instead of the next. In longer epochs a
        run completes (or breaks) within the epoch and nothing is settled early."""
        rows = np.flatnonzero((self._np >= max(1, min_steps)) & (self._np >= self._last_steps))
        if len(rows):
            self._restart(rows)
            self._refit(rows)
            self._lines = None

    def forget_levels(self, rows: Sequence[int]) -> None:
        """Forget the measured levels of ``rows`` and anything held back on them: a speed change known from
        outside to start now (a co-runner arriving or leaving, announced by the scheduler), so that the next
        steps start the new regime's line instead of being fitted with the old regime's. The fixed cost
        ``kappa`` stays, as at a detected change inside its fitted range (a slowdown scales a fixed cost and a
        per-sample cost alike), and the rank's line is fitted afresh from the new regime's steps."""
        r = np.unique(self._rows("rows", rows))
        if len(r) == 0:
            return
        self._gb[r], self._gy[r], self._gw[r] = 0.0, 0.0, 0.0
        self._klo[r], self._khi[r] = np.nan, np.nan
        self._np[r], self._ps[r], self._nobs[r] = 0, 0, 0
        self._lines = None

    def mark_predicted(self, rows: Sequence[int]) -> None:
        """The levels of ``rows`` are a prediction (a seeded line's noise-free points), not measurements: their
        noise is unknown rather than zero, and their fixed cost is as precise as one fit of levels that each err
        by a third of the change threshold, about an epoch's measurements. Noise-free points would otherwise give
        the predicted fixed cost a precision that no measured fit outweighs, so a rank's own levels could never
        reshape a predicted line: a slot priced on its device's line, whose saturation plateau none of its
        measured ranks had reached, kept the line's slope for every later fit of the moved rank, and each level
        measured on the plateau read as a change point."""
        r = np.unique(self._rows("rows", rows))
        if len(r) == 0:
            return
        self._var[r] = np.nan
        self._kappa[r], self._kprec[r] = np.nan, 0.0
        self._klo[r], self._khi[r] = np.nan, np.nan
        self._kbmin[r], self._kbmax[r] = np.inf, -np.inf
        self._refit(r)
        self._lines = None

    def _rows(self, name: str, rows: Any) -> np.ndarray:
        """``rows`` as an array of rank indices in ``[0, size)``, else a ``ValueError`` naming ``name``."""
        r = np.asarray(rows).ravel()
        if r.size and (not np.issubdtype(r.dtype, np.integer) or r.min() < 0 or r.max() >= self.size):
            raise ValueError(f"`{name}`={r.tolist()} must be ranks (ints) in [0, {self.size}). HINT: pass rank "
                             "indices.")
        return r.astype(np.int64)

    def drift(self, b: np.ndarray, t: np.ndarray, tolerance: float, z: float = 2.5) -> np.ndarray:
        """Per rank, whether steps ``(b, t)`` (shape ``(size, steps)``, not yet observed) ran off the level already
        measured at their batch size: +1 slower, -1 faster, 0 not. Off means the median log ratio of step time to
        level beyond ``log(1 + tolerance)`` and ``z`` standard errors (the level's and the median's, from the
        rank's measured noise). Only steps at a measured batch size count, so a line extrapolated to a new size is
        not judged: this is drift at an unchanged batch (a load ramping up or down), which the recency-weighted
        levels follow only slowly.

        Example::

            >>> bank = TimeModelBank(2)
            >>> bank.observe(np.full((2, 8), 32.0), np.full((2, 8), 0.1))
            >>> bank.drift(np.full((2, 4), 32.0), np.array([[0.1] * 4, [0.13] * 4]), tolerance=0.03).tolist()
            [0, 1]
        """
        b, t = np.asarray(b, dtype=np.float64), np.asarray(t, dtype=np.float64)
        match = (b[:, :, None] == self._gb[:, None, :]) & (self._gw[:, None, :] > 0) & (b[:, :, None] > 0)
        level = np.where(match, self._gy[:, None, :], 0.0).sum(axis=2)  # at most one group matches a size
        ok = match.any(axis=2) & np.isfinite(t) & (t > 0) & (level > 0)
        n = ok.sum(axis=1)
        ratio = np.where(ok, np.log(np.where(ok, t, 1.0) / np.where(ok, level, 1.0)), np.nan)
        off = np.zeros(self.size)
        if (n > 0).any():
            off[n > 0] = np.nanmedian(ratio[n > 0], axis=1)
        noise = np.sqrt(np.nan_to_num(self._var, nan=0.0))
        se = np.sqrt(self.uncertainty() ** 2 + (_MEDIAN_SE * noise) ** 2 / np.maximum(n, 1))
        return np.where((n > 0) & (np.abs(off) > np.maximum(np.log1p(tolerance), z * se)), np.sign(off), 0.0
                        ).astype(np.int64)

    def _held(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The held-back steps of ``rows`` (``nan`` past each row's run) and which entries hold one."""
        valid = np.arange(self._pb.shape[1])[None, :] < self._np[rows][:, None]
        return np.where(valid, self._pb[rows], np.nan), np.where(valid, self._pt[rows], np.nan), valid

    def _restart(self, rows: np.ndarray) -> None:
        """A change point on ``rows``: forget the old regime, restart from the held-back run."""
        pb, pt, valid = self._held(rows)
        m = self._np[rows].copy()
        counted = self._nobs[rows] >= self.change_steps  # a model younger than one run was wrong from its start
        self._changes[rows[counted]] += 1
        self._gb[rows], self._gy[rows], self._gw[rows] = 0.0, 0.0, 0.0
        # kappa stays for the prediction (a slowdown scales a fixed cost and a per-sample cost alike) when the
        # change was found between the batch sizes it was fitted on, where its error is small; found outside,
        # the deviation may be kappa's own error (a line fitted across a change that a plan change hid), so it
        # goes. A kept kappa keeps its precision: the new regime's lines pool with it, so that a line fitted
        # across a slow ramp (a small batch measured as slow as a large one) cannot replace it alone. Until the
        # new regime's first line the change test does not lean on it.
        with np.errstate(invalid="ignore"):
            inside = np.all(~valid | ((pb >= self._kbmin[rows][:, None]) & (pb <= self._kbmax[rows][:, None])), axis=1)
        self._kappa[rows[~inside]] = np.nan
        self._kprec[rows[~inside]] = 0.0
        self._klo[rows], self._khi[rows] = np.nan, np.nan
        age = m[:, None] - 1 - np.arange(pb.shape[1])[None, :]
        age_w = np.where(valid, np.power(self._lam[rows][:, None], np.maximum(age, 0)), 0.0)
        same = np.all(~valid | (pb == pb[:, :1]), axis=1)
        if same.any():
            self._gb[rows[same], 0] = pb[same, 0]
            self._gy[rows[same], 0] = np.nanmedian(pt[same], axis=1)
            self._gw[rows[same], 0] = age_w[same].sum(axis=1)
        for i in np.flatnonzero(~same):  # a run across a plan change: one level per batch size
            for g, size in enumerate(np.unique(pb[i][valid[i]])[-self.groups:]):
                sel = valid[i] & (pb[i] == size)
                self._gb[rows[i], g], self._gy[rows[i], g] = size, np.median(pt[i, sel])
                self._gw[rows[i], g] = age_w[i, sel].sum()
        self._nobs[rows] = m
        self._seen[rows] += m
        self._np[rows] = 0
        self._ps[rows] = 0

    def _refit(self, rows: np.ndarray) -> None:
        """Weighted least squares through the solid levels; a valid line updates ``kappa`` and its interval."""
        gb, gy, gw = self._gb[rows], self._gy[rows], self._gw[rows]
        solid = (gw >= max(self.min_group_weight, 1e-12)) & (gb > 0)
        ws = np.where(solid, gw, 0.0)
        n_solid = solid.sum(axis=1)
        big = np.where(solid, gb, -np.inf).max(axis=1)
        small = np.where(solid, gb, np.inf).min(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = (n_solid >= 2) & (big - small >= self.min_relative_spread * big)
            wsum = ws.sum(axis=1)
            xm = (ws * gb).sum(axis=1) / wsum
            ym = (ws * gy).sum(axis=1) / wsum
            sxx = (ws * (gb - xm[:, None]) ** 2).sum(axis=1)
            slope = (ws * (gb - xm[:, None]) * (gy - ym[:, None])).sum(axis=1) / sxx
            intercept = ym - slope * xm
            y_min = np.where(solid, gy, np.inf).min(axis=1)
            # A line that contradicts the physics (negative cost, or a fixed cost above the observed times)
            # means old levels disagree with recent ones: keep the last valid kappa.
            ok &= (slope > 0) & (intercept >= 0) & (intercept <= y_min)
            if not ok.any():
                return
            r = rows[ok]
            s, a, b1, b2 = slope[ok], intercept[ok], small[ok], big[ok]
            y1, y2 = a + s * b1, a + s * b2

            def kap(z1: np.ndarray, z2: np.ndarray) -> np.ndarray:
                return np.where(z2 > z1, np.maximum((z1 * b2 - z2 * b1) / (z2 - z1), 0.0), np.inf)

            # This fit's kappa and its variance, from the standard errors of the two end levels (the noise
            # over the square root of their weights); pooled with the earlier fits' by precision, the older
            # ones forgotten like observations. A fit from a young level counts little.
            u = self.change_threshold / 3.0
            sd = np.sqrt(self._var[r])
            sd = np.where(np.isfinite(sd), sd, u)
            w1 = np.where(gb[ok] == b1[:, None], gw[ok], 0.0).max(axis=1)
            w2 = np.where(gb[ok] == b2[:, None], gw[ok], 0.0).max(axis=1)
            k_fit = a / s
            var = ((kap(y1 * (1 + sd / np.sqrt(w1)), y2) - k_fit) ** 2
                   + (kap(y1, y2 * (1 + sd / np.sqrt(w2))) - k_fit) ** 2)
            prec = 1.0 / np.maximum(var, 1e-12 * (1.0 + k_fit) ** 2)
            prec = np.where(np.isfinite(prec), prec, 0.0)
            lam = np.power(0.5, (self._seen[r] - self._ktick[r]) / self.half_life[r])
            old_prec = np.where(np.isnan(self._kappa[r]), 0.0, self._kprec[r] * lam)
            total = old_prec + prec
            # A fit without precision (its ends within noise of each other) replaces no kappa.
            kept = np.where(np.isnan(self._kappa[r]), k_fit, self._kappa[r])
            pooled = np.where(total > 0, (np.nan_to_num(self._kappa[r]) * old_prec + k_fit * prec) / np.where(
                total > 0, total, 1.0), kept)
            self._kappa[r], self._kprec[r], self._ktick[r] = pooled, total, self._seen[r]
            fresh = old_prec <= 0
            self._kbmin[r] = np.where(fresh, b1, np.minimum(self._kbmin[r], b1))
            self._kbmax[r] = np.where(fresh, b2, np.maximum(self._kbmax[r], b2))
            # kappa's interval for the change test: the line's ends moved apart or together by a third of the
            # change threshold.
            z1, z2 = pooled + b1, pooled + b2
            self._klo[r] = kap(z1 * (1 - u), z2 * (1 + u))
            self._khi[r] = kap(z1 * (1 + u), z2 * (1 - u))

    # -- rows ------------------------------------------------------------------------------------------

    _ROW_ARRAYS = ("half_life", "_gb", "_gy", "_gw", "_kappa", "_klo", "_khi", "_kprec", "_kbmin", "_kbmax", "_ktick",
                   "_seen", "_var", "_nobs", "_changes", "_pb", "_pt", "_np", "_ps", "_last_steps")

    def copy_row(self, source: TimeModelBank, src: int, dst: int) -> None:
        """Make row ``dst`` a copy of ``source``'s row ``src`` (same options required)."""
        if source.options() != self.options():
            diff = {k: (v, self.options()[k]) for k, v in source.options().items() if self.options()[k] != v}
            raise ValueError(
                f"a time model with options {diff} (theirs, ours) cannot join this planner's models. HINT: create "
                "it with the planner's options, e.g. LinearTimeModel(half_life=planner.models[0].half_life)."
            )
        for name in self._ROW_ARRAYS:
            getattr(self, name)[dst] = getattr(source, name)[src]
        self._lines = None

    def row_state(self, i: int) -> dict[str, Any]:
        """Row ``i`` as plain data (for checkpoints)."""
        used = self._gb[i] > 0
        k = int(self._np[i])
        return {
            "format": 2,
            "half_life": float(self.half_life[i]),
            "window": self.window,
            # What was observed, per batch size: the size, the recency-weighted level of the step seconds, and
            # its weight (earlier versions kept the raw observations under this key, as [size, seconds]).
            "observations": [[float(b), float(y), float(w)] for b, y, w in zip(self._gb[i][used], self._gy[i][used],
                                                                               self._gw[i][used])],
            "kappa": None if np.isnan(self._kappa[i]) else float(self._kappa[i]),
            "kappa_interval": None if np.isnan(self._klo[i]) else [float(self._klo[i]), float(self._khi[i])],
            "kappa_precision": [float(self._kprec[i]), float(self._ktick[i]), float(self._seen[i])],
            "kappa_sizes": [float(self._kbmin[i]), float(self._kbmax[i])],
            "noise": None if np.isnan(self._var[i]) else float(self._var[i]),
            "observations_in_regime": int(self._nobs[i]),
            "change_points": int(self._changes[i]),
            "held_back": [[float(self._pb[i, j]), float(self._pt[i, j])] for j in range(k)],
            "held_back_sign": int(self._ps[i]),
            # Valid steps of the last observe call: settle() reads it at the next decision (a resume in between).
            "last_steps": int(self._last_steps[i]),
        }

    def load_row(self, i: int, state: dict[str, Any]) -> None:
        """Restore row ``i`` from :meth:`row_state` (or from the observation list of earlier versions)."""
        self._clear(i)
        self.half_life[i] = float(state["half_life"])
        if state.get("format", 1) < 2:  # earlier format: replay the kept observations
            obs = np.asarray(state["observations"], dtype=np.float64).reshape(-1, 2)
            for b, t in obs:
                self.observe(np.array([b]), np.array([t]), rows=[i])
            ratio = state.get("intercept_ratio")
            if ratio and np.isnan(self._kappa[i]) and self._gw[i].max() > 0 and ratio < 1:
                b_cur = self._gb[i, int(np.argmax(self._gw[i]))]
                self._kappa[i] = ratio * b_cur / (1 - ratio)
                self._klo[i] = self._khi[i] = self._kappa[i]
            self._lines = None
            return
        for g, (b, y, w) in enumerate(state["observations"][: self.groups]):
            self._gb[i, g], self._gy[i, g], self._gw[i, g] = b, y, w
        if state.get("kappa") is not None:
            self._kappa[i] = state["kappa"]
            # No interval with a kappa: a change point kept kappa and the new regime has no line yet.
            self._klo[i], self._khi[i] = state.get("kappa_interval") or (np.nan, np.nan)
            self._kprec[i], self._ktick[i], self._seen[i] = state.get("kappa_precision", (0.0, 0.0, 0.0))
            self._kbmin[i], self._kbmax[i] = state.get("kappa_sizes", (np.inf, -np.inf))
        if state.get("noise") is not None:
            self._var[i] = state["noise"]
        self._nobs[i] = int(state.get("observations_in_regime", 0))
        self._changes[i] = int(state.get("change_points", 0))
        held = state.get("held_back", [])[: self._pb.shape[1]]
        for j, (b, t) in enumerate(held):
            self._pb[i, j], self._pt[i, j] = b, t
        self._np[i] = len(held)
        self._ps[i] = int(state.get("held_back_sign", 0))
        # Earlier checkpoints lack it: never settle their held-back run early (a run must span the last call).
        self._last_steps[i] = int(state.get("last_steps", len(held) + 1))
        self._lines = None

    def _clear(self, i: int) -> None:
        for name in ("_gb", "_gy", "_gw", "_pb", "_pt", "_kprec", "_ktick", "_seen"):
            getattr(self, name)[i] = 0.0
        for name in ("_kappa", "_klo", "_khi", "_var"):
            getattr(self, name)[i] = np.nan
        self._kbmin[i], self._kbmax[i] = np.inf, -np.inf
        for name in ("_nobs", "_changes", "_np", "_ps", "_last_steps"):
            getattr(self, name)[i] = 0
        self._lines = None
