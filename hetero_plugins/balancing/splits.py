"""Exact integer splits of a global batch on per-rank step-time lines (optionally steeper past a knee):
the shortest step (:func:`min_makespan_split`, ``equal_finish``'s objective) and the smallest spread
(:func:`min_spread_split`, LBB's), both by bisection over the ranks' times, not by rounding continuous shares."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetero_plugins._validation import check_int

__all__ = ["min_makespan_split", "min_spread_split"]


def _counts_up_to(a: np.ndarray, s: np.ndarray, start: np.ndarray, stop: np.ndarray, theta: float) -> np.ndarray:
    """Per rank, how many of the times ``a + s * k``, ``k = start+1 .. stop``, are ``<= theta``.

    The floor of ``(theta - a) / s`` is corrected against the very expression
    :meth:`~hetero_plugins.balancing.time_model.TimeModelParams.predict` evaluates (IEEE arithmetic is
    monotone in ``k``), so the count is exact for the floating-point times, not only up to rounding.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        k = np.clip(np.floor((theta - a) / s), start, stop)
    while True:
        over = (k > start) & (a + s * k > theta)
        if not over.any():
            break
        k[over] -= 1
    while True:
        under = (k < stop) & (a + s * (k + 1) <= theta)
        if not under.any():
            break
        k[under] += 1
    return k - start


def _smallest_of_progressions(a: np.ndarray, s: np.ndarray, start: np.ndarray, stop: np.ndarray,
                              need: int) -> np.ndarray:
    """How many of each rank's times ``a_i + s_i k``, ``k = start_i+1 .. stop_i``, are among the ``need``
    smallest of all ranks' times together (ties go to the lower rank index).

    A bracket ``[lo, hi]`` on the ``need``-th smallest time (fewer than ``need`` times ``<= lo``, at least
    ``need`` times ``<= hi``) shrinks by secant steps on the count (close to linear in the time) alternating
    with halvings, until at most one time per rank lies inside; those are sorted explicitly.
    """
    n = len(a)
    taken = np.zeros(n, dtype=np.float64)
    if need <= 0:
        return taken
    avail = stop - start
    has = avail > 0
    first = a[has] + s[has] * (start[has] + 1)
    lo_t = float(np.nextafter(first.min(), -np.inf))
    m_lo, c_lo = taken, 0
    hi_t = float(np.max(a[has] + s[has] * (start[has] + np.minimum(avail[has], need))))
    m_hi = _counts_up_to(a, s, start, stop, hi_t)
    c_hi = int(m_hi.sum())
    inv = 1.0 / s[has]
    # The unclamped continuous solution: sum_i (T - a_i) / s_i - start_i = need.
    guess = float((need + np.sum((a[has] + s[has] * start[has]) * inv)) / inv.sum())
    for it in range(400):
        if c_hi - c_lo <= n:
            break
        if it % 3 == 2 or not lo_t < guess < hi_t:
            guess = 0.5 * (lo_t + hi_t)
        if not lo_t < guess < hi_t:
            break  # adjacent floating-point numbers: every time inside the bracket is the same number
        m = _counts_up_to(a, s, start, stop, guess)
        c = int(m.sum())
        if c >= need:
            hi_t, m_hi, c_hi = guess, m, c
        else:
            lo_t, m_lo, c_lo = guess, m, c
        guess = lo_t + (hi_t - lo_t) * (need - c_lo - 0.5) / (c_hi - c_lo)
    extra = (m_hi - m_lo).astype(np.int64)
    total = int(extra.sum())
    idx = np.repeat(np.arange(n), extra)
    offset = np.arange(total) - np.repeat(np.cumsum(extra) - extra, extra)
    k = start[idx] + m_lo[idx] + offset + 1
    values = a[idx] + s[idx] * k
    pick = np.lexsort((idx, values))[: need - c_lo]  # stable: within a rank, smaller k first
    return m_lo + np.bincount(idx[pick], minlength=n)


def _check_lines(intercept: Any, slope: Any, global_batch: int, min_batch: Any, max_batch: Any
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    a = np.asarray(intercept, dtype=np.float64).ravel()
    s = np.asarray(slope, dtype=np.float64).ravel()
    lo = np.asarray(min_batch, dtype=np.float64).ravel()
    hi = np.asarray(max_batch, dtype=np.float64).ravel()
    n = len(a)
    if not (len(s) == len(lo) == len(hi) == n) or n == 0:
        raise ValueError(
            f"`intercept`, `slope`, `min_batch` and `max_batch` must have one entry per rank, got lengths {len(a)}, "
            f"{len(s)}, {len(lo)} and {len(hi)}. HINT: pass four sequences of the same non-zero length."
        )
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(s)) and np.all(s > 0)):
        raise ValueError(
            f"every `slope` must be finite and > 0 and every `intercept` finite, got slope={s.tolist()} and "
            f"intercept={a.tolist()}. HINT: an unknown or flat time line has no optimal split; keep the current plan."
        )
    if np.any(lo != np.floor(lo)) or np.any(hi != np.floor(hi)) or np.any(lo < 0) or np.any(hi < lo):
        raise ValueError(
            f"`min_batch`={lo.tolist()} and `max_batch`={hi.tolist()} must be integers with 0 <= min <= max. "
            "HINT: pass per-rank batch-size bounds."
        )
    check_int("global_batch", global_batch, minimum=0)
    if not lo.sum() <= global_batch <= hi.sum():
        raise ValueError(
            f"`global_batch`={global_batch} is outside [sum(min_batch), sum(max_batch)] = [{int(lo.sum())}, "
            f"{int(hi.sum())}]. HINT: raise the per-rank maximum or lower the batch size."
        )
    return a, s, lo, hi


def min_makespan_split(intercept: Any, slope: Any, global_batch: int, min_batch: Any, max_batch: Any,
                       knee: Any = None, beyond: Any = None) -> np.ndarray:
    """The integer split with the shortest predicted step: minimises ``max_i a_i + s_i b_i`` subject to
    ``sum_i b_i = global_batch`` and ``min_batch_i <= b_i <= max_batch_i`` (exactly, for positive slopes).

    Every rank starts at its minimum; the ``d = global_batch - sum(min_batch)`` remaining samples go to the
    ``d`` smallest of all the times ``a_i + s_i k`` for ``k = min_i+1 .. max_i`` (rank i's time with its k-th
    sample). Each rank's times increase with k, so taking the d smallest of them all is a valid plan (a prefix
    per rank). It is optimal: any plan adds d samples, so its makespan is at least the d-th smallest of these
    times; and it is at least ``max_i a_i + s_i min_i`` because every rank has at least its minimum. This plan's
    makespan is the larger of those two lower bounds. (The greedy "next sample to the rank that finishes it
    first" rule builds the same plan, one sample at a time; here the d-th smallest time is found by bisection on
    the makespan with secant steps, so a decision costs a few vectorised passes over the ranks.) Ties go to the
    lower rank index.

    With ``knee`` and ``beyond``, rank i's time past ``knee_i`` samples grows by ``beyond_i`` seconds per sample
    instead of ``s_i`` (:func:`~hetero_plugins.balancing.lines.curve_times`). The argument above needs only
    that each rank's times increase with k, so the split stays exact: the times up to the knee and past it are
    two progressions of the same rank, the second starting above the first's last time.

    Args:
        intercept: per-rank fixed seconds per step ``a_i`` (finite).
        slope: per-rank seconds per sample ``s_i`` (finite, > 0).
        global_batch: samples to split.
        min_batch, max_batch: per-rank inclusive bounds.
        knee, beyond: ``None``, or per rank a batch size (``>= 0``, ``inf``: none; a non-integer one bends the
            curve between two batch sizes, as :func:`~hetero_plugins.balancing.lines.curve_times` does) and the
            seconds per sample past it (finite, > 0).

    Example::

        >>> min_makespan_split([0.0, 0.0], [0.001, 0.003], 400, [1, 1], [1000, 1000]).tolist()
        [300, 100]
        >>> min_makespan_split([0.09, 0.0], [0.0001, 0.003], 400, [1, 1], [1000, 1000]).tolist()  # flat line
        [359, 41]
        >>> min_makespan_split([0.09, 0.0], [0.0001, 0.003], 400, [1, 1], [1000, 1000],
        ...                    knee=[100, float("inf")], beyond=[0.001, 1.0]).tolist()  # measured up to 100
        [300, 100]
    """
    a, s, lo, hi = _check_lines(intercept, slope, global_batch, min_batch, max_batch)
    need = int(global_batch - lo.sum())
    if knee is None and beyond is None:
        return (lo + _smallest_of_progressions(a, s, lo, hi, need)).astype(np.int64)
    k = np.asarray(knee, dtype=np.float64).ravel() if knee is not None else None
    c = np.asarray(beyond, dtype=np.float64).ravel() if beyond is not None else None
    if k is None or c is None or len(k) != len(a) or len(c) != len(a) or np.any(np.isnan(k)) or np.any(k < 0) \
            or not (np.all(np.isfinite(c)) and np.all(c > 0)):
        raise ValueError(
            f"`knee`={None if k is None else k.tolist()} and `beyond`={None if c is None else c.tolist()} must both "
            "be given, one entry per rank: knees >= 0 (inf: none), finite slopes > 0 past them. HINT: pass "
            "both or neither."
        )
    finite = np.isfinite(k)
    kf = np.where(finite, np.floor(k), hi)
    m = np.clip(kf, lo, hi)
    # The second line passes through the first at the knee itself, exactly as ``curve_times`` writes it (for a
    # knee between two batch sizes too: the batches up to its floor are on the first line, the rest on the second).
    kr = np.where(finite, k, 0.0)
    a2 = np.where(finite, a + s * kr - c * kr, a)
    extra = _smallest_of_progressions(np.concatenate([a, a2]), np.concatenate([s, np.where(finite, c, s)]),
                                      np.concatenate([lo, m]), np.concatenate([m, hi]), need)
    n = len(a)
    return (lo + extra[:n] + extra[n:]).astype(np.int64)


def min_spread_split(intercept: Any, slope: Any, global_batch: int, min_batch: Any, max_batch: Any,
                     max_candidates: int = 400_000) -> np.ndarray | None:
    """The integer split with the smallest spread ``max_i t_i - min_i t_i`` of predicted times (LBB's objective),
    among those the shortest step; ``None`` when more than ``max_candidates`` times would have to be scanned.

    With ``T*`` the shortest possible makespan (:func:`min_makespan_split`), a plan whose times all lie in
    ``[L, U]`` exists exactly when every rank has a batch with a time in ``[L, U]``, the smallest such batches
    sum to at most the global batch, and ``U >= T*`` (then the largest ones sum to at least it). So for each
    candidate ``L`` (one of the times ``a_i + s_i k``) the best ``U`` is ``max(T*, max_i ceil_i(L))``, where
    ``ceil_i(L)`` is rank i's first time at or above ``L``. The optimum's smallest time is a candidate in
    ``[T* - S0, min(T*, min_i t_i(max_i))]`` (``S0``: the spread of the shortest-step plan, which bounds the
    optimum's); all candidates there are sorted and scanned once with running maxima. The plan is then the
    shortest-step split within the per-rank batches whose times lie in ``[L, U]``.

    Example::

        >>> min_spread_split([0.0, 0.0], [0.001, 0.003], 100, [1, 1], [100, 100]).tolist()
        [75, 25]
    """
    a, s, lo, hi = _check_lines(intercept, slope, global_batch, min_batch, max_batch)
    best = min_makespan_split(a, s, global_batch, lo, hi).astype(np.float64)
    t = a + s * best
    t_star, l_min = float(t.max()), float(t.min())
    if t_star == l_min:
        return best.astype(np.int64)
    l_max = min(t_star, float(np.min(a + s * hi)))
    # Per rank: first batch with a time >= l_min, last with a time <= l_max.
    k_first = lo + _counts_up_to(a, s, lo - 1, hi, float(np.nextafter(l_min, -np.inf)))
    k_last = lo - 1 + _counts_up_to(a, s, lo - 1, hi, l_max)
    count = np.maximum(k_last - k_first + 1, 0).astype(np.int64)
    total = int(count.sum())
    if total > max_candidates:
        return None
    n = len(a)
    idx = np.repeat(np.arange(n), count)
    k = k_first[idx] + (np.arange(total) - np.repeat(np.cumsum(count) - count, count))
    values = a[idx] + s[idx] * k
    succ = np.where(k < hi[idx], a[idx] + s[idx] * (k + 1), np.inf)
    order = np.argsort(values, kind="stable")
    values, succ, idx = values[order], succ[order], idx[order]
    below = np.searchsorted(values, values, side="left")  # times strictly below each candidate
    first_max = float(np.max(np.where(k_first <= hi, a + s * k_first, np.inf)))
    run_max = np.maximum.accumulate(succ)
    ceil_max = np.maximum(first_max, np.where(below > 0, run_max[np.maximum(below - 1, 0)], -np.inf))
    upper = np.maximum(t_star, ceil_max)
    feasible = (k_first.sum() + below <= global_batch) & np.isfinite(upper)
    spread = np.where(feasible, upper - values, np.inf)
    p = int(np.lexsort((upper, spread))[0])
    if not np.isfinite(spread[p]) or spread[p] >= t_star - l_min:
        return best.astype(np.int64)
    low = k_first + np.bincount(idx[: below[p]], minlength=n)
    high = lo + _counts_up_to(a, s, lo, hi, float(upper[p]))
    return min_makespan_split(a, s, global_batch, low, high)
