"""Aggregation modes under stragglers, side by side in one run (``make bench-aggregation``).

Four spawned CPU ranks train the digits CNN (scikit-learn's bundled digits, global batch 128, 12 steps per
epoch); the emulator gives them speeds 1, 1, 0.5, 0.25 at 4 ms per sample at speed 1.

1. **Transient stalls** (the DBS harness): every epoch each rank stalls with probability 0.1 for 4 to 12
   steps at a quarter of its speed (``RandomStalls``, seeded). Stock DDP, per-epoch rebalancing alone
   (``replan_every=None``, ``"weighted"``), and ``"deadline"``, ``"wbsp"``, ``"pseudo_sync"`` (with
   mid-epoch replanning). Reported: mean training seconds per epoch over epochs 1.., the ratio to per-epoch
   rebalancing alone (target >= 1.3x for deadline or wbsp), and final accuracy against stock DDP (target
   within 0.5 points). ``pseudo_sync`` runs at SGD momentum 0.5 (a one-step-late gradient diverges at 0.9)
   and is compared with per-epoch rebalancing at momentum 0.5.
2. **A persistent speed change mid-epoch**: four equal ranks; rank 3 drops to a quarter of its speed from
   step 1 of epoch 2 on. The ideal step time afterwards is the measured pre-change step time x 4 / 3.25
   (the lost capacity); reported is ideal / measured for each of the 10 steps after the change (target
   >= 0.85 within 10 steps), for ``"weighted"`` (mid-epoch replanning) and ``"wbsp"``.
3. **Local SGD** (``local_steps=4``) without stalls: gradient/model bytes per epoch against ``"weighted"``
   (target: down by about H) and accuracy against stock DDP (target within 1 point).

Writes ``bench_output/aggregation.json`` and the table between ``<!-- aggregation-bench:start -->`` and
``<!-- aggregation-bench:end -->`` in README.md.

    python benchmarks/aggregation_bench.py [--epochs 10] [--no-readme]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hetero_plugins.aggregation.options import AggregationOptions
from hetero_plugins.apps.jobs import run_digits_job, steady_mean
from hetero_plugins.emulation import RandomStalls, Stall

SPEEDS = [1.0, 1.0, 0.5, 0.25]
COST = 0.004


def final_acc(run: dict[str, Any]) -> float:
    return 100.0 * float(run["epochs"][-1]["val_acc"])


def bytes_per_epoch(run: dict[str, Any]) -> float:
    epochs = run["epochs"]
    return float(epochs[-1]["communication_bytes"]) / len(epochs)


def stalls_scenario(epochs: int) -> dict[str, Any]:
    stalls = RandomStalls(probability=0.1, min_steps=4, max_steps=12, slowdown=4.0, seed=1)
    # pseudo_sync applies each gradient one step late, which heavy-ball momentum 0.9 at lr 0.1 does not survive
    # (see the strategy's warning); it runs at momentum 0.5, with per-epoch rebalancing at 0.5 as its reference.
    configs: list[tuple[str, str, Any, int | None, float]] = [
        ("stock DDP", "ddp", None, None, 0.9),
        ("per-epoch rebalancing", "hetero", None, None, 0.9),
        ("deadline", "hetero", "deadline", 5, 0.9),
        ("wbsp", "hetero", "wbsp", 5, 0.9),
        ("per-epoch rebalancing, momentum 0.5", "hetero", None, None, 0.5),
        ("pseudo_sync, momentum 0.5", "hetero", "pseudo_sync", 5, 0.5),
    ]
    runs = {}
    for name, mode, aggregation, every, momentum in configs:
        runs[name] = run_digits_job(mode, SPEEDS, COST, epochs, stalls=stalls, replan_every=every,
                                    aggregation=aggregation, momentum=momentum, label=f"stalls/{name}")
    rows = []
    for name, run in runs.items():
        ref = "per-epoch rebalancing, momentum 0.5" if "momentum 0.5" in name else "per-epoch rebalancing"
        acc_ref = final_acc(runs[ref if "momentum 0.5" in name else "stock DDP"])
        t = steady_mean(run, 1)
        rows.append({"name": name, "epoch_s": t, "vs_per_epoch": steady_mean(runs[ref], 1) / t, "acc": final_acc(run),
                     "acc_delta": final_acc(run) - acc_ref})
    stalled = sorted({(e, r) for e in range(epochs) for r in range(4) for s in range(12) if stalls.factor(r, e, s) > 1})
    return {"rows": rows, "stalled_epoch_rank": stalled, "runs": runs}


def speed_change_scenario() -> dict[str, Any]:
    change = Stall(rank=3, epoch=2, start_step=1, num_steps=10**6, slowdown=4.0)
    schedule = {3: {3: 0.25}}  # the later epochs keep the new speed
    runs, rows = {}, []
    for name, aggregation in (("weighted", None), ("wbsp", "wbsp")):
        run = run_digits_job("hetero", [1.0] * 4, COST, 4, schedule=schedule, stalls=[change], replan_every=5,
                             aggregation=aggregation, label=f"change/{name}")
        runs[name] = run
        before = statistics.median(run["epochs"][1]["step_times"][2:])
        ideal = before * 4 / 3.25
        after = (run["epochs"][2]["step_times"] + run["epochs"][3]["step_times"])[1:11]
        ratios = [ideal / t for t in after]
        rows.append({"name": name, "ratios": ratios, "ratio_at_10": ratios[-1],
                     "mean_steps_6_10": statistics.mean(ratios[5:10]),
                     "first_step_at_085": next((k + 1 for k, r in enumerate(ratios) if r >= 0.85), None)})
    return {"rows": rows, "runs": runs}


def local_sgd_scenario(epochs: int) -> dict[str, Any]:
    runs = {}
    for name, mode, aggregation in (("stock DDP", "ddp", None), ("weighted", "hetero", None),
                                    ("local_sgd", "hetero", AggregationOptions("local_sgd", local_steps=4))):
        runs[name] = run_digits_job(mode, SPEEDS, COST, epochs, aggregation=aggregation, label=f"local/{name}")
    weighted, local = runs["weighted"], runs["local_sgd"]
    return {
        "weighted_bytes_per_epoch": bytes_per_epoch(weighted),
        "local_sgd_bytes_per_epoch": bytes_per_epoch(local),
        "reduction": bytes_per_epoch(weighted) / bytes_per_epoch(local),
        "acc_ddp": final_acc(runs["stock DDP"]), "acc_weighted": final_acc(weighted), "acc_local_sgd": final_acc(local),
        "runs": runs,
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| scenario | run | s/epoch | vs per-epoch rebalancing | accuracy (vs stock DDP*) | target |",
             "|---|---|---|---|---|---|"]
    for row in result["stalls"]["rows"]:
        target = ">= 1.3x (deadline or wbsp), within 0.5 pt" if row["name"] in ("deadline", "wbsp") else ""
        lines.append(f"| stalls p=0.1 | {row['name']} | {row['epoch_s']:.2f} | {row['vs_per_epoch']:.2f}x | "
                     f"{row['acc']:.2f}% ({row['acc_delta']:+.2f}) | {target} |")
    lines += ["", "\\* the momentum-0.5 rows compare with per-epoch rebalancing at momentum 0.5.", "",
              "| speed change mid-epoch | ideal/measured, 10th step after | mean, steps 6-10 | first step >= 0.85 |"
              " target |", "|---|---|---|---|---|"]
    for row in result["speed_change"]["rows"]:
        lines.append(f"| {row['name']} | {row['ratio_at_10']:.2f} | {row['mean_steps_6_10']:.2f} | "
                     f"{row['first_step_at_085']} | >= 0.85 within 10 steps |")
    loc = result["local_sgd"]
    lines += ["", "| local SGD (H=4) | bytes/epoch | accuracy | target |", "|---|---|---|---|",
              f"| weighted | {loc['weighted_bytes_per_epoch'] / 1e6:.2f} MB | {loc['acc_weighted']:.2f}% | |",
              f"| local_sgd | {loc['local_sgd_bytes_per_epoch'] / 1e6:.2f} MB ({loc['reduction']:.2f}x less) | "
              f"{loc['acc_local_sgd']:.2f}% (stock DDP {loc['acc_ddp']:.2f}%) | ~H less, within 1 pt |"]
    return "\n".join(lines)


def write_readme(text: str, readme: Path = Path("README.md")) -> None:
    start, end = "<!-- aggregation-bench:start -->", "<!-- aggregation-bench:end -->"
    content = readme.read_text()
    if start not in content or end not in content:
        print(f"aggregation_bench: {readme} has no {start} ... {end} markers; table not written")
        return
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="bench_output/aggregation.json")
    parser.add_argument("--no-readme", action="store_true", help="do not update the README table")
    args = parser.parse_args()
    started = time.time()
    result = {"speeds": SPEEDS, "cost_per_sample": COST, "epochs": args.epochs,
              "stalls": stalls_scenario(args.epochs), "speed_change": speed_change_scenario(),
              "local_sgd": local_sgd_scenario(args.epochs)}
    result["seconds"] = time.time() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    text = table(result)
    print(text)
    if not args.no_readme:
        write_readme(text)
    print(f"aggregation_bench: wrote {args.out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
