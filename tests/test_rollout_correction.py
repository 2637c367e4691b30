"""The planning relocator's critic: features, the ensemble, its file, realised returns, and the critic in the loop."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hetero_plugins.scheduler.planning import PlanningRelocator
from hetero_plugins.scheduler.rollout_correction import ROLLOUT_FEATURES, RolloutCorrection, rollout_features
from hetero_plugins.scheduler.sim import BUILTIN_SCENARIOS, load_scenario, simulate

F = len(ROLLOUT_FEATURES)


def _linear(weights, bias=0.0):
    """A one-member critic that is a fixed linear map of the raw features (no standardisation)."""
    w = np.zeros((F, 1))
    for name, v in weights.items():
        w[ROLLOUT_FEATURES.index(name), 0] = v
    return RolloutCorrection([[(w, np.array([bias]))]], np.zeros(F), np.ones(F))


def test_the_features_by_hand():
    own = [{"intercept": 0.01, "slope": 0.001, "data": 0.0, "rank": 0},
           {"intercept": 0.02, "slope": 0.004, "data": 0.01, "rank": 1}]
    incoming = [{"intercept": 0.005, "slope": 0.001, "data": 0.002, "free_slot": 0}]
    ctx = {"t_cur": 0.1, "steps": 10, "cost": 0.5, "epochs_left": 30, "own": own, "incoming": incoming,
           "plan": [40.0, 24.0], "global_batch": 64, "corunners": [None, None], "next_corunners": [None, "video"],
           "free_slots": [{"device": "v100", "corunner": None}]}
    cand = {"moves": {1: 0}, "kind": "single", "t_new": 0.08}
    x = rollout_features([cand], [0.7], ctx)[0]
    got = dict(zip(ROLLOUT_FEATURES, x))
    step = 0.02 + 0.004 * 24
    assert got["value"] == pytest.approx(0.7) and got["gross"] == pytest.approx(1.2)
    assert got["restart_epochs"] == pytest.approx(0.5) and got["saving"] == pytest.approx(0.2)
    assert got["epochs_left"] == pytest.approx(1.5) and got["moved_fraction"] == pytest.approx(0.5)
    assert got["moves"] == pytest.approx(1 / 8) and got["world"] == pytest.approx(0.1)
    assert (got["is_greedy"], got["is_home"], got["is_single"]) == (0.0, 0.0, 1.0)
    assert got["fixed_from"] == pytest.approx(0.02 / step)
    assert got["fixed_to"] == pytest.approx(0.005 / (0.005 + 0.001 * 24))
    assert got["data_share"] == pytest.approx(0.01 / (step + 0.01))
    assert got["batch_ratio"] == pytest.approx(24 / 32)
    assert (got["from_corunner"], got["to_corunner"], got["corunner_changed"]) == (1.0, 0.0, 1.0)
    # values beyond +-5 epochs are clipped
    assert rollout_features([cand], [100.0], ctx)[0][0] == 5.0


def test_the_ensemble_learns_saves_and_loads(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(600, F))
    y = 0.8 * x[:, 0] - 0.5 * x[:, 12] + 0.1
    c = RolloutCorrection.fit(x, y, members=3, steps=800, seed=2)
    assert len(c.members) == 3 and c.meta["rows"] == 600
    assert float(np.mean(np.abs(c(x) - y))) < 0.15  # an MLP recovers a linear map
    path = c.save(tmp_path / "critic.npz", note="test")
    back = RolloutCorrection.load(path)
    assert back.meta["note"] == "test" and len(back.members) == 3
    assert np.allclose(back(x), c(x), rtol=1e-4, atol=1e-4)  # float32 storage
    # another kind of model file, or another feature list, is refused with the fix
    from hetero_plugins.scheduler.placement_policy import PlacementNetwork

    other = PlacementNetwork.random().save(tmp_path / "placement.npz")
    with pytest.raises(ValueError, match="holds a 'placement' model, expected 'rollout_correction'"):
        RolloutCorrection.load(other)
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(str(z["meta"]))
    meta["rollout_features"] = ["value"]
    np.savez(tmp_path / "old.npz", meta=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(ValueError, match="pretrain-critic"):
        RolloutCorrection.load(tmp_path / "old.npz")


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="`x` must be"):
        RolloutCorrection.fit(np.zeros((4, 3)), np.zeros(4))
    with pytest.raises(ValueError, match="members"):
        RolloutCorrection.fit(np.zeros((4, F)), np.zeros(4), members=0)
    with pytest.raises(ValueError, match=f"maps {F} features"):
        RolloutCorrection([[(np.zeros((3, 1)), np.zeros(1))]], np.zeros(F), np.ones(F))
    with pytest.raises(ValueError, match="is not a hetero_plugins scheduler model"):
        PlanningRelocator(critic=__file__)


def test_a_critic_that_repeats_the_rollout_value_changes_nothing():
    """The critic replaces the rollout value as the score: one that returns the value itself decides as the plain
    planning relocator (run for run), one that values every move below staying never moves."""
    sc = load_scenario(BUILTIN_SCENARIOS["interference"])
    kw = {"workload": sc.workload, "restart_cost": sc.restart_cost}
    plain = PlanningRelocator(adapt=False, **kw)  # a critic's relocator does not adapt by default
    same = PlanningRelocator(critic=_linear({"value": 1.0}), **kw)
    a = simulate(sc, "equal_finish", seed=0, relocation=plain)
    b = simulate(sc, "equal_finish", seed=0, relocation=same)
    assert plain.relocations > 0 and same.relocations == plain.relocations
    assert a["steady_samples_per_s"] == b["steady_samples_per_s"]
    never = PlanningRelocator(critic=_linear({}, bias=-1.0), **kw)
    c = simulate(sc, "equal_finish", seed=0, relocation=never)
    assert never.decisions > 0 and never.relocations == 0
    assert c["steady_samples_per_s"] == simulate(sc, "equal_finish", seed=0)["steady_samples_per_s"]


def test_realised_returns_and_pretraining(tmp_path):
    """Every candidate met gets a feature row and a realised return; the rollout values carry the returns' sign
    (they are the critic's main input); pre-training writes a critic the relocator loads."""
    from hetero_plugins.scheduler.critic_training import collect_rollout_returns, pretrain_critic

    spec = BUILTIN_SCENARIOS["interference"]
    x, y = collect_rollout_returns([spec], seeds=(0, 1), explore=0.3, horizon=3)
    assert x.shape == (len(y), F) and len(y) > 10 and np.isfinite(x).all() and np.isfinite(y).all()
    assert np.corrcoef(x[:, 0], y)[0, 1] > 0.3
    with pytest.raises(ValueError, match="explore"):
        collect_rollout_returns([spec], explore=1.5)
    # averaging over forks: the same states; returns that differ by the forks' noise, and not at all without noise
    one = collect_rollout_returns([spec], seeds=(0,), explore=0.3, horizon=3)
    two_forks = collect_rollout_returns([spec], seeds=(0,), explore=0.3, horizon=3, forks=2)
    assert np.array_equal(one[0], two_forks[0]) and not np.allclose(one[1], two_forks[1], rtol=0, atol=1e-6)
    quiet = dict(spec, noise=0.0)
    q1, q2 = (collect_rollout_returns([quiet], seeds=(0,), explore=0.3, horizon=3, forks=f)[1] for f in (1, 2))
    np.testing.assert_allclose(q2, q1, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="forks"):
        collect_rollout_returns([spec], forks=0)
    # a tail changes the returns of decisions with epochs left after the horizon, and only those
    tailed = collect_rollout_returns([spec], seeds=(0,), explore=0.3, horizon=3, tail=0.7)
    assert np.array_equal(one[0], tailed[0])
    beyond = one[0][:, ROLLOUT_FEATURES.index("epochs_left")] * 20.0 > 3.5
    assert beyond.any() and (~beyond).any()
    np.testing.assert_array_equal(tailed[1][~beyond], one[1][~beyond])
    assert not np.allclose(tailed[1][beyond], one[1][beyond], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="tail"):
        collect_rollout_returns([spec], tail=-0.1)
    two = [dict(spec), dict(BUILTIN_SCENARIOS["elastic"])]
    model, stats = pretrain_critic(out=tmp_path / "c.npz", train_count=2, seeds=(0,), members=2, steps=50, forks=1,
                                   scenarios=lambda split, n, fam: two)
    assert stats["clusters"] == 2 and stats["rows"] > 0 and math.isfinite(stats["seconds"])
    r = PlanningRelocator(critic=str(tmp_path / "c.npz"))
    assert len(r.critic.members) == 2
    # two worker processes collect the same samples in the same order, so the same model
    again, stats2 = pretrain_critic(train_count=2, seeds=(0,), members=2, steps=50, workers=2, forks=1,
                                    scenarios=lambda split, n, fam: two)
    assert stats2["rows"] == stats["rows"] and np.array_equal(again(x), model(x))
    with pytest.raises(ValueError, match="workers"):
        pretrain_critic(workers=0)


def test_on_policy_returns_and_a_start_critic(tmp_path):
    """``continuation="policy"``: the same states, returns read with the relocator deciding on in the forks; with
    a policy that never moves they are the frozen forks' returns exactly. ``start``: the first round runs that
    critic's relocator, and the statistics name it."""
    from hetero_plugins.scheduler.critic_training import collect_rollout_returns, pretrain_critic

    spec = BUILTIN_SCENARIOS["interference"]
    stay = collect_rollout_returns([spec], seeds=(0,), explore=0.3, horizon=3)
    policy = collect_rollout_returns([spec], seeds=(0,), explore=0.3, horizon=3, continuation="policy")
    assert np.array_equal(stay[0], policy[0]) and not np.allclose(stay[1], policy[1], rtol=0, atol=1e-6)
    never = _linear({}, bias=-1.0)  # values every move at -1 epoch: its relocator stays unless exploring
    frozen = collect_rollout_returns([spec], seeds=(0,), explore=0.3, horizon=3, critic=never)
    follows = collect_rollout_returns([spec], seeds=(0,), explore=0.3, horizon=3, critic=never,
                                      continuation="policy")
    assert len(frozen[1]) > 0 and np.array_equal(frozen[0], follows[0])
    np.testing.assert_allclose(follows[1], frozen[1], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="continuation"):
        collect_rollout_returns([spec], continuation="greedy")
    path = never.save(tmp_path / "never.npz")
    _, stats = pretrain_critic(train_count=1, seeds=(0,), rounds=1, members=2, steps=50, forks=1, start=str(path),
                               horizon=3, explore=0.3, continuation="policy", scenarios=lambda split, n, fam: [spec])
    assert stats["rows"] == len(follows[1]) and stats["continuation"] == "policy"
    assert isinstance(stats["start"], str) and len(stats["start"]) == 16
    with pytest.raises(ValueError, match="continuation"):
        pretrain_critic(continuation="frozen")
    # a checkpoint of on-policy returns is not resumed by a run that leaves continuation at its default (which
    # its settings leave out), and a run from a start critic not by one without
    from hetero_plugins.scheduler.placement_training import _read_checkpoint, _write_checkpoint

    ckpt = tmp_path / "c.npz.ckpt.npz"
    _write_checkpoint(ckpt, {"ys": np.zeros(1)}, {"settings": {"seed": 0, "continuation": "policy",
                                                               "start": stats["start"]}, "rounds": 1})
    with pytest.raises(ValueError, match=r"--continuation null \(the checkpoint's run: policy\).*--start-critic "
                                         r"\(another starting network than the checkpoint's run, fingerprint"):
        _read_checkpoint(ckpt, {"seed": 0})
    assert _read_checkpoint(ckpt, {"seed": 0, "continuation": "policy", "start": stats["start"]})[1]["rounds"] == 1


def test_the_pretrain_critic_command_checks_its_options(capsys):
    from hetero_plugins.cli import main

    assert main(["pretrain-critic", "--train", "0"]) == 2
    assert "`--train` must be >= 1, got 0" in capsys.readouterr().err
    assert main(["pretrain-critic", "--forks", "0"]) == 2
    assert "`--forks` must be >= 1, got 0" in capsys.readouterr().err
    assert main(["pretrain-critic", "--tail", "1.5"]) == 2
    assert "`--tail` must be in [0, 1], got 1.5" in capsys.readouterr().err
    assert main(["pretrain-critic", "--explore", "2"]) == 2
    assert "`--explore` must be in [0, 1]" in capsys.readouterr().err
    assert main(["pretrain-critic", "--start-critic", "no-such-critic.npz", "--out", "unused.npz"]) == 2
    assert "no-such-critic.npz" in capsys.readouterr().err


def test_the_module_examples_run():
    import doctest

    from hetero_plugins.scheduler import rollout_correction

    assert doctest.testmod(rollout_correction).failed == 0
