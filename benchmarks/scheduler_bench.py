"""Benchmark of the learned scheduler (issue 4) against the analytic allocators on the cluster simulator.

For every built-in scenario and noise seed, each allocator runs the full balancing loop
(:func:`hetero_plugins.sim.simulate`); the figure is the simulated training time relative to
``equal_finish`` (below 1: faster). Also measured: one allocation's wall time at 1024 ranks on one core,
and the stage-2 NCF's held-out error and the relocation gain it predicts on the ``interference`` cluster.

The issue's rule: where the learned policy does not beat the analytic allocators, the default stays with
what wins, and this benchmark says so (``verdict``).

    python benchmarks/scheduler_bench.py --out bench_output/scheduler.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.allocators import Bounds, get_allocator
from hetero_plugins.sim import ClusterSim, load_scenario, simulate
from hetero_plugins.time_model import TimeModelParams

SMALL = ["static", "proportional", "equal_finish", "lbb", "dqn", "auto", "dqn_no_telemetry"]
LARGE = ["static", "proportional", "equal_finish", "dqn", "auto", "dqn_no_telemetry"]


def _run(name: str, alloc: str, seed: int) -> float:
    """Simulated time; ``dqn_no_telemetry`` is the DQN without utilisation / data-time telemetry (as in Lightning)."""
    if alloc == "dqn_no_telemetry":
        return simulate(name, get_allocator("dqn"), seed=seed, telemetry=False)["total_time"]
    return simulate(name, get_allocator(alloc), seed=seed)["total_time"]


def _single_thread() -> Any:
    try:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(1)
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        import contextlib

        return contextlib.nullcontext()


def scenario_rows(seeds: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("paper_mix", "interference", "dynamic", "large"):
        names = LARGE if name == "large" else SMALL
        per: dict[str, list[float]] = {a: [] for a in names}
        for seed in seeds if name != "large" else seeds[:1]:
            times = {a: _run(name, a, seed) for a in names}
            for a in names:
                per[a].append(times[a] / times["equal_finish"])
        out[name] = {a: {"time_vs_equal_finish": float(np.mean(v)), "worst": float(np.max(v)), "best": float(np.min(v))}
                     for a, v in per.items()}
        print(f"{name}: " + ", ".join(f"{a} {np.mean(v):.3f}" for a, v in per.items()), flush=True)
    return out


def decision_latency(repeats: int = 15) -> dict[str, Any]:
    sim = ClusterSim("large")
    a, beta, _ = sim.params(2)
    models = [TimeModelParams(x, y) for x, y in zip(a, beta)]
    bounds = Bounds((1,) * sim.world_size, tuple(sim.scenario.max_batch))  # type: ignore[arg-type]
    out: dict[str, Any] = {"world_size": sim.world_size, "global_batch": sim.scenario.global_batch}
    with _single_thread():
        for name in ("equal_finish", "dqn", "auto"):
            alloc = get_allocator(name)
            alloc.allocate(models, sim.scenario.global_batch, bounds)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = alloc.allocate(models, sim.scenario.global_batch, bounds)
                ts.append(time.perf_counter() - t0)
            out[name] = {"median_ms": 1000 * float(np.median(ts)), "min_ms": 1000 * float(np.min(ts)),
                         "predicted_makespan_s": max(m.predict(b) for m, b in zip(models, plan))}
    return out


def stage2() -> dict[str, Any]:
    from hetero_plugins.scheduler.ncf import InterferencePredictor, plan_relocation

    p = InterferencePredictor.load()
    sc = load_scenario("interference")
    sim = ClusterSim(sc)
    co = sim.corunners(7)
    slots = [{"device": d, "corunner": c} for d, c in zip(sc.device, co)]
    slots += [{"device": "v100", "corunner": None}, {"device": "t4", "corunner": None}]  # two idle GPUs
    times = {"v100": (0.005, 0.0005), "t4": (0.006, 0.0012)}
    plan = plan_relocation(p, sc.workload, slots, sc.world_size, sc.global_batch, times)
    # The truth: the scenario's interference table, equal-finish step time before and after.
    def true_time(mapping: list[int]) -> float:
        a = np.array([times[slots[s]["device"]][0] * (sc.interference[slots[s]["corunner"]][slots[s]["device"]] if slots[s]["corunner"] else 1.0) for s in mapping])
        b = np.array([times[slots[s]["device"]][1] * (sc.interference[slots[s]["corunner"]][slots[s]["device"]] if slots[s]["corunner"] else 1.0) for s in mapping])
        return float((sc.global_batch + np.sum(a / b)) / np.sum(1 / b))
    return {
        "ncf_training": p.meta.get("trained", {}),
        "relocation_moves": plan.moves,
        "relocation_predicted_gain": plan.predicted_gain,
        "relocation_true_gain": true_time(list(range(sc.world_size))) / true_time(plan.mapping) - 1.0,
    }


def table(res: dict[str, Any]) -> str:
    lines = ["| scenario | " + " | ".join(SMALL) + " |", "|---" * (len(SMALL) + 1) + "|"]
    for name, row in res["scenarios"].items():
        cells = [f"{row[a]['time_vs_equal_finish']:.3f}" if a in row else "-" for a in SMALL]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lat = res["latency_1024_ranks"]
    lines.append("")
    lines.append(f"One allocation at {lat['world_size']} ranks, one core (median ms): "
                 + ", ".join(f"{a} {lat[a]['median_ms']:.1f}" for a in ("equal_finish", "dqn", "auto")))
    s2 = res["stage2"]
    lines.append(f"NCF held-out MSE(log slowdown) {s2['ncf_training'].get('test_mse_log', float('nan')):.4f} vs "
                 f"{s2['ncf_training'].get('mean_baseline_test_mse_log', float('nan')):.4f} for the mean; relocation on "
                 f"`interference`: {len(s2['relocation_moves'])} moves, predicted gain {100 * s2['relocation_predicted_gain']:.1f}%, "
                 f"true gain {100 * s2['relocation_true_gain']:.1f}%")
    lines.append("")
    lines += [f"- {v}" for v in res["verdict"]]
    return "\n".join(lines)


def verdict(scen: dict[str, Any], lat: dict[str, Any]) -> list[str]:
    out = []
    for name, row in scen.items():
        best = min(row, key=lambda a: row[a]["time_vs_equal_finish"])
        analytic = min((a for a in row if a not in ("dqn", "auto", "dqn_no_telemetry")), key=lambda a: row[a]["time_vs_equal_finish"])
        learned = min(("dqn", "auto", "dqn_no_telemetry"), key=lambda a: row[a]["time_vs_equal_finish"])
        d = row[learned]["time_vs_equal_finish"] / row[analytic]["time_vs_equal_finish"] - 1
        word = "beats" if d < -0.005 else "ties" if d <= 0.005 else "loses to"
        out.append(f"{name}: {learned} {word} {analytic} ({100 * d:+.1f}% simulated time); best: {best}")
    wins = sum("beats" in v for v in out)
    out.append(f"dqn decision at 1024 ranks: {lat['dqn']['median_ms']:.1f} ms (target <= 10 ms: "
               f"{'met' if lat['dqn']['median_ms'] <= 10 else 'missed'})")
    out.append("default allocator: stays equal_finish" + (
        f" (the learned policy wins {wins} of {len(scen)} scenarios, not all; use allocator='auto' to opt in)"
        if wins else " (the learned policy never beats it by more than 0.5%)"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_output/scheduler.json")
    parser.add_argument("--seeds", type=int, default=3, help="noise seeds per small scenario")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    scen = scenario_rows(list(range(args.seeds)))
    lat = decision_latency()
    res = {"scenarios": scen, "latency_1024_ranks": lat, "stage2": stage2(), "verdict": verdict(scen, lat),
           "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
           "bench_seconds": time.perf_counter() - t0}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=float))
    print(table(res))
    print(f"\nwritten {path} in {res['bench_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
