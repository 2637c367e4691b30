"""Training the planning relocator's critic (:class:`~hetero_plugins.scheduler.rollout_correction.RolloutCorrection`)
in the simulator: the realised returns of the candidates the relocator meets in closed-loop runs of the family's
*train* split, read from forks of each run (:func:`collect_rollout_returns`), and the rounds that fit the ensemble
to them (:func:`pretrain_critic`, ``hetero-plugins pretrain-critic``). Split from
:mod:`~hetero_plugins.scheduler.placement_training` (the Q-network's fitted Q-iteration), whose scenario sets,
predictor and checkpoints it shares.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._validation import check_float, check_int
from hetero_plugins.progress import progress
from hetero_plugins.scheduler.placement_policy import candidate_decision
from hetero_plugins.scheduler.placement_training import (
    _checkpoint,
    _fingerprint,
    _remove_checkpoint,
    _restoring,
    _settings,
    _write_checkpoint,
    default_predictor,
    relocation_scenarios,
)
from hetero_plugins.scheduler.sim import ClusterSim, load_scenario
from hetero_plugins.scheduler.sim.loop import SimulationRun

__all__ = ["CONTINUATIONS", "collect_rollout_returns", "pretrain_critic"]


def collect_rollout_returns(scenarios: Sequence[Mapping[str, Any]], seeds: Sequence[int] = (0,),
                            explore: float = 0.2, horizon: int = 4, predictor: Any = None,
                            critic: Any = None, known_future: bool = True,
                            forks: int = 1, tail: float = 0.0,
                            continuation: str = "stay") -> tuple[np.ndarray, np.ndarray]:
    """The :data:`~hetero_plugins.scheduler.rollout_correction.ROLLOUT_FEATURES` rows and realised returns of
    every candidate the :class:`~hetero_plugins.scheduler.planning.PlanningRelocator` (with ``critic``, and
    a random candidate or stay with probability ``explore``) meets in closed-loop runs of ``scenarios`` under
    noise ``seeds``: each candidate's return is the seconds it saves over staying, restart included, in the next
    ``horizon`` epochs of a fork of the run (same noise, nobody moving after), in epochs of the current step.

    ``known_future=True`` (default): the forks replay the co-runner and slot events to come, so a return is what
    the move earned in the run, of which the critic learns the mean over the futures its features allow (how long
    co-runners stay, for one). ``False``: the forks play what is announced at the boundary as lasting (the true
    curves and interference, no later events); a critic trained on those returns chose worse on the validation
    split (1.011x / 1.018x the greedy rule on its two halves against 1.018x / 1.020x).

    ``forks`` > 1 averages each return over that many pairs of forks (staying and the move under the same noise):
    the run's own noise, then independent noise seeds, which lowers the variance of the target by what the noise
    of a few epochs adds to it.

    ``tail`` > 0 adds to each return the saving of the fork's last epoch for every epoch the run has left after
    the ``horizon``, discounted by ``tail`` per epoch (:func:`~hetero_plugins.scheduler.planning.tail_weight`):
    a move that pays from its third epoch on in a run with ten left is then valued for those ten, not four.

    ``continuation``: who moves in the forks after the boundary. ``"stay"`` (default): nobody, so a return is the
    move's worth against staying with the placement frozen. ``"policy"``: the relocator being run (a copy, with
    ``critic``, never exploring) keeps deciding at the forks' later boundaries, in the staying fork as in the
    moving ones, so a return is the move's worth under the policy that follows (Q-learning's on-policy target,
    SARSA-like: Rummery and Niranjan, 1994): a move that takes the only free slot is charged for the better move
    that slot would have held a boundary later, a move the policy would make an epoch later anyway is worth that
    epoch, and a move that the policy then undoes pays both restarts. About 3x the collection time per fork."""
    from hetero_plugins.scheduler.planning import PlanningRelocator, tail_weight
    from hetero_plugins.scheduler.rollout_correction import ROLLOUT_FEATURES, rollout_features

    check_int("horizon", horizon, minimum=1, hint="e.g. 4 (epochs a realised return runs over)")
    check_float("explore", explore, minimum=0.0, maximum=1.0, hint="e.g. 0.2")
    check_int("forks", forks, minimum=1, hint="e.g. 1 (pairs of forks a return is averaged over)")
    check_float("tail", tail, minimum=0.0, maximum=1.0, hint="e.g. 0.0 (off) or 0.7")
    _check_continuation(continuation)
    predictor = default_predictor() if predictor is None else predictor
    xs: list[np.ndarray] = []
    ys: list[float] = []
    for spec in scenarios:
        sc = load_scenario(dict(spec))
        for seed in seeds:
            rel = PlanningRelocator(predictor=predictor, workload=sc.workload, restart_cost=sc.restart_cost,
                                    critic=critic, adapt=False, seed=seed)  # the states the critic will meet
            rel.explore = float(explore)
            run = SimulationRun(ClusterSim(sc, seed=seed), "equal_finish", None, 0.03, True, rel)

            def recorder(cands: list[dict[str, Any]], value: np.ndarray, ctx: Mapping[str, Any],
                         run: SimulationRun = run) -> None:
                unit = ctx["t_cur"] * ctx["steps"]
                xs.append(rollout_features(cands, value, ctx))
                saved = np.zeros(len(cands))
                follow = _policy_copy(run.relocator) if continuation == "policy" else None
                for k in range(forks):  # fork 0 replays the run's noise; the others draw their own
                    noise = None if k == 0 else run.sim.seed + 7919 * k
                    stay = run.branch_epochs(None, horizon, seed=noise, known_future=known_future,
                                             continuation=follow)
                    w = tail_weight(tail, int(ctx["epochs_left"]) - len(stay))
                    for j, c in enumerate(cands):
                        move = run.branch_epochs(candidate_decision(c, ctx["incoming"], ctx["keep"], ctx["t_cur"]),
                                                 horizon, seed=noise, known_future=known_future,
                                                 continuation=follow)
                        saved[j] += sum(stay) - sum(move) + (w * (stay[-1] - move[-1]) if w else 0.0)
                ys.extend(saved / (forks * unit))

            rel.recorder = recorder
            for e in range(run.epochs):
                run.epoch(e)
    return (np.concatenate(xs) if xs else np.zeros((0, len(ROLLOUT_FEATURES))), np.array(ys))


#: Who moves in the forks a realised return is read from, after the boundary (:func:`collect_rollout_returns`).
CONTINUATIONS = ("stay", "policy")


def _check_continuation(continuation: str) -> None:
    if continuation not in CONTINUATIONS:
        raise ValueError(f"`continuation`={continuation!r} is not one of {CONTINUATIONS}. HINT: \"stay\" (nobody "
                         "moves in the forks after the boundary; the shipped critic's) or \"policy\" (the relocator "
                         "keeps deciding there).")


def _policy_copy(relocator: Any) -> Any:
    """A copy of ``relocator`` in its current state that decides as it does (no exploration, no training hook),
    for the forks to follow (``continuation="policy"``)."""
    hook, relocator.recorder = relocator.recorder, None  # the hook holds the run: never copy it
    try:
        out = copy.deepcopy(relocator)
    finally:
        relocator.recorder = hook
    out.explore = 0.0
    return out


def _collect_cluster(spec: Mapping[str, Any], **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """:func:`collect_rollout_returns` of one scenario (a worker's unit of :func:`pretrain_critic`)."""
    return collect_rollout_returns([spec], **kw)


@contextlib.contextmanager
def _pool(workers: int) -> Iterator[Any]:
    """A process pool of ``workers`` (``None`` for one: work in this process). A worker that dies (killed, out of
    memory) fails the call with ``BrokenProcessPool`` instead of leaving it waiting."""
    if workers <= 1:
        yield None
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def pretrain_critic(out: str | Path | None = None, family: str = "default", train_count: int = 150,
                    seeds: Sequence[int] = (0, 1), rounds: int = 2, explore: float = 0.2, horizon: int = 4,
                    members: int = 5, hidden: Sequence[int] = (32, 32), steps: int = 3000, seed: int = 0,
                    known_future: bool = True, forks: int = 3, tail: float = 0.0, resume: bool = True,
                    scenarios: Callable[[str, int, str], list[dict[str, Any]]] | None = None,
                    workers: int = 1, continuation: str = "stay",
                    start: Any = None) -> tuple[Any, dict[str, Any]]:
    """Train the :class:`~hetero_plugins.scheduler.rollout_correction.RolloutCorrection` of the planning
    relocator on the *train* split of ``family``: the realised returns of every candidate met in closed-loop runs
    of its first ``train_count`` scenarios with churn and free slots (:func:`collect_rollout_returns`, noise
    ``seeds``, ``explore``, ``horizon``, ``known_future``, ``forks``, ``tail``), an ensemble of ``members`` MLPs
    (``hidden``, ``steps``) fit to them; saved to ``out`` if given. The defaults are the shipped critic's
    procedure (123 clusters, 2 seeds, 2 rounds, each return averaged over 3 pairs of forks: 22,838 returns).

    ``rounds``: the first round's runs are the plain planning relocator's, each later round's are the relocator
    with the critic fit so far, and each refit uses every sample so far (as DAgger does, Ross et al., AISTATS
    2011: the critic is corrected on the states its own choices lead to). With ``out``, the samples and the rounds
    done are checkpointed (atomically) to ``<out>.ckpt.npz`` after each round, and with ``resume`` a later call
    with the same settings (all but ``rounds`` and ``workers``) continues from there; a checkpoint written with
    other settings, or unreadable, raises ``ValueError`` naming the differing settings and the fix
    (``resume=False``, or delete it). The checkpoint is deleted once the model is written.
    ``workers`` > 1 collects the clusters in that many processes; the samples, their order and so the model are
    the same as with one. ``continuation``: who moves in the forks after the boundary (``"stay"``: nobody;
    ``"policy"``: the relocator being run; :func:`collect_rollout_returns`). ``start``: the critic whose relocator
    runs the first round (a :class:`~hetero_plugins.scheduler.rollout_correction.RolloutCorrection`, its file, or
    ``"shipped"``; ``None``: the plain planning relocator), to continue the rounds from a trained critic; the
    model is still fit to the samples of this call's rounds only. Returns the model and its training
    statistics."""
    from hetero_plugins.scheduler.rollout_correction import ROLLOUT_FEATURES, RolloutCorrection

    check_int("train_count", train_count, minimum=1, hint="e.g. 150")
    check_int("rounds", rounds, minimum=1, hint="e.g. 2")
    check_int("workers", workers, minimum=1, hint="e.g. 2 (processes; at most the cores)")
    if not seeds:
        raise ValueError("`seeds` is empty. HINT: give at least one noise seed, e.g. seeds=(0, 1).")
    _check_continuation(continuation)
    first = start if start is None or isinstance(start, RolloutCorrection) \
        else RolloutCorrection.load(None if start == "shipped" else start)
    start_id = None if first is None else _fingerprint([layer for m in first.members for layer in m])
    get = scenarios or relocation_scenarios
    train = [s for s in get("train", train_count, family)
             if s.get("free_slots") and any("corunner" in ev for ev in s.get("events", []))]
    if not train:
        raise ValueError(f"no scenario among the first {train_count} of {family!r}'s train split has co-runner churn "
                         "and free slots. HINT: raise `train_count`.")
    t0 = time.perf_counter()
    xs, ys = np.zeros((0, len(ROLLOUT_FEATURES))), np.zeros(0)
    done, history = 0, []
    settings = _settings(family=family, train_count=train_count, seeds=[int(s) for s in seeds], explore=explore,
                         horizon=horizon, known_future=known_future, forks=forks, tail=tail, members=members,
                         hidden=[int(h) for h in hidden], steps=steps, seed=seed,
                         **({} if continuation == "stay" else {"continuation": continuation}),
                         **({} if start_id is None else {"start": start_id}))
    ckpt, saved = _checkpoint(out, resume, settings)
    if resumed := saved is not None:
        with _restoring(ckpt, saved) as (arrays, meta):
            xs, ys, done, history = arrays["xs"], arrays["ys"], int(meta["rounds"]), list(meta["history"])
    # a resumed run's critic so far (also the result when the checkpoint has every round asked for); else the start
    # critic, and rounds >= 1 fits one
    model = RolloutCorrection.fit(xs, ys, members=members, hidden=hidden, steps=steps, seed=seed) if done else first
    for r in range(done, int(rounds)):
        bar = progress(total=len(train), desc=f"critic round {r + 1}/{rounds}: realised returns", unit="cluster")
        collect_one = functools.partial(_collect_cluster, seeds=[s + 1000 * r for s in seeds], explore=explore,
                                        horizon=horizon, critic=model, known_future=known_future, forks=forks,
                                        tail=tail, continuation=continuation)
        with _pool(workers) as pool:
            for x, y in (pool.map(collect_one, train) if pool is not None else map(collect_one, train)):
                xs, ys = np.concatenate([xs, x]), np.concatenate([ys, y])
                bar.update(1)
        bar.close()
        model = RolloutCorrection.fit(xs, ys, members=members, hidden=hidden, steps=steps, seed=seed)
        history.append({"round": r + 1, "rows": int(len(ys)), "seconds": round(time.perf_counter() - t0, 1)})
        if ckpt is not None:
            _write_checkpoint(ckpt, {"xs": xs, "ys": ys}, {"settings": settings, "rounds": r + 1, "history": history})
    stats = {"family": family, "clusters": len(train), "seeds": list(seeds), "rounds": max(int(rounds), done),
             "explore": explore, "horizon": horizon, "known_future": known_future, "forks": int(forks),
             "tail": float(tail), "continuation": continuation, "start": start_id, "rows": int(len(ys)),
             "history": history, "seconds": round(time.perf_counter() - t0, 1), "resumed": resumed}
    model.meta.update(trained=stats)
    if out is not None:
        model.save(out)
        if ckpt is not None:
            _remove_checkpoint(ckpt)
    return model, stats
