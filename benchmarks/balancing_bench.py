"""Benchmark of the balancing core: decision latency at 1024 ranks, and how the oracle bounds the policies.

Targets (reported as met / missed; timings are the median of repeated runs on one CPU core, after a
warm-up, so they say what a decision costs, not what a loaded machine does once):

- ``equal_finish`` decides a split of 32768 samples over 1024 ranks in <= 1 ms;
- the planner's epoch end (learn an epoch's step records, decide, write the history entry) at 1024 ranks
  in <= 5 ms, for epochs of 3 steps (the ``large`` scenario's) and, for reference, of 20 and 100 steps;
- on the built-in scenarios without noise, no policy beats the oracle on any epoch (the oracle's split is
  exact); with the scenarios' own noise, how often one does by luck of the noise, and by how much.

    python benchmarks/balancing_bench.py --out bench_output/balancing.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.balancing.allocators import Bounds, get_allocator
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.time_model import TimeModelLines, TimeModelParams
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, ClusterSim, oracle, simulate

POLICIES = ("static", "proportional", "equal_finish", "lbb", "dqn", "auto")
SCENARIOS = ("paper_mix", "static_mix", "interference", "dynamic", "elastic")


def _single_thread() -> Any:
    try:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(1)
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        import contextlib

        return contextlib.nullcontext()


def _median_ms(fn: Any, repeats: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times), min(times)


def allocator_latency(repeats: int) -> dict[str, Any]:
    sim = ClusterSim("large")
    a, s, _ = sim.params(2)
    n, total = sim.world_size, sim.scenario.global_batch
    bounds = Bounds((1,) * n, tuple(int(c) for c in sim.scenario.max_batch))  # type: ignore[arg-type]
    lines = TimeModelLines(a, s, np.ones(n, dtype=bool))
    listed = [TimeModelParams(float(x), float(y)) for x, y in zip(a, s)]
    out: dict[str, Any] = {}
    for name in ("equal_finish", "proportional", "lbb", "static"):
        alloc = get_allocator(name)
        med, best = _median_ms(lambda: alloc.allocate(lines, total, bounds), repeats)
        out[name] = {"median_ms": med, "min_ms": best}
    med, best = _median_ms(lambda: get_allocator("equal_finish").allocate(listed, total, bounds), repeats)
    out["equal_finish_from_parameter_list"] = {"median_ms": med, "min_ms": best}
    return out


def planner_latency(steps: int, repeats: int) -> dict[str, float]:
    sim = ClusterSim("large")
    n, total = sim.world_size, sim.scenario.global_batch
    rng = np.random.default_rng(0)
    planner = BalancePlanner(n, total)
    caps = list(sim.scenario.max_batch)
    times = []
    for epoch in range(repeats + 3):
        a, s, _ = sim.params(min(epoch, 3))
        plan = np.asarray(planner.plan, dtype=np.float64)
        rec = np.zeros((n, steps, 3))
        rec[:, :, 0] = plan[:, None]
        rec[:, :, 1] = (a + s * plan)[:, None] * np.exp(rng.normal(0, 0.02, (n, steps)))
        t0 = time.perf_counter()
        planner.end_epoch(epoch, rec, epoch_time=1.0, memory_caps=caps)
        if epoch >= 3:  # after the warm-up epochs (first plan changes, lazy imports)
            times.append(1000 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "steps": steps}


def oracle_bounds(seeds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SCENARIOS:
        for noisy in (False, True):
            spec = copy.deepcopy(BUILTIN_SCENARIOS[name])
            if not noisy:
                spec["noise"] = 0.0
            beaten = total = 0
            worst = 0.0
            for seed in range(seeds):
                best = oracle(spec, seed=seed)["epoch_times"]
                for policy in POLICIES:
                    times = simulate(spec, policy, seed=seed)["epoch_times"]
                    for t, o in zip(times, best):
                        total += 1
                        if t < o * (1 - 1e-12):
                            beaten += 1
                            worst = max(worst, o / t - 1)
            out[f"{name}{'' if noisy else ' (noise 0)'}"] = {"epochs": total, "policy_faster": beaten,
                                                             "by_at_most": worst}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_output/balancing.json")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3, help="noise seeds per scenario for the oracle bound")
    args = parser.parse_args()
    t0 = time.time()
    with _single_thread():
        alloc = allocator_latency(args.repeats)
        plan = {str(steps): planner_latency(steps, args.repeats) for steps in (3, 20, 100)}
    bounds = oracle_bounds(args.seeds)
    result = {"allocators_1024_ranks": alloc, "planner_epoch_end_1024_ranks": plan, "oracle_bound": bounds,
              "machine": f"{platform.machine()}, python {platform.python_version()}", "seconds": time.time() - t0}
    ef = alloc["equal_finish"]["median_ms"]
    pe = plan["3"]["median_ms"]
    print(f"equal_finish at 1024 ranks: {ef:.2f} ms median (target <= 1 ms: {'met' if ef <= 1 else 'missed'}); "
          + ", ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in alloc.items() if k != "equal_finish"))
    print(f"planner epoch end at 1024 ranks, 3 steps: {pe:.2f} ms median (target <= 5 ms: "
          f"{'met' if pe <= 5 else 'missed'}); 20 steps {plan['20']['median_ms']:.2f} ms, 100 steps "
          f"{plan['100']['median_ms']:.2f} ms")
    for name, row in bounds.items():
        print(f"{name}: a policy beat the oracle in {row['policy_faster']} of {row['epochs']} epochs"
              + (f", by at most {100 * row['by_at_most']:.2f}%" if row["policy_faster"] else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"written {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
