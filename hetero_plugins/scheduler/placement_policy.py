"""Learned relocation: a deep Q-network over the sequential "which rank moves to which slot, and when" decisions.

Zhang, Geng, Ma, "Learning-Driven Interference-Aware Workload Parallelization for Streaming Applications in
Heterogeneous Cluster" (IEEE TPDS 2021), LDWP: a deep Q-network, pre-trained and then learned online, maps the
cluster's runtime status and a task's features to the node that task runs on. The batch split has a closed
form (the exact equal-finish allocator is optimal on linear lines), so here the Q-network decides what has
none: at each epoch boundary, whether to move ranks to free slots, which ones, or to move a relocated rank
back, under co-runners of unknown duration, interference the NCF only predicts, and a restart cost. The
greedy :class:`~hetero_plugins.scheduler.relocation.Relocator` applies a myopic rule (a move must pay over a
fixed ``horizon_epochs``); :class:`LearnedRelocator` is a drop-in for it.

- **Actions** (enumerated each boundary, :func:`candidate_actions`): stay; the greedy best placement
  (:func:`~hetero_plugins.scheduler.placement.best_placement` on the Relocator's lines); each single move of one
  of the slowest ranks to one of the best free slots; each relocated rank back to its own (home) place when
  that is free. The split under any placement is the exact allocator's (the simulator's planner).
- **State-action features** (:data:`PLACEMENT_FEATURES`): predicted relative gain and seconds saved per epoch
  (on the Relocator's NCF-scaled lines), restart cost in epochs, epochs left, the ranks moved, whether the
  places left and taken have co-runners, how long those co-runners have been there (the relocator tracks
  each place's co-runner across calls), their predicted slowdowns, the fit's spread, the observed error of
  its own past predictions, world size.
- **Value**: the advantage over staying, in epochs of the current step time: the discounted seconds a
  placement saves over the following epochs against keeping the current one, minus the restart cost
  (stay is 0). The relocator moves only when the best action's value is above 0.
- **Learning**: pre-training is fitted Q-iteration (Ernst, Geurts, Wehenkel, JMLR 2005; Riedmiller's NFQ,
  ECML 2005) in the simulator: behaviour episodes explore the actions, every candidate's return is realised in
  a fork of the run (the move applied, the next epochs run under the same noise, against the fork that stays;
  Monte Carlo rollouts with common random numbers), and the network is refit on the growing set
  (:mod:`hetero_plugins.scheduler.placement_training`). Online (``online=True``), as
  LDWP learns online: at each call the relocator compares the gain it predicted for its last move with the
  gain the fitted lines now show, stores that transition in a small replay, and every ``update_every``
  transitions takes a few gradient steps towards the target ``Q_target(s, a) + (observed - predicted) * D``
  (``D``: the discounted epochs the error persists over; ``Q_target``: a copy of the network synced after each
  round of updates, as in DQN).
- **Decision**: the greedy placement whenever the Relocator's own rule would move with a one-epoch payback
  (``keep_greedy``, chosen on validation scenarios: the network alone lost to greedy on a few of them by
  swapping its move for a close single move); otherwise the candidate of highest value when that value is
  above ``margin``, else stay. So the network adds the moves the myopic rule misses (longer runs, cheap
  restarts against many epochs left, slots freed late) and times them.
- **Safety**: an action whose predicted step-time gain on the Relocator's lines is not positive is never a
  candidate, so the learned relocator never moves ranks to a placement the greedy one predicts slower.

Inference is numpy only (a small MLP); training needs no torch either.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_bool, check_float, check_int
from hetero_plugins.scheduler.features import (
    mlp_arrays,
    mlp_fit,
    mlp_forward,
    mlp_from_arrays,
    mlp_random,
    read_model,
    write_model,
)
from hetero_plugins.scheduler.candidates import (
    candidate_actions,
    candidate_decision,
    free_homes,
    move_record,
    placement_step_time,
    places_after,
    realised_gain,
    slot_places,
    smoothed_shortfall,
)
from hetero_plugins.scheduler.relocation import Relocation, Relocator

__all__ = ["AUTO_RELOCATION",
           "DEFAULT_PLACEMENT_MODEL", "PLACEMENT_FEATURES", "RELOCATION_POLICIES", "LearnedRelocator",
           "PlacementNetwork", "candidate_actions", "candidate_decision", "default_relocator", "make_relocator"]

DEFAULT_PLACEMENT_MODEL = "placement_v1.npz"

#: The state-action features, in order (each roughly in [0, 2]).
PLACEMENT_FEATURES = (
    "gain",             # predicted relative step-time gain (t_now / t_new - 1)
    "saving",           # predicted fraction of an epoch saved per epoch (1 - t_new / t_now)
    "saving_horizon",   # predicted discounted epochs saved over the epochs left
    "saving_3",         # predicted epochs saved over 3 epochs minus the restart cost (the greedy rule)
    "restart_epochs",   # restart cost in epochs of the current step time
    "epochs_left",      # epochs left / 20 (capped at 3)
    "moved_fraction",   # ranks moved / world size
    "moves",            # ranks moved / 8 (capped at 2)
    "from_corunner",    # share of the moved ranks whose place has a co-runner next epoch
    "from_age",         # log1p(epochs that co-runner state has lasted) / 3, mean over moved ranks
    "to_corunner",      # share of the places taken that have a co-runner
    "to_age",           # log1p(epochs their co-runner state has lasted) / 3
    "from_slowdown",    # predicted slowdown - 1 at the places left (mean)
    "to_slowdown",      # predicted slowdown - 1 at the places taken (mean)
    "uncertainty",      # spread of the ranks' solo slopes within a device type (std of log)
    "residual",         # running mean |observed - predicted| saving of the relocator's own past moves
    "world",            # log2(world size) / 10
    "is_greedy",        # the greedy best placement
    "is_home",          # a relocated rank back to its own place
)
_F = len(PLACEMENT_FEATURES)


class PlacementNetwork:
    """The Q-network: an MLP ``PLACEMENT_FEATURES -> advantage over staying`` in numpy (float64).

    Args:
        layers: ``[(W, b), ...]``; ReLU between layers, one linear output.
        meta: metadata saved with the weights.

    Example::

        >>> net = PlacementNetwork.random(seed=0)
        >>> net(np.zeros((2, len(PLACEMENT_FEATURES)))).shape
        (2,)
    """

    def __init__(self, layers: Sequence[tuple[np.ndarray, np.ndarray]], meta: Mapping[str, Any] | None = None) -> None:
        self.layers = [(np.array(w, dtype=np.float64), np.array(b, dtype=np.float64)) for w, b in layers]
        if not self.layers or self.layers[0][0].shape[0] != _F or self.layers[-1][0].shape[1] != 1:
            raise ValueError(f"a placement Q-network maps {_F} features to 1 value; got layer shapes "
                             f"{[w.shape for w, _ in self.layers]}. HINT: build it with PlacementNetwork.random().")
        self.meta = dict(meta or {})

    @classmethod
    def random(cls, hidden: Sequence[int] = (32, 32), seed: int = 0) -> PlacementNetwork:
        """An untrained network (He-initialised, output layer near zero: "stay" everywhere)."""
        return cls(mlp_random([_F, *hidden, 1], seed, out_scale=0.01))

    @classmethod
    def load(cls, path: str | Path | None = None) -> PlacementNetwork:
        """Load a model file (``None``: the shipped one); refuses another feature list."""
        arrays, meta = read_model(path, "placement", DEFAULT_PLACEMENT_MODEL, PLACEMENT_FEATURES,
                                  rebuild="`hetero-plugins pretrain-placement`")
        return cls(mlp_from_arrays(arrays), meta)

    def save(self, path: str | Path, **meta: Any) -> Path:
        """Write the weights and a metadata header (the feature list, ``meta``)."""
        return write_model(path, mlp_arrays(self.layers), {**self.meta, **meta, "kind": "placement",
                                          "features": list(PLACEMENT_FEATURES)})

    def copy(self) -> PlacementNetwork:
        return PlacementNetwork([(w.copy(), b.copy()) for w, b in self.layers], self.meta)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return mlp_forward(self.layers, x, np.float64)

    def fit(self, x: np.ndarray, y: np.ndarray, steps: int = 2000, lr: float = 1e-3, batch: int = 128,
            seed: int = 0, weight_decay: float = 1e-5, state: dict[str, Any] | None = None) -> float:
        """Adam on the Huber loss towards targets ``y`` (:func:`~hetero_plugins.scheduler.features.mlp_fit`);
        returns the last mean loss. ``state`` carries Adam's moments between calls (online updates)."""
        return mlp_fit(self.layers, x, y, steps=steps, lr=lr, batch=batch, seed=seed, weight_decay=weight_decay,
                       state=state)


class LearnedRelocator(Relocator):
    """A :class:`~hetero_plugins.scheduler.relocation.Relocator` whose moves a Q-network chooses (LDWP).

    Args:
        model: a :class:`PlacementNetwork`, a model file, or ``None`` for the shipped model.
        predictor: the NCF pricing the slots (as :class:`Relocator`).
        workload: this job's workload type.
        restart_cost: seconds a restart costs (the simulator passes its scenario's with each call).
        gamma: discount per epoch of the value (the one the model was trained with).
        margin: smallest value (epochs of the current step time saved) worth a move of the network's own
            (default 0.5, chosen on the validation split: with 0 the network's extra moves lost 0.5% against the
            greedy rule's there; at 0.5 and 1.5 it moves where that rule does, and rarely more).
        other_margin: how much more than the greedy placement another candidate must be worth to be chosen
            instead (a large value such as ``1e9``: choose only between stay and the greedy placement; chosen on
            validation scenarios).
        keep_greedy: when the greedy Relocator's own rule would move (gain of at least ``greedy_min_gain`` paid
            back over ``greedy_horizon`` epochs), take the greedy placement whatever the network says; the
            network then decides the moves the myopic rule misses (chosen on validation scenarios).
        greedy_min_gain, greedy_horizon: that rule's parameters: a gain of 5% that pays the restart back within
            one epoch (the :class:`Relocator`'s horizon is 3; a move that needs longer is the network's to take.
            Chosen on the validation and training splits: worst cluster 1.000x / 0.951x no relocation against
            0.968x / 0.918x with 3 epochs; mean 1.049x / 1.076x against 1.058x / 1.059x).
        veto: with ``keep_greedy``, the greedy placement is not forced when the network values it below
            ``-veto`` (epochs of the current step time); ``None`` (default): never vetoed (0.3 and 1.0 scored
            the same as ``None`` on the validation split).
        online: keep learning from the outcomes observed at the next call (default ``True``, as LDWP does; on
            the family's validation split it changed no run's outcome: short runs make few moves to learn from).
        update_every: online transitions between rounds of updates.
        replay_size: online replay capacity.
        online_lr, online_steps: learning rate and minibatch steps of each online round.
        adapt: learn caution from the run's own moves, as the planning relocator's ``adapt`` does: after each move
            the gain it was priced at (``1 - t_new / t_now`` on the lines) is compared with the gain the fitted
            lines show one epoch later over the places the moved ranks left; the shortfall (smoothed by halves,
            never below 0) is taken off every later candidate's value over ``adapt_span`` epochs and added, as a
            share of the current step, to the step the greedy rule predicts for its move, so a move that
            disappointed makes the next ones, the forced greedy ones included, prove more (default ``True``,
            session 19). Validation (3 seeds; ``dqn`` against the best analytic allocator, the learned relocation
            against the greedy rule / no relocation / worst, over the clusters with churn and free slots), first 60
            clusters: without 1.229x, 0.997 / 1.062 / 0.939; with **1.234x, 1.000 / 1.064 / 0.969**; next 60:
            without 1.231x (worst 0.973x), 1.011 / 1.076 / 0.877; with **1.235x (worst 0.989x), 1.014 / 1.078 /
            0.971**; re-planning every 5 steps (first 60) ``dqn`` 1.252x -> 1.262x. Per cluster 0.945x-1.201x the
            former: the online rule loses where a first move disappointed and a later one would have paid.
        adapt_span: epochs over which the shortfall is asked of a candidate's value (the training horizon).
        seed: seeds the online minibatches.
        peer_batches: given the ``planner`` (the simulator and the cluster advisor pass theirs to relocators with
            ``observes_planner``), a rank that moves starts its time model as measured up to the median batch of
            the ranks on its slot's device type (``Relocation.batches``), as the planning relocator's
            ``peer_batches`` does; without it the planner grows a rank moved from a slow device over two or three
            epochs. Validation (3 seeds, the learned relocation against ``peer_batches=False``, clusters with churn
            and free slots): the first 100 seeds (80 clusters) 1.0037x (45 up, 3 down, worst 0.999x), against the
            greedy rule 1.003x -> 1.007x (arithmetic means), no relocation 1.070x -> 1.075x; the next 100 (85)
            1.0061x (38 up, 13 down, 0.989x-1.064x), 1.018x -> 1.024x, 1.080x -> 1.087x (session 24).

    The simulator (:func:`~hetero_plugins.scheduler.sim.simulate`) passes ``places``, ``homes``, ``epoch`` and
    ``restart_cost`` to relocators with ``observes_places``; without them (a plain call as to a
    :class:`Relocator`) places are identified by rank and free-slot index.

    Example::

        >>> r = LearnedRelocator(restart_cost=0.0)
        >>> d = r.propose(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, "video"],
        ...               lines=[(0.005, 0.0005), (0.006, 0.0012)], free_slots=[{"device": "v100"}],
        ...               global_batch=512, steps_per_epoch=20, epochs_left=5)
        >>> d.predicted_gain >= 0
        True
    """

    observes_places = True
    observes_planner = True

    def __init__(self, model: PlacementNetwork | str | Path | None = None, predictor: Any = None,
                 workload: str = "training", restart_cost: float = 60.0, gamma: float = 0.98, margin: float = 0.5,
                 other_margin: float = 0.0, keep_greedy: bool = True, greedy_min_gain: float = 0.05,
                 greedy_horizon: int = 1, veto: float | None = None, online: bool = True, update_every: int = 4,
                 replay_size: int = 256, online_lr: float = 3e-4,
                 online_steps: int = 20, adapt: bool = True, adapt_span: int = 4, seed: int = 0,
                 peer_batches: bool = True) -> None:
        super().__init__(predictor, workload=workload, min_gain=0.0, restart_cost=restart_cost, horizon_epochs=1)
        self.net = model.copy() if isinstance(model, PlacementNetwork) else PlacementNetwork.load(model)
        self.gamma = check_float("gamma", gamma, minimum=0.0, maximum=1.0, hint="e.g. 0.98")
        self.margin = check_float("margin", margin, hint="e.g. 0.0")
        self.other_margin = check_float("other_margin", other_margin, minimum=0.0,
                                        hint="e.g. 0.1, or 1e9 for stay-or-greedy only")
        self.online = bool(online)
        self.keep_greedy = bool(keep_greedy)
        self.greedy_min_gain = check_float("greedy_min_gain", greedy_min_gain, minimum=0.0, hint="e.g. 0.05")
        self.greedy_horizon = check_int("greedy_horizon", greedy_horizon, minimum=1, hint="e.g. 3")
        self.veto = None if veto is None else check_float("veto", veto, minimum=0.0,
                                                          hint="e.g. 0.5, or None to never veto the greedy move")
        self.update_every = check_int("update_every", update_every, minimum=1, hint="e.g. 4")
        self.online_lr = check_float("online_lr", online_lr, minimum=0.0, hint="e.g. 3e-4")
        self.online_steps = check_int("online_steps", online_steps, minimum=1, hint="e.g. 20")
        self.replay: deque[tuple[np.ndarray, float]] = deque(maxlen=check_int("replay_size", replay_size, minimum=1))
        self.target = self.net.copy()
        self.seed = int(seed)
        self.updates = 0  #: online rounds of updates taken
        self.residual = 0.0  #: running mean |observed - predicted| saving of past moves
        self.adapt = check_bool("adapt", adapt, hint="True or False")
        self.adapt_span = check_int("adapt_span", adapt_span, minimum=1, hint="e.g. 4")
        self.peer_batches = check_bool("peer_batches", peer_batches, hint="True or False")
        self.shortfall = 0.0  #: how much less its moves gained than predicted (relative step time, smoothed)
        self.recorder: Any = None  #: training hook: called with each decision's candidates and features
        self.explore = 0.0  #: training: probability of a random candidate (or stay)
        self._rng = np.random.default_rng(seed)
        self._adam: dict[str, Any] = {}
        self._seen: dict[Any, tuple[Any, int]] = {}  # place -> (co-runner, epoch it started)
        self._calls = 0
        self._last: dict[str, Any] | None = None

    # ---------------------------------------------------------------- bookkeeping across calls
    def _age(self, place: Any, corunner: Any, epoch: int) -> int:
        prev = self._seen.get(place)
        if prev is None or prev[0] != corunner:
            self._seen[place] = (corunner, epoch)
            return 0 if prev is not None else 4  # first sight: state of unknown age (treated as settled)
        return epoch - prev[1]

    def _observe(self, lines: Sequence[tuple[float, float]], data: np.ndarray, places: list[Any],
                 global_batch: int) -> None:
        """Compare the last move's predicted saving with what the fitted lines show now; learn online."""
        last, self._last = self._last, None
        now = [{"intercept": a, "slope": b, "data": float(d)} for (a, b), d in zip(lines, data)]
        observed = None if last is None else realised_gain(last, now, global_batch, places)
        if observed is None:
            return
        error = observed - last["predicted"]
        self.residual = 0.7 * self.residual + 0.3 * min(abs(error), 1.0)
        self.shortfall = smoothed_shortfall(self.shortfall, last, observed)
        if not self.online:
            return
        d = sum(self.gamma ** k for k in range(max(1, last["epochs_left"])))
        y = float(self.target(last["x"][None])[0]) + error * d
        self.replay.append((last["x"], y))
        if len(self.replay) % self.update_every == 0:
            xs = np.stack([r[0] for r in self.replay])
            ys = np.array([r[1] for r in self.replay])
            self.net.fit(xs, ys, steps=self.online_steps, lr=self.online_lr, batch=32,
                         seed=self.seed + self.updates, state=self._adam)
            self.target = self.net.copy()
            self.updates += 1

    # ---------------------------------------------------------------- the decision
    def propose(  # type: ignore[override]
        self,
        *,
        devices: Sequence[str],
        corunners: Sequence[str | None],
        next_corunners: Sequence[str | None],
        lines: Sequence[tuple[float, float]],
        free_slots: Sequence[Mapping[str, Any]],
        global_batch: int,
        steps_per_epoch: int,
        epochs_left: int,
        data: Sequence[float] | None = None,
        workload: str | None = None,
        solo: Mapping[str, tuple[float, float]] | None = None,
        places: Sequence[Any] | None = None,
        homes: Sequence[Any] | None = None,
        epoch: int | None = None,
        restart_cost: float | None = None,
        planner: Any = None,
    ) -> Relocation:
        """The Q-network's choice among stay and the :func:`candidate_actions` (keywords as
        :meth:`Relocator.propose`, plus each rank's ``places`` and ``homes`` (place ids), the ``epoch`` and the
        ``restart_cost`` in seconds, which the simulator passes)."""
        n = len(devices)
        self.check_lengths(devices, corunners, next_corunners, lines, data)
        self.check_places(n, places, homes)
        self.decisions += 1
        self._calls += 1
        epoch = self._calls if epoch is None else int(epoch)
        cost = self.restart_cost if restart_cost is None else check_float("restart_cost", restart_cost, minimum=0.0)
        wl = workload or self.workload
        data_v = np.zeros(n) if data is None else np.asarray(data, dtype=np.float64)
        places_l = [("rank", i) for i in range(n)] if places is None else list(places)
        slot_ids = slot_places(free_slots)
        self._observe(lines, data_v, places_l, global_batch)
        batches = list(planner.plan) if planner is not None and self.peer_batches else None
        own, incoming, unknown, solo = self.price_places(devices, corunners, next_corunners, lines, free_slots, data,
                                                         wl, solo, batches=batches)
        ages_from = [self._age(p, c, epoch) for p, c in zip(places_l, next_corunners)]
        ages_to = {k: self._age(slot_ids[k], s.get("corunner"), epoch) for k, s in enumerate(free_slots)}
        keep = [(x["intercept"], x["slope"]) for x in own]
        t_cur = placement_step_time(own, global_batch)
        stay = Relocation([None] * n, keep, t_cur, t_cur, 0.0, len(incoming), unknown)
        if not incoming or t_cur <= 0:
            return stay
        cands = candidate_actions(own, incoming, global_batch, free_homes(places_l, homes, free_slots, incoming))
        if not cands:
            return stay
        ctx = {"epoch": epoch, "n": n, "t_cur": t_cur, "cost": cost, "steps": int(steps_per_epoch),
               "epochs_left": int(epochs_left),
               "devices": devices, "corunners": corunners, "next_corunners": next_corunners, "lines": lines,
               "workload": wl, "ages_from": ages_from, "ages_to": ages_to, "incoming": incoming,
               "free_slots": free_slots, "solo": solo}
        x = self.features(cands, ctx)
        q = self.net(x)
        score = q - np.array([0.0 if c["kind"] == "greedy" else self.other_margin for c in cands])
        caution = self.shortfall if self.adapt else 0.0
        score = score - caution * min(self.adapt_span, int(epochs_left))
        pick = int(np.argmax(score)) if score.max() > self.margin else -1
        if self.keep_greedy:
            for k, c in enumerate(cands):
                t_new = c["t_new"] + caution * t_cur
                gain = t_cur / t_new - 1.0
                saved = (t_cur - t_new) * min(int(epochs_left), self.greedy_horizon) * steps_per_epoch - cost
                if c["kind"] == "greedy" and gain >= self.greedy_min_gain and saved > 0 \
                        and (self.veto is None or q[k] > -self.veto):
                    pick = k
        if self.explore > 0 and self._rng.random() < self.explore:
            pick = int(self._rng.integers(-1, len(cands)))
        if self.recorder is not None:
            self.recorder(cands, x, ctx, places_l, slot_ids, pick)
        if pick < 0:
            return stay
        c = cands[pick]
        after = places_after(c, incoming, slot_ids, places_l)
        self._last = {**move_record(c, own, t_cur, after), "x": x[pick], "epochs_left": int(epochs_left)}
        self.relocations += 1
        return candidate_decision(c, incoming, keep, t_cur, float(q[pick]) * t_cur * steps_per_epoch, unknown)

    def features(self, cands: list[dict[str, Any]], ctx: Mapping[str, Any]) -> np.ndarray:
        """The :data:`PLACEMENT_FEATURES` row of each candidate."""
        n, t_cur, e_left = ctx["n"], ctx["t_cur"], max(0, ctx["epochs_left"])
        restart = min(ctx["cost"] / (t_cur * max(ctx["steps"], 1)), 5.0)
        disc = sum(self.gamma ** k for k in range(e_left)) if e_left else 0.0
        wl = ctx["workload"]
        logs: dict[str, list[float]] = {}
        for d, c, (_, b) in zip(ctx["devices"], ctx["corunners"], ctx["lines"]):
            s = self.slowdown(d, c, wl)
            if s and b > 0:
                logs.setdefault(d, []).append(math.log(b / s))
        spread = [float(np.std(v)) for v in logs.values() if len(v) > 1]
        uncertainty = min(float(np.mean(spread)) if spread else 0.0, 1.0)
        x = np.zeros((len(cands), _F))
        for r, c in enumerate(cands):
            moves = c["moves"]
            saving = 1.0 - c["t_new"] / t_cur
            src = list(moves)
            dst = [ctx["incoming"][j]["free_slot"] for j in moves.values()]
            co_from = [ctx["next_corunners"][i] is not None for i in src]
            co_to = [ctx["free_slots"][k].get("corunner") is not None for k in dst]
            sd_from = [(self.slowdown(ctx["devices"][i], ctx["next_corunners"][i], wl) or 1.0) - 1.0 for i in src]
            sd_to = [(self.slowdown(ctx["free_slots"][k].get("device"), ctx["free_slots"][k].get("corunner"), wl)
                      or 1.0) - 1.0 for k in dst]
            x[r] = (min(t_cur / c["t_new"] - 1.0, 2.0), saving, min(saving * disc, 10.0) / 2.0,
                    saving * min(e_left, 3) - restart, restart, min(e_left / 20.0, 3.0), len(moves) / n,
                    min(len(moves) / 8.0, 2.0), float(np.mean(co_from)),
                    float(np.mean([math.log1p(ctx["ages_from"][i]) for i in src])) / 3.0,
                    float(np.mean(co_to)), float(np.mean([math.log1p(ctx["ages_to"][k]) for k in dst])) / 3.0,
                    min(float(np.mean(sd_from)), 2.0), min(float(np.mean(sd_to)), 2.0), uncertainty,
                    self.residual, math.log2(max(n, 1)) / 10.0, float(c["kind"] == "greedy"),
                    float(c["kind"] == "home"))
        return x


#: Relocation policies by name (for benchmarks): no relocation, the greedy Relocator, the learned one, the
#: model-based one (:class:`~hetero_plugins.scheduler.planning.PlanningRelocator`), and the model-based one whose
#: rollout values the shipped critic corrects (:mod:`~hetero_plugins.scheduler.rollout_correction`).
RELOCATION_POLICIES = ("none", "greedy", "learned", "planned", "planned_critic")


def make_relocator(name: str, scenario: Any = None, **kw: Any) -> Relocator | None:
    """The relocation policy ``name`` (:data:`RELOCATION_POLICIES`) for a scenario (its workload and restart
    cost; ``scenario`` is a :class:`~hetero_plugins.scheduler.sim.Scenario` or ``None``); ``kw`` go to the
    relocator. ``"none"`` is ``None`` (``simulate(..., relocation=None)``)."""
    if name not in RELOCATION_POLICIES:
        raise ValueError(f"`name`={name!r} is not a relocation policy. HINT: use one of {RELOCATION_POLICIES}.")
    if name == "none":
        return None
    if scenario is not None:
        kw = {"workload": scenario.workload, "restart_cost": scenario.restart_cost, **kw}
    if name in ("planned", "planned_critic"):
        from hetero_plugins.scheduler.planning import PlanningRelocator  # imports this module
        return PlanningRelocator(**({"critic": "shipped", **kw} if name == "planned_critic" else kw))
    return Relocator(**kw) if name == "greedy" else LearnedRelocator(**kw)


#: The relocation ``auto`` guards by default (``relocation=True``): the model-based relocator with the shipped critic.
#: Chosen on the validation split (the 48 clusters with free slots among its first 60, 3 seeds; ``auto`` relative to
#: the best analytic allocator, mean / worst): around the critic-corrected planner 1.177 / 1.000, around the
#: placement Q-network (``"learned"``, the default before) 1.150 / 1.000. With the critic shipped since session 15
#: (returns averaged over three forks): 1.176 / 1.000, per cluster 0.950x-1.045x the former.
AUTO_RELOCATION = "planned_critic"


def default_relocator(allocator: Any, scenario: Any = None) -> Any:
    """What ``relocation=True`` means beside ``allocator``, in the integrations and in ``hetero-plugins simulate
    --relocate``: with an allocator that guards relocations (``auto``), its guard around
    :data:`AUTO_RELOCATION` (the planning relocator with the shipped critic); with any other, the greedy
    :class:`~hetero_plugins.scheduler.relocation.Relocator` (``scenario``: as for :func:`make_relocator`)."""
    guard = getattr(allocator, "guard", None)
    return make_relocator("greedy", scenario) if guard is None else guard(make_relocator(AUTO_RELOCATION, scenario))
