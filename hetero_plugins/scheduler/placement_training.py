"""Pre-training the learned relocation (:class:`~hetero_plugins.scheduler.placement_policy.LearnedRelocator`) in
the simulator: fitted Q-iteration on generated scenarios of the *train* split, model selection on *val*.

Each round runs behaviour episodes (the current network, with exploration) in the simulator; at every decision,
each candidate action's return is realised (``returns="rollout"``): the run is forked under the same noise, the
move applied and the next ``horizon`` epochs run with nobody moving after, against the fork that stays; the
seconds saved, restart included, in epochs of the staying fork's. (``returns="lines"``: the discounted seconds
its placement saves on the true noise-free lines, minus the restart cost; that target misses the planner's refit,
nonlinear curves and the noise of the slowest rank, and a choice by it among the candidates, with the future
known, was no better than the greedy rule on the validation split.) The network is refit on all samples so far
(Ernst et al., JMLR 2005; Riedmiller, ECML 2005) and scored closed loop on validation scenarios against the greedy
:class:`~hetero_plugins.scheduler.relocation.Relocator`; the best round is kept. Zhang, Geng, Ma, IEEE TPDS 2021
(LDWP) pre-train their scheduling DQN before it runs online.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins._files import write_atomic
from hetero_plugins._validation import check_int
from hetero_plugins.balancing.allocators import equal_finish_time
from hetero_plugins.progress import progress
from hetero_plugins.scheduler.candidates import places_after
from hetero_plugins.scheduler.features import mlp_arrays, mlp_from_arrays
from hetero_plugins.scheduler.placement_policy import LearnedRelocator, PlacementNetwork, candidate_decision
from hetero_plugins.scheduler.relocation import Relocator
from hetero_plugins.scheduler.sim import ClusterSim, load_scenario, simulate
from hetero_plugins.scheduler.sim.loop import SimulationRun

__all__ = ["collect", "default_predictor", "evaluate_relocation", "pretrain_placement", "relocation_scenarios"]


#: Stand-in measured interference table (format 1) for the generated family while none is shipped.
STANDIN_TABLE: dict[str, Any] = {"format": 1, "rows": [
    {"workload": w, "corunner": c, "slowdown": s}
    for w, row in {"cnn": {"cpu_burn": 1.9, "membw": 1.5, "io": 1.1, "train": 2.0},
                   "mlp": {"cpu_burn": 1.7, "membw": 1.8, "io": 1.05, "train": 1.8},
                   "digits": {"cpu_burn": 1.6, "membw": 1.3, "io": 1.2, "train": 1.7},
                   "loader": {"cpu_burn": 1.3, "membw": 1.2, "io": 2.2, "train": 1.4}}.items()
    for c, s in row.items()]}


def relocation_scenarios(split: str, count: int, family: str = "default") -> list[dict[str, Any]]:
    """The first ``count`` scenarios of ``split`` in the generated scenario family ``family``
    (:func:`~hetero_plugins.scheduler.sim.family.family_scenarios`; interference from the shipped measured table,
    or :data:`STANDIN_TABLE` where none is shipped)."""
    from hetero_plugins.scheduler.sim.family import family_scenarios

    try:
        return family_scenarios(split, count, family=family)
    except ValueError:
        return family_scenarios(split, count, family=family, table=STANDIN_TABLE)


class _Truth:
    """True (noise-free) equal-finish step times of placements in the simulator, cached per epoch."""

    def __init__(self, scenario: Any, seed: int | None) -> None:
        self.sim = ClusterSim(scenario, seed=seed)
        self.sc = self.sim.scenario
        self._params: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def step_time(self, epoch: int, places: Sequence[int]) -> float:
        if epoch not in self._params:
            self._params[epoch] = self.sim.place_params(epoch)
        a, b, d = self._params[epoch]
        idx = np.asarray(places, dtype=np.int64)
        return float(equal_finish_time(a[idx] + d[idx], np.maximum(b[idx], 1e-12), self.sc.global_batch))

    def returns(self, epoch: int, base: Sequence[int], placements: Sequence[Sequence[int]], cost: float,
                gamma: float, epochs: int) -> np.ndarray:
        """Each placement's discounted seconds saved against ``base`` from ``epoch + 1`` on, less ``cost``, in
        epochs of ``base``'s next step time."""
        sim, steps = self.sim, self.sc.steps_per_epoch
        act = sim.active(epoch)
        t0 = self.step_time(epoch + 1, base)
        out = np.full(len(placements), -cost / (t0 * steps))
        for k, e in enumerate(range(epoch + 1, epochs)):
            if not np.array_equal(sim.active(e), act):
                break
            tb = self.step_time(e, base)
            for j, pl in enumerate(placements):
                out[j] += gamma ** k * (tb - self.step_time(e, pl)) / t0
        return out


@functools.lru_cache(maxsize=1)
def default_predictor() -> Any:
    """The NCF the relocators price slots with in training and evaluation: the one trained on the shipped
    measured table (the family draws its interference from that table), else the shipped default."""
    from hetero_plugins.scheduler.measured import load_measured_predictor

    try:
        return load_measured_predictor()
    except (OSError, ValueError):
        return None


#: How a candidate's return is read in pre-training: ``"rollout"``, realised in a forked run; ``"lines"``, from the
#: true noise-free step times of the placements.
RETURNS = ("rollout", "lines")


def _check_returns(returns: str, horizon: int) -> None:
    """``ValueError`` naming the option unless ``returns`` is one of :data:`RETURNS` and ``horizon`` >= 1."""
    if returns not in RETURNS:
        raise ValueError(f"`returns`={returns!r} is not one of {RETURNS}. HINT: use 'rollout' (realised) or 'lines'.")
    check_int("horizon", horizon, minimum=1, hint="e.g. 4 (epochs a rollout return runs over)")


def _episode(scenario: Mapping[str, Any], net: PlacementNetwork, seed: int, explore: float,
             gamma: float, record: bool = True, online: bool = False,
             predictor: Any = None, returns: str = "rollout",
             horizon: int = 4) -> tuple[list[np.ndarray], list[float], float]:
    """One closed-loop run; returns the features and returns of every candidate met, and the throughput.

    ``returns="rollout"``: each candidate's return is realised: the run is forked at the decision
    (:meth:`~hetero_plugins.scheduler.sim.loop.SimulationRun.branch`, same noise), the candidate applied, and the next
    ``horizon`` epochs run with nobody moving after, against the same fork staying; the seconds saved (restart
    included) in epochs of the staying fork's. This prices what the lines miss: the planner's refit after a
    move, nonlinear step curves, the co-runner's true slowdown. ``"lines"``: the discounted saving of the true
    noise-free lines (placements held, until the ranks change), less the restart cost."""
    _check_returns(returns, horizon)
    sc = load_scenario(dict(scenario))
    truth = _Truth(sc, seed) if returns == "lines" else None
    rel = LearnedRelocator(net, predictor=predictor, workload=sc.workload, restart_cost=sc.restart_cost, gamma=gamma,
                           online=online, adapt=False, seed=seed)  # the shipped network's collection, unchanged
    rel.explore = explore
    xs: list[np.ndarray] = []
    ys: list[float] = []
    run = SimulationRun(ClusterSim(sc, seed=seed), "equal_finish", None, 0.03, True, rel)

    def recorder(cands: list[dict[str, Any]], x: np.ndarray, ctx: Mapping[str, Any], places: list[Any],
                 slot_ids: list[Any], pick: int) -> None:
        if not record:
            return
        if truth is None:
            stay = run.branch(None, horizon)
            epochs = min(horizon, run.epochs - ctx["epoch"] - 1)
            unit = stay / max(epochs, 1)
            y = []
            for c in cands:
                moved = candidate_decision(c, ctx["incoming"], ctx["lines"], ctx["t_cur"])
                y.append((stay - run.branch(moved, horizon)) / unit)
        else:
            placements = [places_after(c, ctx["incoming"], slot_ids, places) for c in cands]
            y = truth.returns(ctx["epoch"], places, placements, sc.restart_cost, gamma, sc.epochs).tolist()
        xs.extend(x)
        ys.extend(y)

    rel.recorder = recorder
    for e in range(run.epochs):
        run.epoch(e)
    return xs, ys, float(run.result()["steady_samples_per_s"])


def collect(scenarios: Sequence[Mapping[str, Any]], net: PlacementNetwork, explore: float = 0.3, gamma: float = 0.98,
            seed: int = 0, predictor: Any = None, returns: str = "rollout",
            horizon: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Features and returns of every candidate met in one behaviour episode per scenario (``predictor``: the
    relocator's NCF, default :func:`default_predictor`; ``returns``, ``horizon``: how returns are read, see
    :data:`RETURNS`)."""
    xs: list[np.ndarray] = []
    ys: list[float] = []
    predictor = default_predictor() if predictor is None else predictor
    for k, sc in enumerate(scenarios):
        x, y, _ = _episode(sc, net, seed + k, explore, gamma, predictor=predictor, returns=returns, horizon=horizon)
        xs += x
        ys += y
    return (np.array(xs).reshape(-1, len(net.layers[0][0])), np.array(ys))


def evaluate_relocation(scenarios: Sequence[Mapping[str, Any]], net: PlacementNetwork | None = None,
                        seeds: Sequence[int] = (0,), gamma: float = 0.98, online: bool = False,
                        policies: Sequence[str] = ("none", "greedy", "learned"), predictor: Any = None,
                        **relocator_kw: Any) -> list[dict[str, Any]]:
    """Closed-loop steady throughput of no relocation, the greedy Relocator and the learned one per scenario
    (mean over noise ``seeds``; each seed's values kept; ``predictor``: both relocators' NCF, default
    :func:`default_predictor`; ``relocator_kw`` go to the learned relocator)."""
    predictor = default_predictor() if predictor is None else predictor
    rows = []
    for sc in scenarios:
        sc_obj = load_scenario(dict(sc))
        row: dict[str, Any] = {"scenario": sc_obj.name}
        for pol in policies:
            vals = []
            for s in seeds:
                if pol == "none":
                    rel: Any = None
                elif pol == "greedy":
                    rel = Relocator(predictor, workload=sc_obj.workload, restart_cost=sc_obj.restart_cost)
                else:
                    rel = LearnedRelocator(net, predictor=predictor, workload=sc_obj.workload,
                                           restart_cost=sc_obj.restart_cost,
                                           gamma=gamma, online=online, seed=s, **relocator_kw)
                vals.append(float(simulate(sc_obj, "equal_finish", seed=s, relocation=rel)["steady_samples_per_s"]))
            row[pol] = float(np.mean(vals))
            row[f"{pol}_seeds"] = vals
        rows.append(row)
    return rows


def score(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean throughput ratios of the learned relocator to greedy and to none, and its worst ratio to none."""
    lg = [r["learned"] / r["greedy"] for r in rows]
    ln = [r["learned"] / r["none"] for r in rows]
    gn = [r["greedy"] / r["none"] for r in rows]
    return {"learned_vs_greedy": float(np.mean(lg)), "learned_vs_none": float(np.mean(ln)),
            "greedy_vs_none": float(np.mean(gn)), "worst_learned_vs_none": float(np.min(ln)), "scenarios": len(rows)}


# ---------------------------------------------------------------------------------------------------- checkpoints
#: The command-line flag of each setting a checkpoint records (named in the error on a mismatch).
_FLAGS = {"family": "--family", "train_count": "--train", "val_count": "--val", "episodes_per_round": "--episodes",
          "seed": "--seed", "fit_steps": "--fit-steps", "returns": "--returns", "horizon": "--horizon",
          "init": "--init", "seeds": "--seeds", "explore": "--explore", "forks": "--forks", "tail": "--tail",
          "members": "--members", "steps": "--fit-steps", "continuation": "--continuation",
          "start": "--start-critic", "hidden": "--hidden"}


def _fingerprint(layers: Iterable[tuple[np.ndarray, np.ndarray]] | None) -> str | None:
    """A short hash of a network's ``(W, b)`` layers (``None`` for none): what a checkpoint records of the network
    a run started from (``--init``, ``--start-critic``)."""
    if layers is None:
        return None
    h = hashlib.sha256()
    for w, b in layers:
        h.update(np.ascontiguousarray(w, dtype=np.float64).tobytes())
        h.update(np.ascontiguousarray(b, dtype=np.float64).tobytes())
    return h.hexdigest()[:16]


def _settings(**settings: Any) -> dict[str, Any]:
    """``settings`` as a checkpoint stores them (through JSON: tuples become lists)."""
    return json.loads(json.dumps(settings))


def _write_checkpoint(path: Path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """Write a checkpoint atomically (an interrupted write leaves the previous one whole)."""
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(dict(meta))), **arrays)
    write_atomic(path, buf.getvalue())


def _remove_checkpoint(path: Path) -> None:
    """Delete a finished run's checkpoint (and the side files of the older placement checkpoints)."""
    for p in (path, Path(str(path) + ".net.npz"), Path(str(path) + ".best.npz")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _read_checkpoint(path: Path, settings: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and meta of the checkpoint ``path``; ``ValueError`` naming the file and the fix if it cannot be
    read or was written by a run with other ``settings`` (naming the differing flags)."""
    fresh = f"pass --no-resume (resume=False) to start from scratch, or delete {str(path)!r}"
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files if k != "meta"}
            meta = json.loads(str(z["meta"]))
        if not isinstance(meta, dict):
            raise ValueError(f"its meta is a {type(meta).__name__}, not an object")
    except Exception as err:  # noqa: BLE001 - a truncated zip, a missing member, bad JSON: the same advice
        raise ValueError(f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: {err}); it is truncated "
                         f"or not a checkpoint of this command. HINT: {fresh}.") from None
    saved = meta.get("settings")
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {str(path)!r} records no settings (an older version wrote it), so whether it "
                         f"belongs to this run cannot be checked. HINT: {fresh}.")
    # a setting either side records (one left at its default may be left out of the settings: absent is None)
    diff = [k for k in (*settings, *(k for k in saved if k not in settings)) if saved.get(k) != settings.get(k)]
    if diff:
        parts = []
        for k in diff:
            flag = _FLAGS.get(k)
            if k in ("init", "start"):
                was = "none" if saved.get(k) is None else f"fingerprint {saved.get(k)}"
                parts.append(f"{flag} (another starting network than the checkpoint's run, {was})")
            elif flag is None:
                parts.append(f"`{k}`={_show(settings.get(k))} (the checkpoint's run: {_show(saved.get(k))})")
            else:
                parts.append(f"{flag} {_show(settings.get(k))} (the checkpoint's run: {_show(saved.get(k))})")
        raise ValueError(f"checkpoint {str(path)!r} was written by a run with other settings: {'; '.join(parts)}. "
                         f"HINT: rerun with the checkpoint's settings to resume it, or {fresh}.")
    return arrays, meta


def _checkpoint(out: str | Path | None, resume: bool, settings: Mapping[str, Any],
                ) -> tuple[Path | None, tuple[dict[str, np.ndarray], dict[str, Any]] | None]:
    """The checkpoint path of a run writing ``out`` (``<out>.ckpt.npz``; ``None`` without ``out``), and, when
    ``resume`` and it exists, its arrays and meta (checked against ``settings`` by :func:`_read_checkpoint`)."""
    path = None if out is None else Path(str(out) + ".ckpt.npz")
    if path is None or not resume or not path.exists():
        return path, None
    return path, _read_checkpoint(path, settings)


@contextlib.contextmanager
def _restoring(path: Path, saved: tuple[dict[str, np.ndarray], dict[str, Any]],
               ) -> Iterator[tuple[dict[str, np.ndarray], dict[str, Any]]]:
    """Hand the block the ``(arrays, meta)`` read from the checkpoint ``path``; a missing or malformed entry met
    while restoring them becomes one ``ValueError`` naming the file and the fix, and a restore that succeeds says
    so on stderr (the rounds done, from ``meta["rounds"]``)."""
    try:
        yield saved
        done = int(saved[1]["rounds"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete ({type(err).__name__}: {err}). HINT: pass "
                         f"--no-resume (resume=False) to start from scratch, or delete it.") from None
    _say_resuming(path, done)


def _prefixed(prefix: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f"{prefix}{k}": v for k, v in arrays.items()}


def _unprefixed(prefix: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _say_resuming(path: Path, done: int) -> None:
    print(f"resuming from {path} ({done} round{'s' if done != 1 else ''} done; --no-resume starts from scratch)",
          file=sys.stderr, flush=True)


def pretrain_placement(
    seconds: float = 300.0,
    seed: int = 0,
    out: str | Path | None = None,
    family: str = "default",
    train_count: int = 60,
    val_count: int = 12,
    episodes_per_round: int = 12,
    net: PlacementNetwork | None = None,
    gamma: float = 0.98,
    fit_steps: int = 1500,
    lr: float = 1e-3,
    max_rounds: int | None = None,
    scenarios: Callable[[str, int, str], list[dict[str, Any]]] | None = None,
    resume: bool = True,
    returns: str = "rollout",
    horizon: int = 4,
) -> tuple[PlacementNetwork, dict[str, Any]]:
    """Fitted Q-iteration on the *train* split of ``family`` for ``seconds``; keep the round that scores best on
    *val* (closed loop, mean throughput ratio to the greedy Relocator); save to ``out`` if given. ``returns``
    and ``horizon``: how each candidate's return is read (:data:`RETURNS`; realised over ``horizon`` epochs of
    a forked run by default).

    With ``out``, the samples, the networks, the random state and the round reached are checkpointed
    (atomically) to ``<out>.ckpt.npz`` after each round, and with ``resume`` a later call with the same ``out``
    and the same settings (all but ``seconds`` and ``max_rounds``) continues from there: the result is the one an
    uninterrupted run would have given. A checkpoint written with other settings, or unreadable, raises
    ``ValueError`` naming the differing settings and the fix (``resume=False``, or delete it). The checkpoint is
    deleted once the model is written.

    Returns the kept network and the training statistics (samples, rounds, validation history).
    """
    _check_returns(returns, horizon)
    get = scenarios or relocation_scenarios
    train = [s for s in get("train", train_count, family) if s.get("free_slots")]  # no free slot: nothing to learn
    val = [s for s in get("val", val_count, family) if s.get("free_slots")]
    rng = np.random.default_rng(seed)
    predictor = default_predictor()
    start = net.copy() if net is not None else PlacementNetwork.random(seed=seed)
    cur = start.copy()
    xs = np.zeros((0, len(cur.layers[0][0])))
    ys = np.zeros(0)
    history: list[dict[str, Any]] = []
    best, best_val, rounds = cur.copy(), -np.inf, 0
    settings = _settings(family=family, train_count=train_count, val_count=val_count,
                         episodes_per_round=episodes_per_round, seed=seed, fit_steps=fit_steps, returns=returns,
                         horizon=horizon, init=_fingerprint(None if net is None else net.layers), gamma=gamma, lr=lr)
    ckpt, saved = _checkpoint(out, resume, settings)
    if resumed := saved is not None:
        with _restoring(ckpt, saved) as (arrays, meta):
            xs, ys = arrays["xs"], arrays["ys"]
            cur = PlacementNetwork(mlp_from_arrays(_unprefixed("net_", arrays)), start.meta)
            best = PlacementNetwork(mlp_from_arrays(_unprefixed("best_", arrays)), start.meta)
            best_val, rounds, history = float(meta["best_val"]), int(meta["rounds"]), list(meta["history"])
            rng.bit_generator.state = meta["rng"]
    greedy = {r["scenario"]: r["greedy"] for r in evaluate_relocation(val, policies=("greedy",), predictor=predictor)}

    def val_score(net: PlacementNetwork) -> float:
        rows = evaluate_relocation(val, net, gamma=gamma, policies=("learned",), predictor=predictor)
        return float(np.mean([r["learned"] / greedy[r["scenario"]] for r in rows]))

    if not np.isfinite(best_val) and val:
        best_val = val_score(cur)
        history.append({"round": 0, "samples": 0, "episodes": 0, "val_vs_greedy": round(best_val, 4)})
    t0 = time.perf_counter()
    bar = progress(total=max_rounds, desc="placement pre-training", unit="round")  # type: ignore[arg-type]
    while (max_rounds is None or rounds < max_rounds) and time.perf_counter() - t0 < seconds:
        picks = rng.choice(len(train), min(episodes_per_round, len(train)), replace=False)
        explore = max(0.1, 0.5 * 0.7 ** rounds)
        x, y = collect([train[i] for i in picks], cur, explore=explore, gamma=gamma, seed=seed * 1000 + rounds * 50,
                       predictor=predictor, returns=returns, horizon=horizon)
        xs, ys = np.concatenate([xs, x]), np.concatenate([ys, y])
        cur.fit(xs, ys, steps=fit_steps, lr=lr, seed=seed + rounds)
        rounds += 1
        v = val_score(cur) if val else 0.0
        history.append({"round": rounds, "samples": int(len(ys)), "episodes": rounds * episodes_per_round,
                        "val_vs_greedy": round(v, 4)})
        if v > best_val:
            best, best_val = cur.copy(), v
        if ckpt is not None:
            _write_checkpoint(ckpt, {"xs": xs, "ys": ys, **_prefixed("net_", mlp_arrays(cur.layers)),
                                     **_prefixed("best_", mlp_arrays(best.layers))},
                              {"settings": settings, "best_val": float(best_val), "rounds": rounds,
                               "history": history, "rng": rng.bit_generator.state})
        bar.update(1)
    bar.close()
    stats = {"family": family, "rounds": rounds, "samples": int(len(ys)), "episodes": rounds * episodes_per_round,
             "validation": history, "best_val_vs_greedy": round(float(best_val), 4), "seed": seed,
             "seconds": seconds, "gamma": gamma, "returns": returns, "horizon": horizon, "resumed": resumed}
    if out is not None:
        best.save(out, trained=stats)
        if ckpt is not None:
            _remove_checkpoint(ckpt)
    return best, stats
