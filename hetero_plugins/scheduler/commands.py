"""``hetero-plugins simulate | pretrain | pretrain-placement | pretrain-critic | transfer``: the learned scheduler's
command-line side."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetero_plugins._files import check_output_path
from hetero_plugins.balancing.allocators import ALLOCATORS, get_allocator
from hetero_plugins.progress import progress, timed
from hetero_plugins.scheduler.pretrain import pretrain_dqn, pretrain_ncf
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, load_scenario, oracle, simulate
from hetero_plugins.scheduler.transfer import transfer_dqn

__all__ = ["compare", "default_relocation", "pretrain_critic_main", "pretrain_main", "pretrain_placement_main",
           "simulate_main", "transfer_main"]

DEFAULT_ALLOCATORS = "static,proportional,equal_finish,lbb,dqn,auto"


def _allocators(text: str) -> list[str]:
    """The names of ``--allocators``; ``ValueError`` naming the flag, the value and the fix."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise ValueError(f"`--allocators`={text!r} is empty. HINT: e.g. --allocators equal_finish,dqn,auto")
    for a in names:
        try:
            get_allocator(a)
        except ValueError:
            raise ValueError(f"`--allocators`={text!r}: {a!r} is not an allocator. HINT: use names from "
                             f"{sorted(ALLOCATORS)}, comma-separated, e.g. --allocators equal_finish,dqn,auto"
                             ) from None
    return names


def _error(message: str) -> int:
    """Print a usage error; the exit code of one (2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def _seed_error(seed: int | None) -> str | None:
    """Why ``--seed`` is unusable (``None``: it is fine); every command checks it the same way."""
    if seed is not None and seed < 0:
        return f"`--seed` must be an int >= 0, got {seed}. HINT: e.g. --seed 0"
    return None


def _seconds_error(seconds: float, example: str) -> str | None:
    """Why ``--seconds`` is unusable (``None``: it is fine): it must be a finite number > 0."""
    if not (math.isfinite(seconds) and seconds > 0):
        return f"`--seconds` must be a finite number > 0, got {seconds}. HINT: e.g. --seconds {example}"
    return None


def _out_error(path: str, flag: str = "--out", folder: bool = False) -> str | None:
    """Why the output path ``path`` cannot be written (``None``: it can), checked before the work."""
    try:
        check_output_path(path, flag, folder=folder)
    except ValueError as err:
        return str(err)
    return None


def _first(*errors: str | None) -> str | None:
    return next((e for e in errors if e is not None), None)


ANALYTIC = ("static", "proportional", "equal_finish", "lbb")


def default_relocation(alloc: Any, sc: Any, relocation: Any) -> Any:
    """``relocation`` for a simulated run of ``alloc``: ``True`` becomes what it means in the integrations
    (:func:`~hetero_plugins.scheduler.placement_policy.default_relocator`: ``auto``'s guard around the planning
    relocator with the shipped critic, else the greedy ``Relocator``); anything else is returned as given."""
    if relocation is not True:
        return relocation
    from hetero_plugins.scheduler.placement_policy import default_relocator

    return default_relocator(alloc, sc)


def compare(scenario: Any, policy: Any = "auto", epochs: int | None = None, seed: int | None = None,
            analytic: tuple[str, ...] = ANALYTIC, relocation: Any = None,
            replan_every: int | None = None) -> dict[str, Any]:
    """One run of ``policy`` on ``scenario`` beside the oracle, the equal split and the best analytic allocator.

    ``relocation`` (``True``: :func:`default_relocation`, or a
    :class:`~hetero_plugins.scheduler.relocation.Relocator`) lets the policy's run move ranks to free slots
    (see :func:`~hetero_plugins.scheduler.sim.simulate`); the analytic runs never
    relocate (they have no model of a slot they have not run on). ``replan_every``: mid-epoch re-plans every this
    many steps in every run but the oracle's (see :func:`~hetero_plugins.scheduler.sim.simulate`).

    Throughputs are samples per second of simulated training over all epochs (``samples_per_s``) and after the
    first, measuring epoch (``steady_samples_per_s``: the oracle knows the true times from the start, every
    policy spends the first epoch on an equal split to measure them).
    """
    sc = load_scenario(scenario)
    alloc = get_allocator(policy)
    policy = policy if isinstance(policy, str) else alloc.name
    if "static" not in analytic:
        analytic = ("static", *analytic)
    bar = progress(total=len(analytic) + 2, desc=f"simulate {sc.name}", unit="run")
    runs = {"policy": simulate(sc, alloc, epochs=epochs, seed=seed,
                               relocation=default_relocation(alloc, sc, relocation), replan_every=replan_every)}
    bar.update()
    for name in analytic:
        runs[name] = (runs["policy"] if name == policy and not relocation
                      else simulate(sc, name, epochs=epochs, seed=seed, replan_every=replan_every))
        bar.update()
    orc = oracle(sc, epochs=epochs, seed=seed)
    bar.update()
    bar.close()
    best = max([a for a in analytic if a != "static"] or ["static"], key=lambda a: runs[a]["steady_samples_per_s"])

    def tp(r: dict[str, Any]) -> dict[str, float]:
        return {"samples_per_s": r["samples_per_s"], "steady_samples_per_s": r["steady_samples_per_s"],
                "busy_fraction": r["steady_busy_fraction"]}

    pol = runs["policy"]
    out: dict[str, Any] = {
        "scenario": sc.name, "policy": policy, "world_size": sc.world_size, "global_batch": sc.global_batch,
        "epochs": pol["epochs"], "seed": sc.seed if seed is None else seed,
        "throughput": {"policy": tp(pol), "oracle": tp(orc), "equal_split": tp(runs["static"]),
                       "best_analytic": {"allocator": best, **tp(runs[best])}},
        "ratios_steady": {
            "policy_vs_oracle": pol["steady_samples_per_s"] / orc["steady_samples_per_s"],
            "policy_vs_equal_split": pol["steady_samples_per_s"] / runs["static"]["steady_samples_per_s"],
            "policy_vs_best_analytic": pol["steady_samples_per_s"] / runs[best]["steady_samples_per_s"],
        },
        "decision_ms_per_epoch": {"policy": pol["decision_ms"],
                                  **{a: runs[a]["decision_ms"] for a in analytic if a != "static"}},
        "analytic_steady_samples_per_s": {a: runs[a]["steady_samples_per_s"] for a in analytic},
        "restarts": pol["restarts"],
        "relocations": pol["relocations"],
        "policy_final_plan": pol["plans"][-1],
        "oracle_final_placement": orc["placements"][-1],
    }
    if hasattr(alloc, "last_choice"):
        out["policy_last_choice"] = alloc.last_choice
    return out


def _simulate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero-plugins simulate", description=simulate_main.__doc__)
    parser.add_argument("scenario_pos", nargs="?", default=None, metavar="SCENARIO",
                        help="same as --scenario (kept for compatibility)")
    parser.add_argument("--scenario", default=None,
                        help=f"built-in ({', '.join(BUILTIN_SCENARIOS)}) or a scenario JSON file (default paper_mix)")
    parser.add_argument("--policy", default="auto", help="allocator to evaluate (dqn, auto, equal_finish, ...)")
    parser.add_argument("--allocators", default=None,
                        help="instead: a comma-separated list of allocators compared in one table")
    parser.add_argument("--epochs", type=int, default=None, help="epochs (default: the scenario's)")
    parser.add_argument("--seed", type=int, default=None, help="noise seed (default: the scenario's)")
    parser.add_argument("--relocate", action="store_true",
                        help="let the policy move ranks to free slots (stage 2: NCF-predicted lines, restart_cost "
                        "per move)")
    parser.add_argument("--replan-every", type=int, default=None, metavar="STEPS",
                        help="re-plan within each epoch every STEPS steps, as the Lightning integrations do with "
                             "their replan_every option (default: at epoch ends only)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def simulate_main(argv: list[str] | None = None) -> int:
    """Run a policy on a simulated cluster beside the oracle, the equal split and the best analytic allocator."""
    args = _simulate_parser().parse_args(argv)
    if args.scenario and args.scenario_pos and args.scenario != args.scenario_pos:
        print(f"error: two scenarios given ({args.scenario_pos!r} and --scenario {args.scenario!r}). "
              "HINT: give only --scenario.", file=sys.stderr)
        return 2
    name = args.scenario or args.scenario_pos or "paper_mix"
    try:
        sc = load_scenario(name)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.epochs is not None and args.epochs < 1:
        print(f"error: `--epochs` must be >= 1, got {args.epochs}. HINT: e.g. --epochs 10", file=sys.stderr)
        return 2
    if args.replan_every is not None and args.replan_every < 1:
        print(f"error: `--replan-every` must be >= 1, got {args.replan_every}. HINT: e.g. --replan-every 5, or "
              "leave it out to plan at epoch ends only", file=sys.stderr)
        return 2
    if (err := _seed_error(args.seed)) is not None:
        return _error(err)
    if args.allocators is not None:
        try:
            names = _allocators(args.allocators)
        except ValueError as err:
            return _error(str(err))
        try:
            return _simulate_allocators(sc, args, names)
        except ValueError as err:  # what the scenario's own checks cannot see: --epochs past its events
            return _error(str(err))
    try:
        get_allocator(args.policy)
    except ValueError:
        print(f"error: `--policy` {args.policy!r} is not an allocator. HINT: use one of {sorted(ALLOCATORS)}.",
              file=sys.stderr)
        return 2
    try:  # what the scenario's own checks cannot see: --epochs past its events, a negative --seed
        out = compare(sc, args.policy, epochs=args.epochs, seed=args.seed, relocation=args.relocate or None,
                      replan_every=args.replan_every)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_comparison(sc, args.policy, out)
    return 0


def _print_comparison(sc: Any, policy: str, out: dict[str, Any]) -> None:
    """The table of one :func:`compare` run."""
    t = out["throughput"]
    print(f"scenario {sc.name}: {sc.world_size} ranks, global batch {sc.global_batch}, {out['epochs']} epochs, "
          f"policy {policy}")
    print("| run | samples/s (all epochs) | samples/s (after epoch 0) | busy (after epoch 0) |")
    print("|---|---|---|---|")
    for label, key in (("policy " + policy, "policy"), ("oracle", "oracle"), ("equal split", "equal_split"),
                       (f"best analytic ({t['best_analytic']['allocator']})", "best_analytic")):
        print(f"| {label} | {t[key]['samples_per_s']:.0f} | {t[key]['steady_samples_per_s']:.0f} | "
              f"{100 * t[key]['busy_fraction']:.1f}% |")
    r = out["ratios_steady"]
    for m in out["relocations"]:
        print(f"relocation before epoch {m['epoch']}: (rank, place) {m['moves']}, predicted "
              f"{100 * m['predicted_gain']:.1f}% faster steps")
    print(f"policy / oracle {r['policy_vs_oracle']:.3f}, / equal split {r['policy_vs_equal_split']:.2f}x, "
          f"/ best analytic {r['policy_vs_best_analytic']:.3f}; decision "
          f"{out['decision_ms_per_epoch']['policy']:.2f} ms per epoch")


def _simulate_allocators(sc: Any, args: argparse.Namespace, names: list[str]) -> int:
    """``simulate --allocators a,b,c``: one run per allocator (``names``, checked), in one table."""
    results: dict[str, Any] = {}
    for a in progress(names, desc=f"simulate {sc.name}", unit="allocator"):
        alloc = get_allocator(a)
        r = simulate(sc, alloc, epochs=args.epochs, seed=args.seed,
                     relocation=default_relocation(alloc, sc, args.relocate or None), replan_every=args.replan_every)
        if hasattr(alloc, "last_choice"):
            r["last_choice"] = alloc.last_choice
        results[a] = r
    ref = results.get("equal_finish")
    for r in results.values():
        r["time_vs_equal_finish"] = None if ref is None else r["total_time"] / ref["total_time"]
        r["final_plan"] = r["plans"][-1]
    table = {"scenario": sc.name, "world_size": sc.world_size, "global_batch": sc.global_batch,
             "epochs": next(iter(results.values()))["epochs"], "results": {
                 k: {f: v[f] for f in ("total_time", "samples_per_s", "steady_samples_per_s", "time_vs_equal_finish",
                                      "final_plan", "decision_ms", "epoch_times", "straggler_level",
                                      "steady_busy_fraction")
                     + (("last_choice",) if "last_choice" in v else ())}
                 for k, v in results.items()}}
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(f"scenario {sc.name}: {sc.world_size} ranks, global batch {sc.global_batch}, {table['epochs']} epochs")
    print("| allocator | simulated time (s) | samples/s | time vs equal_finish (< 1: faster) | busy (after epoch 0) | "
          "planner ms/epoch |")
    print("|---|---|---|---|---|---|")
    for k, v in table["results"].items():
        rel = "-" if v["time_vs_equal_finish"] is None else f"{v['time_vs_equal_finish']:.3f}"
        print(f"| {k} | {v['total_time']:.3f} | {v['samples_per_s']:.0f} | {rel} | "
              f"{100 * v['steady_busy_fraction']:.1f}% | {v['decision_ms']:.1f} |")
    return 0


def pretrain_main(argv: list[str] | None = None) -> int:
    """Pre-train the stage-1 DQN and/or the stage-2 NCF on the simulator and write model files."""
    parser = argparse.ArgumentParser(prog="hetero-plugins pretrain", description=pretrain_main.__doc__)
    parser.add_argument("--stage", choices=["dqn", "ncf", "both"], default="both")
    parser.add_argument("--out", default="scheduler_models", help="folder for dqn_v1.npz / ncf_v1.npz")
    parser.add_argument("--seconds", type=float, default=60.0, help="DQN training budget (NCF: a third)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    err = _first(_seconds_error(args.seconds, "60"), _seed_error(args.seed), _out_error(args.out, folder=True),
                 *(_out_error(str(out / f"{k}_v1.npz"), "--out") for k in ("dqn", "ncf")
                   if args.stage in (k, "both")))
    if err is not None:
        return _error(err)
    report: dict[str, Any] = {}
    if args.stage in ("dqn", "both"):
        _, report["dqn"] = pretrain_dqn(seconds=args.seconds, seed=args.seed, out=out / "dqn_v1.npz",
                                        gamma=0.3, target_sync=200)
    if args.stage in ("ncf", "both"):
        with timed(max(1.0, args.seconds / 3), desc="NCF pre-training"):
            _, report["ncf"] = pretrain_ncf(seconds=max(1.0, args.seconds / 3), seed=args.seed, out=out / "ncf_v1.npz")
    print(json.dumps(report, indent=2))
    print(f"wrote {', '.join(str(out / f'{k}_v1.npz') for k in report)}", file=sys.stderr)
    return 0


def transfer_main(argv: list[str] | None = None) -> int:
    """Fine-tune the DQN (default: the shipped one) for a new cluster scenario and write the model file."""
    parser = argparse.ArgumentParser(prog="hetero-plugins transfer", description=transfer_main.__doc__)
    parser.add_argument("scenario_pos", nargs="?", default=None, metavar="SCENARIO", help="same as --scenario")
    parser.add_argument("--scenario", default=None,
                        help="built-in scenario name or scenario JSON file of the new cluster")
    parser.add_argument("--from", "--model", dest="model", default=None, metavar="MODEL",
                        help="source DQN model file (default: the shipped one)")
    parser.add_argument("--out", default="dqn_transfer.npz")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.scenario and args.scenario_pos and args.scenario != args.scenario_pos:
        return _error(f"two scenarios given ({args.scenario_pos!r} and --scenario {args.scenario!r}). "
                      "HINT: give only --scenario.")
    name = args.scenario or args.scenario_pos
    if name is None:
        print("error: no scenario given. HINT: hetero-plugins transfer --from MODEL --scenario NAME|FILE",
              file=sys.stderr)
        return 2
    err = _first(_seconds_error(args.seconds, "20"), _seed_error(args.seed), _out_error(args.out))
    if err is not None:
        return _error(err)
    if args.model is not None and not os.path.isfile(args.model):
        print(f"error: --from {args.model!r} is not a file. HINT: pass a model written by `hetero-plugins pretrain` "
              "or `transfer`, or leave --from out for the shipped one.", file=sys.stderr)
        return 2
    return _train_and_report(args.out, lambda: transfer_dqn(load_scenario(name), source=args.model,
                                                            seconds=args.seconds, seed=args.seed, out=args.out)[1])


def pretrain_placement_main(argv: list[str] | None = None) -> int:
    """Pre-train the learned relocation (the placement Q-network) on the train split of a generated scenario
    family, keep the round best on its val split, and write the model file (an interrupted run resumes from its
    checkpoint <out>.ckpt.npz when rerun with the same settings)."""
    from hetero_plugins.scheduler.placement_policy import PlacementNetwork
    from hetero_plugins.scheduler.placement_training import pretrain_placement

    parser = argparse.ArgumentParser(prog="hetero-plugins pretrain-placement",
                                     description=pretrain_placement_main.__doc__)
    parser.add_argument("--out", default="placement_v1.npz", help="model file to write (checkpoint: <out>.ckpt.npz)")
    parser.add_argument("--seconds", type=float, default=300.0, help="training budget in seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", default="default", help="scenario family to train on (default, shifted)")
    parser.add_argument("--init", default=None, metavar="MODEL",
                        help="start from this placement model ('shipped': the shipped one) to fine-tune it")
    parser.add_argument("--train", type=int, default=120, help="train-split scenarios drawn from")
    parser.add_argument("--val", type=int, default=20, help="val-split scenarios to choose the model on")
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    parser.add_argument("--episodes", type=int, default=12, help="behaviour episodes per round")
    parser.add_argument("--fit-steps", type=int, default=1000, help="gradient steps per round")
    parser.add_argument("--no-resume", action="store_true",
                        help="start from scratch even if an unfinished run left a checkpoint (<out>.ckpt.npz)")
    parser.add_argument("--returns", default="rollout", choices=("rollout", "lines"),
                        help="each candidate's return: realised in a forked run (rollout) or from the true lines")
    parser.add_argument("--horizon", type=int, default=4, help="epochs a rollout return runs over")
    args = parser.parse_args(argv)
    if (err := _seconds_error(args.seconds, "300")) is not None:
        return _error(err)
    for name in ("train", "val", "episodes", "fit_steps", "horizon", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            flag = name.replace("_", "-")
            print(f"error: `--{flag}` must be >= 1, got {getattr(args, name)}. HINT: e.g. --{flag} 10", file=sys.stderr)
            return 2
    err = _first(_seed_error(args.seed), _out_error(args.out), _out_error(args.out + ".ckpt.npz", "--out's checkpoint"))
    if err is not None:
        return _error(err)
    if args.init not in (None, "shipped") and not os.path.isfile(args.init):
        return _error(f"`--init`={args.init!r} is not a file. HINT: pass 'shipped' or a model file written by "
                      "`hetero-plugins pretrain-placement`, or leave --init out to start from a random network.")
    try:
        init = None if args.init is None else PlacementNetwork.load(None if args.init == "shipped" else args.init)
    except ValueError as err:  # not a placement model, or one built for other features: the error says which
        return _error(f"`--init`={args.init!r}: {err}")

    def train() -> dict[str, Any]:
        return pretrain_placement(seconds=args.seconds, seed=args.seed, out=args.out, family=args.family, net=init,
                                  train_count=args.train, val_count=args.val, episodes_per_round=args.episodes,
                                  max_rounds=args.rounds, resume=not args.no_resume,
                                  fit_steps=args.fit_steps, returns=args.returns, horizon=args.horizon)[1]

    return _train_and_report(args.out, train)


def pretrain_critic_main(argv: list[str] | None = None) -> int:
    """Train the planning relocator's critic (a learned correction of its rollout values) on the realised returns
    of the candidate moves met in closed-loop runs of a generated family's train split, and write the model file
    (an interrupted run resumes from its checkpoint <out>.ckpt.npz when rerun with the same settings)."""
    from hetero_plugins.scheduler.critic_training import CONTINUATIONS, pretrain_critic

    parser = argparse.ArgumentParser(prog="hetero-plugins pretrain-critic", description=pretrain_critic_main.__doc__)
    parser.add_argument("--out", default="rollout_correction_v1.npz", help="model file to write")
    parser.add_argument("--family", default="default", help="scenario family to train on (default, shifted)")
    parser.add_argument("--train", type=int, default=150, help="train-split scenarios drawn from (those with "
                        "co-runner churn and free slots are used)")
    parser.add_argument("--seeds", type=int, default=2, help="noise seeds per scenario")
    parser.add_argument("--explore", type=float, default=0.2, help="probability of a random candidate (or stay)")
    parser.add_argument("--horizon", type=int, default=4, help="epochs a realised return runs over")
    parser.add_argument("--forks", type=int, default=3, help="pairs of forked runs (staying, moving) each "
                        "return is averaged over: the run's own noise, then independent noise (the shipped "
                        "critic: 3)")
    parser.add_argument("--tail", type=float, default=0.0, help="count the last fork epoch's saving for every "
                        "epoch left after the horizon, discounted by this per epoch (0: off)")
    parser.add_argument("--continuation", choices=CONTINUATIONS, default="stay",
                        help="who moves in the forks after the boundary: nobody (stay, the shipped critic's) or "
                        "the relocator being run (policy: on-policy returns, about 3x the time per fork)")
    parser.add_argument("--start-critic", default=None, metavar="FILE",
                        help="critic whose relocator runs the first round ('shipped' or a model file; default: "
                        "the plain planning relocator)")
    parser.add_argument("--rounds", type=int, default=2, help="DAgger rounds: the first run by the plain planning "
                        "relocator (or --start-critic's), each later one by the critic fit so far (the shipped "
                        "critic: 2)")
    parser.add_argument("--members", type=int, default=5, help="networks in the ensemble")
    parser.add_argument("--hidden", default="32,32", help="hidden layer widths of each network, comma-separated")
    parser.add_argument("--fit-steps", type=int, default=3000, help="gradient steps per member")
    parser.add_argument("--workers", type=int, default=1, help="processes collecting the returns (same result)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-resume", action="store_true",
                        help="start from scratch even if an unfinished run left a checkpoint (<out>.ckpt.npz)")
    args = parser.parse_args(argv)
    for name in ("train", "seeds", "horizon", "forks", "rounds", "members", "fit_steps", "workers"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            print(f"error: `--{flag}` must be >= 1, got {getattr(args, name)}. HINT: e.g. --{flag} 2", file=sys.stderr)
            return 2
    for name, example in (("explore", "0.2"), ("tail", "0.7")):
        if not 0.0 <= getattr(args, name) <= 1.0:
            print(f"error: `--{name}` must be in [0, 1], got {getattr(args, name)}. HINT: e.g. --{name} {example}",
                  file=sys.stderr)
            return 2
    try:
        hidden = tuple(int(h) for h in args.hidden.split(","))
    except ValueError:
        hidden = ()
    if not hidden or min(hidden) < 1:
        print(f"error: `--hidden` must be comma-separated layer widths >= 1, got {args.hidden!r}. HINT: e.g. "
              "--hidden 32,32", file=sys.stderr)
        return 2
    err = _first(_seed_error(args.seed), _out_error(args.out), _out_error(args.out + ".ckpt.npz", "--out's checkpoint"))
    if err is not None:
        return _error(err)
    return _train_and_report(args.out, lambda: pretrain_critic(
        out=args.out, family=args.family, train_count=args.train, seeds=tuple(range(args.seeds)),
        explore=args.explore, horizon=args.horizon, forks=args.forks, tail=args.tail,
        rounds=args.rounds, members=args.members, hidden=hidden, steps=args.fit_steps,
        continuation=args.continuation, start=args.start_critic, seed=args.seed, workers=args.workers,
        resume=not args.no_resume)[1])


def _train_and_report(out: str, train: Callable[[], dict[str, Any]]) -> int:
    """Run a training command's ``train`` (which writes ``out`` and returns its statistics); print the statistics as
    JSON and where the model went (exit 0), or the ``ValueError`` it raised (exit 2)."""
    try:
        stats = train()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"out": out, **stats}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0
