"""The simulator reports each policy's accelerator busy fraction beside its throughput."""

from __future__ import annotations

import numpy as np

from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, oracle, simulate


def test_busy_fractions_are_fractions_and_balancing_raises_them() -> None:
    for name in BUILTIN_SCENARIOS:
        static = simulate(name, "static")
        balanced = simulate(name, "equal_finish")
        best = oracle(name)
        for run in (static, balanced, best):
            assert len(run["busy_fraction"]) == run["epochs"]
            assert all(0.0 < b <= 1.0 for b in run["busy_fraction"])
            assert 0.0 < run["steady_busy_fraction"] <= 1.0
        # where the equal split leaves fast ranks idle, the balanced split keeps them busier
        if static["steady_samples_per_s"] < 0.9 * balanced["steady_samples_per_s"]:
            assert balanced["steady_busy_fraction"] > static["steady_busy_fraction"], name


def test_the_steady_busy_fraction_is_the_time_weighted_mean_after_the_first_epoch() -> None:
    run = simulate("paper_mix", "equal_finish")
    t = np.asarray(run["epoch_times"][1:])
    b = np.asarray(run["busy_fraction"][1:])
    assert abs(run["steady_busy_fraction"] - float((t * b).sum() / t.sum())) < 1e-12
    # busy time can never exceed the epoch's rank-seconds, and the slowest rank of a step is busy throughout
    assert run["steady_busy_fraction"] >= 1.0 / run["world_size"]
