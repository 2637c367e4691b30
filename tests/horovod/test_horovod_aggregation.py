"""``aggregation=`` modes of ``hetero_plugins.horovod.DistributedOptimizer`` under a real ``horovodrun -np 2 --gloo``.

One job (the session's ``plain_checks``) runs every phase of ``scripts/aggregation_check.py`` (a float64 MLP on 96 digits samples, rank 1
slowed by a sleep per micro-batch sample); the script itself asserts, on every rank and after every step,
that each sample is processed exactly once per epoch and that the parameters equal the single-process
reference of the mode; the tests below check the summary it writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.horovod.conftest import job_output

pytestmark = pytest.mark.horovod


@pytest.fixture(scope="module")
def results(plain_checks: Path) -> dict[str, Any]:
    out = plain_checks / "aggregation_check" / "aggregation.json"
    assert out.exists(), job_output(plain_checks)
    return json.loads(out.read_text())


def test_errors_name_argument_value_and_fix(results):
    errors = results["errors"]
    expected = {
        "unknown_mode": ("aggregation", "'fastest'"),
        "option_not_used": ("local_steps", "aggregation='deadline'"),
        "backward_passes": ("backward_passes_per_step", "2"),
        "locality": ("locality", "wbsp"),
        "wbsp_without_dataset": ("dataset", "None"),
        "wbsp_dataset_not_indexable": ("dataset", "got 5", "indexable"),
        "op_average": ("op", "hvd.Sum"),
        "predivide": ("gradient_predivide_factor", "2.0"),
        "compression": ("compression", "local_sgd"),
        "not_an_optimizer": ("optimizer", "'sgd'", "torch.optim.Optimizer"),
        "step_without_micro_batches": ("micro_batches", "deadline"),
    }
    for case, words in expected.items():
        message = errors[case]
        assert message is not None, f"{case}: no error raised"
        assert "HINT" in message and all(w in message for w in words), f"{case}: {message}"


def test_wbsp_equals_one_process_on_each_union_and_steals(results):
    r = results["wbsp"]
    assert r["worst"] < 1e-9 and r["steps"] == 16
    assert sum(r["stolen_samples"]) > 0, r
    assert r["rank_param_diff"] == 0.0
    assert r["communication_rounds"] == [16, 16]


def test_deadline_without_deadline_hit_equals_weighted(results):
    r = results["deadline_equiv"]
    assert r["max_diff"] < 1e-9
    assert r["deadline"]["carried_samples"] == [0, 0]
    assert r["deadline"]["rank_param_diff"] == 0.0


def test_deadline_with_stalled_rank_carries_and_stays_exact(results):
    r = results["deadline_stall"]
    assert r["carried_samples"][1] > 0, r
    assert r["partial_steps"] > 0, r  # steps that updated on fewer samples than planned
    assert r["worst"] < 1e-9  # each step equals one process on the samples it processed


def test_pseudo_sync_equals_one_step_delayed_replay(results):
    r = results["pseudo_sync"]
    assert r["worst"] < 1e-9 and r["flushed"] and r["default_flushed"]
    assert r["communication_rounds"] == [16, 16]
    assert r["rank_param_diff"] == 0.0


def test_local_sgd_communicates_one_in_h_and_ends_identical(results):
    r = results["local_sgd"]
    weighted = r["weighted"]["communication_bytes"][0] / r["weighted"]["epochs"]
    local = r["local_sgd"]["communication_bytes"][0] / r["local_sgd"]["epochs"]
    assert 0.2 <= local / weighted <= 0.3, (local, weighted)  # H = 4
    assert r["local_sgd"]["communication_rounds"] == [4, 4]
    assert r["local_sgd"]["rank_param_diff"] < 1e-12


def test_broadcast_optimizer_state_only_initialises_the_state(results):
    r = results["init_state"]
    for mode in ("weighted", "deadline", "wbsp", "pseudo_sync", "local_sgd"):
        # a step() with no backward pass since the last one: momentum buffers exist, nothing was exchanged,
        # the zero gradients moved no parameter, and the sampler saw no step
        assert r[mode] == {"state": 4, "rounds": 0, "unchanged": True, "steps_done": 0}, (mode, r[mode])
    assert r["weighted_worst"] < 1e-9
