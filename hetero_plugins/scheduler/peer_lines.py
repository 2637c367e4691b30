"""A rank's nearly flat time line, refuted by ranks of the same device type (``DQNAllocator(peer_lines=True)``).

The learned allocators split on each rank's fitted line ``t(b) = a + s b`` (LBB's online per-worker linear
model, seed paper 5). A load that ramps up on one rank between two plan changes is fitted as a line with a huge
fixed cost: the level at the larger batch, measured before the ramp, took as long as the one at the smaller batch
measured after it (test ``default-38``: 167 samples in 0.840 s, then 130 in 0.838 s, a fixed cost of about 1,100
samples). On that line, cutting the rank gains nothing, so the plan stays while the rank grows slower. A
saturation plateau (a step that takes as long however few the samples) gives the same flat line, and rightly.

What tells them apart is the device. A co-runner slows a line's fixed cost and its per-sample cost alike, so
ranks of one device type share the fixed cost measured in samples, ``kappa = (a - data) / s``, and a plateau is
the device's: every rank of that type that runs at as few samples is flat there too. So a rank's line is flat
over what it measured (``kappa`` above its largest measured batch and its current one) *and refuted* when a rank
of the same device type runs at no more than ``reach`` times its batch on a line that is steep there
(``kappa < batch``), with ``kappa`` more than ``ratio`` times theirs. The refuted line is replaced, for the
split and the planner's gate, by the line with the peers' median ``kappa`` through the rank's time at its current
batch (its latest level): the same prediction where it was measured last, proportional below it as its peers are.
Nothing else changes: the time models keep their own fit, and a new measurement is fitted as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["peer_fixed_costs"]


def peer_fixed_costs(intercept: np.ndarray, slope: np.ndarray, data: np.ndarray, measured_max: np.ndarray | None,
                     devices: Sequence[str], current: Sequence[int], ratio: float = 4.0,
                     reach: float = 1.1) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The lines ``(intercept, slope)`` with each refuted flat line replaced (see the module docstring), and the
    ranks replaced.

    Args:
        intercept, slope: per-rank fitted lines (seconds, seconds per sample; ``nan`` where unknown).
        data: per rank, the seconds of ``intercept`` that are the wait for data (not compute; kept as they are).
        measured_max: per rank, the largest batch its line was measured at (``inf``/``nan``: unknown, then the
            current batch stands for it); ``None``: nothing is replaced.
        devices: each rank's device type.
        current: each rank's batch in the plan now in force (where its latest level was measured).
        ratio: how many times its peers' fixed cost a rank's must be to be refuted.
        reach: a peer counts when its batch is at most ``reach`` times the rank's.

    Example::

        >>> a, s, moved = peer_fixed_costs(np.array([0.75, 0.006, 0.0]), np.array([0.00067, 0.0042, 0.0049]),
        ...                                np.zeros(3), np.array([167.0, 197.0, 177.0]), ["t4", "t4", "t4"],
        ...                                [130, 135, 61])
        >>> moved, round(float(a[0] + s[0] * 130), 4) == round(0.75 + 0.00067 * 130, 4)
        ([0], True)
    """
    a = np.asarray(intercept, dtype=np.float64)
    s = np.asarray(slope, dtype=np.float64)
    n = len(a)
    if measured_max is None or len(devices) != n or len(current) != n:
        return a, s, []
    d = np.asarray(data, dtype=np.float64)
    c = np.asarray(current, dtype=np.float64)
    compute = a - d
    ok = np.isfinite(compute) & np.isfinite(s) & (s > 0) & (c > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        kappa = np.where(ok, np.maximum(compute, 0.0) / np.where(ok, s, 1.0), np.nan)
    top = np.asarray(measured_max, dtype=np.float64)
    top = np.where(np.isfinite(top), top, c)
    out_a, out_s, moved = a.copy(), s.copy(), []
    flat = np.flatnonzero(ok & (kappa > np.maximum(top, c)))
    if len(flat) == 0:
        return out_a, out_s, moved
    dev = np.asarray(devices, dtype=object)
    steep = ok & (kappa < c)  # a flat rank is never steep: it is never its own peer
    for kind in dict.fromkeys(dev[flat]):
        peers = np.flatnonzero(steep & (dev == kind))
        if len(peers) == 0:
            continue
        peers = peers[np.argsort(c[peers], kind="stable")]  # by batch: the peers within reach are a prefix
        for r in flat[dev[flat] == kind]:
            m = int(np.searchsorted(c[peers], reach * c[r], side="right"))
            if m == 0:
                continue
            kp = float(np.median(kappa[peers[:m]]))
            if kappa[r] <= ratio * max(kp, 1.0):
                continue
            t = compute[r] + s[r] * c[r]
            out_s[r] = t / (kp + c[r])
            out_a[r] = kp * out_s[r] + d[r]
            moved.append(int(r))
    return out_a, out_s, sorted(moved)
