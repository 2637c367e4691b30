"""The generated scenario family, the simulator's nonlinear curves and free-slot events, the exact curve
split of the oracle, and the evaluation helpers."""

from __future__ import annotations

import doctest
import importlib
import itertools
import json

import numpy as np
import pytest

from hetero_plugins.scheduler.sim import ClusterSim, load_scenario, oracle, simulate
from hetero_plugins.scheduler.sim.cluster import min_makespan_curves
from hetero_plugins.scheduler.sim.evaluate import ANALYTIC, best_analytic, evaluate, relative_to_best
from hetero_plugins.scheduler.sim.family import (FAMILIES, SPLITS, family_scenarios, family_seeds, generate_scenario,
                                                 split_of, table_pairs)

# A small measured table in the format profile-interference writes (three workloads, three co-runners).
_SLOWDOWNS = {"mlp": {"cpu_burn": 1.8, "membw": 1.4, "io": 1.1}, "cnn": {"cpu_burn": 2.2, "membw": 1.6, "io": 1.05},
              "loader": {"cpu_burn": 1.3, "membw": 1.2, "io": 1.9}}
TABLE = {"format": 1, "machine": {"cpu": "test"}, "device": "cpu",
         "rows": [{"workload": w, "device": "cpu", "corunner": c, "solo_s": 1.0, "shared_s": s, "slowdown": s,
                   "repeats": 3} for w, row in _SLOWDOWNS.items() for c, s in row.items()]}


def _base(**device):
    return {"global_batch": 64, "epochs": 4, "steps_per_epoch": 3, "noise": 0.0,
            "devices": {"g": {"cost_per_sample": 0.001, "overhead": 0.01, "memory_samples": 64, **device},
                        "h": {"cost_per_sample": 0.004, "overhead": 0.01, "memory_samples": 64}},
            "ranks": [{"device": "g"}, {"device": "h"}]}


@pytest.mark.parametrize("module", ["hetero_plugins.scheduler.sim.family", "hetero_plugins.scheduler.sim.evaluate",
                                    "hetero_plugins.scheduler.sim.cluster", "hetero_plugins.scheduler.sim.scenario"])
def test_docstring_examples(module):
    assert doctest.testmod(importlib.import_module(module)).failed == 0


# ------------------------------------------------------------------------------------------------ splits
def test_split_of_and_family_seeds():
    assert [split_of(s) for s in range(10)] == ["train"] * 7 + ["val"] + ["test"] * 2
    assert split_of(127) == "val" and split_of(1009) == "test"
    assert family_seeds("test", 4) == [8, 9, 18, 19]
    assert family_seeds("val", 3) == [7, 17, 27]
    seen = [set(family_seeds(s, 50)) for s in SPLITS]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            split_of(bad)
    with pytest.raises(ValueError, match="split.*HINT"):
        family_seeds("training", 3)


def test_generate_is_deterministic_and_json():
    a = generate_scenario(11, table=TABLE)
    assert a == generate_scenario(11, table=TABLE)
    assert a != generate_scenario(12, table=TABLE)
    assert a != generate_scenario(11, "shifted", table=TABLE)
    assert json.loads(json.dumps(a)) == a
    assert [s["name"] for s in family_scenarios("val", 2, table=TABLE, world=5)] == ["default-7", "default-17"]
    with pytest.raises(ValueError, match="family.*HINT"):
        generate_scenario(1, "other", table=TABLE)
    with pytest.raises(ValueError, match="world.*HINT"):
        generate_scenario(1, world=1, table=TABLE)
    with pytest.raises(ValueError, match="rows.*HINT"):
        generate_scenario(1, table={"format": 1, "rows": []})
    with pytest.raises(ValueError, match=r"rows\[0\]\.slowdown.*HINT"):
        generate_scenario(1, table={"format": 1, "rows": [{"workload": "w", "corunner": "c", "slowdown": -1}]})


def test_shipped_table_or_a_clear_error():
    try:
        importlib.import_module("hetero_plugins.scheduler.measured")
    except ImportError:
        with pytest.raises(ValueError, match="table.*HINT"):
            generate_scenario(3)
    else:
        assert load_scenario(generate_scenario(3, world=6)).world_size == 6


@pytest.mark.parametrize("family", FAMILIES)
def test_many_seeds_load_and_cover_what_varies(family):
    stats: dict[str, int] = {k: 0 for k in ("saturation", "cliff", "taken", "freed", "slot_co", "arrive", "leave",
                                            "ramp", "data_bound", "cpu")}
    worlds, ntypes, workloads = [], [], set()
    pairs = table_pairs(TABLE)
    for seed in range(80):
        spec = generate_scenario(seed, family, table=TABLE)
        sc = load_scenario(spec)
        worlds.append(sc.world_size)
        ntypes.append(len(sc.device_types))
        workloads.add(sc.workload)
        cost = [t.cost_per_sample for t in sc.device_types.values()]
        assert 3.5 <= max(cost) / min(cost) <= 14.5  # costs span about 10x
        assert 0.01 <= sc.noise <= 0.10 and sc.restart_cost > 0
        assert all(t.memory_samples for t in sc.device_types.values())
        for c, row in sc.interference.items():  # drawn from the table's slowdowns of the job's workload
            assert (sc.workload, c) in pairs and all(v >= 1.0 for v in row.values())
        stats["saturation"] += any(t.saturation for t in sc.device_types.values())
        stats["cliff"] += any(t.cliff_at is not None for t in sc.device_types.values())
        stats["cpu"] += any(d.startswith("cpu") for d in sc.device_types)
        stats["taken"] += any(ev.get("taken") is True for ev in sc.slot_events)
        stats["freed"] += any(ev.get("taken") is False for ev in sc.slot_events)
        stats["slot_co"] += any("corunner" in ev for ev in sc.slot_events)
        stats["arrive"] += any(ev["kind"] == "corunner" and ev["corunner"] and ev["epoch"] > 0 for ev in sc.events)
        stats["leave"] += any(ev["kind"] == "corunner" and ev["corunner"] is None for ev in sc.events)
        stats["ramp"] += any(ev["kind"] == "ramp" for ev in sc.events)
        typical = np.median(np.asarray(sc.intercept) + np.asarray(sc.slope) * sc.global_batch / sc.world_size)
        stats["data_bound"] += bool(np.max(sc.data) > 0.5 * typical)
    assert 4 <= min(worlds) and max(worlds) <= 256 and max(worlds) >= 100 and min(worlds) <= 8
    assert set(ntypes) == {2, 3, 4, 5, 6}
    for k, v in stats.items():
        if k == "cpu":
            assert (v > 0) == (family == "shifted"), (k, v)
        else:
            assert 5 <= v, (k, v)
    assert workloads == ({"cnn", "mlp"} if family == "default" else {"loader"})  # another interference draw


def test_generated_scenarios_simulate_and_large_world_loads():
    for seed in (8, 9, 18):
        for family in FAMILIES:
            sc = load_scenario(generate_scenario(seed, family, table=TABLE, world=6))
            out = simulate(sc, "equal_finish", epochs=3)
            best = oracle(sc, epochs=3)
            assert out["steady_samples_per_s"] > 0 and 0 < out["steady_busy_fraction"] <= 1
            assert best["steady_samples_per_s"] > 0
    assert load_scenario(generate_scenario(5, table=TABLE, world=1024)).world_size == 1024


# ------------------------------------------------------------------------------------------------ curves
def test_saturation_and_cliff_step_times():
    sc = load_scenario(_base(saturation=16, cliff={"at": 40, "factor": 3.0}))
    sim = ClusterSim(sc)
    compute, _ = sim.step_times(0, 0, [8, 8])
    assert compute[0] == pytest.approx(0.01 + 0.001 * 16)  # saturated: 8 samples take as long as 16
    assert compute[1] == pytest.approx(0.01 + 0.004 * 8)  # a linear device
    compute, _ = sim.step_times(0, 0, [50, 8])
    assert compute[0] == pytest.approx(0.01 + 0.001 * (40 + 3.0 * 10))  # beyond the cliff, 3x per sample
    times = [sim.step_times(0, 0, [b, 1])[0][0] for b in range(1, 65)]
    assert all(x <= y for x, y in zip(times, times[1:]))
    # The planner measures the curve: an equal_finish run still completes, and the oracle is never slower.
    assert oracle(sc)["steady_samples_per_s"] >= simulate(sc, "equal_finish")["steady_samples_per_s"] * 0.999


def test_linear_fields_leave_results_bit_identical():
    plain = _base()
    plain["noise"] = 0.05
    explicit = json.loads(json.dumps(plain))
    explicit["devices"]["g"]["saturation"] = 0
    for a, b in ((simulate(plain), simulate(explicit)), (oracle(plain), oracle(explicit))):
        assert a["epoch_times"] == b["epoch_times"] and a["plans"] == b["plans"]


@pytest.mark.parametrize("bad, field", [
    ({"saturation": -1}, "devices.g.saturation"),
    ({"saturation": 2.5}, "devices.g.saturation"),
    ({"cliff": {"at": 10}}, "devices.g.cliff"),
    ({"cliff": {"at": 0, "factor": 2.0}}, "devices.g.cliff.at"),
    ({"cliff": {"at": 10, "factor": 0.5}}, "devices.g.cliff.factor"),
])
def test_curve_fields_are_validated(bad, field):
    with pytest.raises(ValueError, match=rf"`{field}`.*HINT"):
        load_scenario(_base(**bad))


def _brute(times, gb, lo, hi):
    best = np.inf
    for plan in itertools.product(*[range(a, b + 1) for a, b in zip(lo, hi)]):
        if sum(plan) == gb:
            best = min(best, float(np.max(times(np.array(plan)))))
    return best


def test_min_makespan_curves_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 4))
        a, s = rng.uniform(0, 0.02, n), rng.uniform(0.001, 0.01, n)
        sat = rng.integers(0, 8, n) * (rng.random(n) < 0.6)
        at, f = rng.integers(1, 10, n), np.where(rng.random(n) < 0.6, rng.uniform(1, 5, n), 1.0)
        step = rng.random(n) < 0.2  # plain steps (any nondecreasing function is allowed)

        def times(b, a=a, s=s, sat=sat, at=at, f=f, step=step):
            b = np.asarray(b, dtype=np.float64)
            w = np.maximum(b, sat) + (f - 1) * np.maximum(0, b - at)
            return np.where(step, a + 0.01 * np.floor(b / 4), a + s * w)

        lo = rng.integers(0, 3, n)
        hi = lo + rng.integers(0, 10, n)
        gb = int(rng.integers(lo.sum(), hi.sum() + 1))
        plan = min_makespan_curves(times, gb, lo, hi)
        assert plan.sum() == gb and np.all(plan >= lo) and np.all(plan <= hi)
        assert float(np.max(times(plan))) == _brute(times, gb, lo, hi)
    with pytest.raises(ValueError, match="global_batch.*HINT"):
        min_makespan_curves(lambda b: b * 1.0, 10, [1, 1], [4, 4])


def test_oracle_split_is_exact_with_curves():
    spec = _base(saturation=20, cliff={"at": 30, "factor": 4.0})
    spec.update(global_batch=40, epochs=2)
    sc = load_scenario(spec)
    sim = ClusterSim(sc)
    out = oracle(sc, placement=False)
    plan = out["plans"][0]
    best = _brute(lambda b: sim.step_times(0, 0, b)[0], 40, [1, 1], [40, 40])
    assert sim.true_makespan(0, plan) == pytest.approx(best, rel=1e-12)
    assert plan != [32, 8]  # the linear equal-finish split would ignore the cliff


# ------------------------------------------------------------------------------------------------ free slots
def _slots(events):
    spec = _base()
    spec.update(epochs=6, interference={"video": 2.0},
                free_slots=[{"device": "g", "corunner": None}], events=events)
    spec["devices"]["f"] = {"cost_per_sample": 0.0001, "overhead": 0.0, "memory_samples": 64}
    spec["free_slots"].append({"device": "f", "corunner": None})
    return spec


def test_free_slot_events_change_corunners_and_availability():
    sc = load_scenario(_slots([{"epoch": 2, "slot": 0, "corunner": "video"}, {"epoch": 4, "slot": 0, "corunner": None},
                               {"epoch": 0, "slot": 1, "taken": True}, {"epoch": 3, "slot": 1, "taken": False}]))
    sim = ClusterSim(sc)
    assert [sim.slot_corunners(e)[0] for e in range(6)] == [None, None, "video", "video", None, None]
    assert [bool(sim.slot_taken(e)[1]) for e in range(6)] == [True, True, True, False, False, False]
    assert sim.place_multipliers(2)[2] == 2.0 and sim.place_multipliers(4)[2] == 1.0
    assert sim.place_taken(0).tolist() == [False, False, False, True]
    assert sim.place_caps() == [64, 64, 64, 64]  # a slot of a type no rank starts on
    # The oracle uses the fast slot (of a type no rank has) only once it is freed.
    used = [any(p["free_slot"] == 1 for p in ps) for ps in oracle(sc)["placements"]]
    assert used == [False, False, False, True, True, True]


def test_oracle_places_on_freed_slots_with_curves():
    spec = _slots([{"epoch": 0, "slot": 1, "taken": True}, {"epoch": 3, "slot": 1, "taken": False}])
    spec["devices"]["f"]["cliff"] = {"at": 50, "factor": 2.0}  # nonlinear: the vectorised placement search
    out = oracle(spec)
    assert [any(p["free_slot"] == 1 for p in ps) for ps in out["placements"]] == [False] * 3 + [True] * 3
    assert min(out["epoch_times"][3:]) < max(out["epoch_times"][:3])


def test_oracle_keeps_a_slot_it_holds_when_another_job_would_take_it():
    sc = load_scenario(_slots([{"epoch": 2, "slot": 1, "taken": True}]))
    used = [any(p["free_slot"] == 1 for p in ps) for ps in oracle(sc)["placements"]]
    assert used == [True] * 6
    sc = load_scenario(_slots([{"epoch": 0, "slot": 1, "taken": True}]))
    assert not any(p["free_slot"] == 1 for ps in oracle(sc)["placements"] for p in ps)


@pytest.mark.parametrize("event, field", [
    ({"epoch": 1, "slot": 5, "taken": True}, r"events\[0\]\.slot"),
    ({"epoch": 1, "slot": 0, "taken": 1}, r"events\[0\]\.taken"),
    ({"epoch": 1, "slot": 0, "taken": True, "corunner": None}, r"events\[0\]"),
    ({"epoch": 1, "slot": 0, "corunner": "nope"}, r"events\[0\]\.corunner"),
])
def test_free_slot_events_are_validated(event, field):
    with pytest.raises(ValueError, match=rf"`{field}`.*HINT"):
        load_scenario(_slots([event]))


# ------------------------------------------------------------------------------------------------ evaluation
def test_evaluate_and_best_analytic():
    scs = [generate_scenario(s, table=TABLE, world=4) for s in (8, 9)]
    pols = {a: (a, None) for a in ANALYTIC}
    pols["relocating"] = ("equal_finish", True)
    rows = evaluate(scs, pols, seeds=(0, 1), epochs=3)
    assert [(r["scenario"], r["policy"]) for r in rows] == [(s["name"], p) for s in scs for p in pols]
    for r in rows:
        per = [p["steady_samples_per_s"] for p in r["per_seed"]]
        assert [p["seed"] for p in r["per_seed"]] == [0, 1] and r["steady_samples_per_s"] == pytest.approx(np.mean(per))
        assert 0 < r["steady_busy_fraction"] <= 1
    best = best_analytic(scs, seeds=(0, 1), epochs=3, rows=rows)
    for s in scs:
        cands = [r for r in rows if r["scenario"] == s["name"] and r["policy"] in ANALYTIC]
        assert best[s["name"]]["steady_samples_per_s"] == max(r["steady_samples_per_s"] for r in cands)
    assert best_analytic(scs[:1], seeds=(0, 1), epochs=3)[scs[0]["name"]]["steady_samples_per_s"] == \
        best[scs[0]["name"]]["steady_samples_per_s"]  # recomputed: the same (deterministic)
    rel = relative_to_best(rows, best)
    assert max(r["vs_best"] for r in rel if r["policy"] in ANALYTIC) == 1.0
    with pytest.raises(ValueError, match="policies.*HINT"):
        evaluate(scs, {"x": "equal_finish"})
    with pytest.raises(ValueError, match="seeds.*HINT"):
        evaluate(scs, pols, seeds=())


def test_evaluate_replans_within_epochs_when_asked():
    """``replan_every`` reaches the simulated loop, and ``best_analytic`` reuses only rows planned the same way."""
    sc = generate_scenario(8, table=TABLE, world=4)
    rows = evaluate([sc], {"ef": ("equal_finish", None)}, seeds=(0,), epochs=3, replan_every=2)
    direct = simulate(sc, "equal_finish", epochs=3, seed=0, replan_every=2)["steady_samples_per_s"]
    assert rows[0]["replan_every"] == 2 and rows[0]["steady_samples_per_s"] == direct
    ends = evaluate([sc], {a: (a, None) for a in ANALYTIC}, seeds=(0,), epochs=3)
    assert ends[0]["replan_every"] is None and ends[0]["steady_samples_per_s"] != direct  # re-planning changed the run
    replanned = best_analytic([sc], seeds=(0,), epochs=3, replan_every=2)[sc["name"]]
    reused = best_analytic([sc], seeds=(0,), epochs=3, rows=ends, replan_every=2)[sc["name"]]
    assert reused["replan_every"] == 2 and reused["steady_samples_per_s"] == replanned["steady_samples_per_s"]
    assert best_analytic([sc], seeds=(0,), epochs=3, rows=ends)[sc["name"]] in ends  # same planning: reused
