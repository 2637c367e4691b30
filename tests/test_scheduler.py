"""The learned two-stage scheduler: simulator, DQN, NCF, model files, "auto" fallback, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero_plugins.balancing.allocators import ALLOCATORS, Bounds, EqualFinishAllocator, get_allocator
from hetero_plugins.cli import main as cli_main
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.scheduler import (
    AutoAllocator,
    DQNAllocator,
    InterferencePredictor,
    QNetwork,
    plan_relocation,
    write_restart_spec,
)
from hetero_plugins.scheduler.dqn import DQNTrainer
from hetero_plugins.scheduler.features import FEATURES, write_model
from hetero_plugins.scheduler.pretrain import evaluate_dqn, slowdown_table
from hetero_plugins.scheduler.transfer import transfer_ncf
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, ClusterSim, decision_problems, load_scenario, simulate
from hetero_plugins.balancing.time_model import TimeModelParams as P


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- simulator
@pytest.mark.parametrize("name", sorted(BUILTIN_SCENARIOS))
def test_builtin_scenarios_validate(name):
    sc = load_scenario(name)
    assert sc.world_size == len(sc.slope) and sc.global_batch >= sc.world_size


def test_step_times_monotone_in_batch():
    sim = ClusterSim("dynamic")
    plan = np.full(sim.world_size, 32)
    for epoch in range(4):
        lo, _ = sim.step_times(epoch, 3, plan)
        hi, _ = sim.step_times(epoch, 3, plan + 1)
        assert np.all(hi > lo)


def test_events_applied():
    sim = ClusterSim("interference")
    table = sim.scenario.interference
    assert np.all(sim.multipliers(1) == 1.0)
    assert sim.multipliers(2)[0] == pytest.approx(table["video"]["v100"])
    assert sim.multipliers(2)[4] == pytest.approx(table["video"]["t4"])
    assert sim.multipliers(6)[0] == 1.0  # the co-runner left
    ramp = ClusterSim("dynamic").multipliers
    assert 1.0 < ramp(2)[0] < ramp(4)[0] < ramp(6)[0] == pytest.approx(2.5)
    assert ramp(8)[0] == 1.0  # speed reset


def test_simulation_deterministic_for_a_seed():
    a = simulate("paper_mix", "equal_finish", epochs=3)
    b = simulate("paper_mix", "equal_finish", epochs=3)
    c = simulate("paper_mix", "equal_finish", epochs=3, seed=7)
    assert a["epoch_times"] == b["epoch_times"] and a["plans"] == b["plans"]
    assert a["epoch_times"] != c["epoch_times"]
    assert a["epoch_times"][2] < 0.7 * a["epoch_times"][0]  # balancing pays off on the mixed cluster


BASE = {"name": "t", "global_batch": 16, "devices": {"g": {"overhead": 0.0, "cost_per_sample": 0.001}},
        "ranks": [{"device": "g", "count": 2}]}


@pytest.mark.parametrize("patch, field", [
    ({"global_batch": 0}, "global_batch"),
    ({"devices": {"g": {"cost_per_sample": -1}}}, "devices.g.cost_per_sample"),
    ({"ranks": [{"device": "tpu"}]}, "ranks[0].device"),
    ({"ranks": [{"device": "g", "count": 0}]}, "ranks[0].count"),
    ({"events": [{"epoch": 1, "ranks": [0], "melt": True}]}, "events[0]"),
    ({"events": [{"epoch": 1, "ranks": [5], "speed": 2}]}, "events[0].ranks"),
    ({"events": [{"epoch": 1, "rank": 0, "corunner": "video"}], "interference": {"etl": 1.2}}, "events[0].corunner"),
    ({"events": [{"epoch": 1, "rank": 0, "ramp": 2.0, "over": 0}]}, "events[0].over"),
    ({"interference": {"video": {"tpu": 1.5}}}, "interference.video.tpu"),
    ({"interference": {"video": 0.5}}, "interference.video"),
    ({"device_types": {"g": {"slope": 0.001}}}, "device_types"),
    ({"noise": "loud"}, "noise"),
    ({"colour": "red"}, "colour"),
])
def test_bad_scenario_names_field_and_fix(patch, field):
    with pytest.raises(ValueError, match=rf"`{__import__('re').escape(field)}`.*HINT"):
        load_scenario({**BASE, **patch})


def test_bad_scenario_file(tmp_path):
    f = tmp_path / "s.json"
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON.*HINT"):
        load_scenario(f)
    with pytest.raises(ValueError, match="missing.*HINT"):
        load_scenario({"name": "x"})


# ---------------------------------------------------------------- stage 1: DQN
def _small_problems(seed: int):
    spec = {"name": "small", "global_batch": 96, "epochs": 8, "noise": 0.0,
            "devices": {"fast": {"overhead": 0.002, "cost_per_sample": 0.001}, "slow": {"overhead": 0.004, "cost_per_sample": 0.004}},
            "ranks": [{"device": "fast", "count": 2}, {"device": "slow", "count": 1}, {"device": "slow", "count": 1, "data": 0.02}],
            "events": [{"epoch": 3, "ranks": [0], "speed": 2.0}]}
    rng = np.random.default_rng(seed)
    return [p for _ in range(5) for p in decision_problems(spec, rng)]


def test_dqn_learns_a_small_problem_within_seconds():
    problems = _small_problems(0)
    untrained = evaluate_dqn(QNetwork.random(seed=3), problems)
    trainer = DQNTrainer(net=QNetwork.random(seed=3), lr=1e-3, gamma=0.3, eps_decay=60, seed=3)
    trainer.train(problems, seconds=4.0)
    trained = evaluate_dqn(trainer.network(), problems)
    assert trained < 0.8 * untrained, (trained, untrained)
    assert trained < 1.0  # it learned the input-pipeline time that equal_finish cannot see


def test_dqn_plans_are_the_exact_split_at_scale():
    # dqn's split is exact: without co-runner context it is equal_finish's plan, rank for rank.
    sim = ClusterSim("large")
    a, beta, _ = sim.params(2)
    models = [P(x, y) for x, y in zip(a, beta)]
    bounds = Bounds((1,) * sim.world_size, tuple(sim.scenario.max_batch))  # type: ignore[arg-type]
    plan = DQNAllocator().allocate(models, sim.scenario.global_batch, bounds)
    ef = EqualFinishAllocator().allocate(models, sim.scenario.global_batch, bounds)
    assert sum(plan) == sim.scenario.global_batch and all(lo <= b <= hi for b, lo, hi in zip(plan, bounds.min_batch, bounds.max_batch))
    assert plan == ef


def test_registered_and_usable_by_the_planner():
    assert isinstance(get_allocator("dqn"), DQNAllocator) and isinstance(get_allocator("auto"), AutoAllocator)
    assert {"dqn", "auto"} <= set(ALLOCATORS)
    p = BalancePlanner(world_size=2, global_batch=64, allocator="auto")
    rec = np.array([[[32, 0.032, 0.0]] * 5, [[32, 0.128, 0.0]] * 5])
    p.end_epoch(0, rec)
    assert p.plan[1] < p.plan[0] and sum(p.plan) == 64


def test_model_round_trip_and_schema_refusal(tmp_path):
    net = QNetwork.random(seed=1)
    path = net.save(tmp_path / "q.npz", note="x")
    back = QNetwork.load(path)
    x = np.random.default_rng(0).normal(size=(5, len(FEATURES)))
    assert np.allclose(net(x), back(x)) and back.meta["note"] == "x"
    old = tmp_path / "old.npz"
    write_model(old, {"W0": np.zeros((3, 1)), "b0": np.zeros(1)}, {"kind": "dqn", "schema_version": 0, "features": ["a"]})
    with pytest.raises(ValueError, match="feature schema version 0.*HINT"):
        QNetwork.load(old)
    with pytest.raises(ValueError, match="`model`=.* is no longer an option of DQNAllocator.*HINT: remove `model`"):
        DQNAllocator(model=old)
    with pytest.raises(ValueError, match="holds a 'ncf' model"):
        QNetwork.load(Path(__file__).parents[1] / "hetero_plugins/scheduler/models/ncf_v1.npz")
    with pytest.raises(ValueError, match="is not a file.*HINT"):
        QNetwork.load(tmp_path / "missing.npz")


def test_shipped_models_are_small_and_load():
    root = Path(__file__).parents[1] / "hetero_plugins/scheduler/models"
    assert sum(f.stat().st_size for f in root.iterdir()) < 1_000_000
    assert QNetwork.load().meta["schema_version"] == 1
    assert InterferencePredictor.load().predict("training", "v100", None) == 1.0


# ---------------------------------------------------------------- stage 2: NCF
def test_ncf_learns_slowdowns_within_seconds():
    rows = slowdown_table(seed=0)
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(rows))
    test, train = [rows[i] for i in idx[:30]], [rows[i] for i in idx[30:]]
    p = InterferencePredictor(sorted({r[0] for r in rows}), sorted({r[1] for r in rows}), sorted({r[2] for r in rows}), seed=0)
    untrained = p.mse(test)
    mean = float(np.mean(np.log([r[3] for r in train])))
    baseline = float(np.mean((np.log([r[3] for r in test]) - mean) ** 2))
    p.fit(train, epochs=300, seconds=5.0)
    assert p.mse(test) < 0.5 * baseline and p.mse(test) < 0.2 * untrained


def test_ncf_round_trip_and_transfer(tmp_path):
    p = InterferencePredictor.load()
    q = InterferencePredictor.load(p.save(tmp_path / "n.npz"))
    assert q.predict("bert", "t4", "video") == pytest.approx(p.predict("bert", "t4", "video"))
    with pytest.raises(ValueError, match="unknown device 'h100'.*transfer"):
        p.predict("bert", "h100", "video")
    t, stats = transfer_ncf([("bert", "h100", "video", 1.2), ("bert", "h100", "etl", 1.05)], source=p, epochs=100)
    assert stats["after_mse_log"] < stats["before_mse_log"]
    assert t.predict("bert", "h100", "video") == pytest.approx(1.2, rel=0.05)
    assert t.predict("bert", "t4", "video") == pytest.approx(p.predict("bert", "t4", "video"), rel=0.1)


def test_relocation_moves_off_an_interfered_slot(tmp_path):
    p = InterferencePredictor.load()
    slots = [{"device": "t4", "corunner": "video"}, {"device": "v100", "corunner": None},
             {"device": "t4", "corunner": None}]
    plan = plan_relocation(p, "training", slots, world_size=2, global_batch=64,
                           device_times={"t4": (0.006, 0.0012), "v100": (0.005, 0.0005)})
    assert sorted(plan.mapping) == [1, 2] and plan.predicted_gain > 0.05
    with pytest.warns(RuntimeWarning, match=r"predicted to make steps \d+\.\d% faster"):
        spec = write_restart_spec(tmp_path / "restart.json", plan, slots)
    data = json.loads(spec.read_text())  # type: ignore[union-attr]
    assert data["moves"] and data["predicted_gain"] == pytest.approx(plan.predicted_gain)


# ---------------------------------------------------------------- CLI
def test_cli_simulate_json(capsys):
    assert cli_main(["simulate", "interference", "--json", "--epochs", "3", "--allocators", "equal_finish,dqn,auto"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"] == "interference" and out["world_size"] == 8 and out["epochs"] == 3
    assert set(out["results"]) == {"equal_finish", "dqn", "auto"}
    for r in out["results"].values():
        assert {"total_time", "samples_per_s", "time_vs_equal_finish", "final_plan", "decision_ms"} <= set(r)
        assert sum(r["final_plan"]) == 512 and len(r["epoch_times"]) == 3
    assert out["results"]["auto"]["last_choice"] in ("ncf", "equal_finish")


def test_cli_simulate_bad_scenario(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**BASE, "global_batch": -3}))
    assert cli_main(["simulate", str(bad)]) == 2
    assert "`global_batch`" in capsys.readouterr().err


# ---------------------------------------------------------------- compact schema, oracle, CLI
COMPACT = {
    "ranks": [{"device": "a100", "corunner": None}, {"device": "a100", "corunner": None},
              {"device": "t4", "corunner": "memcpy"}],
    "devices": {"a100": {"cost_per_sample": 0.001, "overhead": 0.01, "memory_samples": 512},
                "t4": {"cost_per_sample": 0.004, "overhead": 0.01, "memory_samples": 256}},
    "free_slots": [{"device": "a100", "corunner": None}],
    "global_batch": 256, "epochs": 6, "noise": 0.05, "seed": 0,
    "events": [{"epoch": 2, "rank": 1, "corunner": "video"}, {"epoch": 3, "rank": 0, "lost": True},
               {"epoch": 4, "add": {"device": "t4", "corunner": None}}],
}


def test_compact_schema():
    sc = load_scenario(COMPACT)
    assert sc.world_size == 4 and sc.device[3] == "t4" and sc.join == (0, 0, 0, 4) and sc.leave[0] == 3
    assert sc.slope[0] == 0.001 and sc.intercept[0] == 0.01 and sc.max_batch[2] == 256 and len(sc.free_slots) == 1
    sim = ClusterSim(sc)
    assert sim.corunners(0)[2] == "memcpy" and sim.multipliers(0)[2] > 1.0  # initial co-runner applied
    assert sim.multipliers(2)[1] > 1.0 == sim.multipliers(1)[1]
    assert list(sim.active(2)) == [0, 1, 2] and list(sim.active(3)) == [1, 2] and list(sim.active(4)) == [1, 2, 3]
    r = simulate(sc, "equal_finish")
    assert r["world_sizes"] == [3, 3, 3, 2, 3, 3] and r["restarts"] == 2
    assert all(sum(p) == 256 for p in r["plans"])


@pytest.mark.parametrize("patch, field", [
    ({"devices": {"a100": {"overhead": 0.01}}}, "devices.a100.cost_per_sample"),
    ({"devices": {"a100": {"cost_per_sample": -1}}}, "devices.a100.cost_per_sample"),
    ({"ranks": [{"device": "h100"}]}, "ranks[0].device"),
    ({"ranks": [{"device": "a100", "corunner": "crypto"}]}, "ranks[0].corunner"),
    ({"events": [{"epoch": 1, "rank": 9, "corunner": None}]}, "events[0].rank"),
    ({"events": [{"epoch": 1, "rank": 0, "explode": True}]}, "events[0]"),
    ({"free_slots": [{"device": "tpu"}]}, "free_slots[0].device"),
    ({"gpus": 3}, "gpus"),
])
def test_compact_schema_errors_name_field_and_fix(patch, field):
    with pytest.raises(ValueError, match=rf"`{__import__('re').escape(field)}`.*HINT"):
        load_scenario({**COMPACT, **patch})


def test_allreduce_cost_and_oracle():
    from hetero_plugins.scheduler.sim import oracle

    sim = ClusterSim("paper_mix")
    lat, nbytes, bw = sim.scenario.allreduce
    assert sim.allreduce_time(8) == pytest.approx(lat + 2 * 7 / 8 * nbytes / bw) and sim.allreduce_time(1) == 0.0
    o = oracle("interference")
    ef = simulate("interference", "equal_finish")
    assert o["steady_samples_per_s"] > ef["steady_samples_per_s"]
    assert any(x["free_slot"] is not None for x in o["placements"][8])  # the oracle uses the idle GPUs
    assert oracle("interference", placement=False)["steady_samples_per_s"] < o["steady_samples_per_s"]


def test_cli_simulate_compact_scenario(capsys, tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps(COMPACT))
    assert cli_main(["simulate", "--scenario", str(f), "--policy", "dqn", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["throughput"]
    assert set(t) == {"policy", "oracle", "equal_split", "best_analytic"} and out["policy"] == "dqn"
    assert t["oracle"]["steady_samples_per_s"] >= t["best_analytic"]["steady_samples_per_s"] > t["equal_split"]["steady_samples_per_s"]
    assert out["decision_ms_per_epoch"]["policy"] > 0 and out["scenario"] == "c"
    assert cli_main(["simulate", "--scenario", "nope", "--policy", "dqn"]) == 2
    assert cli_main(["simulate", "--scenario", "paper_mix", "--policy", "magic"]) == 2


def test_policy_alias_on_strategy_and_callback():
    from hetero_plugins.callbacks import BatchBalancer
    from hetero_plugins.strategies import HeteroDDPStrategy

    assert isinstance(HeteroDDPStrategy(policy="auto").balancer.allocator, AutoAllocator)
    assert isinstance(BatchBalancer(policy="dqn").allocator, DQNAllocator)
    assert BatchBalancer(policy="lbb", allocator="lbb").allocator.name == "lbb"
    # The two-stage scheduler's safe policy is the default of the strategy and the callback (and of
    # hh.HeteroBatchSampler, through the same BalancingOptions; tests/horovod checks it under horovodrun).
    assert isinstance(BatchBalancer().allocator, AutoAllocator)
    assert isinstance(HeteroDDPStrategy().balancer.allocator, AutoAllocator)
    with pytest.raises(ValueError, match="`allocator`='lbb' and `policy`='auto' disagree.*HINT"):
        HeteroDDPStrategy(allocator="lbb", policy="auto")


# ---------------------------------------------------------------- single schema, stage 2 feeding stage 1, latency
def test_events_apply_in_epoch_order_whatever_the_file_order():
    spec = {**BASE, "events": [{"epoch": 4, "rank": 0, "corunner": None}, {"epoch": 2, "rank": 0, "corunner": "video"}]}
    sim = ClusterSim(spec)
    assert sim.corunners(3)[0] == "video" and sim.multipliers(3)[0] > 1.0
    assert sim.corunners(4)[0] is None and sim.multipliers(4)[0] == 1.0


def test_old_internal_form_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"`device_types`.*HINT.*cost_per_sample"):
        load_scenario({"name": "x", "global_batch": 8, "device_types": {"g": {"slope": 0.001}},
                       "ranks": [{"device": "g", "count": 2}]})


def test_vectorised_equal_finish_is_makespan_optimal():
    from hetero_plugins.scheduler.placement import equal_finish_plan

    rng = np.random.default_rng(0)
    for _ in range(100):
        n = int(rng.integers(2, 24))
        a, b = rng.uniform(0, 0.02, n), rng.uniform(1e-4, 5e-3, n)
        lo, hi = rng.integers(1, 4, n), rng.integers(20, 200, n)
        gb = int(rng.integers(lo.sum(), hi.sum() + 1))
        plan = equal_finish_plan(a, b, gb, lo, hi)
        ref = EqualFinishAllocator().allocate([P(x, y) for x, y in zip(a, b)], gb,
                                              Bounds(tuple(int(x) for x in lo), tuple(int(x) for x in hi)))
        assert plan.sum() == gb and np.all(plan >= lo) and np.all(plan <= hi)
        assert np.max(a + b * plan) <= np.max(a + b * np.array(ref)) * (1 + 1e-9)


def test_known_corunner_arrival_shifts_load_before_it_is_measured():
    models = [P(0.005, 0.0005)] * 3 + [P(0.006, 0.0012)]
    bounds = Bounds.uniform(4)
    blind = AutoAllocator().allocate(models, 256, bounds)
    auto = AutoAllocator(trust_unverified=True)  # a first arrival: nothing measured to check the NCF against
    auto.set_context(devices=["v100"] * 3 + ["t4"], corunners=[None] * 4, next_corunners=[None] * 3 + ["video"])
    told = auto.allocate(models, 256, bounds)
    assert told[3] < 0.8 * blind[3] and sum(told) == 256  # the NCF predicts the video co-runner's slowdown
    assert auto.dqn.correction is not None and auto.dqn.correction.corrections == 1
    again = auto.allocate(models, 256, bounds)  # the context is used once: then the change is measured
    assert again[3] >= 0.9 * blind[3] and auto.dqn.correction.corrections == 1
    off = AutoAllocator(interference=False)
    off.set_context(devices=["v100"] * 3 + ["t4"], corunners=[None] * 4, next_corunners=[None] * 3 + ["video"])
    assert off.allocate(models, 256, bounds) == blind
    with pytest.raises(ValueError, match="`devices`, `corunners` and `next_corunners` go together.*HINT"):
        auto.set_context(devices=["v100"])
    with pytest.raises(ValueError, match="`interference`=3 .*HINT"):
        DQNAllocator(interference=3)


def test_stage2_context_beats_equal_finish_when_corunners_arrive():
    spec = {"devices": {"v100": {"cost_per_sample": 0.0005, "overhead": 0.005, "memory_samples": 512},
                        "t4": {"cost_per_sample": 0.0012, "overhead": 0.006, "memory_samples": 256}},
            "ranks": [{"device": "v100", "corunner": None, "count": 2}, {"device": "t4", "corunner": None, "count": 2}],
            "global_batch": 256, "epochs": 6, "steps_per_epoch": 5, "noise": 0.0,
            "interference": {"video": {"v100": 1.5, "t4": 1.9}},
            "events": [{"epoch": 2, "rank": 2, "corunner": "video"}, {"epoch": 4, "rank": 2, "corunner": None}]}
    ef = simulate(spec, "equal_finish")["steady_samples_per_s"]
    with_ctx = simulate(spec, AutoAllocator(trust_unverified=True))["steady_samples_per_s"]
    without = simulate(spec, AutoAllocator(trust_unverified=True), telemetry=False)["steady_samples_per_s"]
    assert with_ctx > 1.05 * ef  # the stale epochs after each change are avoided
    assert without == pytest.approx(ef, rel=0.01)  # no context, no information beyond the measured times


def test_auto_plans_1024_ranks_as_well_as_equal_finish():
    sim = ClusterSim("large")
    a, beta, _ = sim.params(2)
    models = [P(x, y) for x, y in zip(a, beta)]
    bounds = Bounds((1,) * sim.world_size, tuple(sim.scenario.max_batch))  # type: ignore[arg-type]
    auto = AutoAllocator()
    plan = auto.allocate(models, sim.scenario.global_batch, bounds)
    ef = EqualFinishAllocator().allocate(models, sim.scenario.global_batch, bounds)
    makespan = lambda p: max(m.predict(b) for m, b in zip(models, p))  # noqa: E731
    assert sum(plan) == sim.scenario.global_batch and makespan(plan) <= makespan(ef) * (1 + 1e-9)


def test_transfer_keeps_the_best_on_validation():
    from hetero_plugins.scheduler.transfer import transfer_dqn

    spec = {"devices": {"fast": {"cost_per_sample": 0.001, "overhead": 0.002},
                        "slow": {"cost_per_sample": 0.004, "overhead": 0.004}},
            "ranks": [{"device": "fast", "count": 2}, {"device": "slow", "count": 2, "data": 0.01}],
            "global_batch": 96, "epochs": 5, "noise": 0.0}
    net, stats = transfer_dqn(spec, source=QNetwork.random(seed=2), seconds=1.0, checkpoints=4)
    assert len(stats["validation"]) == 5 and stats["kept"] in ("source", "fine-tuned")
    kept_val = stats["validation"][0] if stats["kept"] == "source" else min(stats["validation"][1:])
    assert kept_val <= stats["validation"][0]
    with pytest.raises(ValueError, match="`freeze_fraction`"):
        transfer_dqn(spec, freeze_fraction=2.0)


# ---------------------------------------------------------------- layout: the registry, imports one way
def test_a_fresh_interpreter_that_imports_only_the_planner_knows_the_learned_allocators(tmp_path):
    import subprocess
    import sys

    code = ("from hetero_plugins.balancing.planner import BalancePlanner\n"
            "import hetero_plugins.allocators as old_path\n"
            "p = BalancePlanner(4, 64, allocator='auto')\n"
            "print(type(p.allocator).__name__, type(old_path.get_allocator('dqn')).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AutoAllocator", "DQNAllocator"]


def test_register_allocator_and_unknown_names():
    from hetero_plugins.balancing.allocators import StaticAllocator, register_allocator

    class Halves(StaticAllocator):
        name = "halves"

    register_allocator("halves", Halves)
    try:
        assert isinstance(get_allocator("halves"), Halves)
        register_allocator("halves", Halves)  # the same class again: nothing happens
        with pytest.raises(ValueError, match=r"'halves' is already registered.*HINT.*override=True"):
            register_allocator("halves", EqualFinishAllocator)
        register_allocator("halves", EqualFinishAllocator, override=True)
        assert isinstance(get_allocator("halves"), EqualFinishAllocator)
    finally:
        ALLOCATORS.pop("halves", None)
    with pytest.raises(ValueError, match=r"`cls`.*HINT"):
        register_allocator("ints", int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`name`.*HINT"):
        register_allocator("", Halves)
    with pytest.raises(ValueError, match=r"one of \[.*'auto'.*'dqn'.*\], got 'fastest'\. HINT: .*register_allocator"):
        get_allocator("fastest")


def _imported_modules(path: Path) -> set[str]:
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_imports_point_down_balancing_never_reaches_the_scheduler_nor_the_scheduler_its_simulator():
    import hetero_plugins

    root = Path(hetero_plugins.__file__).parent
    for f in sorted((root / "balancing").glob("*.py")):
        assert not any(m.startswith("hetero_plugins.scheduler") for m in _imported_modules(f)), f.name
    # The online scheduler needs nothing from the simulator; only training and the command line use it.
    for f in sorted((root / "scheduler").glob("*.py")):
        if f.stem in ("pretrain", "placement_training", "critic_training", "transfer", "commands"):
            continue
        assert not any(m.startswith("hetero_plugins.scheduler.sim") for m in _imported_modules(f)), f.name


@pytest.mark.parametrize("module", ["hetero_plugins.scheduler.placement", "hetero_plugins.scheduler.interference",
                                    "hetero_plugins.scheduler.sim", "hetero_plugins.scheduler.sim.scenario"])
def test_scheduler_docstring_examples(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(module)).failed == 0


def test_the_sim_alias_keeps_every_name():
    import hetero_plugins.scheduler.sim as sim
    import hetero_plugins.sim as alias

    assert alias is sim
    for name in ("simulate", "oracle", "load_scenario", "ClusterSim", "Scenario", "BUILTIN_SCENARIOS",
                 "decision_problems", "best_placement", "DecisionProblem", "DEFAULT_CORUNNERS", "SCENARIO_FIELDS",
                 "EVENT_KINDS"):
        assert hasattr(alias, name), name
    assert set(sim.__all__) <= set(dir(alias))
