"""Cluster descriptions the built-ins never exercise (found by fuzzing the simulator as a new user would): memory
caps that a move or the oracle's placement would break, a slot that saturates, a rank joining a one-step epoch,
and arguments that must be refused by name."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from hetero_plugins.scheduler.sim import oracle, simulate

#: The slow rank's best move is the fast slot, but that slot holds 64 samples of the 600 the step needs.
CAP_BLIND = {"name": "cap_blind_move", "ranks": [{"device": "fast"}, {"device": "slow"}],
             "devices": {"fast": {"cost_per_sample": 0.0001, "overhead": 0.01, "memory_samples": 64},
                         "slow": {"cost_per_sample": 0.004, "overhead": 0.01, "memory_samples": 1024}},
             "free_slots": [{"device": "fast"}], "global_batch": 600, "epochs": 6, "steps_per_epoch": 5, "noise": 0.0}


@pytest.mark.parametrize("policy", ["equal_finish", "auto", "dqn"])
def test_a_move_the_slots_memory_cannot_hold_is_not_made(policy):
    out = simulate(CAP_BLIND, policy, seed=0, relocation=True)
    assert out["relocations"] == [] and all(sum(p) == 600 for p in out["plans"])
    best = oracle(CAP_BLIND, seed=0)  # the oracle's placement respects the caps too (it raised before)
    assert all(pl[0]["free_slot"] is None and pl[1]["free_slot"] is None for pl in best["placements"])
    assert out["steady_samples_per_s"] <= best["steady_samples_per_s"] * (1 + 1e-9)


def test_the_oracle_never_takes_a_slot_whose_true_curve_is_slower_than_staying():
    """A slot with the lowest cost per sample that saturates at 5,000 samples: the oracle's search ranks it
    first, the true split says staying is 19x faster; the oracle is a bound on staying too."""
    sc = {"name": "saturated_slot", "ranks": [{"device": "a", "count": 2}],
          "devices": {"a": {"cost_per_sample": 0.001, "overhead": 0.01},
                      "s": {"cost_per_sample": 0.0005, "overhead": 0.01, "saturation": 5000}},
          "free_slots": [{"device": "s"}], "global_batch": 256, "epochs": 5, "steps_per_epoch": 5, "noise": 0.0}
    best, stay = oracle(sc, seed=0), oracle(sc, seed=0, placement=False)
    assert best["steady_samples_per_s"] >= stay["steady_samples_per_s"] * (1 - 1e-12)
    policy = simulate(sc, "equal_finish", seed=0)
    assert policy["steady_samples_per_s"] / best["steady_samples_per_s"] < 1.0 + 1e-9  # was 18.2


def test_a_rank_joining_an_epoch_of_one_step_under_relocation():
    """With one step an epoch, a rank that joined has no fitted line at the next boundary; the relocator's
    pricing of the next newcomer's place skips it (it raised AttributeError)."""
    sc = {"name": "add_twice", "ranks": [{"device": "a"}],
          "devices": {"a": {"cost_per_sample": 0.001, "overhead": 0.01},
                      "b": {"cost_per_sample": 0.002, "overhead": 0.01}},
          "global_batch": 64, "epochs": 4, "steps_per_epoch": 1,
          "events": [{"epoch": 1, "add": {"device": "b"}}, {"epoch": 2, "add": {"device": "a"}}]}
    for policy in ("equal_finish", "auto"):
        out = simulate(sc, policy, seed=0, relocation=True)
        assert [len(p) for p in out["plans"]] == [1, 2, 3, 3] and all(sum(p) == 64 for p in out["plans"])


@pytest.mark.parametrize(("kw", "match"), [
    (dict(epochs=0), r"`epochs` must be >= 1, got 0"),
    (dict(epochs=2.7), r"`epochs` must be an int, got 2.7"),
    (dict(seed=-1), r"`seed` must be >= 0, got -1"),
    (dict(relocation="greedy"), r"`relocation`='greedy' is not a relocator\. HINT"),
])
def test_bad_simulate_arguments_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        simulate(CAP_BLIND, "equal_finish", **kw)


def test_a_name_that_is_not_a_string_is_refused_by_its_field():
    for field, spec in (("ranks[0].device", dict(CAP_BLIND, ranks=[{"device": ["fast"]}, {"device": "slow"}])),
                        ("free_slots[0].device", dict(CAP_BLIND, free_slots=[{"device": {"fast": 1}}])),
                        ("ranks[1].corunner", dict(CAP_BLIND, ranks=[{"device": "fast"},
                                                                     {"device": "slow", "corunner": ["x"]}]))):
        with pytest.raises(ValueError, match=re.escape(f"`{field}` is invalid")):
            simulate(spec, "equal_finish")


def test_epochs_past_the_scenario_are_checked_where_it_could_not_and_the_command_says_so(tmp_path):
    lost = {"name": "lost_later", "ranks": [{"device": "a", "count": 2}],
            "devices": {"a": {"cost_per_sample": 0.001, "overhead": 0.01}},
            "global_batch": 64, "epochs": 4, "steps_per_epoch": 3,
            "events": [{"epoch": 5, "ranks": [0, 1], "lost": True}]}
    assert len(simulate(lost, "equal_finish", epochs=5)["epoch_times"]) == 5  # up to the event: fine
    with pytest.raises(ValueError, match=r"`epochs`=7 .* at epoch 5 no rank is left\. HINT: use epochs <= 5"):
        simulate(lost, "equal_finish", epochs=7)
    path = tmp_path / "lost.json"
    path.write_text(json.dumps(lost))
    proc = subprocess.run([sys.executable, "-m", "hetero_plugins.cli", "--quiet", "simulate", "--scenario", str(path),
                           "--epochs", "7"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: `epochs`=7") and "Traceback" not in proc.stderr
    assert np.isfinite(simulate(lost, "auto", epochs=4)["steady_samples_per_s"])


def test_event_keys_that_would_be_ignored_and_unbounded_noise_are_refused():
    base = {"ranks": [{"device": "a", "count": 2}], "devices": {"a": {"cost_per_sample": 0.001}}, "global_batch": 8}
    for events in ([{"epoch": 1, "rank": 0, "ranks": [1], "speed": 2.0}],  # `rank` would be ignored
                   [{"epoch": 1, "rank": 0, "speed": 2.0, "over": 3}]):  # `over` belongs to a ramp
        with pytest.raises(ValueError, match=r"`events\[0\]` is invalid"):
            simulate(dict(base, events=events), "equal_finish")
    assert simulate(dict(base, events=[{"epoch": 1, "rank": 0, "ramp": 2.0, "over": 3}]), "equal_finish")["plans"]
    with pytest.raises(ValueError, match=r"`noise` is invalid: got 1000000.0\. HINT: use a standard deviation in"):
        simulate(dict(base, noise=1e6), "equal_finish")


def test_a_rank_lost_before_it_joins_is_refused():
    spec = {"ranks": [{"device": "a", "count": 2}], "devices": {"a": {"cost_per_sample": 0.001}}, "global_batch": 8,
            "events": [{"epoch": 5, "add": {"device": "a"}}, {"epoch": 3, "rank": 2, "lost": True}]}
    with pytest.raises(ValueError, match=r"`events\[1\]\.rank` is invalid: got 2\. HINT: rank 2 joins at epoch 5"):
        simulate(spec, "equal_finish")
