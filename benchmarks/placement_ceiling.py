"""How much better than the greedy rule can any choice among the learned relocator's moves be, and why?

The learned placement target (>= 1.05x the greedy ``Relocator``) is a claim about choosing among candidate
moves (:func:`~hetero_plugins.scheduler.placement_policy.candidate_actions`: stay, the greedy placement, single
moves of the slowest ranks, moves back home). This benchmark bounds it with *rollout choosers*: at every epoch
boundary each candidate is played forward ``--horizon`` epochs in a fork of the simulated run
(:meth:`~hetero_plugins.scheduler.sim.loop.SimulationRun.branch`, nobody moving after) and the candidate that
saves the most seconds over staying, restart included, is taken (none: stay). What the fork is allowed to know
separates three sources of the margin:

- ``clairvoyant``: the run's own noise and its future (co-runner arrivals and departures, slots freed and
  taken): the most any one-decision-at-a-time chooser among these moves can reach;
- ``indep_noise``: the future, but noise drawn independently (mean of ``--noise-draws`` forks): the share of
  the margin owed to knowing the noise;
- ``true_model``: independent noise and no future (what is announced at the boundary lasts): a chooser that
  knows the cluster's true step-time curves and interference, nothing a real scheduler could not know at that
  moment except those curves. Its margin over ``greedy`` is what better pricing of the moves could win; the
  rest of ``clairvoyant``'s is foresight;
- ``true_lines``: as ``true_model``, but the forks run the true curves' line parts (saturation plateaus and
  memory cliffs removed, interference still true): the share owed to the curves' shape;
- ``believed``: as ``true_model``, but the forks run what the relocator believes at the boundary: each rank's
  fitted line rescaled by the NCF to its place's co-runner, each free slot priced as the relocator prices it
  (data times, noise level and the planner's own dynamics are the cluster's). Everything it uses is known to a
  scheduler at that moment, so it is a model-based relocator, not a bound: what planning with one's own model
  (rolling the planner forward on the fitted state) wins over the greedy rule's one-line payback test.

Beside them: ``none``, ``greedy`` and ``learned`` (the shipped network), all with ``equal_finish`` splitting.
Ratios are averaged over the split's clusters that have co-runner churn and free slots.

    python benchmarks/placement_ceiling.py --split val --out bench_output/placement_ceiling.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.scheduler.measured import load_measured_predictor
from hetero_plugins.scheduler.placement_policy import (
    PLACEMENT_FEATURES,
    LearnedRelocator,
    candidate_decision,
    make_relocator,
)
from hetero_plugins.scheduler.sim import ClusterSim, load_scenario
from hetero_plugins.scheduler.sim.family import family_scenarios, has_churn_and_slots
from hetero_plugins.scheduler.sim.loop import SimulationRun

#: The rollout choosers: (fork noise, fork knows the future, what the forks' places run: the true curves,
#: their lines, or the relocator's belief).
CHOOSERS = {"clairvoyant": ("own", True, "curves"), "indep_noise": ("independent", True, "curves"),
            "true_model": ("independent", False, "curves"), "true_lines": ("independent", False, "lines"),
            "believed": ("independent", False, "belief")}
POLICIES = ("none", "greedy", "learned", *CHOOSERS)


class RolloutChooser(LearnedRelocator):
    """Chooses among the learned relocator's candidates by their realised return in forks of the run."""

    def __init__(self, scenario: Any, predictor: Any, horizon: int, noise: str, known_future: bool,
                 draws: int, places: str = "curves") -> None:
        super().__init__(predictor=predictor, workload=scenario.workload, restart_cost=scenario.restart_cost,
                         keep_greedy=False, online=False, margin=0.0)
        self.horizon, self.noise, self.known_future, self.draws = horizon, noise, known_future, draws
        self.places = places
        self.run: SimulationRun | None = None
        self._pending: tuple[list[dict[str, Any]], dict[str, Any]] | None = None
        self.net = self._returns  # type: ignore[assignment]  # the "network" is the rollouts

    def features(self, cands: list[dict[str, Any]], ctx: Any) -> np.ndarray:
        self._pending = (cands, dict(ctx))
        return np.zeros((len(cands), len(PLACEMENT_FEATURES)))

    def _returns(self, _x: np.ndarray) -> np.ndarray:
        assert self.run is not None and self._pending is not None
        cands, ctx = self._pending
        run, unit = self.run, ctx["t_cur"] * ctx["steps"]
        seeds: list[int | None] = [None] if self.noise == "own" else \
            [10_007 * (k + 1) + 31 * run.sim.seed + ctx["epoch"] for k in range(self.draws)]
        kw = {"known_future": self.known_future, "believed": self._believed(ctx)}
        out = np.zeros(len(cands))
        for seed in seeds:
            stay = run.branch(None, self.horizon, seed=seed, **kw)
            for j, c in enumerate(cands):
                moved = candidate_decision(c, ctx["incoming"], ctx["lines"], ctx["t_cur"])
                out[j] += (stay - run.branch(moved, self.horizon, seed=seed, **kw)) / unit
        return out / len(seeds)

    def _believed(self, ctx: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        """Per place, the line the forks run (``None``: the true curves)."""
        assert self.run is not None and self.run.boundary is not None
        sim = self.run.sim
        e, _, here, _, _, _, co_next = self.run.boundary
        a, b, _ = sim.place_params(e + 1)  # the true lines of the next epoch
        if self.places == "curves":
            return None
        if self.places == "lines":
            return a, b
        a, b = a.copy(), b.copy()  # a place the relocator cannot price keeps its true line
        devices, wl = sim.place_devices(), ctx["workload"]
        at = {int(p): i for i, p in enumerate(here)}
        for p in range(sim.places):
            s1 = self.slowdown(devices[p], co_next[p], wl)
            if p in at:
                i = at[p]
                s0 = self.slowdown(devices[p], ctx["corunners"][i], wl)
                if s0 and s1:
                    a[p], b[p] = ctx["lines"][i][0] / s0 * s1, ctx["lines"][i][1] / s0 * s1
            elif s1 and devices[p] in ctx["solo"]:
                a[p], b[p] = ctx["solo"][devices[p]][0] * s1, ctx["solo"][devices[p]][1] * s1
        return a, b


def run_policy(name: str, sc: Any, seed: int, predictor: Any, horizon: int, draws: int) -> float:
    """Steady samples per second of ``equal_finish`` beside relocation policy ``name``."""
    if name in CHOOSERS:
        noise, known, places = CHOOSERS[name]
        rel: Any = RolloutChooser(sc, predictor, horizon, noise, known, draws, places)
    else:
        rel = make_relocator(name, sc, predictor=predictor)
    run = SimulationRun(ClusterSim(sc, seed=seed), "equal_finish", None, 0.03, True, rel)
    if isinstance(rel, RolloutChooser):
        rel.run = run
    for e in range(run.epochs):
        run.epoch(e)
    return float(run.result()["steady_samples_per_s"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="val", choices=("train", "val", "test"),
                        help="family split (default val; the test split is for reporting only)")
    parser.add_argument("--count", type=int, default=20, help="scenarios of the split to scan (default 20)")
    parser.add_argument("--seeds", type=int, default=1, help="noise seeds per cluster (default 1)")
    parser.add_argument("--horizon", type=int, default=4, help="epochs each fork plays forward (default 4)")
    parser.add_argument("--noise-draws", type=int, default=2, help="independent-noise forks per candidate (default 2)")
    parser.add_argument("--out", default="bench_output/placement_ceiling.json")
    args = parser.parse_args(argv)
    for opt in ("count", "seeds", "horizon", "noise_draws"):
        if getattr(args, opt) < 1:
            parser.error(f"--{opt.replace('_', '-')} must be >= 1, got {getattr(args, opt)}")
    predictor = load_measured_predictor()
    specs = [s for s in family_scenarios(args.split, args.count) if has_churn_and_slots(s)]
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for k, spec in enumerate(specs):
        sc = load_scenario(spec)
        row: dict[str, Any] = {"scenario": sc.name, "world_size": sc.world_size}
        for name in POLICIES:
            row[name] = float(np.mean([run_policy(name, sc, s, predictor, args.horizon, args.noise_draws)
                                       for s in range(args.seeds)]))
        rows.append(row)
        print(f"[{k + 1}/{len(specs)}] {sc.name:>12} ({sc.world_size} ranks) vs greedy: "
              + " ".join(f"{p} {row[p] / row['greedy']:.3f}" for p in POLICIES if p != "greedy")
              + f"  ({time.time() - t0:.0f} s)", flush=True)
    summary = {p: {"vs_greedy": float(np.mean([r[p] / r["greedy"] for r in rows])),
                   "vs_none": float(np.mean([r[p] / r["none"] for r in rows])),
                   "min_vs_none": float(min(r[p] / r["none"] for r in rows))} for p in POLICIES} if rows else {}
    result = {"split": args.split, "count": args.count, "seeds": args.seeds, "horizon": args.horizon,
              "noise_draws": args.noise_draws, "clusters": len(rows), "seconds": round(time.time() - t0, 1),
              "machine": platform.platform(), "summary": summary, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{args.split} split, {len(rows)} clusters with churn and free slots, {args.seeds} seed(s), "
          f"horizon {args.horizon}:\n\n| policy | vs greedy | vs none | worst vs none |\n|---|---|---|---|")
    for p, s in summary.items():
        print(f"| {p} | {s['vs_greedy']:.3f} | {s['vs_none']:.3f} | {s['min_vs_none']:.3f} |")
    print(f"\nwrote {out} ({time.time() - t0:.0f} s)")
    return result


if __name__ == "__main__":
    main()
