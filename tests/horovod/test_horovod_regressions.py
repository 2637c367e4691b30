"""Regressions of ``hetero_plugins.horovod`` found in review, under one real ``horovodrun -np 2 --gloo`` job
(``scripts/regressions_check.py`` in the session's ``plain_checks`` job, one phase each; every rank records what
it saw), plus the launch commands the docs give. Each test failed before its fix:

- ``torch.autograd.grad`` over the parameters (a gradient penalty) went through the weighting's tensor hooks:
  its gradients came back scaled by b_i / B and every call counted as a step, so later steps got wrong weights.
- ``optimizer.zero_grad(set_to_none=False)`` set the gradients to ``None`` in ``"weighted"``.
- ``optimizer.synchronize()`` (Horovod's clipping pattern) waited for the gradient all-reduces without a bound.
- ``"deadline"``: the samples a rank carried were in no ``state_dict``, so a mid-epoch checkpoint lost them, and
  ``load_state_dict`` (an elastic rollback) kept a carry that no longer applied.
- ranks that disagreed on ``locality`` were not told; ``load_state_dict`` swallowed every ``ValueError``.
- README's ``horovodrun`` commands and the strategy's hint lacked ``--gloo`` (the job fails without MPI).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.horovod.conftest import REPO, job_output

pytestmark = pytest.mark.horovod


@pytest.fixture(scope="module")
def job(plain_checks: Path) -> tuple[list[dict[str, Any]], str]:
    out = plain_checks / "regressions_check"
    ranks = [json.loads(f.read_text()) if f.exists() else {} for f in (out / "rank0.json", out / "rank1.json")]
    return ranks, job_output(plain_checks)


def phase(job: tuple[list[dict[str, Any]], str], name: str) -> list[dict[str, Any]]:
    ranks, output = job
    for r, res in enumerate(ranks):
        assert name in res, f"rank {r} recorded no {name!r} phase; {output}"
        assert "crashed" not in res[name], f"rank {r}: {res[name]['crashed']}; {output}"
    return [res[name] for res in ranks]


def test_autograd_grad_is_neither_weighted_nor_counted_as_a_step(job):
    for r, res in enumerate(phase(job, "autograd_grad")):
        assert res["autograd_grad_diff"] < 1e-12, (r, res)  # the gradient autograd.grad returns is the plain one
        assert res["steps_counted"] and res["n_steps"] == 16, (r, res)  # one step per backward(), two epochs
        assert res["worst"] < 1e-9, (r, res)  # exact: the penalty's own gradient is weighted once, by b_i / B


def test_unused_parameters_plain_grouped_and_sparse_stay_exact(job):
    """The bounded wait starts the all-reduces Horovod's synchronize() would (a parameter with no gradient, a
    group left incomplete, a sparse gradient) exactly as it would: every step still equals one process."""
    for r, res in enumerate(phase(job, "unused")):
        for case in ("plain", "groups", "sparse"):
            assert res[case]["worst"] < 1e-9 and res[case]["steps_counted"], (r, case, res[case])


def test_zero_grad_set_to_none_false_zeroes_in_place(job):
    for r, res in enumerate(phase(job, "zero_grad")):
        assert res["zeroed"], (r, res)  # zero tensors, not None
        assert res["worst"] < 1e-9, (r, res)


def test_synchronize_then_clip_then_step_is_bounded_and_exact(job):
    """``optimizer.synchronize()`` went to Horovod's own, whose wait has no bound; now it waits as ``step()`` does
    (the stall itself: ``test_horovod_faults.py``, ``plain_sync``). The clipped steps still equal one process."""
    for r, res in enumerate(phase(job, "synchronize")):
        assert res["worst"] < 1e-9 and res["steps_counted"] and res["n_steps"] == 16, (r, res)
        assert res["explicit_error"] and "aggregation='weighted' only" in res["explicit_error"], (r, res)
        assert "HINT" in res["explicit_error"], (r, res)


def test_deadline_checkpoint_keeps_the_carried_samples(job):
    ranks = phase(job, "deadline")
    carried = ranks[0]["carried_at_checkpoint"]
    assert carried[1] > 0, ranks[0]  # the stalled rank carried samples when the state was saved
    for r, res in enumerate(ranks):
        assert res["carried_after_rollback"] == 0, (r, res)  # load_state_dict dropped the later steps' carry
        for case in ("rollback", "resumed"):  # every rank's own state: each sample exactly once
            assert res[case] == {"total": 96, "unique": 96, "missing": 0}, (r, case, res[case])
            assert res[f"{case}_warnings"] == [], (r, case, res[f"{case}_warnings"])
        # Rank 0's state on every rank: rank 0's carry comes back, rank 1's is lost, and rank 1 says how much.
        lost = carried[1]
        assert res["rank0_state"] == {"total": 96 - lost, "unique": 96 - lost, "missing": lost}, (r, res)
    assert ranks[0]["rank0_state_warnings"] == []
    [warning] = ranks[1]["rank0_state_warnings"]
    assert f"rank 1 carried {carried[1]} samples" in warning and "saved on rank 0" in warning, warning
    assert "HINT" in warning and "epoch end" in warning, warning


def test_ranks_that_disagree_on_locality_are_told(job):
    for r, res in enumerate(phase(job, "locality")):
        assert res["error"] is not None, (r, res)
        assert "rank 1 has locality=True but rank 0 has locality=False" in res["error"], res["error"]
        assert "HINT" in res["error"] and "locality on every rank" in res["error"], res["error"]


def test_sampler_load_state_dict_raises_real_errors_only(job):
    for r, res in enumerate(phase(job, "load_error")):
        assert res["error"] is not None and "global batch 1 cannot give each of 2 ranks" in res["error"], (r, res)
        assert res["after_shutdown"] == "loaded", (r, res)  # Horovod not initialised: reconciled later


# ------------------------------------------------------------------ the launch commands, no job
def test_horovodrun_commands_in_the_readme_and_the_strategy_hint_use_gloo():
    """``--gloo``: without it horovodrun picks MPI, which the mpich wheel's launcher is not (docs/horovod.md)."""
    commands = [m.group(0) for m in re.finditer(r"horovodrun -np [^`\n]*", (REPO / "README.md").read_text())]
    assert len(commands) >= 3, commands
    assert all("--gloo" in c for c in commands), [c for c in commands if "--gloo" not in c]
    pytest.importorskip("lightning")
    from hetero_plugins.strategies import HeteroHorovodStrategy

    with pytest.raises(ValueError, match=r"HINT: .*horovodrun -np N --gloo python train\.py"):
        HeteroHorovodStrategy(parallel_devices=[])


def test_docs_say_how_the_sampler_pads():
    """Padding is to a multiple of the world size (as DistributedSampler), not only for a last short batch."""
    from hetero_plugins.horovod import HeteroBatchSampler

    for text in (HeteroBatchSampler.__doc__ or "", (REPO / "docs" / "horovod.md").read_text()):
        flat = " ".join(text.split())
        assert "padded with samples from its start to a multiple of the world size" in flat, flat[:400]
        assert "shorter than the world size" not in flat
