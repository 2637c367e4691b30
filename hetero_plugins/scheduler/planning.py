"""Model-based relocation: judge each candidate move by rolling the balancing planner forward on what the
scheduler believes.

The greedy :class:`~hetero_plugins.scheduler.relocation.Relocator` prices a move by one number, the
equal-finish step time of the lines after it, and asks it to pay the restart back within a few epochs. What a
move realises also depends on how the planner reacts: the moved rank starts from a predicted line that its
measurements then replace, the damping gate and the per-epoch change limit hold the split back for an epoch or
two, and the step waits for the slowest of many noisy ranks. :func:`planner_rollout` plays that out on a copy
of the planner: every step of the next ``horizon`` epochs takes each rank's believed line at the planner's
split, times lognormal noise, plus its data time; the planner learns from those steps as it would from real
ones. :class:`PlanningRelocator` compares the candidates of
:func:`~hetero_plugins.scheduler.candidates.candidate_actions` (stay, the greedy placement, single moves,
moves home) by the seconds their rollouts save over staying, restart cost included, under common noise.

This is model-predictive control with the scheduler's own learned models (the fitted time lines, the NCF's
slowdowns; LDWP's stage-2 predictor, Zhang et al., IEEE TPDS 2021); ``benchmarks/placement_ceiling.py`` measures
the same choice with the simulator's forks (its ``believed`` chooser) beside choosers that know more.
Framework-free: a planner and numbers in, seconds out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_bool, check_float, check_int
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
from hetero_plugins.scheduler.rollout_correction import RolloutCorrection, rollout_features

__all__ = ["PlanningRelocator", "planner_rollout", "rollout_epochs", "tail_weight"]


def planner_rollout(planner: Any, lines: Sequence[tuple[float, float]], data: Sequence[float], steps: int,
                    horizon: int, noise: float = 0.05, seed: int = 0,
                    seeds: Mapping[int, tuple[tuple[float, float], float]] | None = None) -> float:
    """Seconds of compute-and-data time the next ``horizon`` epochs take if every rank runs ``lines``.

    Args:
        planner: a :class:`~hetero_plugins.balancing.planner.BalancePlanner` (copied, never changed).
        lines: each rank's believed ``(intercept, slope)`` of compute seconds per step, for every epoch played.
        data: each rank's data-loading seconds per step.
        steps: steps per epoch.
        horizon: epochs played.
        noise: log-standard deviation of each step's compute time (lognormal, per rank and step).
        seed: the noise draws (use the same one for the alternatives compared: common random numbers).
        seeds: ranks that move: ``{rank: ((intercept, slope), data)}``, the predicted line and data time their
            models start from at the new place (as the integrations and the simulator do after a restart); a
            third entry, ``((intercept, slope), data, batch)``, is the batch the line stands for (``None``: the
            rank's current batch); the planner then re-plans before the first epoch.

    The all-reduce time and the restart cost are the same for every alternative and left out.

    Example::

        >>> from hetero_plugins.balancing.planner import BalancePlanner
        >>> p = BalancePlanner(2, 64, extrapolate="line")  # the lines everywhere: [48, 16], 0.058 s a step
        >>> p.seed_model(0, (0.01, 0.001)); p.seed_model(1, (0.01, 0.003)); _ = p.replan()
        >>> round(planner_rollout(p, [(0.01, 0.001), (0.01, 0.003)], [0.0, 0.0], steps=10, horizon=1, noise=0.0), 3)
        0.58
    """
    return float(sum(rollout_epochs(planner, lines, data, steps, horizon, noise, seed, seeds)))


def rollout_epochs(planner: Any, lines: Sequence[tuple[float, float]], data: Sequence[float], steps: int,
                   horizon: int, noise: float = 0.05, seed: int = 0,
                   seeds: Mapping[int, tuple[Any, ...]] | None = None,
                   floors: Mapping[int, float] | None = None) -> list[float]:
    """:func:`planner_rollout` epoch by epoch: the seconds of each of the ``horizon`` epochs played (``seeds``: per
    moved rank ``(line, data seconds[, batch its line is known up to])``, seeded before the first epoch;
    ``floors``: ranks whose step takes at least that many compute seconds at any batch, a plateau)."""
    n = len(lines)
    check_int("steps", steps, minimum=1, hint="e.g. 20")
    check_int("horizon", horizon, minimum=1, hint="e.g. 4")
    check_float("noise", noise, minimum=0.0, hint="e.g. 0.05")
    if len(data) != n or planner.world_size != n:
        raise ValueError(f"`lines` ({n}), `data` ({len(data)}) and the planner ({planner.world_size} ranks) must "
                         "agree. HINT: give one line and one data time per rank.")
    for name, given in (("seeds", seeds), ("floors", floors)):
        bad = [i for i in (given or {})
               if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n]
        if bad:
            raise ValueError(f"`{name}` names {bad}, which are not ranks of these {n} lines. HINT: key it by rank "
                             f"index, 0 to {n - 1}.")
    p = copy.deepcopy(planner)
    if seeds:
        for i, (line, d, *size) in seeds.items():
            known = size[0] if size else None
            p.seed_model(int(i), line, batch_size=None if known is None else int(known), data_time=float(d))
        p.replan()
    a = np.array([x[0] for x in lines], dtype=np.float64)
    b = np.array([x[1] for x in lines], dtype=np.float64)
    dv = np.asarray(data, dtype=np.float64)
    floor = np.zeros(n)
    for i, f in (floors or {}).items():
        floor[int(i)] = float(f)
    rng = np.random.default_rng(seed)
    times: list[float] = []
    for e in range(int(horizon)):
        plan = np.asarray(p.plan, dtype=np.float64)
        compute = np.maximum(a + b * plan, floor)[:, None] * np.exp(rng.normal(0.0, noise, (n, int(steps))))
        records = np.stack([np.broadcast_to(plan[:, None], compute.shape), compute,
                            np.broadcast_to(dv[:, None], compute.shape)], axis=2)
        times.append(float((compute + dv[:, None]).max(axis=0).sum()))
        if e + 1 < horizon:
            p.end_epoch(e, records, epoch_time=times[-1])
    return times


def tail_weight(tail: float, beyond: int) -> float:
    """How many epochs of the last played epoch's saving count for the ``beyond`` epochs a run has left after a
    rollout (or a fork): ``tail + tail**2 + ... + tail**beyond``, each later epoch discounted by ``tail`` for the
    chance that what was announced no longer holds; 0 for ``tail=0`` or nothing left.

    Example::

        >>> tail_weight(1.0, 3), round(tail_weight(0.5, 2), 2), tail_weight(0.7, 0)
        (3.0, 0.75, 0.0)
    """
    return 0.0 if tail <= 0 or beyond <= 0 else float(beyond if tail == 1 else tail * (1 - tail ** beyond) / (1 - tail))


class PlanningRelocator(Relocator):
    """A :class:`~hetero_plugins.scheduler.relocation.Relocator` that chooses by :func:`planner_rollout`.

    Args:
        predictor, workload, restart_cost: as the :class:`Relocator`'s (the NCF prices the slots and rescales
            the lines to the co-runners placed beside them next epoch).
        horizon: epochs each candidate is played forward (fewer when the run ends sooner).
        draws: noise draws per candidate (common to all candidates; only with ``noise > 0``).
        noise: log-standard deviation of the step noise the rollouts assume.
        margin: smallest saving, in epochs of the current step time and net of the restart, worth a move.
        slowest, best_slots: single moves are tried from the ``slowest`` ranks to the ``best_slots`` free slots
            (besides the greedy placement and moves home; the learned relocator tries 3 x 3).
        critic: a :class:`~hetero_plugins.scheduler.rollout_correction.RolloutCorrection` (or its file;
            ``"shipped"``: the one shipped, trained on the family's training split) that turns each candidate's
            rollout value and what the scheduler sees of the move into the saving it is expected to realise; the
            choice is then the candidate the critic values most, when above ``margin``. ``None`` (default): the
            rollout values decide. ``make_relocator("planned_critic")`` is this relocator with the shipped critic.
        adapt: learn caution online from the run's own moves: after each move, the relocator compares the gain it
            priced the move at with the gain the fitted lines show one epoch later over the places left, keeps the
            shortfall (smoothed, never below 0) and asks every later move to beat it over the span its values
            cover (the rollout ``horizon``, or the critic's training horizon). ``None`` (default): on without a
            critic, off with one. Chosen on the validation split (97 clusters with churn and free slots, 3
            seeds; against greedy / against none / worst): rollouts 1.018 / 1.088 / 0.908 without, **1.022 /
            1.092 / 0.973** with; with the critic of sessions 10-14 1.025 / 1.096 / 0.996 without, 1.024 / 1.094 /
            0.996 with (its training already priced the caution in); the shipped critic (returns averaged over
            three forks) 1.028 / 1.099 / 0.999 without; session 19, first 60 clusters (46 with churn and slots):
            1.033 / 1.101 / 0.994 without, 1.033 / 1.102 / 0.970 with (9 clusters changed, 0.973x-1.068x).
        tail: besides the ``horizon`` epochs played, count the last played epoch's saving once for each epoch
            the run has left after them, discounted by ``tail`` per epoch (:func:`tail_weight`; 0, the default,
            counts the played epochs only). A move whose gain shows only from the planner's third epoch on is
            worth nothing over two played epochs less the restart, though the run has ten left (validation
            ``default-757``: the greedy rule's move there ran 1.13x no relocation; every rollout valued it below 0).
            Validation (97 clusters, 3 seeds, with ``adapt``; against greedy / none / worst): 0 **1.022 / 1.092 /
            0.973**, 0.7 1.024 / 1.096 / 0.956, 1.0 1.022 / 1.093 / 0.935: the mean moves by 0.2%, single clusters
            by up to 24% either way (a long tail also multiplies a wrong belief), so it stays off.
        seed: seeds the noise draws.
        floors: price a free slot no faster than its device's saturation plateau, where the device's ranks show
            one (:meth:`~hetero_plugins.scheduler.relocation.Relocator.device_floors`: the ranks cut to a few
            samples run well above the device's line), and play the moved ranks' steps no shorter than that in the
            rollouts. The device line, fitted where most of the batch runs, prices a slot at a few samples far
            too fast on a plateau (test ``default-248``: a move to a slot beside a 4x co-runner, priced at 6.7 ms a
            step, ran 30 ms; the critic's relocator was 0.920x no relocation there, 0.988x with floors).
            Validation (3 seeds, against ``floors=False``, the critic's relocator): the default family's first 200
            seeds (165 clusters with churn and free slots) 1.0006x, 15 changed (12 up, 3 down; 0.989x-1.037x);
            the ``shifted`` family's first 80 (66) 0.9999x, 3 changed (0.977x-1.019x).
        peer_batches: a rank that moves starts its time model as measured up to the median batch of the ranks on
            its slot's device type (the batches the slot's line was fitted at; ``Relocation.batches``, written to
            the restart spec as ``"batch"``), in the simulator, the integrations and the rollouts alike. Off, it
            starts as measured at its own batch only, and the planner, which prices a batch past what a rank has
            measured in proportion to it (``extrapolate="proportional"``), grows a rank moved from a slow device
            to a fast one over two or three epochs: a move's gain showed from its second or third epoch
            (validation ``default-757``: the greedy rule's move of five ranks priced 1.8x faster ran no faster in
            its first epoch). A slot whose device shows a plateau floor names no batch (its line holds at none).
            Validation (3 seeds, the critic's relocator against ``peer_batches=False``): the first 100 seeds (80
            clusters with churn and free slots) 1.0045x (30 up, 6 down; 0.977x-1.097x), the next 100 (85)
            1.0039x (31 up, 10 down; 0.985x-1.055x), the worst against no relocation unchanged (0.994x, 1.000x);
            ``auto`` around it (before the plateau exception, which changed 7 + 7 of those clusters by at most
            0.4%), the 48 clusters with free slots among the first 60: 1.0001x (0.978x-1.021x).

    Defaults chosen on the validation split (19 clusters with churn and free slots, 3 seeds; mean against the
    greedy rule / mean and worst against no relocation). With ``noise=0.05``, ``horizon`` 1 / 2 / 3 / 4: 1.001 /
    1.057 / 1.000, 1.013 / 1.070 / 1.000, 1.009 / 1.066 / 0.974, 1.008 / 1.065 / 0.968; with 2 epochs, ``noise``
    0 / 0.02 / 0.10: 1.017 / 1.074 / 1.000, 1.016 / 1.073 / 1.000, 1.009 / 1.065 / 1.000; single moves from the
    6 slowest ranks to the 6 best slots instead of 3 x 3: **1.020 / 1.077 / 1.000** (training split, 32 clusters:
    1.026 / 1.122 / 0.966 against 1.021 / 1.117 / 0.966); a margin of 0.25 epochs: 1.001 / 1.058 / 1.000. The
    greedy rule is 1.058x no relocation there, worst 0.968x; the learned relocator 1.049x, worst 1.000x.

    Needs the planner: ``propose(..., planner=...)`` (the simulator and the cluster advisor pass theirs to
    relocators with ``observes_planner``); without one it decides as the greedy :class:`Relocator` does. The
    candidates are of the kinds the learned relocator scores, priced the same way; a candidate the lines predict
    slower is never one.

    Example::

        >>> from hetero_plugins.balancing.planner import BalancePlanner
        >>> p = BalancePlanner(2, 512)
        >>> p.seed_model(0, (0.005, 0.0005)); p.seed_model(1, (0.006, 0.0024)); _ = p.replan()
        >>> r = PlanningRelocator(restart_cost=0.0, noise=0.0)
        >>> d = r.propose(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, "video"],
        ...               lines=[(0.005, 0.0005), (0.006, 0.0024)], free_slots=[{"device": "v100"}],
        ...               global_batch=512, steps_per_epoch=20, epochs_left=5, planner=p)
        >>> d.moves
        [(1, 0)]
    """

    observes_places = True
    observes_planner = True

    def __init__(self, predictor: Any = None, workload: str = "training", restart_cost: float = 60.0,
                 horizon: int = 2, draws: int = 1, noise: float = 0.0, margin: float = 0.0, slowest: int = 6,
                 best_slots: int = 6, critic: RolloutCorrection | str | Path | None = None,
                 adapt: bool | None = None, tail: float = 0.0, seed: int = 0, floors: bool = True,
                 peer_batches: bool = True) -> None:
        super().__init__(predictor, workload=workload, restart_cost=restart_cost)
        self.floors = check_bool("floors", floors)
        self.peer_batches = check_bool("peer_batches", peer_batches)
        self.horizon = check_int("horizon", horizon, minimum=1, hint="e.g. 4")
        self.draws = check_int("draws", draws, minimum=1, hint="e.g. 2")
        self.noise = check_float("noise", noise, minimum=0.0, hint="e.g. 0.05")
        self.margin = check_float("margin", margin, minimum=0.0, hint="e.g. 0.0")
        self.slowest = check_int("slowest", slowest, minimum=1, hint="e.g. 6")
        self.best_slots = check_int("best_slots", best_slots, minimum=1, hint="e.g. 6")
        self.critic = critic if critic is None or isinstance(critic, RolloutCorrection) \
            else RolloutCorrection.load(None if critic == "shipped" else critic)
        self.tail = check_float("tail", tail, minimum=0.0, maximum=1.0, hint="e.g. 0.0 (off) or 0.7")
        self.adapt = self.critic is None if adapt is None else check_bool(
            "adapt", adapt, hint="True, False, or None (on without a critic)")
        self.shortfall = 0.0  #: how much less its moves gained than predicted (relative step time, smoothed)
        self._last: dict[str, Any] | None = None
        self.seed = int(seed)
        self.recorder: Any = None  #: training hook: called with each decision's candidates, values and context
        self.explore = 0.0  #: training: probability of a random candidate (or stay)
        self._rng = np.random.default_rng(seed)

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
        """The candidate whose rollout saves the most over staying (keywords as :meth:`Relocator.propose`, plus
        the place ids, the epoch and the restart cost the simulator passes, and the ``planner``)."""
        if planner is None:
            return super().propose(devices=devices, corunners=corunners, next_corunners=next_corunners, lines=lines,
                                   free_slots=free_slots, global_batch=global_batch, steps_per_epoch=steps_per_epoch,
                                   epochs_left=epochs_left, data=data, workload=workload, solo=solo)
        n = len(devices)
        self.check_lengths(devices, corunners, next_corunners, lines, data)
        self.check_places(n, places, homes)
        self.decisions += 1
        cost = self.restart_cost if restart_cost is None else check_float("restart_cost", restart_cost, minimum=0.0)
        own, incoming, unknown, _ = self.price_places(devices, corunners, next_corunners, lines, free_slots, data,
                                                      workload or self.workload, solo,
                                                      batches=list(planner.plan), floors=self.floors,
                                                      peer_batches=self.peer_batches)
        data_v = np.array([x["data"] for x in own])
        keep = [(x["intercept"], x["slope"]) for x in own]
        self._observe(own, global_batch, places)
        t_cur = placement_step_time(own, global_batch)
        stay = Relocation([None] * n, keep, t_cur, t_cur, 0.0, len(incoming), unknown)
        horizon = min(self.horizon, int(epochs_left))
        if not incoming or t_cur <= 0 or horizon < 1:
            return stay
        cands = candidate_actions(own, incoming, global_batch, free_homes(places, homes, free_slots, incoming),
                                  slowest=self.slowest, best_slots=self.best_slots)
        if not cands:
            return stay
        steps = int(steps_per_epoch)
        value = self.rollout_values(planner, keep, data_v, cands, incoming, steps, horizon, cost,
                                    self.tail_weight(int(epochs_left) - horizon))
        unit = t_cur * steps
        ctx = {"epoch": epoch, "t_cur": t_cur, "steps": steps, "cost": cost, "epochs_left": int(epochs_left),
               "own": own, "incoming": incoming, "keep": keep, "plan": [float(b) for b in planner.plan],
               "global_batch": int(global_batch), "devices": list(devices), "corunners": list(corunners),
               "next_corunners": list(next_corunners), "free_slots": list(free_slots)}
        score = value / unit if self.critic is None else self.critic(rollout_features(cands, value, ctx))
        if self.adapt:
            span = (self.horizon + self.tail_weight(int(epochs_left) - horizon) if self.critic is None
                    else int(self.critic.meta.get("trained", {}).get("horizon", 4)))
            score = score - self.shortfall * min(span, int(epochs_left))
        best = int(np.argmax(score))
        pick = best if score[best] > self.margin else -1  # stay is worth 0
        if self.explore > 0 and self._rng.random() < self.explore:
            pick = int(self._rng.integers(-1, len(cands)))
        if self.recorder is not None:
            self.recorder(cands, value, {**ctx, "pick": pick})
        if pick < 0:
            return stay
        self.relocations += 1
        c = cands[pick]
        self._last = move_record(c, own, t_cur, None if places is None else
                                 places_after(c, incoming, slot_places(free_slots), places))
        return candidate_decision(c, incoming, keep, t_cur, float(score[pick]) * unit, unknown)

    def tail_weight(self, beyond: int) -> float:
        """:func:`tail_weight` of this relocator's ``tail``."""
        return tail_weight(self.tail, beyond)

    def _observe(self, own: Sequence[Mapping[str, float]], global_batch: int, places: Sequence[Any] | None) -> None:
        """After a move: how much less the fitted lines now gain over the old places than the move was priced at."""
        last, self._last = self._last, None
        observed = None if last is None else realised_gain(last, own, global_batch, places)
        if observed is not None:
            self.shortfall = smoothed_shortfall(self.shortfall, last, observed)

    def rollout_values(self, planner: Any, keep: Sequence[tuple[float, float]], data: np.ndarray,
                       cands: Sequence[Mapping[str, Any]], incoming: Sequence[Mapping[str, Any]], steps: int,
                       horizon: int, cost: float, tail_epochs: float = 0.0) -> np.ndarray:
        """Each candidate's seconds saved over staying in ``horizon`` epochs of :func:`planner_rollout`, plus
        ``tail_epochs`` times the saving of the last epoch played, less the restart ``cost`` (mean over the noise
        draws, common to all candidates)."""
        value = np.zeros(len(cands))
        draws = self.draws if self.noise > 0 else 1

        def played(times: list[float]) -> float:
            return sum(times) + tail_epochs * times[-1]

        for k in range(draws):
            seed = self.seed + 7919 * self.decisions + k
            base = played(rollout_epochs(planner, keep, data, steps, horizon, self.noise, seed))
            for j, c in enumerate(cands):
                new_lines, new_data, moved, floors = list(keep), np.array(data, dtype=np.float64), {}, {}
                for i, s in c["moves"].items():
                    slot = incoming[s]
                    new_lines[i] = (slot["intercept"], slot["slope"])
                    new_data[i] = slot["data"]
                    moved[i] = (new_lines[i], slot["data"], slot.get("batch"))
                    if slot.get("floor"):
                        floors[i] = slot["floor"]
                t = played(rollout_epochs(planner, new_lines, new_data, steps, horizon, self.noise, seed, seeds=moved,
                                          floors=floors))
                value[j] += (base - t - cost) / draws
        return value
