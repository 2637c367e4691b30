"""``hetero-plugins simulate | pretrain | transfer``: the learned scheduler's command-line side (issue 4)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["pretrain_main", "simulate_main", "transfer_main"]

DEFAULT_ALLOCATORS = "static,proportional,equal_finish,lbb,dqn,auto"


def _allocators(text: str) -> list[str]:
    from hetero_plugins.allocators import ALLOCATORS, get_allocator

    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise SystemExit("--allocators is empty. HINT: e.g. --allocators equal_finish,dqn,auto")
    for a in names:
        try:
            get_allocator(a)
        except ValueError as err:
            raise SystemExit(f"--allocators: {err} Known: {sorted(ALLOCATORS)}.") from None
    return names


def simulate_main(argv: list[str] | None = None) -> int:
    """Run allocators on a simulated scenario and print a table (or JSON)."""
    from hetero_plugins.allocators import get_allocator
    from hetero_plugins.sim import BUILTIN_SCENARIOS, load_scenario, simulate

    parser = argparse.ArgumentParser(prog="hetero-plugins simulate", description=simulate_main.__doc__)
    parser.add_argument("scenario", nargs="?", default="paper_mix",
                        help=f"built-in ({', '.join(BUILTIN_SCENARIOS)}) or a scenario JSON file")
    parser.add_argument("--allocators", default=DEFAULT_ALLOCATORS, help="comma-separated allocator names")
    parser.add_argument("--epochs", type=int, default=None, help="epochs (default: the scenario's)")
    parser.add_argument("--seed", type=int, default=None, help="noise seed (default: the scenario's)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        sc = load_scenario(args.scenario)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.epochs is not None and args.epochs < 1:
        print(f"error: `--epochs` must be >= 1, got {args.epochs}. HINT: e.g. --epochs 10", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    for name in _allocators(args.allocators):
        alloc = get_allocator(name)
        r = simulate(sc, alloc, epochs=args.epochs, seed=args.seed)
        if hasattr(alloc, "last_choice"):
            r["last_choice"] = alloc.last_choice
        results[name] = r
    ref = results.get("equal_finish")
    for r in results.values():
        r["time_vs_equal_finish"] = None if ref is None else r["total_time"] / ref["total_time"]
        r["final_plan"] = r["plans"][-1]
    out = {"scenario": sc.name, "world_size": sc.world_size, "global_batch": sc.global_batch,
           "epochs": next(iter(results.values()))["epochs"], "results": {
               k: {f: v[f] for f in ("total_time", "samples_per_s", "time_vs_equal_finish", "final_plan", "decision_ms",
                                    "epoch_times", "straggler_level") + (("last_choice",) if "last_choice" in v else ())}
               for k, v in results.items()}}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"scenario {sc.name}: {sc.world_size} ranks, global batch {sc.global_batch}, {out['epochs']} epochs")
    print("| allocator | simulated time (s) | samples/s | vs equal_finish | planner ms/epoch |")
    print("|---|---|---|---|---|")
    for k, v in out["results"].items():
        rel = "-" if v["time_vs_equal_finish"] is None else f"{v['time_vs_equal_finish']:.3f}"
        print(f"| {k} | {v['total_time']:.3f} | {v['samples_per_s']:.0f} | {rel} | {v['decision_ms']:.1f} |")
    return 0


def pretrain_main(argv: list[str] | None = None) -> int:
    """Pre-train the stage-1 DQN and/or the stage-2 NCF on the simulator and write model files."""
    from hetero_plugins.scheduler.pretrain import pretrain_dqn, pretrain_ncf

    parser = argparse.ArgumentParser(prog="hetero-plugins pretrain", description=pretrain_main.__doc__)
    parser.add_argument("--stage", choices=["dqn", "ncf", "both"], default="both")
    parser.add_argument("--out", default="scheduler_models", help="folder for dqn_v1.npz / ncf_v1.npz")
    parser.add_argument("--seconds", type=float, default=60.0, help="DQN training budget (NCF: a third)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        print(f"error: `--seconds` must be > 0, got {args.seconds}. HINT: e.g. --seconds 60", file=sys.stderr)
        return 2
    out = Path(args.out)
    report: dict[str, Any] = {}
    if args.stage in ("dqn", "both"):
        _, report["dqn"] = pretrain_dqn(seconds=args.seconds, seed=args.seed, out=out / "dqn_v1.npz",
                                        gamma=0.3, target_sync=200)
    if args.stage in ("ncf", "both"):
        _, report["ncf"] = pretrain_ncf(seconds=max(1.0, args.seconds / 3), seed=args.seed, out=out / "ncf_v1.npz")
    print(json.dumps(report, indent=2))
    return 0


def transfer_main(argv: list[str] | None = None) -> int:
    """Fine-tune the DQN (default: the shipped one) for a new cluster scenario and write the model file."""
    from hetero_plugins.scheduler.transfer import transfer_dqn
    from hetero_plugins.sim import load_scenario

    parser = argparse.ArgumentParser(prog="hetero-plugins transfer", description=transfer_main.__doc__)
    parser.add_argument("scenario", help="built-in scenario name or scenario JSON file of the new cluster")
    parser.add_argument("--model", default=None, help="source DQN model file (default: shipped)")
    parser.add_argument("--out", default="dqn_transfer.npz")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        sc = load_scenario(args.scenario)
        _, stats = transfer_dqn(sc, source=args.model, seconds=args.seconds, seed=args.seed, out=args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, **stats}, indent=2))
    return 0
