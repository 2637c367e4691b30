"""A learned correction of the planning relocator's rollout values, trained on the returns moves realised.

:class:`~hetero_plugins.scheduler.planning.PlanningRelocator` judges each candidate move by rolling the
balancing planner forward on what the scheduler believes (fitted lines, NCF-priced slots). That belief is
biased where it matters: a saturation plateau makes a fitted line nearly flat and the move it prices is worth
less than the rollout says; a co-runner leaves sooner than announced; a data-bound rank gains nothing from a
faster device. :class:`RolloutCorrection` learns the map from a candidate's rollout value and what the scheduler
sees of it (:data:`ROLLOUT_FEATURES`) to the seconds the move actually saved over staying, restart included,
in the next epochs of a forked simulated run (Monte Carlo returns with common random numbers, as the Q-network's
pre-training reads them). It is the value function of LDWP's stage-1 DQN (Zhang, Geng, Ma, IEEE TPDS 2021) fed
with a model-based estimate: "Dyna"-style planning whose errors a learned critic absorbs (Sutton, ICML 1990;
value expansion, Feinberg et al., 2018).

An ensemble of small MLPs (independent initialisations and minibatches) whose mean is the estimate; features
are standardised with the training set's mean and spread, stored with the weights. Numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.scheduler.features import mlp_fit, mlp_forward, mlp_random, read_model, write_model

__all__ = ["DEFAULT_CORRECTION_MODEL", "ROLLOUT_FEATURES", "RolloutCorrection", "rollout_features"]

DEFAULT_CORRECTION_MODEL = "rollout_correction_v1.npz"

#: What the correction sees of each candidate, in order.
ROLLOUT_FEATURES = (
    "value",            # rollout saving over staying, net of the restart, in epochs of the current step (+-5)
    "gross",            # the same before the restart cost
    "restart_epochs",   # restart cost in epochs of the current step time (capped at 5)
    "saving",           # 1 - t_new / t_now on the priced lines (the greedy rule's number)
    "epochs_left",      # epochs left / 20 (capped at 3)
    "moved_fraction",   # ranks moved / world size
    "moves",            # ranks moved / 8 (capped at 2)
    "world",            # log2(world size) / 10
    "is_greedy",        # the greedy best placement
    "is_home",          # relocated ranks back to their own places
    "is_single",        # one rank to one free slot
    "fixed_from",       # share of the moved ranks' compute step that is fixed cost at their planned batch
    "fixed_to",         # the same on the slots they take (a flat line there: a saturation plateau)
    "data_share",       # share of the moved ranks' step spent waiting for data
    "batch_ratio",      # the moved ranks' planned batch / the mean batch (capped at 3)
    "from_corunner",    # share of the places left that have a co-runner next epoch
    "to_corunner",      # share of the places taken that have one
    "corunner_changed",  # share of the places left whose co-runner changes at this boundary
)
_F = len(ROLLOUT_FEATURES)


def rollout_features(cands: Sequence[Mapping[str, Any]], values: Sequence[float],
                     ctx: Mapping[str, Any]) -> np.ndarray:
    """The :data:`ROLLOUT_FEATURES` row of each candidate.

    Args:
        cands: the candidates (:func:`~hetero_plugins.scheduler.candidates.candidate_actions`).
        values: each one's rollout saving over staying in seconds, restart included.
        ctx: the decision's context as :class:`~hetero_plugins.scheduler.planning.PlanningRelocator` hands its
            ``recorder``: ``t_cur``, ``steps``, ``cost``, ``epochs_left``, ``own``, ``incoming``, ``plan``,
            ``global_batch``, ``corunners``, ``next_corunners``, ``free_slots``.
    """
    own, incoming, plan = ctx["own"], ctx["incoming"], ctx["plan"]
    n = len(own)
    unit = ctx["t_cur"] * max(int(ctx["steps"]), 1)
    cost = ctx["cost"] / unit
    mean_b = ctx["global_batch"] / max(n, 1)
    x = np.zeros((len(cands), _F))
    for r, (c, v) in enumerate(zip(cands, values)):
        moves = c["moves"]
        fixed_from, fixed_to, data_share, ratio, co_from, co_to, changed = [], [], [], [], [], [], []
        for i, s in moves.items():
            b = max(float(plan[i]), 1.0)
            o, t = own[i], incoming[s]
            step = o["intercept"] + o["slope"] * b
            fixed_from.append(o["intercept"] / max(step, 1e-12))
            fixed_to.append(t["intercept"] / max(t["intercept"] + t["slope"] * b, 1e-12))
            data_share.append(o["data"] / max(step + o["data"], 1e-12))
            ratio.append(b / mean_b)
            co_from.append(ctx["next_corunners"][i] is not None)
            co_to.append(ctx["free_slots"][t["free_slot"]].get("corunner") is not None)
            changed.append(ctx["next_corunners"][i] != ctx["corunners"][i])
        value = float(v) / unit
        x[r] = (float(np.clip(value, -5.0, 5.0)), float(np.clip(value + cost, -5.0, 5.0)), min(cost, 5.0),
                1.0 - c["t_new"] / ctx["t_cur"], min(max(ctx["epochs_left"], 0) / 20.0, 3.0), len(moves) / n,
                min(len(moves) / 8.0, 2.0), math.log2(max(n, 1)) / 10.0, float(c["kind"] == "greedy"),
                float(c["kind"] == "home"), float(c["kind"] == "single"), float(np.mean(fixed_from)),
                float(np.mean(fixed_to)), float(np.mean(data_share)), min(float(np.mean(ratio)), 3.0),
                float(np.mean(co_from)), float(np.mean(co_to)), float(np.mean(changed)))
    return x


class RolloutCorrection:
    """An ensemble of MLPs ``ROLLOUT_FEATURES -> realised saving over staying`` (epochs of the current step time,
    restart included); the estimate is the members' mean.

    Args:
        members: each member's layers ``[(W, b), ...]`` (ReLU between layers, one linear output).
        mean, scale: the standardisation applied to the features first (the training set's).
        meta: metadata saved with the weights (how it was trained).

    Example::

        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(400, len(ROLLOUT_FEATURES)))
        >>> c = RolloutCorrection.fit(x, 0.5 * x[:, 0], members=2, steps=400)
        >>> bool(np.corrcoef(c(x), x[:, 0])[0, 1] > 0.9)
        True
    """

    def __init__(self, members: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], mean: np.ndarray,
                 scale: np.ndarray, meta: Mapping[str, Any] | None = None) -> None:
        self.members = [[(np.array(w, dtype=np.float64), np.array(b, dtype=np.float64)) for w, b in m]
                        for m in members]
        self.mean = np.asarray(mean, dtype=np.float64)
        self.scale = np.asarray(scale, dtype=np.float64)
        bad = [m for m in self.members if not m or m[0][0].shape[0] != _F or m[-1][0].shape[1] != 1]
        if not self.members or bad or self.mean.shape != (_F,) or self.scale.shape != (_F,):
            raise ValueError(f"a rollout correction maps {_F} features to 1 value with one mean and scale per "
                             f"feature; got {len(self.members)} members, mean {self.mean.shape}, scale "
                             f"{self.scale.shape}. HINT: build it with RolloutCorrection.fit().")
        self.meta = dict(meta or {})

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, members: int = 5, hidden: Sequence[int] = (32, 32),
            steps: int = 3000, lr: float = 1e-3, clip: float = 5.0, seed: int = 0) -> RolloutCorrection:
        """Fit ``members`` networks (seeds ``seed``, ``seed + 1``, ...) to the realised savings ``y`` (clipped to
        ``+-clip`` epochs) of the feature rows ``x``."""
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != _F or len(x) != len(y) or len(x) == 0:
            raise ValueError(f"`x` must be (rows, {_F}) with one `y` per row; got {x.shape} and {y.shape}. "
                             "HINT: build the rows with rollout_features().")
        check_int("members", members, minimum=1, hint="e.g. 5")
        check_float("clip", clip, minimum=0.0, hint="e.g. 5.0")
        mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-9
        z = (x - mean) / scale
        out = []
        for k in range(int(members)):
            layers = mlp_random([_F, *hidden, 1], seed + k, out_scale=0.01)
            mlp_fit(layers, z, np.clip(y, -clip, clip), steps=steps, lr=lr, seed=seed + k)
            out.append(layers)
        return cls(out, mean, scale, {"rows": int(len(y)), "members": int(members), "hidden": list(hidden),
                                      "steps": int(steps), "clip": float(clip), "seed": int(seed)})

    def __call__(self, x: np.ndarray) -> np.ndarray:
        z = (np.asarray(x, dtype=np.float64) - self.mean) / self.scale
        return np.mean([mlp_forward(m, z, np.float64) for m in self.members], axis=0)

    @classmethod
    def load(cls, path: str | Path | None = None) -> RolloutCorrection:
        """Load a model file (``None``: the shipped one); refuses another feature list."""
        arrays, meta = read_model(path, "rollout_correction", DEFAULT_CORRECTION_MODEL, ROLLOUT_FEATURES,
                                  feature_key="rollout_features", rebuild="`hetero-plugins pretrain-critic`")
        count = int(meta.get("members", 0))
        members = [[(arrays[f"m{k}_W{i}"], arrays[f"m{k}_b{i}"])
                    for i in range(len([a for a in arrays if a.startswith(f"m{k}_W")]))] for k in range(count)]
        return cls(members, arrays["mean"], arrays["scale"], meta)

    def save(self, path: str | Path, **meta: Any) -> Path:
        """Write the members, the standardisation and a metadata header (the feature list, ``meta``)."""
        arrays = {"mean": self.mean, "scale": self.scale}
        for k, m in enumerate(self.members):
            for i, (w, b) in enumerate(m):
                arrays[f"m{k}_W{i}"], arrays[f"m{k}_b{i}"] = w, b
        return write_model(path, arrays, {**self.meta, **meta, "kind": "rollout_correction",
                                          "members": len(self.members), "rollout_features": list(ROLLOUT_FEATURES)})
