"""Stock Horovod vs ``hetero_plugins.horovod`` on emulated heterogeneous ranks; writes ``bench_output/horovod.json``.

Runs ``examples/horovod_train.py`` twice under ``horovodrun -np 2 -H localhost:2 --gloo`` with ranks emulated
at speeds 1 and 0.25: once with ``--stock`` (``hvd.DistributedOptimizer`` + ``DistributedSampler``, equal
batches), once with the hooks (per-rank batch sizes). Steady epochs are those from ``--warmup`` on (the first
epoch measures, the second runs the new plan). The ideal speed-up for equal work is
``max_i(B / n / s_i) / (B / sum_i s_i)`` (2.5 for speeds 1 and 0.25).

Targets: steady epochs >= 1.8x faster than stock and >= 0.8 of the ideal speed-up.

Usage::

    python benchmarks/horovod_bench.py [--epochs 5] [--cost-per-sample 0.002] [--out bench_output/horovod.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]


def run(mode: str, args: argparse.Namespace, out: Path) -> dict:
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "60")
    cmd = [
        str(bin_dir / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
        str(REPO / "examples" / "horovod_train.py"), "--speeds", args.speeds, "--cost-per-sample",
        str(args.cost_per_sample), "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
        "--json-out", str(out),
    ] + (["--stock"] if mode == "stock" else [])
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"horovod_bench: the {mode} run took longer than {args.timeout}s")
    if proc.returncode != 0:
        raise SystemExit(f"horovod_bench: the {mode} run failed ({proc.returncode}):\n{log[-4000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Stock Horovod vs hetero_plugins.horovod")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="epochs left out of the steady-state figures")
    p.add_argument("--speeds", default="1,0.25")
    p.add_argument("--cost-per-sample", type=float, default=0.002)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--out", default=str(REPO / "bench_output" / "horovod.json"))
    args = p.parse_args(argv)
    if args.epochs <= args.warmup:
        p.error(f"--epochs ({args.epochs}) must exceed --warmup ({args.warmup})")
    speeds = [float(s) for s in args.speeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        stock = run("stock", args, Path(tmp) / "stock.json")
        hetero = run("hetero", args, Path(tmp) / "hetero.json")
    steady = slice(args.warmup, None)
    t_stock = median(e["train_time"] for e in stock["epochs"][steady])
    t_hetero = median(e["train_time"] for e in hetero["epochs"][steady])
    n = len(speeds)
    ideal = max(1.0 / (n * s) for s in speeds) / (1.0 / sum(speeds))
    ratio = t_stock / t_hetero
    result = {
        "command": "horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py "
                   f"--speeds {args.speeds} --cost-per-sample {args.cost_per_sample} --epochs {args.epochs} "
                   f"--batch-size {args.batch_size} [--stock]",
        "steady_epoch_time_stock": t_stock,
        "steady_epoch_time_hetero": t_hetero,
        "speedup": ratio,
        "ideal_speedup": ideal,
        "fraction_of_ideal": ratio / ideal,
        "targets": {"speedup>=1.8": ratio >= 1.8, "fraction_of_ideal>=0.8": ratio / ideal >= 0.8},
        "final_plan": hetero["epochs"][-1]["plan"],
        "val_acc": {"stock": stock["epochs"][-1]["val_acc"], "hetero": hetero["epochs"][-1]["val_acc"]},
        "stock": stock,
        "hetero": hetero,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(
        f"horovod_bench: steady epoch stock {t_stock:.3f}s, hetero {t_hetero:.3f}s: {ratio:.2f}x "
        f"(ideal {ideal:.2f}x, {100 * ratio / ideal:.0f}% of ideal); plan {result['final_plan']}; wrote {out}"
    )
    return result


if __name__ == "__main__":
    main()
