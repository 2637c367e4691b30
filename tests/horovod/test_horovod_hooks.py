"""``hetero_plugins.horovod`` hooks in plain scripts under a real ``horovodrun -np 2 --gloo`` job (the session's
``plain_checks`` job, shared with the aggregation and regressions checks; ``HeteroHorovodStrategy``:
``test_horovod_lightning.py``)."""

from __future__ import annotations

import json

import pytest

from tests.horovod.conftest import job_output

pytestmark = pytest.mark.horovod


def test_hooks_exact_balanced_every_sample_once(plain_checks):
    out = plain_checks / "hooks_check" / "hooks.json"
    assert out.exists(), job_output(plain_checks)
    res = json.loads(out.read_text())  # every rank asserted exactness, coverage and identical plans
    assert res["ok"]
    assert res["epochs"][0]["plan"] == [3, 5]
    assert res["epochs"][-1]["plan"][0] > res["epochs"][-1]["plan"][1]
    assert sum(res["epochs"][-1]["plan"]) == 8
    assert res["max_diff"] < 1e-9 and res["max_diff_accumulation"] < 1e-9
    assert [h["epoch"] for h in res["plan_history"]] == [0, 1, 2]
    # balancing=BalancingOptions(...) is accepted; the Lightning-only options are refused, each by name.
    assert sorted(res["refused"]) == ["apply_relocation", "balance_eval", "log_metrics", "memory_headroom",
                                      "replan_every"]
    assert all(f"`{k}`" in msg and "HINT" in msg for k, msg in res["refused"].items())
    hist = res["hooks_history"]  # timed through the public hooks batch_drawn/backward_done/step_done
    assert [h["epoch"] for h in hist] == [0, 1] and hist[-1]["next_batch_sizes"][0] > hist[-1]["next_batch_sizes"][1]
    # Per-rank epoch means of the utilisation readings (injected), and CPU load, in every entry on every rank.
    for h in hist:
        assert h["gpu_util"] == [40.0, 60.0] and h["gpu_mem_used"] == [1e9, 2e9], h
        assert len(h["cpu_percent"]) == 2 and all(v is not None and v >= 0 for v in h["cpu_percent"])
    # Without a GPU the default sampler reads nothing: no made-up utilisation.
    assert all(h["gpu_util"] == [None, None] for h in res["plan_history"])


def test_plain_script_cluster_context_and_relocation_spec(plain_checks):
    tmp_path = plain_checks / "cluster_check"
    assert (tmp_path / "rank1.json").exists(), job_output(plain_checks)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    hist = res[0]["plan_history"]
    assert hist == res[1]["plan_history"]  # every rank adopted rank 0's decision and its record
    assert hist[0]["batch_sizes"] == [16, 16] and 11 <= hist[0]["next_batch_sizes"][1] <= 14, hist[0]
    assert hist[0]["relocation"]["moves"] == [[1, 0]] and hist[0]["relocation"]["spec"], res[0]["lines"]
    spec = json.loads((tmp_path / "restart.json").read_text())
    assert spec["moves"] == [{"rank": 1, "to_free_slot": 0}] and spec["epoch"] == 1  # not rewritten at epoch 2
    assert hist[1]["relocation"]["moves"] == [[1, 0]] and hist[1]["relocation"]["spec"] is None
    # A bad description stops every rank with the same error (no rank left waiting in a collective).
    assert res[0]["error"] == res[1]["error"] and "one entry per rank (2)" in res[0]["error"]
    assert "`hosts_file`=" in res[0]["hosts_error"] and "not an existing file" in res[0]["hosts_error"]
