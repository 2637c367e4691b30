"""The main job: the digits CNN on 4 emulated CPU ranks (speeds 1, 1, 0.5, 0.25), stock DDP then
HeteroDDPStrategy, with a table and a plot of batch sizes and epoch times.

The HeteroDDPStrategy run keeps what a user's run leaves behind (Lightning's CSV log and checkpoint) in
``<out>/run``; ``make demo`` ends with ``hetero-plugins report <out>/run``, the command a user runs on a run.

A demo replaces the ``<out>/run`` of an earlier demo (it holds the file ``.hetero_demo_run``), so the report shows
one run; it refuses to touch an ``<out>/run`` it did not write (choose another ``--out``, or move that folder)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetero_plugins._files import check_output_path
from hetero_plugins.apps.digits import val_accuracy
from hetero_plugins.apps.jobs import run_digits_job, steady_mean
from hetero_plugins.progress import is_quiet

__all__ = ["DEMO_MARKER", "ideal_speedup", "main", "render_table"]

#: The file that marks ``<out>/run`` as a demo's own run folder, which a later demo may replace.
DEMO_MARKER = ".hetero_demo_run"


def ideal_speedup(speeds: Sequence[float]) -> float:
    """The speed-up of a perfect balance over equal batches: ``sum(speeds) / (ranks x slowest speed)``.

    Example::

        >>> ideal_speedup([1, 1, 0.5, 0.25])
        2.75
    """
    return sum(speeds) / (len(speeds) * min(speeds))


def render_table(ddp: dict[str, Any], hetero: dict[str, Any], speeds: Sequence[float] | None = None) -> str:
    """A plain-text table of both runs, epoch by epoch, then a summary (with the ideal speed-up for ``speeds``)."""
    lines = [
        f"{'epoch':>5} | {'stock DDP s':>11} {'samples/s':>9} {'straggler':>9} | "
        f"{'hetero s':>8} {'samples/s':>9} {'straggler':>9} {'batch sizes per rank':<22}",
        "-" * 96,
    ]
    n = 0
    for d, h in zip(ddp["epochs"], hetero["epochs"]):
        dh = ddp["plan_history"][n] if n < len(ddp["plan_history"]) else {}
        hh = hetero["plan_history"][n] if n < len(hetero["plan_history"]) else {}
        samples = hh.get("samples", 0)  # the same data every epoch, in both runs
        sizes = str(hh.get("batch_sizes", ""))
        for change in hh.get("plan_changes", []):
            sizes += f" -> {change['batch_sizes']} from step {change['step']}"
        lines.append(
            f"{n:>5} | {d['train_time']:>11.2f} {samples / d['train_time'] if samples else 0:>9.0f} "
            f"{dh.get('straggler_level', float('nan')):>9.2f} | {h['train_time']:>8.2f} "
            f"{samples / h['train_time'] if samples else 0:>9.0f} {hh.get('straggler_level', float('nan')):>9.2f} "
            f"{sizes}"
        )
        n += 1
    speedup = steady_mean(ddp, 1) / steady_mean(hetero, 1)
    lines += [
        "-" * 96,
        f"steady epoch time (epochs 1..): stock DDP {steady_mean(ddp, 1):.2f}s, hetero {steady_mean(hetero, 1):.2f}s "
        f"-> {speedup:.2f}x{'' if not speeds else f' (ideal for these speeds: {ideal_speedup(speeds):.2f}x)'}",
        f"final val accuracy{' (every validation sample once)' if 'final_val_acc' in ddp else ''}: "
        f"stock DDP {_final_acc(ddp):.4f}, hetero {_final_acc(hetero):.4f}",
    ]
    return "\n".join(lines)


def _final_acc(record: dict[str, Any]) -> float:
    """The final weights' accuracy on the whole validation split where the record has it, else the last epoch's
    in-run ``val_acc`` (stock DDP's pads its last validation batch with repeated samples)."""
    return float(record.get("final_val_acc", record["epochs"][-1].get("val_acc", float("nan"))))


def plot(ddp: dict[str, Any], hetero: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    hist = hetero["plan_history"]
    epochs = [h["epoch"] for h in hist]
    for r in range(len(hist[0]["batch_sizes"])):
        ax1.plot(epochs, [h["batch_sizes"][r] for h in hist], marker="o", label=f"rank {r}")
    ax1.set(title="HeteroDDPStrategy: batch size per rank", xlabel="epoch", ylabel="local batch size")
    ax1.legend()
    ax2.plot([e["epoch"] for e in ddp["epochs"]], [e["train_time"] for e in ddp["epochs"]], marker="o", label="stock DDP")
    ax2.plot([e["epoch"] for e in hetero["epochs"]], [e["train_time"] for e in hetero["epochs"]], marker="o",
             label="HeteroDDPStrategy")
    ax2.set(title="training time per epoch", xlabel="epoch", ylabel="seconds")
    ax2.set_ylim(bottom=0)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _older_demo(out: Path) -> bool:
    """Whether ``out`` holds the output of a demo from before :data:`DEMO_MARKER`: its ``results.json`` beside
    ``run/``, whose only entry is the ``lightning_logs`` folder of the CSV logger."""
    try:
        results = json.loads((out / "results.json").read_text())
        entries = [p.name for p in (out / "run").iterdir()]
    except (OSError, ValueError):
        return False
    return (isinstance(results, dict) and {"speeds", "ddp", "hetero"} <= set(results)
            and entries == ["lightning_logs"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero-plugins demo", description=__doc__)
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (default 6)")
    parser.add_argument("--speeds", default="1,1,0.5,0.25", help="emulated speed per rank (default 1,1,0.5,0.25)")
    parser.add_argument("--cost-per-sample", type=float, default=0.002, help="emulated seconds per sample at speed 1")
    parser.add_argument("--out", default="demo_output",
                        help="folder for results.json, plot.png and run/ (the HeteroDDPStrategy run's log and "
                        "checkpoint; an earlier demo's run/ is replaced, any other run/ is refused)")
    args = parser.parse_args(argv)
    try:
        speeds = [float(s) for s in args.speeds.split(",")]
    except ValueError:
        parser.error(f"--speeds must be comma-separated numbers, got {args.speeds!r}")
    if not speeds or min(speeds) <= 0:
        parser.error(f"--speeds must be positive numbers (1: full speed, 0.5: half), got {args.speeds!r}")
    if args.epochs < 2:
        parser.error(f"--epochs must be >= 2 (the first epoch measures, later ones are balanced), got {args.epochs}")
    out = Path(args.out)
    run_dir = out / "run"
    try:
        check_output_path(out, "--out", folder=True)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if run_dir.exists() or run_dir.is_symlink():
        ours = (run_dir.is_dir() and not run_dir.is_symlink()
                and ((run_dir / DEMO_MARKER).is_file() or not any(run_dir.iterdir()) or _older_demo(out)))
        if not ours:
            print(f"error: `--out`={args.out!r} holds {str(run_dir)!r}, which an earlier demo did not write (no "
                  f"{DEMO_MARKER} in it), and the demo writes its run there. HINT: choose another --out, or move "
                  f"{str(run_dir)!r} away if you no longer need it.", file=sys.stderr)
            return 2
        shutil.rmtree(run_dir)  # an earlier demo's run: one run per demo, so the report shows this one
    run_dir.mkdir(parents=True)
    (run_dir / DEMO_MARKER).write_text("written by `hetero-plugins demo`; a later demo with the same --out replaces "
                                       "this folder\n")
    t0 = time.perf_counter()
    say = (lambda text: None) if is_quiet() else (lambda text: print(text, flush=True))
    say(f"hetero-plugins demo: digits CNN, {len(speeds)} CPU ranks emulated at speeds {speeds}, "
        f"{args.epochs} epochs per run")
    say("1/2 stock DDP (equal batches, unweighted mean)...")
    ddp = run_digits_job("ddp", speeds, args.cost_per_sample, args.epochs, label="stock DDP", keep_weights=True)
    say("2/2 HeteroDDPStrategy (per-rank batches, sample-weighted gradients)...")
    hetero = run_digits_job("hetero", speeds, args.cost_per_sample, args.epochs, label="hetero", run_dir=run_dir,
                            keep_weights=True)
    for record in (ddp, hetero):
        record["final_val_acc"] = val_accuracy(record.pop("state_dict"))
    print()
    print(render_table(ddp, hetero, speeds))
    (out / "results.json").write_text(json.dumps({"speeds": speeds, "ddp": ddp, "hetero": hetero}, indent=1))
    plot(ddp, hetero, out / "plot.png")
    print(f"\nwrote {out / 'results.json'}, {out / 'plot.png'} and {run_dir} (the HeteroDDPStrategy run's CSV log "
          f"and checkpoint) in {time.perf_counter() - t0:.0f}s")
    print(f"what the balancer did: hetero-plugins report {run_dir}")
    return 0
