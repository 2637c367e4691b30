"""``hetero_plugins.horovod`` hooks and ``HeteroHorovodStrategy`` under real ``horovodrun -np 2 --gloo`` jobs."""

from __future__ import annotations

import json
import sys

import pytest

from tests.horovod.conftest import SCRIPTS

pytestmark = pytest.mark.horovod


def test_hooks_exact_balanced_every_sample_once(horovodrun, tmp_path):
    out = tmp_path / "hooks.json"
    horovodrun(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "hooks_check.py"), str(out)])
    res = json.loads(out.read_text())  # every rank asserted exactness, coverage and identical plans
    assert res["ok"]
    assert res["epochs"][0]["plan"] == [3, 5]
    assert res["epochs"][-1]["plan"][0] > res["epochs"][-1]["plan"][1]
    assert sum(res["epochs"][-1]["plan"]) == 8
    assert res["max_diff"] < 1e-9 and res["max_diff_accumulation"] < 1e-9
    assert [h["epoch"] for h in res["plan_history"]] == [0, 1, 2]


def test_lightning_strategy(horovodrun, tmp_path):
    out = tmp_path / "lightning.json"
    horovodrun(
        ["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "lightning_check.py"), str(out), str(tmp_path)],
        timeout=200,
    )
    res = json.loads(out.read_text())
    assert res["ok"]
    assert res["plans"][0] == [8, 8] and res["plans"][-1][0] > res["plans"][-1][1]
    assert res["checked_steps"] >= 40 and res["checked_steps_accumulation"] >= 10
    assert max(res["max_diff"], res["max_diff_resumed"], res["max_diff_accumulation"]) < 1e-9
    assert res["resumed_plan"] == res["plans"][-1]
