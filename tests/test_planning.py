"""Model-based relocation: the planner rollout against the simulator, and the planning relocator in the loop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.scheduler.planning import PlanningRelocator, planner_rollout, rollout_epochs, tail_weight
from hetero_plugins.scheduler.relocation import Relocation, Relocator
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, ClusterSim, load_scenario, simulate
from hetero_plugins.scheduler.sim.loop import SimulationRun


def _planner(lines, batch=256):
    p = BalancePlanner(len(lines), batch)
    for i, line in enumerate(lines):
        p.seed_model(i, line)
    p.replan()
    return p


def test_the_rollout_is_the_simulator_on_the_same_lines():
    """Without noise, rolling the planner forward on the cluster's true lines takes exactly the seconds the
    simulator's own fork takes on them (its all-reduce time aside): two implementations of one loop."""
    sc = dataclasses.replace(load_scenario(BUILTIN_SCENARIOS["interference"]), noise=0.0)
    checked = []

    class Probe:
        observes_planner = True

        def propose(self, **kw):
            e = run.boundary[0]
            here = run.boundary[2]
            a, b, d = run.sim.place_params(e + 1)
            lines = [(float(a[p]), float(b[p])) for p in here]
            got = planner_rollout(kw["planner"], lines, [float(d[p]) for p in here], sc.steps_per_epoch, 3, noise=0.0)
            fork = run.branch(None, 3, known_future=False, believed=(a, b))
            epochs = min(3, run.epochs - e - 1)
            comm = run.sim.allreduce_time(len(here)) * sc.steps_per_epoch * epochs
            if epochs == 3:
                assert got == pytest.approx(fork - comm, rel=1e-12)
                checked.append(e)
            return Relocation([None] * len(kw["devices"]), list(kw["lines"]), 1.0, 1.0)

    run = SimulationRun(ClusterSim(sc, seed=0), "equal_finish", None, 0.03, True, Probe())
    for e in range(run.epochs):
        run.epoch(e)
    assert len(checked) >= 3


def test_the_rollout_leaves_the_planner_alone_and_prices_a_move():
    p = _planner([(0.01, 0.001), (0.01, 0.004)])
    plan, lines = list(p.plan), [(m.intercept, m.slope) for m in p.model_params()]
    slow = planner_rollout(p, lines, [0.0, 0.0], steps=10, horizon=3, noise=0.05, seed=1)
    assert slow == planner_rollout(p, lines, [0.0, 0.0], steps=10, horizon=3, noise=0.05, seed=1)
    assert slow != planner_rollout(p, lines, [0.0, 0.0], steps=10, horizon=3, noise=0.05, seed=2)
    fast_line = (0.01, 0.001)
    moved = planner_rollout(p, [lines[0], fast_line], [0.0, 0.0], steps=10, horizon=3, noise=0.05, seed=1,
                            seeds={1: (fast_line, 0.0)})
    assert moved < slow * 0.8
    assert list(p.plan) == plan and [(m.intercept, m.slope) for m in p.model_params()] == lines
    with pytest.raises(ValueError, match="horizon"):
        planner_rollout(p, lines, [0.0, 0.0], steps=10, horizon=0)
    with pytest.raises(ValueError, match="data"):
        planner_rollout(p, lines, [0.0], steps=10, horizon=1)
    with pytest.raises(ValueError, match="noise"):
        planner_rollout(p, lines, [0.0, 0.0], steps=10, horizon=1, noise=-1.0)


def test_the_planning_relocator_moves_what_pays_and_stays_otherwise():
    kw = dict(devices=["v100", "t4"], corunners=[None, None], lines=[(0.005, 0.0005), (0.006, 0.0024)],
              free_slots=[{"device": "v100"}], global_batch=512, steps_per_epoch=20, epochs_left=5)
    p = _planner(kw["lines"], 512)
    r = PlanningRelocator(restart_cost=0.0, noise=0.0)
    assert r.propose(next_corunners=[None, "video"], planner=p, **kw).moves == [(1, 0)]
    # a restart that costs more than the whole horizon can save: stay
    costly = PlanningRelocator(restart_cost=1e4, noise=0.0)
    assert costly.propose(next_corunners=[None, "video"], planner=p, **kw).moves == []
    # without a planner it is the greedy Relocator
    greedy = Relocator(restart_cost=0.0).propose(next_corunners=[None, "video"], **kw)
    assert r.propose(next_corunners=[None, "video"], **kw).moves == greedy.moves
    with pytest.raises(ValueError, match="`places` has 1 entries for 2 ranks"):
        r.propose(next_corunners=[None, "video"], planner=p, places=[0], homes=[0, 1], **kw)
    for bad in ({"horizon": 0}, {"draws": 0}, {"noise": -0.1}, {"margin": -1.0}, {"slowest": 0}, {"best_slots": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PlanningRelocator(**bad)


def test_a_tail_values_a_move_for_the_epochs_left_after_its_rollout():
    """``tail`` adds the last rollout epoch's saving once per epoch left after the rollout (discounted), so a move
    that pays back over the run but not within the two epochs played is taken with it and not without."""
    kw = dict(devices=["v100", "t4"], corunners=[None, None], lines=[(0.005, 0.0005), (0.006, 0.0024)],
              free_slots=[{"device": "v100"}], global_batch=512, steps_per_epoch=20, epochs_left=10,
              next_corunners=[None, "video"])
    p = _planner(kw["lines"], 512)
    values = {}
    for tail in (0.0, 0.7, 1.0):
        r = PlanningRelocator(restart_cost=0.0, noise=0.0, tail=tail)
        r.recorder = lambda cands, v, ctx, tail=tail: values.setdefault(tail, np.asarray(v))
        r.propose(planner=p, **kw)
    extra = {t: values[t] - values[0.0] for t in (0.7, 1.0)}
    assert np.all(extra[1.0] > 0)  # every candidate saves in the last epoch played
    np.testing.assert_allclose(extra[0.7] / extra[1.0], tail_weight(0.7, 8) / tail_weight(1.0, 8), rtol=1e-9)
    # the rollout epoch by epoch sums to the rollout
    lines = [(m.intercept, m.slope) for m in p.model_params()]
    assert sum(rollout_epochs(p, lines, [0.0, 0.0], 20, 2, noise=0.0)) == pytest.approx(
        planner_rollout(p, lines, [0.0, 0.0], 20, 2, noise=0.0), rel=1e-12)
    # a restart that two epochs do not pay back but ten do
    cost = float(values[0.0].max() + 0.5 * (values[1.0].max() - values[0.0].max()))
    assert PlanningRelocator(restart_cost=cost, noise=0.0).propose(planner=p, **kw).moves == []
    assert PlanningRelocator(restart_cost=cost, noise=0.0, tail=1.0).propose(planner=p, **kw).moves == [(1, 0)]
    assert tail_weight(1.0, 8) == 8.0 and tail_weight(0.5, 3) == pytest.approx(0.875) and tail_weight(0.0, 5) == 0.0
    with pytest.raises(ValueError, match="tail"):
        PlanningRelocator(tail=1.5)


def test_the_planning_relocator_in_the_simulator():
    """Closed loop on the built-in interference scenario: the simulator hands it the planner, it decides every
    boundary with a free slot, and the run is at least as fast as without relocation."""
    sc = load_scenario(BUILTIN_SCENARIOS["interference"])
    seen = []

    class Watch(PlanningRelocator):
        def propose(self, **kw):
            seen.append(kw["planner"].world_size == len(kw["devices"]))
            return super().propose(**kw)

    r = Watch(workload=sc.workload, restart_cost=sc.restart_cost)
    out = simulate(sc, "equal_finish", seed=0, relocation=r)
    assert seen and all(seen) and r.decisions == len(seen)
    assert out["steady_samples_per_s"] >= 0.99 * simulate(sc, "equal_finish", seed=0)["steady_samples_per_s"]


def test_the_cluster_advisor_hands_its_planner_to_a_planning_relocator(tmp_path):
    """In the integrations the cluster advisor decides relocations; a model-based relocator gets the planner it
    rolls forward (and moves the t4 whose next co-runner slows it to the free v100), a plain one does not."""
    import json

    from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor

    path = tmp_path / "cluster.json"
    now = {"ranks": [{"device": "v100"}, {"device": "t4"}], "free_slots": [{"device": "v100"}]}
    path.write_text(json.dumps(now))
    got = []

    class Watch(PlanningRelocator):
        def propose(self, **kw):
            got.append(kw.get("planner"))
            return super().propose(**kw)

    adv = ClusterAdvisor(str(path), relocation=Watch(restart_cost=0.0, noise=0.0))
    adv.start(0, 2)
    planner = BalancePlanner(2, 64)
    planner.observe(np.array([[[32, 0.005 + 0.0005 * 32, 0.0]] * 4, [[32, 0.006 + 0.0012 * 32, 0.0]] * 4]))
    planner.replan()
    path.write_text(json.dumps({**now, "ranks": [{"device": "v100"}, {"device": "t4", "corunner": "video"}]}))
    upcoming = adv.before_decision(0, 2, planner.allocator, [0.0, 0.0])
    decision, new = adv.relocate(upcoming, planner, steps_per_epoch=10, epochs_left=5, data=[0.0, 0.0])
    assert got == [planner] and decision.moves == [(1, 0)] and new


def test_the_module_examples_run():
    import doctest

    from hetero_plugins.scheduler import planning

    assert doctest.testmod(planning).failed == 0


def test_make_relocator_builds_the_planned_policy():
    from hetero_plugins.scheduler.placement_policy import RELOCATION_POLICIES, make_relocator

    sc = load_scenario(BUILTIN_SCENARIOS["interference"])
    r = make_relocator("planned", sc, horizon=3)
    assert "planned" in RELOCATION_POLICIES and isinstance(r, PlanningRelocator)
    assert r.restart_cost == sc.restart_cost and r.workload == sc.workload and r.horizon == 3


def test_make_relocator_builds_the_planned_policy_with_the_shipped_critic():
    from hetero_plugins.scheduler.placement_policy import RELOCATION_POLICIES, make_relocator
    from hetero_plugins.scheduler.rollout_correction import RolloutCorrection

    sc = load_scenario(BUILTIN_SCENARIOS["interference"])
    r = make_relocator("planned_critic", sc)
    assert "planned_critic" in RELOCATION_POLICIES and isinstance(r, PlanningRelocator)
    assert isinstance(r.critic, RolloutCorrection) and r.critic.meta["trained"]["family"] == "default"
    assert make_relocator("planned", sc).critic is None


def test_the_planning_relocator_learns_caution_from_a_move_that_gained_less_than_priced():
    """adapt: after a move, the gain the lines show over the places left is compared with the gain the move was
    priced at; the shortfall is asked of every later move (over the rollout horizon, 4 epochs here), and a large
    one stops them. A relocator with adapt=False (the default beside a critic) keeps pricing as before."""
    kw = dict(corunners=[None, None], next_corunners=[None, None], global_batch=512, steps_per_epoch=20,
              epochs_left=5)
    slow, fast = (0.006, 0.0024), (0.005, 0.0005)
    r = PlanningRelocator(restart_cost=0.0, noise=0.0, horizon=4)
    assert r.adapt and not PlanningRelocator(critic=_zero_critic()).adapt
    first = r.propose(devices=["v100", "t4"], lines=[fast, slow], free_slots=[{"device": "v100"}],
                      planner=_planner([fast, slow], 512), **kw)
    assert first.moves == [(1, 0)] and r.shortfall == 0.0
    priced = 1.0 - first.step_time / first.current_step_time
    # one epoch later the moved rank's fitted line is as slow as at its old place: the move gained nothing
    again = dict(devices=["v100", "v100"], lines=[fast, slow], free_slots=[{"device": "t4"}, {"device": "v100"}],
                 planner=_planner([fast, slow], 512), **kw)
    r.propose(**again)
    assert r.shortfall == pytest.approx(0.5 * priced)  # smoothed: half the first shortfall
    # every later candidate's value (epochs of the current step) is lowered by the shortfall over the horizon
    r.shortfall = 0.02
    after = r.propose(**dict(again, planner=_planner([fast, slow], 512)))
    fresh = PlanningRelocator(restart_cost=0.0, noise=0.0, horizon=4, adapt=False).propose(**again)
    assert fresh.moves == after.moves == [(1, 1)]
    unit = fresh.current_step_time * 20
    assert fresh.saved_seconds - after.saved_seconds == pytest.approx(0.02 * 4 * unit, rel=1e-9)
    r.shortfall = 10.0  # moves that kept falling short: nothing pays any more
    assert r.propose(**dict(again, planner=_planner([fast, slow], 512))).moves == []
    with pytest.raises(ValueError, match="`adapt` must be True or False, got 'yes'"):
        PlanningRelocator(adapt="yes")


def _zero_critic():
    from hetero_plugins.scheduler.rollout_correction import ROLLOUT_FEATURES, RolloutCorrection

    f = len(ROLLOUT_FEATURES)
    return RolloutCorrection([[(np.zeros((f, 1)), np.zeros(1))]], np.zeros(f), np.ones(f))


# ------------------------------------------------------------------------------------- plateau floors (session 22)
def test_device_floors_read_a_plateau_from_the_small_ranks_and_not_from_one_rank_or_the_line():
    r = Relocator()
    devices, corunners = ["gpu"] * 6, [None] * 6
    big = [(0.001, 0.0002)] * 4  # the device's line, measured at 60 samples
    # Two ranks cut to 2 samples (data-bound) run 8 ms however few their samples: the line says 1.4 ms.
    plateau = big + [(0.0, 0.004)] * 2
    assert r.device_floors(devices, corunners, plateau, [60] * 4 + [2, 2]) == {"gpu": pytest.approx(0.008)}
    # One such rank (a load ramp, say) is not enough; small ranks on the line show no plateau.
    assert r.device_floors(devices, corunners, big + [(0.0, 0.004), (0.001, 0.0002)], [60] * 4 + [2, 2]) == {}
    assert r.device_floors(devices, corunners, [(0.001, 0.0002)] * 6, [60] * 4 + [2, 2]) == {}
    # Without small ranks nothing is known below the measured sizes.
    assert r.device_floors(devices, corunners, plateau, [60] * 6) == {}


def test_a_plateau_slot_carries_its_floor_and_no_batch_and_the_options_leave_either_out():
    r = Relocator()
    devices, corunners = ["gpu"] * 6, [None] * 6
    plateau, plan = [(0.001, 0.0002)] * 4 + [(0.0, 0.004)] * 2, [60] * 4 + [2, 2]

    def slot(**options):
        _, incoming, _, _ = r.price_places(devices, corunners, corunners, plateau, [{"device": "gpu"}], None, None,
                                           None, batches=plan, **options)
        return {k: incoming[0][k] for k in ("floor", "batch") if k in incoming[0]}

    assert slot() == {"floor": pytest.approx(0.008)}  # on a plateau the line holds at no batch
    assert slot(floors=False) == {"batch": 60}  # priced by its line, known up to its device's median batch
    assert slot(floors=False, peer_batches=False) == {}
    with pytest.raises(ValueError, match="floors"):
        slot(floors="yes")


def test_a_rollout_floor_holds_a_ranks_step_at_its_plateau():
    p = BalancePlanner(2, 64, extrapolate="line")
    p.seed_model(0, (0.01, 0.001)); p.seed_model(1, (0.01, 0.003)); _ = p.replan()  # noqa: E702
    lines = [(0.01, 0.001), (0.01, 0.003)]
    free = rollout_epochs(p, lines, [0.0, 0.0], steps=10, horizon=1, noise=0.0)
    held = rollout_epochs(p, lines, [0.0, 0.0], steps=10, horizon=1, noise=0.0, floors={1: 0.2})
    assert free == [pytest.approx(0.58)] and held == [pytest.approx(2.0)]  # rank 1 at 0.2 s a step, 10 steps
    with pytest.raises(ValueError, match=r"`floors` names \[2\].*0 to 1"):
        rollout_epochs(p, lines, [0.0, 0.0], steps=10, horizon=1, floors={2: 0.2})
    with pytest.raises(ValueError, match="`seeds` names"):
        rollout_epochs(p, lines, [0.0, 0.0], steps=10, horizon=1, seeds={-1: ((0.01, 0.001), 0.0)})


def test_a_moved_rank_starts_known_up_to_its_slot_devices_batches():
    """A slot is priced from its device's ranks' median line, fitted at their batches; a rank that moves there
    from a slow device starts its model as measured up to those batches, not its own few samples, so the planner
    hands it a fast rank's share in the first epoch after the move instead of growing it epoch by epoch."""
    fast, slow = (0.002, 0.0001), (0.002, 0.001)
    p = _planner([fast, fast, slow, slow], batch=512)
    devices, corunners = ["fast", "fast", "slow", "slow"], [None] * 4
    r = PlanningRelocator(restart_cost=0.0)
    _, incoming, _, _ = r.price_places(devices, corunners, corunners, [fast, fast, slow, slow],
                                       [{"device": "fast"}], None, None, None, batches=list(p.plan))
    assert incoming[0]["batch"] == int(np.median(p.plan[:2])) > 4 * p.plan[3]
    d = r.propose(devices=devices, corunners=corunners, next_corunners=corunners, lines=[fast, fast, slow, slow],
                  free_slots=[{"device": "fast"}], global_batch=512, steps_per_epoch=10, epochs_left=5, planner=p)
    assert d.moves == [(3, 0)] and d.batches[3] == incoming[0]["batch"] and d.batches[0] is None
    lines = [fast, fast, slow, fast]
    known = rollout_epochs(p, lines, [0.0] * 4, 10, 1, 0.0, seeds={3: (fast, 0.0, d.batches[3])})
    young = rollout_epochs(p, lines, [0.0] * 4, 10, 1, 0.0, seeds={3: (fast, 0.0)})
    # The exact split of these lines takes 18.5 ms a step (165 samples a fast rank): the known rank is near it.
    assert known[0] < 1.03 * 0.185 and young[0] > 1.1 * known[0], (known, young)
    r.peer_batches = False  # the option off: the moved rank starts at its own batch, as before
    d = r.propose(devices=devices, corunners=corunners, next_corunners=corunners, lines=[fast, fast, slow, slow],
                  free_slots=[{"device": "fast"}], global_batch=512, steps_per_epoch=10, epochs_left=5, planner=p)
    assert d.batches[3] is None


PLATEAU = {  # a device that saturates at 34 samples; two data-bound ranks; two slots beside a heavy co-runner
    "name": "plateau", "workload": "dataload_b256",
    "devices": {"gpu0": {"cost_per_sample": 0.0002, "overhead": 0.001, "memory_samples": 150, "saturation": 34}},
    "ranks": [{"device": "gpu0"}] * 4 + [{"device": "gpu0", "data": 0.012}] * 2,
    "free_slots": [{"device": "gpu0", "corunner": "io_x2"}] * 2, "interference": {"io_x2": {"gpu0": 4.1}},
    "global_batch": 256, "epochs": 8, "steps_per_epoch": 8, "noise": 0.02, "restart_cost": 0.01,
}


def test_floors_keep_the_planning_relocator_off_slots_a_plateau_makes_slow():
    """The data-bound ranks, cut to one sample, run on the plateau; a slot beside a 4x co-runner is priced by the
    device line at a few samples (about 5 ms) but runs 32 ms. Floors read the plateau from those ranks and
    price the slot at it, so fewer bad moves are made (none of the relocators is yet at no relocation here:
    docs/scheduler.md, "Known gaps")."""
    from hetero_plugins.scheduler.measured import load_measured_predictor
    from hetero_plugins.scheduler.placement_policy import make_relocator

    sc, ncf = load_scenario(PLATEAU), load_measured_predictor()
    runs = {}
    for floors in (False, True):
        v = []
        for seed in (0, 1, 2):
            rel = make_relocator("planned", sc, predictor=ncf)
            rel.floors, rel.peer_batches = floors, False  # floors alone (a moved rank's known batch moves seeds)
            v.append(simulate(sc, "equal_finish", seed=seed, relocation=rel)["steady_samples_per_s"])
        runs[floors] = np.array(v)
    assert (runs[True] >= runs[False] * 0.999).all() and runs[True].mean() > 1.04 * runs[False].mean(), runs
