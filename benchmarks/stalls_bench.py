"""Transient stalls (the DBS harness): per-epoch rebalancing alone vs mid-epoch replanning, side by side.

Four CPU ranks emulated at speeds 1, 1, 0.5, 0.25 (4 ms per sample at speed 1); every epoch each rank
stalls with probability 0.1 for 4 to 12 steps at a quarter of its speed (``RandomStalls``, seeded). Runs
HeteroDDPStrategy with ``replan_every=None`` (plans change at epoch ends only) and with ``replan_every=5``,
and prints the mean training time per epoch over epochs 1.. and the ratio. Writes bench_output/stalls.json.

    python benchmarks/stalls_bench.py [--epochs 10]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hetero_plugins.apps.jobs import run_digits_job, steady_mean
from hetero_plugins.emulation import RandomStalls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="bench_output/stalls.json")
    args = parser.parse_args()
    speeds = [1.0, 1.0, 0.5, 0.25]
    stalls = RandomStalls(probability=0.1, min_steps=4, max_steps=12, slowdown=4.0, seed=1)
    runs = {}
    for name, every in (("epoch_only", None), ("mid_epoch", 5)):
        runs[name] = run_digits_job("hetero", speeds, 0.004, args.epochs, stalls=stalls, replan_every=every,
                                    label=f"stalls/{name}")
    ratio = steady_mean(runs["epoch_only"], 1) / steady_mean(runs["mid_epoch"], 1)
    stalled = [(e, r) for e in range(args.epochs) for r in range(4) if any(
        stalls.factor(r, e, s) > 1 for s in range(12))]
    result = {"speeds": speeds, "stalls": "RandomStalls(p=0.1, 4..12 steps, 4x, seed=1)", "stalled_epoch_rank": stalled,
              "epoch_only_s": steady_mean(runs["epoch_only"], 1), "mid_epoch_s": steady_mean(runs["mid_epoch"], 1),
              "speedup": ratio, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"stalls_bench: per-epoch only {result['epoch_only_s']:.2f} s/epoch, mid-epoch replanning "
          f"{result['mid_epoch_s']:.2f} s/epoch -> {ratio:.2f}x; stalled (epoch, rank): {stalled}; wrote {args.out}")


if __name__ == "__main__":
    main()
