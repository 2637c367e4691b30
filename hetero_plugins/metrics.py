"""Straggler metrics computed from per-rank compute times of one step or one epoch.

The straggler level is LBB's L = (max - min) / mean of the ranks' compute times (Yao et al., "LBB:
Load-Balanced Batching for Efficient Distributed Learning on Heterogeneous GPU Cluster", 2024). The idle
fraction is the share of rank-time spent waiting at the gradient barrier for the slowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["idle_fraction", "straggler_level"]


def straggler_level(compute_times: Sequence[float]) -> float:
    """(max - min) / mean of per-rank compute times; 0 for a perfectly balanced step.

    Example::

        >>> straggler_level([1.0, 1.0, 2.0])
        0.75
    """
    t = np.asarray(compute_times, dtype=np.float64)
    if t.size == 0:
        raise ValueError("`compute_times` must hold one time per rank, got an empty sequence.")
    mean = float(t.mean())
    if mean <= 0:
        return 0.0
    return float((t.max() - t.min()) / mean)


def idle_fraction(compute_times: Sequence[float]) -> float:
    """Fraction of all ranks' time spent idle at the barrier: mean_i (max - t_i) / max.

    Example::

        >>> idle_fraction([1.0, 0.5])
        0.25
    """
    t = np.asarray(compute_times, dtype=np.float64)
    if t.size == 0:
        raise ValueError("`compute_times` must hold one time per rank, got an empty sequence.")
    top = float(t.max())
    if top <= 0:
        return 0.0
    return float(np.mean((top - t) / top))
