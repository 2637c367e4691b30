"""Many steps of many ranks at once: the block update of :class:`~hetero_plugins.balancing.time_bank.TimeModelBank`.

Within an epoch a rank runs one batch size at every step, and the bank's step-by-step rule then reduces to a few
array operations over the whole block of steps:

- the change test compares each step with the interval the model predicts at the block's start (the step-by-step
  rule moves that interval by at most one level update per step, a small fraction of the noise once a level has
  weight); a run of ``change_steps`` steps beyond it by half the threshold whose median is beyond it by the whole
  threshold is a change, found at the first step where it completes;
- every other step is added in order, clipped to the interval widened by the threshold (a no-op for the steps
  inside it; the held-back steps of a broken run, and the oldest of a run that does not make a change), and the
  recency-weighted level after ``m`` additions has a closed form: with ``lam`` the per-observation decay,
  ``W_m = lam^m W_0 + (1 - lam^m)/(1 - lam)`` and ``W_m Y_m = lam^m W_0 Y_0 + sum_i lam^(m-i) t_i``;
- the noise estimate (the recency-weighted mean squared log deviation of each step from the level before it) is
  the same recurrence over the steps that have a level to compare with;
- after a change the rank restarts from the run (as step by step) and the rest of its block is a new block.

A rank whose block mixes batch sizes or invalid steps takes the step-by-step rule. A rank whose line is refitted
(two solid batch sizes, after a plan change) is refitted every :data:`TRANSITION_STEPS` steps instead of every
step. Blocks are at most
:data:`BLOCK_STEPS` steps long, so the interval a block is tested against is never older than that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TimeModelBank = Any  # the bank whose arrays are updated (imported by it, so not imported here)

__all__ = ["BLOCK_STEPS", "observe_block"]

#: Longest block of steps tested against one predicted interval.
BLOCK_STEPS = 32

#: Steps between refits while two batch sizes' levels are solid (the first epoch after a plan change).
TRANSITION_STEPS = 3


def observe_block(bank: TimeModelBank, rows: np.ndarray, b: np.ndarray, t: np.ndarray) -> None:
    """Learn ``t`` (shape ``(len(rows), m)``, every step valid) at one batch size per row, ``b`` (shape ``(len(rows),)``)."""
    m = t.shape[1]
    pos = np.zeros(len(rows), dtype=np.int64)  # next step of each row still to learn
    todo = np.arange(len(rows))
    while len(todo):
        r = rows[todo]
        # While another batch size's level is still solid (after a plan change) the line is refitted every
        # TRANSITION_STEPS steps, as the step-by-step rule refits after every step then.
        floor = max(bank.min_group_weight, 1e-12)
        other = ((bank._gw[r] >= floor) & (bank._gb[r] > 0) & (bank._gb[r] != b[todo][:, None])).any(axis=1)
        steps = np.where(other, np.minimum(m - pos[todo], TRANSITION_STEPS), m - pos[todo])
        cols = pos[todo][:, None] + np.arange(int(steps.max()))[None, :]
        present = cols < (pos[todo] + steps)[:, None]
        p0 = pos[todo]
        if p0.min() == p0.max():  # every row at the same step (the first round): a slice
            tt = t[todo, int(p0[0]):int(p0[0]) + cols.shape[1]]
        else:
            tt = np.take_along_axis(t[todo], np.minimum(cols, m - 1), axis=1)
        stop = _round(bank, r, b[todo], tt, present)  # per row: steps used, or -1 when all were
        bank._lines = None
        solid = ((bank._gw[r] >= floor) & (bank._gb[r] > 0)).sum(axis=1) >= 2
        if solid.any():
            bank._refit(r[solid])
        pos[todo] += np.where(stop < 0, steps, stop)
        todo = todo[pos[todo] < m]


def _round(bank: TimeModelBank, rows: np.ndarray, b: np.ndarray, t: np.ndarray, present: np.ndarray) -> np.ndarray:
    """One pass over each row's steps against its current interval: commit, hold back, or restart at a change.

    Returns, per row, the number of its steps consumed when a change restarted it (the rest form a new block),
    or -1 when every step was consumed.
    """
    tau = bank.change_threshold
    lo, hi = bank._band(rows, b)
    half = 1 + tau / 2
    with np.errstate(invalid="ignore"):
        dev = np.where(t > hi[:, None] * half, 1, np.where(t < lo[:, None] / half, -1, 0)).astype(np.int8)
    dev[~present] = 0
    # Quiet rows (nothing held back, no step outside the interval) add every step as it is.
    busy = (dev != 0).any(axis=1) | (bank._np[rows] > 0)
    stop = np.full(len(rows), -1)
    quiet = ~busy
    if quiet.any():
        zeros = np.zeros(int(quiet.sum()), dtype=np.int64)
        _commit_run(bank, rows[quiet], b[quiet], t[quiet], zeros, present[quiet].sum(axis=1))
    if busy.any():
        stop[busy] = _busy_round(bank, rows[busy], b[busy], t[busy], present[busy], dev[busy], lo[busy], hi[busy])
    return stop


def _busy_round(bank: TimeModelBank, rows: np.ndarray, b: np.ndarray, t: np.ndarray, present: np.ndarray,
                dev: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`_round` for rows with a held-back run or a step outside the interval."""
    k, tau = bank.change_steps, bank.change_threshold
    n, steps = t.shape
    # The sequence of each row: its held-back run (right-aligned in the first w slots), then the block's steps.
    held = bank._np[rows]
    w = int(held.max())
    if w:
        slot = np.arange(w)[None, :]
        h_mask = slot >= (w - held)[:, None]
        h_idx = np.clip(slot - (w - held)[:, None], 0, k - 1)
        pre_b = np.take_along_axis(bank._pb[rows], h_idx, axis=1)
        seq_t = np.concatenate([np.take_along_axis(bank._pt[rows], h_idx, axis=1), t], axis=1)
        live = np.concatenate([h_mask, present], axis=1)
        seq_dev = np.concatenate([np.where(h_mask, bank._ps[rows][:, None], 0), dev], axis=1)
    else:
        pre_b, seq_t, live, seq_dev = np.zeros((n, 0)), t, present, dev
    length = w + steps
    idx = np.arange(length)[None, :]
    brk = seq_dev == 0
    brk[:, 1:] |= seq_dev[:, 1:] != seq_dev[:, :-1]
    last_brk = np.maximum.accumulate(np.where(brk, idx, 0), axis=1)
    run = np.where(brk & (seq_dev != 0), 1, idx - last_brk + 1) * (seq_dev != 0)
    # The change test where a run completes k steps (rare: computed only there).
    change_at = np.full(n, length)
    cand_r, cand_p = np.nonzero(run >= k)
    if len(cand_r):
        win = cand_p[:, None] - k + 1 + np.arange(k)[None, :]
        wt = seq_t[cand_r[:, None], win]
        wb = np.where(win >= w, b[cand_r][:, None], pre_b[cand_r[:, None], np.minimum(win, max(w - 1, 0))]
                      if w else 0.0)
        plo, phi = bank._band(rows[cand_r], wb)
        ratio = np.where(seq_dev[cand_r, cand_p][:, None] > 0, wt / phi, plo / wt)
        ratio = np.sort(ratio, axis=1)  # the median of a few: the middle of the sorted row
        hit = 0.5 * (ratio[:, (k - 1) // 2] + ratio[:, k // 2]) > 1 + tau
        np.minimum.at(change_at, cand_r[hit], cand_p[hit])
    changed = change_at < length
    change_at = np.where(changed, change_at, -1)
    last = (length - 1) - np.argmax(live[:, ::-1], axis=1)  # last live position
    ar = np.arange(n)
    tail_run = run[ar, last]
    tail = np.where(tail_run >= k, k - 1, tail_run)
    # Commit every live entry before the held tail (no change) or before the change's window.
    end = np.where(changed, change_at - k + 1, last + 1 - tail)
    first = w - held
    with np.errstate(invalid="ignore"):
        clipped = np.where(np.isnan(lo)[:, None], seq_t,
                           np.clip(seq_t, (lo / (1 + tau))[:, None], (hi * (1 + tau))[:, None]))
    _commit_run(bank, rows, b, clipped, first, end)
    # The new held-back run: the tail (no change), or the change's window, from which the row restarts.
    hold_end = np.where(changed, change_at + 1, last + 1)
    hold_len = hold_end - end
    bank._np[rows] = 0
    bank._ps[rows] = 0
    for count in np.unique(hold_len[hold_len > 0]):
        sel = np.flatnonzero(hold_len == count)
        cols = end[sel][:, None] + np.arange(count)[None, :]
        bank._pb[rows[sel], :count] = np.where(cols >= w, b[sel][:, None],
                                               pre_b[sel[:, None], np.minimum(cols, max(w - 1, 0))] if w else 0.0)
        bank._pt[rows[sel], :count] = seq_t[sel[:, None], cols]
        bank._np[rows[sel]] = count
        bank._ps[rows[sel]] = seq_dev[sel, end[sel]]
    if changed.any():
        bank._restart(rows[changed])
    return np.where(changed, change_at + 1 - w, -1)


def _commit_run(bank: TimeModelBank, rows: np.ndarray, b: np.ndarray, x: np.ndarray, first: np.ndarray,
                end: np.ndarray) -> None:
    """Add the entries ``x[i, first[i]:end[i]]`` of each row in order at its batch size ``b[i]`` (closed form)."""
    count = np.maximum(end - first, 0)
    go = count > 0
    if not go.any():
        return
    rows, b, x, first, count = rows[go], b[go], x[go], first[go], count[go]
    n, width = len(rows), int(count.max())
    j = np.arange(width)[None, :]
    inside = j < count[:, None]
    if first.min() == first.max() and int(first[0]) + width <= x.shape[1]:
        xs = np.where(inside, x[:, int(first[0]):int(first[0]) + width], 0.0)
    else:
        xs = np.where(inside, np.take_along_axis(x, np.minimum(first[:, None] + j, x.shape[1] - 1), axis=1), 0.0)
    lam = bank._lam[rows]
    gb, gy, gw = bank._gb[rows], bank._gy[rows], bank._gw[rows]
    match = (gb == b[:, None]) & (gb > 0)
    has = match.any(axis=1)
    slot = np.where(has, np.argmax(match, axis=1), np.argmin(np.where(gb > 0, gw, -1.0), axis=1))
    ar = np.arange(n)
    w0 = np.where(has, gw[ar, slot], 0.0)
    y0 = np.where(has, gy[ar, slot], 0.0)
    # Level before each entry (entry i = 0..count-1): W_i, Y_i after i additions.
    uniform = bool(lam.min() == lam.max())
    if uniform:  # one half-life for every row (the usual case): one row of powers
        powers = np.broadcast_to(np.power(lam[0], np.arange(width + 1, dtype=np.float64)), (n, width + 1))
    else:
        powers = np.power(lam[:, None], np.arange(width + 1)[None, :])  # lam^0 .. lam^width
    geo = (1.0 - powers) / (1.0 - lam[:, None])
    w_after = powers * w0[:, None] + geo  # W_0 .. W_width
    acc = np.cumsum(xs / powers[:, 1:], axis=1) * powers[:, 1:]  # sum_{i<=j} lam^(j-i) x_i
    s_after = np.concatenate([(w0 * y0)[:, None], powers[:, 1:] * (w0 * y0)[:, None] + acc], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        y_after = np.where(w_after > 0, s_after / w_after, 0.0)
    # Noise: each entry against the level before it, where that level has weight >= 1 after decay.
    w_pre = lam[:, None] * w_after[:, :-1]
    exists = np.concatenate([has[:, None], np.ones((n, width - 1), dtype=bool)], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = np.log(xs / y_after[:, :-1]) ** 2
    ok = inside & exists & (w_pre >= 1.0) & np.isfinite(r2)
    r2 = np.where(ok, r2, 0.0)
    nv = ok.sum(axis=1)
    last_ok = width - np.argmax(ok[:, ::-1], axis=1)  # one past the last valid entry
    if (nv == last_ok - np.argmax(ok, axis=1)).all():  # valid entries contiguous (the usual case): lam^(last - j)
        after = np.maximum(last_ok[:, None] - 1 - j, 0)
    else:
        after = nv[:, None] - np.cumsum(ok, axis=1)  # valid entries after each one
    if uniform:
        decay = powers[0][np.minimum(after, width)]  # lam^after
    else:
        decay = np.take_along_axis(powers, np.minimum(after, width), axis=1)
    v0 = bank._var[rows]
    first_ok = np.argmax(ok, axis=1)
    r2_first = r2[ar, first_ok]
    lead = np.where(np.isnan(v0), 0.0, np.power(lam, nv) * np.nan_to_num(v0))
    tail = ((1.0 - lam)[:, None] * r2 * decay * ok)
    # Without an earlier estimate the first valid entry starts it (weight 1 instead of 1 - lam).
    start = np.isnan(v0) & (nv > 0)
    tail[ar[start], first_ok[start]] = r2_first[start] * decay[ar[start], first_ok[start]]
    v_new = np.where((nv == 0), v0, lead + tail.sum(axis=1))
    bank._var[rows] = v_new
    # Levels: every group decays count times; the entries' group gets the closed form.
    decay_all = np.power(lam, count)
    new_gw = gw * decay_all[:, None]
    new_gy = gy.copy()
    new_gb = gb.copy()
    new_gw[ar, slot] = w_after[ar, count]
    new_gy[ar, slot] = y_after[ar, count]
    new_gb[ar, slot] = b
    gone = new_gw < bank._forget[rows][:, None]
    new_gw[gone], new_gy[gone], new_gb[gone] = 0.0, 0.0, 0.0
    bank._gb[rows], bank._gy[rows], bank._gw[rows] = new_gb, new_gy, new_gw
    bank._nobs[rows] += count
    bank._seen[rows] += count
