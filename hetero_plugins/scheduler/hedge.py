"""Hedging an uncertain slowdown correction: plan a corrected rank at the quantile of its time that minimises the
expected makespan.

A rank whose co-runner changes at an epoch boundary has its line scaled by a predicted ratio (the NCF's) that
errs, and the two ways of erring cost unequally. A rank handed too many samples is the straggler every rank waits
for; one handed too few idles while the rest share its samples. With rank ``i``'s step ``X s_i b`` (``X`` the
correction, uncertain) against the other ranks' common finish ``s_rest (B - b)``, the expected makespan is least
where ``P(S) E[X | S] s_i = (1 - P(S)) s_rest``, ``S`` the event that rank ``i`` is the straggler (the newsvendor's
critical fractile, weighted by what a late sample costs). For ``X = f exp(sigma Z)``, ``Z`` standard normal, and a
plan on ``f exp(sigma z)`` this reads ``exp(sigma^2 / 2) (1 - Phi(z - sigma)) = r Phi(z)``, where ``r`` is the
rank's throughput over the rest's under the point plan: one root ``z``, found by bisection. A small rank is
planned at a high quantile of its slowdown, one carrying most of the work near or below the median. Ranks whose
changes share a key (device type, old and new co-runner) err together, since the error is that device's
sensitivity to that co-runner, so they form one group with their summed share.

The error is taken log-normal with a spread proportional to the size of the correction (``sigma = spread *
|log f|``): a device's sensitivity scales the whole slowdown, so a ratio near 1 is nearly certain and a 2.5x one
is not. A correction that speeds a rank up (``f < 1``, a co-runner leaving) is never hedged past 1: it is known
not to slow the rank.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from statistics import NormalDist

import numpy as np

from hetero_plugins._validation import check_float

__all__ = ["corunner_groups", "critical_z", "hedged_factors", "throughput_shares"]

_NORMAL = NormalDist()


def hedged_factors(factors: np.ndarray, shares: np.ndarray, groups: Sequence[Hashable] | None, spread: float,
                   max_z: float = 3.0) -> np.ndarray:
    """Each rank's correction ``factors`` moved to the quantile of its group's time that minimises the expected
    makespan (module docstring); ranks with factor 1 (no change) are left alone.

    Args:
        factors: per-rank multipliers of the fitted lines (1: no correction).
        shares: per-rank share of the cluster's throughput under the plan the point corrections give (sums to 1).
        groups: per-rank key of ranks whose corrections err together (``None``: each rank alone).
        spread: standard deviation of the log error per unit of ``|log factor|`` (0: no hedge).
        max_z: the largest number of standard deviations a correction is moved by.

    Example::

        >>> hedged_factors(np.array([1.0, 2.0, 0.5]), np.array([0.5, 0.1, 0.4]), None, 0.2).round(3).tolist()
        [1.0, 2.433, 0.524]
    """
    spread = check_float("spread", spread, minimum=0.0, hint="e.g. 0.2 (20% of the log ratio), or 0 for no hedge")
    f = np.asarray(factors, dtype=np.float64)
    out = f.copy()
    changed = np.isfinite(f) & (f > 0) & (f != 1.0)
    if spread == 0 or not changed.any():
        return out
    keys = list(range(len(f))) if groups is None else list(groups)
    share = np.asarray(shares, dtype=np.float64)
    members: dict[Hashable, list[int]] = {}
    for i in np.flatnonzero(changed):
        members.setdefault(keys[i], []).append(int(i))
    for idx in members.values():
        g = float(np.clip(np.nansum(share[idx]), 1e-12, 1.0 - 1e-12))
        sigma = spread * float(np.mean(np.abs(np.log(f[idx]))))
        z = float(np.clip(critical_z(sigma, g / (1.0 - g)), -max_z, max_z))
        moved = f[idx] * np.exp(z * sigma)
        out[idx] = np.where(f[idx] < 1.0, np.minimum(moved, 1.0), moved)
    return out


def critical_z(sigma: float, ratio: float) -> float:
    """The root ``z`` of ``exp(sigma^2 / 2) (1 - Phi(z - sigma)) = ratio Phi(z)`` (module docstring): the standard
    normal quantile at which to plan a rank whose log slowdown errs by ``sigma``, with ``ratio`` its throughput over
    the rest of the cluster's (0 when ``sigma`` is 0).

    Example::

        >>> round(critical_z(0.2, 1 / 9), 3), round(critical_z(0.2, 1.0), 3), critical_z(0.0, 0.5)
        (1.474, 0.114, 0.0)
    """
    if sigma <= 0:
        return 0.0
    c = math.exp(sigma * sigma / 2.0)
    lo, hi = -8.0, 8.0  # the left side falls, the right side rises in z
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if c * (1.0 - _NORMAL.cdf(mid - sigma)) > ratio * _NORMAL.cdf(mid):
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def throughput_shares(plan: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Each rank's share of the cluster's throughput, ``plan / times`` normalised (0 for a rank without a finite
    positive time; all zeros when no rank has one).

    Example::

        >>> throughput_shares(np.array([30, 10]), np.array([0.1, 0.1])).tolist()
        [0.75, 0.25]
    """
    plan, times = np.asarray(plan, dtype=np.float64), np.asarray(times, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where((times > 0) & np.isfinite(times), plan / times, 0.0)
    total = rate.sum()
    return rate / total if total > 0 else rate


def corunner_groups(ctx: tuple[str, Sequence[str], Sequence[str | None], Sequence[str | None]] | None,
                    ) -> list[tuple[str, str | None, str | None]] | None:
    """Per rank, the key of the ranks whose corrections err together: (device, old co-runner, new co-runner) from
    an allocator's co-runner context ``(workload, devices, old, new)``; ``None`` without a context."""
    return None if ctx is None else list(zip(ctx[1], ctx[2], ctx[3]))
