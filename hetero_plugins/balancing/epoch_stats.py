"""One epoch's balance, measured from its step records: what :meth:`BalancePlanner.end_epoch
<hetero_plugins.balancing.planner.BalancePlanner.end_epoch>` writes to the history besides its decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetero_plugins.balancing.cliffs import row_medians

__all__ = ["epoch_entry"]


def epoch_entry(epoch: int, records: np.ndarray, batch_sizes: Sequence[int], epoch_time: float | None,
                predicted_step_time: float | None,
                system: Sequence[Mapping[str, float] | None] | None = None) -> dict[str, Any]:
    """The history entry of an epoch from its step records, shape ``(world_size, steps, >= 2)`` (batch size,
    compute seconds, ...).

    A step counts where every rank reported (a NaN row is a rank that never did). Per step: LBB's straggler level
    ``(max - min) / mean`` and the idle fraction ``mean(max - t) / max`` (:mod:`hetero_plugins.metrics`), whose
    medians over the epoch are kept, with each rank's median compute time and its throughput (samples over
    compute seconds).

    Example::

        >>> rec = np.array([[[32, 0.03, 0.0]] * 4, [[32, 0.06, 0.0]] * 4])
        >>> e = epoch_entry(0, rec, [32, 32], 0.25, None)
        >>> round(e["straggler_level"], 3), round(e["idle_fraction"], 2), e["samples"], e["samples_per_s"]
        (0.667, 0.25, 256, 1024.0)
    """
    records = np.asarray(records, dtype=np.float64)
    world = records.shape[0]
    b, t = records[:, :, 0], records[:, :, 1]
    valid = ((b > 0) & np.isfinite(t) & (t >= 0)).all(axis=0)
    tv, bv = t[:, valid], b[:, valid]
    if valid.any():
        top, mean = tv.max(axis=0), tv.mean(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            levels = np.where(mean > 0, (top - tv.min(axis=0)) / mean, 0.0)
            idles = np.where(top > 0, (top - tv).mean(axis=0) / top, 0.0)
        per_rank_compute = row_medians(tv).tolist()
        per_rank_throughput = (bv.sum(axis=1) / np.maximum(tv.sum(axis=1), 1e-12)).tolist()
    else:
        levels = idles = np.zeros(0)
        per_rank_compute = [float("nan")] * world
        per_rank_throughput = [0.0] * world
    steps = int(records.shape[1])
    samples = int(np.where(np.isfinite(b) & (b > 0), b, 0.0).sum())
    return {
        "epoch": int(epoch),
        "batch_sizes": list(batch_sizes),
        "throughput": per_rank_throughput,
        "compute_time": per_rank_compute,
        "straggler_level": float(np.median(levels)) if len(levels) else 0.0,
        "idle_fraction": float(np.median(idles)) if len(idles) else 0.0,
        "predicted_epoch_time": None if predicted_step_time is None else predicted_step_time * steps,
        "measured_epoch_time": None if epoch_time is None else float(epoch_time),
        "samples": samples,
        "samples_per_s": None if not epoch_time else samples / float(epoch_time),
        "system": None if system is None else [None if m is None else dict(m) for m in system],
    }
