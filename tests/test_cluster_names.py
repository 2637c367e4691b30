"""Names in a cluster description that the interference model does not know are announced, once each."""

from __future__ import annotations

import json
import warnings

import pytest

from hetero_plugins.scheduler.cluster_advisor import ClusterAdvisor
from hetero_plugins.scheduler.ncf import InterferencePredictor
from hetero_plugins.scheduler.relocation import Relocator

KNOWN = {"ranks": [{"device": "v100"}, {"device": "t4", "corunner": "video"}], "free_slots": [{"device": "v100"}]}


def test_the_relocator_knows_its_models_vocabulary(tmp_path):
    shipped = Relocator().known_names()
    p = InterferencePredictor.load()
    assert shipped == {"workload": p.workloads, "device": p.devices,
                       "corunner": [c for c in p.corunners if c != "none"]}
    small = InterferencePredictor(["train"], ["gpu"], ["video"])
    assert Relocator(small).known_names() == {"workload": ["train"], "device": ["gpu"], "corunner": ["video"]}
    small.save(tmp_path / "ncf.npz")
    assert Relocator(str(tmp_path / "ncf.npz")).known_names()["device"] == ["gpu"]
    # a correction object tells its predictor's names too (it used to answer "cannot tell")
    from hetero_plugins.scheduler.interference import InterferenceCorrection
    assert Relocator(InterferenceCorrection(small)).known_names()["corunner"] == ["video"]

    class Bare:  # a predictor without a vocabulary
        def predict(self, workload, device, corunner):
            return 1.5
    assert Relocator(Bare()).known_names() is None


def test_known_names_pass_quietly():
    adv = ClusterAdvisor(lambda e: KNOWN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adv.start(0, 2)
        assert adv.before_decision(0, 2, allocator=None, data=[0.0, 0.0]) is not None
    assert adv.check_names(adv.placement) == []


def test_unknown_names_warn_once_naming_the_field_the_value_and_the_known_names(tmp_path):
    desc = {"workload": "training", "ranks": [{"device": "V100"}, {"device": "t4", "corunner": "vidoe"}],
            "free_slots": [{"device": "a10", "corunner": None}]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(desc))
    adv = ClusterAdvisor(str(path))
    with pytest.warns(RuntimeWarning) as caught:
        adv.start(0, 2)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3
    assert "field `ranks[0].device` is 'V100', a device name" in messages[0]
    assert "'v100'" in messages[0] and "HINT: fix the name" in messages[0] and "transfer_ncf" in messages[0]
    assert "field `ranks[1].corunner` is 'vidoe', a corunner name" in messages[1] and "'video'" in messages[1]
    assert "field `free_slots[0].device` is 'a10'" in messages[2] and "never chosen" in messages[2]
    # Re-read every epoch: each name is announced once, and the run goes on with the fallback.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upcoming = adv.before_decision(0, 2, allocator=None, data=[0.0, 0.0])
    assert upcoming is not None and upcoming.devices == ["V100", "t4"]
    assert adv.check_names(upcoming) == [("ranks[0].device", "V100"), ("ranks[1].corunner", "vidoe"),
                                         ("free_slots[0].device", "a10")]
    # A new unknown name later in the run is announced then.
    path.write_text(json.dumps({**desc, "workload": "crypto"}))
    with pytest.warns(RuntimeWarning, match=r"field `workload` is 'crypto', a workload name .*'training'"):
        adv.before_decision(1, 2, allocator=None, data=[0.0, 0.0])


def test_the_fallback_an_unknown_free_slot_is_never_chosen():
    r = Relocator(restart_cost=0.0)
    d = r.propose(devices=["v100", "t4"], corunners=[None, None], next_corunners=[None, "video"],
                  lines=[(0.005, 0.0005), (0.006, 0.0012)], free_slots=[{"device": "v100", "corunner": "vidoe"}],
                  global_batch=512, steps_per_epoch=20, epochs_left=5)
    assert d.moves == [] and d.unknown_slots == [0]


def test_names_are_checked_against_the_relocators_own_model_or_without_relocation_the_allocators():
    custom = Relocator(InterferencePredictor(["training"], ["gpu"], ["video"]))
    adv = ClusterAdvisor(lambda e: {"ranks": [{"device": "gpu", "corunner": "video"}]}, relocation=custom)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adv.start(0, 1)  # unknown to the shipped model, known to this relocator's
    with pytest.warns(RuntimeWarning, match=r"`ranks\[0\]\.device` is 'v100'.*knows \['gpu'\]"):
        ClusterAdvisor(lambda e: {"ranks": [{"device": "v100"}]}, relocation=custom).start(0, 1)
    # relocation=False: the names reach only the allocator's correction, so they are checked against its model,
    # once an allocator has decided; an allocator that reads no names (equal_finish) checks none.
    from hetero_plugins.balancing.allocators import get_allocator
    from hetero_plugins.scheduler.policy import AutoAllocator, DQNAllocator

    off = ClusterAdvisor(lambda e: {"ranks": [{"device": "V100", "corunner": "video"}]}, relocation=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off.start(0, 1)
        upcoming = off.before_decision(0, 1, allocator=get_allocator("equal_finish"), data=[0.0])
    assert upcoming is not None and off.check_names(upcoming) == []
    with pytest.warns(RuntimeWarning, match=r"`ranks\[0\]\.device` is 'V100', a device name the allocator's "
                      r"interference model.*'v100'.*HINT: fix the name.*pass allocator=AutoAllocator\(interference="):
        off.before_decision(1, 1, allocator=AutoAllocator(), data=[0.0])
    own = ClusterAdvisor(lambda e: {"ranks": [{"device": "gpu", "corunner": "video"}]}, relocation=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known to this allocator's model
        upcoming = own.before_decision(0, 1, data=[0.0],
                                       allocator=DQNAllocator(InterferencePredictor(["training"], ["gpu"], ["video"])))
    assert own.check_names(upcoming) == []
