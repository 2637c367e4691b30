"""Stage 2 applied: the Relocator's decisions, and relocation inside the simulator's loop."""

from __future__ import annotations

import copy
import doctest
import json

import numpy as np
import pytest

from hetero_plugins.scheduler import relocation as relocation_module
from hetero_plugins.scheduler.relocation import Relocator
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, load_scenario, simulate
from hetero_plugins.balancing.time_model import LinearTimeModel, TimeModelParams

V100, T4 = (0.005, 0.0005), (0.006, 0.0012)


def _propose(r: Relocator, **overrides):
    kwargs = dict(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, "video"],
                  lines=[V100, T4], free_slots=[{"device": "v100"}], global_batch=512, steps_per_epoch=20,
                  epochs_left=5)
    kwargs.update(overrides)
    return r.propose(**kwargs)


def test_doctests():
    assert doctest.testmod(relocation_module).failed == 0


def test_a_rank_beside_a_new_corunner_moves_to_a_faster_free_slot():
    d = _propose(Relocator(restart_cost=0.0))
    assert d.moves == [(1, 0)]
    # The mover's line is the v100 solo line (rank 0 is dedicated, so it is rank 0's own).
    assert d.lines[1] == pytest.approx(V100)
    assert d.lines[0] == pytest.approx(V100)
    assert d.step_time < d.current_step_time and d.predicted_gain > 0.2
    assert d.saved_seconds == pytest.approx((d.current_step_time - d.step_time) * 3 * 20)


def test_the_restart_cost_and_the_horizon_decide():
    free = _propose(Relocator(restart_cost=0.0))
    per_step = free.current_step_time - free.step_time
    # A restart that costs more than the steps of the horizon save: stay.
    assert _propose(Relocator(restart_cost=per_step * 60 * 1.01)).moves == []
    assert _propose(Relocator(restart_cost=per_step * 60 * 0.99)).moves == [(1, 0)]
    # One epoch left: the horizon shrinks to it.
    assert _propose(Relocator(restart_cost=per_step * 30), epochs_left=1).moves == []
    assert _propose(Relocator(restart_cost=per_step * 30, horizon_epochs=1)).moves == []


def test_no_move_on_noise_and_no_move_to_an_unknown_device():
    r = Relocator(restart_cost=0.0)
    # A free t4 slot like rank 1's own, and rank 1 measured 2% slower than the other t4: nobody moves.
    d = r.propose(devices=["t4", "t4"], corunners=[None, None], next_corunners=[None, None],
                  lines=[T4, (T4[0] * 1.02, T4[1] * 1.02)], free_slots=[{"device": "t4"}], global_batch=256,
                  steps_per_epoch=20, epochs_left=10)
    assert d.moves == []
    # No rank runs on an a100, so its solo line is unknown: the slot is not considered.
    d = _propose(r, free_slots=[{"device": "a100"}])
    assert d.moves == [] and d.unknown_slots == [0]
    # The same slot with a co-runner the NCF does not know is skipped too.
    d = _propose(r, free_slots=[{"device": "v100", "corunner": "crypto-miner"}])
    assert d.moves == [] and d.unknown_slots == [0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="restart_cost"):
        Relocator(restart_cost=-1.0)
    with pytest.raises(ValueError, match="horizon_epochs"):
        Relocator(horizon_epochs=0)
    with pytest.raises(ValueError, match="one entry per rank"):
        _propose(Relocator(), lines=[V100])


def test_a_predicted_time_model_is_replaced_by_measurements():
    m = LinearTimeModel.from_params(TimeModelParams(0.01, 0.002), 32)
    assert m.predict(32) == pytest.approx(0.074)
    for _ in range(6):  # the slot is 2x slower than predicted
        m.observe(32, 0.148)
    assert m.predict(32) == pytest.approx(0.148, rel=0.02)


def test_measured_levels_reshape_a_predicted_line():
    # The prediction has the right slope but half the fixed cost: every measured step is 8-13% slower than
    # predicted, inside the change threshold, so no change point fires and only the fit can correct the shape.
    m = LinearTimeModel.from_params(TimeModelParams(0.002, 0.0006), 38)
    rng = np.random.default_rng(0)
    for b in [38, 23] * 15:  # about an epoch at each of two batch sizes, 1% noise
        m.observe(b, (0.004 + 0.0006 * b) * (1 + 0.01 * rng.standard_normal()))
    p = m.params()
    # The measured fixed cost wins over the predicted one (noise-free seed points used to fix it for good).
    assert p.intercept == pytest.approx(0.004, rel=0.1)
    assert p.slope == pytest.approx(0.0006, rel=0.05)
    assert m.predict(4) == pytest.approx(0.0064, rel=0.05)


@pytest.mark.parametrize("name", ["elastic", "interference"])
def test_relocation_in_the_simulator_beats_staying(name):
    stay = [simulate(name, "auto", seed=s)["steady_samples_per_s"] for s in (0, 1)]
    runs = [simulate(name, "auto", seed=s, relocation=True) for s in (0, 1)]
    assert all(r["relocations"] for r in runs)
    moved = runs[0]["relocations"][0]["moves"]
    place = {r: p for r, p in moved}
    # The rank took a free place (after the scenario's own ranks) and kept it.
    assert all(p >= load_scenario(name).world_size for p in place.values())
    for r, p in place.items():
        later = [pl for pl in runs[0]["placements"][runs[0]["relocations"][0]["epoch"]:]]
        assert all(p in pl for pl in later)
    assert np.mean([r["steady_samples_per_s"] for r in runs]) > 1.05 * np.mean(stay)


def test_the_restart_cost_is_charged_once_and_placement_events_stay_with_the_place():
    spec = copy.deepcopy(BUILTIN_SCENARIOS["elastic"])
    base = simulate(spec, "equal_finish", relocation=True)
    spec["restart_cost"] = 0.05
    cheap = simulate(spec, "equal_finish", relocation=True)
    e = base["relocations"][0]["epoch"]
    assert cheap["relocations"] == base["relocations"]
    assert base["epoch_times"][e] - cheap["epoch_times"][e] == pytest.approx(0.2 - 0.05)
    assert base["epoch_times"][e + 1] == pytest.approx(cheap["epoch_times"][e + 1])
    # Without relocation nothing changes from the place-free simulator: the same times as before.
    plain = simulate(spec, "equal_finish")
    assert plain["relocations"] == [] and plain["placements"][0] == list(range(6))


def test_restart_cost_is_validated():
    spec = copy.deepcopy(BUILTIN_SCENARIOS["elastic"])
    spec["restart_cost"] = -1
    with pytest.raises(ValueError, match="restart_cost"):
        load_scenario(spec)


def test_the_spec_names_the_moves_and_warns_with_the_gain(tmp_path):
    import json

    from hetero_plugins.scheduler.restart_spec import write_relocation_spec

    d = _propose(Relocator(restart_cost=0.0))
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) \[1\] to free slot\(s\) \[0\].*% faster"):
        path = write_relocation_spec(tmp_path / "spec.json", d,
                                     [{"device": "v100", "corunner": None, "host": "a", "index": 0},
                                      {"device": "t4", "corunner": "video", "host": "a", "index": 1}],
                                     [{"device": "v100", "corunner": None, "host": "a", "index": 2}], epoch=3)
    spec = json.loads(path.read_text())
    assert spec["moves"] == [{"rank": 1, "to_free_slot": 0}] and spec["epoch"] == 3
    assert spec["ranks"][0] == {"rank": 0, "device": "v100", "corunner": None, "host": "a", "index": 0,
                                "from": "own", "line": list(V100)}
    assert spec["ranks"][1]["index"] == 2 and spec["ranks"][1]["from"] == "free_slots[0]"
    assert spec["predicted_gain"] == pytest.approx(d.predicted_gain)
    stay = _propose(Relocator(restart_cost=1e9))
    assert write_relocation_spec(tmp_path / "none.json", stay, [{"device": "v100"}] * 2, []) is None
    assert not (tmp_path / "none.json").exists()


def test_cluster_descriptions_are_validated(tmp_path, monkeypatch):
    from hetero_plugins import cluster as cluster_module
    from hetero_plugins.cluster import CLUSTER_ENV, parse_cluster, read_cluster, resolve_cluster_source

    assert doctest.testmod(cluster_module).failed == 0
    good = {"workload": "resnet", "ranks": [{"device": "v100"}, {"device": "t4", "corunner": "video"}],
            "free_slots": [{"device": "a100", "corunner": None, "data": 0.001}]}
    v = parse_cluster(good, 2)
    assert v.free_slots == [{"device": "a100", "corunner": None, "data": 0.001}] and v.workload == "resnet"
    for spec, match in [({"ranks": [{"device": "v100"}]}, r"`ranks` is invalid.*one entry per rank \(2\)"),
                        ({"ranks": [{"device": "v100"}, {"gpu": "t4"}]}, r"`ranks\[1\]` is invalid"),
                        ({"ranks": [{"device": "v100"}, {"device": ""}]}, r"`ranks\[1\].device`"),
                        ({**good, "free_slots": [{"device": "v100", "data": -1}]}, r"`free_slots\[0\].data`"),
                        ({**good, "nodes": 3}, r"`nodes` is invalid.*remove it")]:
        with pytest.raises(ValueError, match=match):
            parse_cluster(spec, 2)
    path = tmp_path / "c.json"
    with pytest.raises(ValueError, match="does not exist"):
        read_cluster(path, 0, 2)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_cluster(path, 0, 2)
    path.write_text(json.dumps(good))
    assert read_cluster(path, 0, 2).corunners == [None, "video"]
    assert read_cluster(lambda e: good if e else {"ranks": [{"device": "v100"}] * 2}, 0, 2).corunners == [None, None]
    monkeypatch.setenv(CLUSTER_ENV, str(path))
    assert resolve_cluster_source(None) == str(path)
    with pytest.raises(ValueError, match="`cluster`=3"):
        resolve_cluster_source(3)


def test_resume_checkpoint_only_in_a_later_restart_of_the_same_run(tmp_path, monkeypatch):
    from hetero_plugins.scheduler.restart_spec import resume_checkpoint

    ckpt = tmp_path / "hetero_relocation.ckpt"
    ckpt.write_bytes(b"x")
    spec = tmp_path / "hetero_restart.json"
    spec.write_text(json.dumps({"checkpoint": str(ckpt), "run_id": "job1", "restart_count": 0, "moves": []}))
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.warns(RuntimeWarning, match="not started by torchrun"):
        assert resume_checkpoint(spec) is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_checkpoint(spec) is None  # the attempt that wrote it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_checkpoint(spec) == str(ckpt)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job2")
    with pytest.warns(RuntimeWarning, match="is stale"):
        assert resume_checkpoint(spec) is None  # a stale spec of another run
    assert resume_checkpoint(tmp_path / "missing.json") is None


def test_cluster_advisor_context_relocation_and_a_file_caught_mid_write(tmp_path):
    from hetero_plugins.balancing.planner import BalancePlanner
    from hetero_plugins.scheduler import cluster_advisor as advisor_module
    from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor
    from hetero_plugins.scheduler.policy import AutoAllocator

    assert doctest.testmod(advisor_module).failed == 0
    path = tmp_path / "cluster.json"
    now = {"ranks": [{"device": "v100"}, {"device": "t4"}], "free_slots": [{"device": "v100"}]}
    path.write_text(json.dumps(now))
    adv = ClusterAdvisor(str(path), relocation=Relocator(restart_cost=0.0))
    adv.start(0, 2)
    planner = BalancePlanner(2, 64, allocator=AutoAllocator())
    planner.observe(np.array([[[32, 0.005 + 0.0005 * 32, 0.0]] * 4, [[32, 0.006 + 0.0012 * 32, 0.0]] * 4]))
    path.write_text(json.dumps({**now, "ranks": [{"device": "v100"}, {"device": "t4", "corunner": "video"}]}))
    upcoming = adv.before_decision(0, 2, planner.allocator, [0.0, 0.0])
    planner.replan()
    assert planner.allocator.dqn.correction.corrections == 1  # the t4's line was scaled for the video job
    decision, new = adv.relocate(upcoming, planner, steps_per_epoch=10, epochs_left=5, data=[0.0, 0.0])
    assert decision.moves == [(1, 0)] and new
    assert adv.relocate(upcoming, planner, 10, 5, [0.0, 0.0])[1] is False  # the same moves: not new again
    assert adv.placement.corunners == [None, "video"]
    path.write_text("{half a json")  # a manager caught mid-write: skipped with a warning, training goes on
    with pytest.warns(RuntimeWarning, match="skipped this epoch"):
        assert adv.before_decision(1, 2, planner.allocator, [0.0, 0.0]) is None
    assert adv.relocate(None, planner, 10, 5, [0.0, 0.0]) is None
    with pytest.raises(ValueError, match="`relocation`=3"):
        ClusterAdvisor(str(path), relocation=3)


def test_default_relocation_is_the_learned_one_under_autos_guard(tmp_path):
    """relocation=True with the default allocator ("auto"): the planning relocator with the shipped critic decides
    (it is handed the planner and rolls it forward), auto guards it; with another allocator, the greedy Relocator."""
    from hetero_plugins.balancing.allocators import get_allocator
    from hetero_plugins.balancing.options import BalancingOptions
    from hetero_plugins.balancing.planner import BalancePlanner
    from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor
    from hetero_plugins.scheduler.planning import PlanningRelocator
    from hetero_plugins.scheduler.policy import AutoAllocator
    from hetero_plugins.scheduler.rollout_correction import RolloutCorrection
    from hetero_plugins.scheduler.safety import GuardedRelocator

    assert BalancingOptions().allocator == "auto" and BalancingOptions().relocation is True
    path = tmp_path / "cluster.json"
    now = {"ranks": [{"device": "v100"}, {"device": "t4"}], "free_slots": [{"device": "v100"}]}
    path.write_text(json.dumps(now))
    for name, kind in (("auto", GuardedRelocator), ("equal_finish", Relocator)):
        adv = ClusterAdvisor(str(path))
        adv.start(0, 2)
        planner = BalancePlanner(2, 64, allocator=get_allocator(name))
        planner.observe(np.array([[[32, 0.005 + 0.0005 * 32, 0.0]] * 4, [[32, 0.006 + 0.0012 * 32, 0.0]] * 4]))
        upcoming = adv.before_decision(0, 2, planner.allocator, [0.0, 0.0])
        planner.replan()
        decision, _ = adv.relocate(upcoming, planner, steps_per_epoch=10, epochs_left=5, data=[0.0, 0.0])
        rel = adv._get_relocator()  # noqa: SLF001 - what the default built
        assert type(rel) is kind
        if name == "auto":
            assert isinstance(rel.inner, PlanningRelocator) and rel.allocator is planner.allocator
            assert isinstance(rel.inner.critic, RolloutCorrection) and not rel.inner.adapt
            assert isinstance(planner.allocator, AutoAllocator) and rel.inner.decisions == 1
        # The t4 at 2.4x the v100's cost per sample: a free v100 pays for the default 60 s restart over 5 epochs
        # of 10 steps only if a step is long; here it is ~40 ms, so neither policy moves.
        assert decision.moves == []


def test_new_balancer_options_are_checked():
    from hetero_plugins.callbacks import BatchBalancer

    with pytest.raises(ValueError, match="`apply_relocation` must be True or False, got 'yes'"):
        BatchBalancer(apply_relocation="yes")
    with pytest.raises(ValueError, match="`restart_spec` must be a file path, got 3"):
        BatchBalancer(restart_spec=3)
    with pytest.raises(ValueError, match="`relocation`=3 is not usable"):
        BatchBalancer(relocation=3)
    with pytest.raises(ValueError, match="`cluster`=3 is not usable"):
        BatchBalancer(cluster=3)
    assert BatchBalancer(restart_spec="runs/spec.json").restart_spec == "runs/spec.json"


def test_plan_relocation_is_the_relocator_and_writes_the_one_spec_format(tmp_path):
    from hetero_plugins.scheduler import InterferencePredictor, plan_relocation, write_restart_spec
    from hetero_plugins.scheduler.restart_spec import read_relocation_spec

    p = InterferencePredictor.load()
    slots = [{"device": "t4", "corunner": "video"}, {"device": "v100", "corunner": None},
             {"device": "t4", "corunner": None}]
    times = {"t4": T4, "v100": V100}
    plan = plan_relocation(p, "training", slots, world_size=2, global_batch=64, device_times=times)
    # The Relocator's decision: a rank's line is its slot's solo line times the slot's predicted slowdown.
    s = p.predict("training", "t4", "video")
    d = Relocator(p, min_gain=0.05, restart_cost=0.0, horizon_epochs=1).propose(
        devices=["t4", "v100"], corunners=["video", None], next_corunners=["video", None],
        lines=[(T4[0] * s, T4[1] * s), V100], free_slots=[slots[2]], global_batch=64, steps_per_epoch=1,
        epochs_left=1, data=[0.0, 0.0], solo=times)
    assert plan.decision == d and d.moves == [(0, 0)]
    assert plan.mapping == [2, 1] and plan.moves == [(0, 2)] and plan.free == [2]
    assert plan.predicted_gain == pytest.approx(d.predicted_gain) and plan.predicted_step_time < plan.current_step_time
    with pytest.warns(RuntimeWarning, match=r"rank\(s\) \[0\] to free slot\(s\) \[0\].*% faster"):
        path = write_restart_spec(tmp_path / "spec.json", plan, slots)
    spec = read_relocation_spec(path)  # the reader the integrations use after a restart
    assert spec is not None and spec["moves"] == [{"rank": 0, "to_free_slot": 0}]
    assert spec["ranks"][0] == {"rank": 0, "device": "t4", "corunner": None, "from": "free_slots[0]",
                                "line": list(d.lines[0])}
    assert spec["ranks"][1]["from"] == "own" and spec["predicted_gain"] == pytest.approx(plan.predicted_gain)
    # Ranks on other slots than their index, and nothing to gain: nobody moves, no spec.
    stay = plan_relocation(p, "training", slots, world_size=2, global_batch=64, device_times=times, current=[2, 1])
    assert stay.mapping == [2, 1] and stay.moves == []
    assert write_restart_spec(tmp_path / "none.json", stay, slots) is None and not (tmp_path / "none.json").exists()


def test_plan_relocation_names_bad_arguments():
    from hetero_plugins.scheduler import plan_relocation

    slots = [{"device": "t4", "corunner": None}, {"device": "v100", "corunner": None}]
    times = {"t4": T4, "v100": V100}
    with pytest.raises(ValueError, match=r"`current`.*HINT"):
        plan_relocation(None, "training", slots, 2, 64, times, current=[0, 0])
    with pytest.raises(ValueError, match=r"`slots` has 2 entries.*HINT"):
        plan_relocation(None, "training", slots, 3, 64, times)
    with pytest.raises(ValueError, match=r"without solo times.*HINT"):
        plan_relocation(None, "training", slots, 2, 64, {"t4": T4})
    with pytest.raises(ValueError, match=r"does not know.*crypto-miner.*HINT.*transfer"):
        plan_relocation(None, "training", [*slots, {"device": "t4", "corunner": "crypto-miner"}], 2, 64, times)


def test_simulate_command_relocates_as_the_integrations_do():
    from hetero_plugins.balancing.allocators import get_allocator
    from hetero_plugins.scheduler.commands import compare, default_relocation
    from hetero_plugins.scheduler.planning import PlanningRelocator
    from hetero_plugins.scheduler.policy import AutoAllocator, DQNAllocator
    from hetero_plugins.scheduler.safety import GuardedRelocator
    from hetero_plugins.scheduler.sim import load_scenario

    sc = load_scenario("interference")
    auto = AutoAllocator()
    guarded = default_relocation(auto, sc, True)
    assert isinstance(guarded, GuardedRelocator) and isinstance(guarded.inner, PlanningRelocator)
    assert guarded.inner.critic is not None
    assert guarded.inner.restart_cost == sc.restart_cost and guarded.allocator is auto
    for other in (DQNAllocator(), get_allocator("lbb")):  # as in the integrations: the greedy Relocator
        greedy = default_relocation(other, sc, True)
        assert type(greedy) is Relocator and greedy.restart_cost == sc.restart_cost
    custom = Relocator(restart_cost=1.0)
    assert default_relocation(auto, sc, custom) is custom and default_relocation(auto, sc, None) is None
    out = compare("interference", "auto", relocation=True)
    assert len(out["relocations"]) >= 1  # co-runners arrive beside ranks and a free slot exists: auto moves
    assert out["ratios_steady"]["policy_vs_best_analytic"] >= 0.99


def test_a_data_bound_rank_is_moved_to_a_free_slot():
    """A rank that waits for its data longer than the others compute sets every step's length whatever its
    batch; a free slot of the same device without that wait is worth a restart. (The placement objective
    once gave such a rank negative samples and saw no gain in moving it.)"""
    r = Relocator(restart_cost=0.0)
    d = r.propose(devices=["t4", "t4", "t4"], corunners=[None] * 3, next_corunners=[None] * 3,
                  lines=[T4, T4, T4], data=[0.0, 0.0, 0.5], free_slots=[{"device": "t4", "data": 0.0}],
                  global_batch=256, steps_per_epoch=20, epochs_left=10)
    assert d.moves == [(2, 0)]
    assert d.current_step_time == pytest.approx(0.5 + T4[0] + T4[1])
    assert d.step_time < 0.2


def test_a_device_the_ncf_never_saw_borrows_the_known_devices_slowdown():
    """The measured NCF knows one device ('cpu'); on a GPU it has not seen, a co-runner's slowdown is the mean
    over the devices it knows (unseen_device="mean", as the DQN allocator does), so a slot with a co-runner can
    be priced (and avoided) and an announced arrival corrects a line. With "skip" the slot stays unknown."""
    from hetero_plugins.scheduler.interference import InterferenceCorrection
    from hetero_plugins.scheduler.measured import load_measured_predictor

    ncf = load_measured_predictor()
    wl, co = ncf.workloads[0], "compute_x2"
    known = ncf.predict(wl, "cpu", co)
    assert known > 1.2
    assert InterferenceCorrection(ncf).slowdown(wl, "gpu7", co) == pytest.approx(known)
    assert InterferenceCorrection(ncf, unseen_device="skip").slowdown(wl, "gpu7", co) is None
    assert InterferenceCorrection(ncf).slowdown("no-such-workload", "gpu7", co) is None
    with pytest.raises(ValueError, match="unseen_device"):
        InterferenceCorrection(ncf, unseen_device="max")
    from hetero_plugins.scheduler.policy import DQNAllocator

    assert DQNAllocator(interference=ncf).slowdown(wl, "gpu7", co) == pytest.approx(known)
    assert DQNAllocator(interference=ncf, unseen_device="skip").slowdown(wl, "gpu7", co) is None
    assert DQNAllocator(interference=ncf, unseen_device="skip").slowdown(wl, "cpu", co) == pytest.approx(known)
    # A rank beside a heavy co-runner next epoch moves to the clean free slot, not to the busy one.
    line = (0.002, 0.0004)
    kw = dict(devices=["gpu7"] * 3, corunners=[None] * 3, next_corunners=[None, None, co], lines=[line] * 3,
              free_slots=[{"device": "gpu7", "corunner": co}, {"device": "gpu7"}], global_batch=600,
              steps_per_epoch=20, epochs_left=10, workload=wl)
    d = Relocator(ncf, restart_cost=0.0).propose(**kw)
    assert d.moves == [(2, 1)] and d.predicted_gain > 0.1
    assert d.unknown_slots == []
    blind = Relocator(InterferenceCorrection(ncf, unseen_device="skip"), restart_cost=0.0).propose(**kw)
    assert blind.moves == [] and blind.unknown_slots == [0]
