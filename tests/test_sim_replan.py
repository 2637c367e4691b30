"""The simulator's mid-epoch re-plans (``simulate(replan_every=...)``), as the Lightning integrations make them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hetero_plugins.scheduler.sim import oracle, simulate
from hetero_plugins.scheduler.sim.cluster import ClusterSim
from hetero_plugins.scheduler.sim.family import family_scenarios
from hetero_plugins.scheduler.sim.loop import SimulationRun


def _slowdown(steps: int = 20) -> dict:
    """Four equal ranks; rank 0 runs 3x slower from epoch 2 on, unannounced (a ``speed`` event)."""
    return {"name": "slowdown", "global_batch": 256, "epochs": 5, "steps_per_epoch": steps, "noise": 0.0,
            "devices": {"gpu": {"cost_per_sample": 0.001, "overhead": 0.004, "memory_samples": 512}},
            "ranks": [{"device": "gpu"}] * 4, "events": [{"epoch": 2, "ranks": [0], "speed": 3.0}]}


def test_replan_every_beyond_the_epoch_changes_nothing() -> None:
    for spec in family_scenarios("val", 3):
        base = simulate(spec, "equal_finish", seed=1)
        late = simulate(spec, "equal_finish", seed=1, replan_every=spec["steps_per_epoch"])
        assert late["epoch_times"] == base["epoch_times"]
        assert late["plans"] == base["plans"]


def test_a_mid_epoch_replan_rebalances_the_epoch_a_rank_slows_down_in() -> None:
    base = simulate(_slowdown(), "equal_finish")
    mid = simulate(_slowdown(), "equal_finish", replan_every=5)
    # before the slowdown both runs are the same; in its epoch only the re-planning run adapts
    assert mid["epoch_times"][:2] == pytest.approx(base["epoch_times"][:2], rel=1e-12)
    assert mid["epoch_times"][2] < 0.8 * base["epoch_times"][2]
    # the epoch's starting plans are recorded, and the slowed rank starts the next epoch with fewer samples
    assert len(mid["plans"]) == 5 and all(sum(p) == 256 for p in mid["plans"])
    assert mid["plans"][3][0] < min(mid["plans"][3][1:])
    # never worse than the oracle, which knows the slowdown from its first step
    best = oracle(_slowdown(), placement=False)
    assert mid["steady_samples_per_s"] <= best["steady_samples_per_s"] * (1 + 1e-9)


def test_every_step_of_a_replanned_epoch_keeps_the_global_batch() -> None:
    spec = family_scenarios("val", 2)[1]
    run = SimulationRun(ClusterSim(spec, seed=0), "equal_finish", None, 0.03, True, None, replan_every=2)
    seen: list[np.ndarray] = []
    for e in range(run.epochs):
        run.epoch(e)
        seen.append(np.asarray(run.planner.history[-1]["batch_sizes"]))
    assert all(int(p.sum()) == spec["global_batch"] for p in seen)
    # the history records each epoch's starting plan, the plan the run recorded for it
    assert [p.tolist() for p in seen] == run.plans


@pytest.mark.parametrize("bad", [0, -3, 1.5, "5"])
def test_replan_every_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="replan_every"):
        simulate("paper_mix", "equal_finish", replan_every=bad)  # type: ignore[arg-type]


def test_the_simulate_command_takes_replan_every() -> None:
    cmd = [sys.executable, "-m", "hetero_plugins.cli", "simulate", "--scenario", "interference", "--policy",
           "equal_finish", "--replan-every", "3", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout)
    assert res["ratios_steady"]["policy_vs_oracle"] <= 1.0 + 1e-9
    bad = subprocess.run(cmd[:-3] + ["--replan-every", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--replan-every" in bad.stderr and "HINT" in bad.stderr


def test_auto_applies_an_announced_co_runner_after_mid_epoch_re_plans() -> None:
    # Validation cluster default-297: a co-runner announced for epoch 1. Mid-epoch re-plans in epoch 0 must not
    # become the reference auto scores its lines against (a single-size line then looked like noise and auto
    # fell back to equal_finish for that boundary).
    from hetero_plugins.scheduler.measured import load_measured_predictor
    from hetero_plugins.scheduler.policy import AutoAllocator
    from hetero_plugins.scheduler.sim.family import generate_scenario

    spec = generate_scenario(297)
    auto = simulate(spec, AutoAllocator(interference=load_measured_predictor()), seed=0, replan_every=5)
    plain = simulate(spec, "equal_finish", seed=0, replan_every=5)
    assert auto["epoch_times"][0] == pytest.approx(plain["epoch_times"][0], rel=1e-12)
    assert auto["epoch_times"][1] < 0.8 * plain["epoch_times"][1]
    assert auto["steady_samples_per_s"] > plain["steady_samples_per_s"]
