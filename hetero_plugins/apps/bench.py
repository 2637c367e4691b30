"""Benchmarks: stock DDP vs HeteroDDPStrategy on 4 emulated CPU ranks, measured side by side in one run.

Writes ``bench_output/results.json`` and rewrites the table between the ``bench:start``/``bench:end``
markers of README.md. Ratios are the target: each pair of runs shares the machine, the model and the data.

Scenarios (digits CNN, global batch 128, emulated cost 4 ms per sample at speed 1):
- ``heterogeneous``: speeds 1, 1, 0.5, 0.25, 12 epochs; steady epochs (2..) time ratio, the fraction of the
  ideal ratio sum(speeds) / (world x min(speeds)) = 2.75, final accuracy and time to 95% validation accuracy;
  then the same pair again in float64 (a quarter of the emulated cost, not timed): the two runs compute the same
  updates in a different order, so their final weights agree to rounding there, and the float32 pair's accuracy
  gap is float32's rounding grown over 12 epochs. Final accuracies are the final weights' on the whole
  validation split, each sample once (stock DDP's in-run validation pads its last batch with repeats);
- ``homogeneous``: speeds 1, 1, 1, 1, 5 epochs: the overhead of balancing when there is nothing to balance;
- ``slowdown``: speeds 1, 1, 1, 1 and rank 1 drops to 0.3 at epoch 3: the fraction of the ideal reached in
  epoch 4, one epoch after the change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from hetero_plugins._files import check_output_path
from hetero_plugins.apps.digits import val_accuracy
from hetero_plugins.apps.jobs import run_digits_job, steady_mean

__all__ = ["main"]

COST = 0.004
TARGET_ACC = 0.95


def ideal_ratio(speeds: list[float]) -> float:
    return sum(speeds) / (len(speeds) * min(speeds))


def time_to_accuracy(record: dict[str, Any], target: float) -> float | None:
    elapsed = 0.0
    for e in record["epochs"]:
        elapsed += e["train_time"]
        if e.get("val_acc", 0.0) >= target:
            return elapsed
    return None


def scenario_heterogeneous(epochs: int) -> dict[str, Any]:
    speeds = [1.0, 1.0, 0.5, 0.25]
    ddp = run_digits_job("ddp", speeds, COST, epochs, label="heterogeneous/ddp", keep_weights=True)
    het = run_digits_job("hetero", speeds, COST, epochs, label="heterogeneous/hetero", keep_weights=True)
    ratio = steady_mean(ddp) / steady_mean(het)
    tta_d, tta_h = time_to_accuracy(ddp, TARGET_ACC), time_to_accuracy(het, TARGET_ACC)
    kw = dict(dtype="float64", keep_weights=True)
    ddp64 = run_digits_job("ddp", speeds, COST / 4, epochs, label="heterogeneous/ddp float64", **kw)
    het64 = run_digits_job("hetero", speeds, COST / 4, epochs, label="heterogeneous/hetero float64", **kw)
    gap = max(float((ddp64["state_dict"][k] - het64["state_dict"][k]).abs().max()) for k in ddp64["state_dict"])
    acc = {name: val_accuracy(run.pop("state_dict"), dtype) for name, run, dtype in
           (("ddp", ddp, "float32"), ("hetero", het, "float32"), ("ddp64", ddp64, "float64"), ("hetero64", het64, "float64"))}
    return {
        "speeds": speeds, "epochs": epochs,
        "ddp_steady_epoch_s": steady_mean(ddp), "hetero_steady_epoch_s": steady_mean(het),
        "speedup": ratio, "ideal_speedup": ideal_ratio(speeds), "fraction_of_ideal": ratio / ideal_ratio(speeds),
        "ddp_final_acc": acc["ddp"], "hetero_final_acc": acc["hetero"],
        "acc_diff_points": 100 * (acc["hetero"] - acc["ddp"]),
        "float64": {"ddp_final_acc": acc["ddp64"], "hetero_final_acc": acc["hetero64"],
                    "acc_diff_points": 100 * (acc["hetero64"] - acc["ddp64"]), "max_weight_gap": gap,
                    "hetero_batch_sizes": [p["batch_sizes"] for p in het64["plan_history"]]},
        "target_acc": TARGET_ACC, "ddp_time_to_acc_s": tta_d, "hetero_time_to_acc_s": tta_h,
        "time_to_acc_speedup": (tta_d / tta_h) if tta_d and tta_h else None,
        "final_batch_sizes": het["plan_history"][-1]["batch_sizes"],
        "ddp": ddp, "hetero": het,
    }


def scenario_homogeneous(epochs: int) -> dict[str, Any]:
    speeds = [1.0, 1.0, 1.0, 1.0]
    ddp = run_digits_job("ddp", speeds, COST, epochs, label="homogeneous/ddp")
    het = run_digits_job("hetero", speeds, COST, epochs, label="homogeneous/hetero")
    slowdown = steady_mean(het, 1) / steady_mean(ddp, 1) - 1.0
    return {"speeds": speeds, "epochs": epochs, "ddp_steady_epoch_s": steady_mean(ddp, 1),
            "hetero_steady_epoch_s": steady_mean(het, 1), "hetero_slower_by": slowdown, "ddp": ddp, "hetero": het}


def scenario_slowdown(epochs: int) -> dict[str, Any]:
    speeds, change_epoch = [1.0, 1.0, 1.0, 1.0], 3
    schedule = {change_epoch: {1: 0.3}}
    after = [1.0, 0.3, 1.0, 1.0]
    ddp = run_digits_job("ddp", speeds, COST, epochs, schedule=schedule, label="slowdown/ddp")
    het = run_digits_job("hetero", speeds, COST, epochs, schedule=schedule, label="slowdown/hetero")
    ddp_after = steady_mean(ddp, change_epoch + 1)
    het_next = het["epochs"][change_epoch + 1]["train_time"]
    ratio = ddp_after / het_next
    return {"speeds": speeds, "schedule": {str(k): v for k, v in schedule.items()}, "epochs": epochs,
            "ddp_epoch_after_change_s": ddp_after, "hetero_epoch_after_change_s": het_next,
            "speedup_one_epoch_after": ratio, "ideal_speedup": ideal_ratio(after),
            "fraction_of_ideal_one_epoch_after": ratio / ideal_ratio(after),
            "hetero_batch_sizes": [h["batch_sizes"] for h in het["plan_history"]], "ddp": ddp, "hetero": het}


def table(results: dict[str, Any]) -> str:
    h, m, s = results["heterogeneous"], results["homogeneous"], results["slowdown"]
    rows = [
        "| scenario (4 CPU ranks, emulated) | stock DDP | HeteroDDPStrategy | result | target |",
        "|---|---|---|---|---|",
        f"| speeds 1, 1, 0.5, 0.25: steady epoch | {h['ddp_steady_epoch_s']:.2f} s | {h['hetero_steady_epoch_s']:.2f} s "
        f"| **{h['speedup']:.2f}x** faster, {h['fraction_of_ideal']:.2f} of ideal {h['ideal_speedup']:.2f}x "
        f"| >= 2.0x and >= 0.85 of ideal |",
        f"| same: final val accuracy ({h['epochs']} epochs) | {100 * h['ddp_final_acc']:.2f}% "
        f"| {100 * h['hetero_final_acc']:.2f}% | {h['acc_diff_points']:+.2f} points | within +/-0.5 points |",
        f"| same in float64 (not timed): final val accuracy; largest gap between the final weights "
        f"| {100 * h['float64']['ddp_final_acc']:.2f}% | {100 * h['float64']['hetero_final_acc']:.2f}% "
        f"| {h['float64']['acc_diff_points']:+.2f} points; {h['float64']['max_weight_gap']:.1e} "
        f"| the same updates: equal to rounding |",
        f"| same: training time to {100 * h['target_acc']:.0f}% val accuracy | "
        f"{_fmt(h['ddp_time_to_acc_s'])} | {_fmt(h['hetero_time_to_acc_s'])} | "
        f"**{_fmt(h['time_to_acc_speedup'], 'x')}** better | >= 2x |",
        f"| speeds 1, 1, 1, 1: steady epoch | {m['ddp_steady_epoch_s']:.2f} s | {m['hetero_steady_epoch_s']:.2f} s "
        f"| {100 * m['hetero_slower_by']:+.1f}% | at most +3% |",
        f"| rank 1 slows 1 -> 0.3 at epoch 3: epoch 4 | {s['ddp_epoch_after_change_s']:.2f} s "
        f"| {s['hetero_epoch_after_change_s']:.2f} s | {s['speedup_one_epoch_after']:.2f}x, "
        f"{s['fraction_of_ideal_one_epoch_after']:.2f} of ideal {s['ideal_speedup']:.2f}x | >= 0.85 of ideal |",
    ]
    hv = results.get("horovod")
    if hv:
        rows.append(
            f"| Horovod, 2 ranks at speeds 1, 0.25 (`horovodrun --gloo`): steady epoch | "
            f"{hv['steady_epoch_time_stock']:.2f} s | {hv['steady_epoch_time_hetero']:.2f} s | "
            f"**{hv['speedup']:.2f}x** faster, {hv['fraction_of_ideal']:.2f} of ideal {hv['ideal_speedup']:.2f}x "
            f"| >= 1.8x and >= 0.8 of ideal |"
        )
    meta = results["meta"]
    rows.append("")
    rows.append(f"Measured {meta['date']} on {meta['machine']} with `make bench` ({meta['seconds']:.0f} s); "
                "times are training time per epoch (validation excluded), ratios from runs made side by side. "
                "Final accuracies are the final weights' on all 359 validation samples, each once. Both strategies "
                "compute the same updates (the float64 row); in float32 each rank sums its own share first, so the "
                "two runs round differently, and over 12 epochs of SGD with momentum that moves the final accuracy "
                "by a few samples, either way.")
    return "\n".join(rows)


def _fmt(v: float | None, unit: str = " s") -> str:
    return "not reached" if v is None else f"{v:.2f}{unit}"


def update_readme(readme: Path, text: str) -> bool:
    if not readme.exists():
        return False
    content = readme.read_text()
    pattern = re.compile(r"(<!-- bench:start -->\n).*?(\n<!-- bench:end -->)", re.S)
    if not pattern.search(content):
        return False
    readme.write_text(pattern.sub(lambda m: m.group(1) + text + m.group(2), content))
    return True


#: What the table reads of ``--horovod-json`` (benchmarks/horovod_bench.py writes them).
HOROVOD_KEYS = ("steady_epoch_time_stock", "steady_epoch_time_hetero", "speedup", "fraction_of_ideal", "ideal_speedup")


def read_horovod_json(path: str) -> dict[str, Any]:
    """The Horovod results of ``--horovod-json`` for the table; ``ValueError`` naming the flag, the file and the fix."""
    fix = "run `python benchmarks/horovod_bench.py` first (it writes bench_output/horovod.json), or leave --horovod-json out"
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"`--horovod-json`={path!r} {'is not a file' if p.exists() else 'does not exist'}. HINT: {fix}.")
    try:
        hv = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"`--horovod-json`={path!r} cannot be read as JSON ({err}). HINT: {fix}.") from None
    if not isinstance(hv, dict):
        raise ValueError(f"`--horovod-json`={path!r} holds a {type(hv).__name__}, not the object horovod_bench.py "
                         f"writes. HINT: {fix}.")
    for key in HOROVOD_KEYS:
        v = hv.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"`--horovod-json`={path!r}: field `{key}`={v!r} must be a finite number. HINT: {fix}.")
    return {k: v for k, v in hv.items() if k not in ("stock", "hetero")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero-plugins bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_output", help="folder for results.json")
    parser.add_argument("--readme", default="README.md", help="README whose bench table is rewritten")
    parser.add_argument("--epochs", type=int, default=12, help="epochs of the heterogeneous scenario")
    parser.add_argument("--horovod-json", default=None,
                        help="results of benchmarks/horovod_bench.py to include in the table (run first)")
    args = parser.parse_args(argv)
    # everything checked before the first run (the benchmarks take minutes)
    if args.epochs < 3:
        print(f"error: `--epochs` must be >= 3 (epochs 2.. are the steady ones measured), got {args.epochs}. "
              "HINT: e.g. --epochs 12", file=sys.stderr)
        return 2
    if Path(args.readme).is_dir():
        print(f"error: `--readme`={args.readme!r} is a directory. HINT: give the README file whose bench table is "
              "rewritten, e.g. --readme README.md", file=sys.stderr)
        return 2
    try:
        check_output_path(args.out, "--out", folder=True)
        hv = None if args.horovod_json is None else read_horovod_json(args.horovod_json)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "heterogeneous": scenario_heterogeneous(args.epochs),
        "homogeneous": scenario_homogeneous(5),
        "slowdown": scenario_slowdown(6),
    }
    if hv is not None:
        results["horovod"] = hv
    results["meta"] = {"date": time.strftime("%Y-%m-%d"), "seconds": time.perf_counter() - t0,
                       "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    print("\n" + text)
    if update_readme(Path(args.readme), text):
        print(f"\nupdated the table in {args.readme}")
    print(f"wrote {out / 'results.json'}")
    return 0
