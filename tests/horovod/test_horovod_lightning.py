"""``HeteroHorovodStrategy`` under a real ``horovodrun -np 2 --gloo`` job: exactness, resume and accumulation
(``scripts/lightning_check.py``), the explicit aggregation modes (``scripts/lightning_aggregation_check.py``) and
the cluster context with its relocation spec (``scripts/lightning_cluster_check.py``), run one after another in
one job (``scripts/several_checks.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.horovod.conftest import several_checks

pytestmark = pytest.mark.horovod


@pytest.fixture(scope="module")
def job(horovod_available: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return several_checks(tmp_path_factory.mktemp("lightning"),
                          ["lightning_check", "lightning_aggregation_check", "lightning_cluster_check"], timeout=280)


def test_lightning_strategy(job):
    res = json.loads((job / "lightning_check" / "lightning.json").read_text())
    assert res["ok"]
    assert res["plans"][0] == [8, 8] and res["plans"][-1][0] > res["plans"][-1][1]
    assert res["checked_steps"] >= 40 and res["checked_steps_accumulation"] >= 10
    assert max(res["max_diff"], res["max_diff_resumed"], res["max_diff_accumulation"]) < 1e-9
    assert res["resumed_plan"] == res["plans"][-1]


def test_lightning_strategy_aggregation_modes(job):
    res = json.loads((job / "lightning_aggregation_check" / "aggregation.json").read_text())
    assert res["ok"]  # every rank asserted exactly-once coverage per epoch and mode
    assert res["wbsp"]["stolen"][0] > res["wbsp"]["stolen"][1] and res["wbsp"]["max_diff"] < 1e-9
    assert res["deadline"]["carried"][1] > 0
    assert res["local_sgd"]["identical"] and res["local_sgd"]["rounds"] == 4  # 13 steps, H=4: 4 averages
    assert all(res[m]["identical"] for m in ("wbsp", "deadline", "pseudo_sync"))


def test_lightning_strategy_cluster_context_and_relocation_spec(job):
    out = job / "lightning_cluster_check"
    hist = [json.loads((out / f"rank{r}.json").read_text())["plan_history"] for r in (0, 1)]
    assert hist[0] == hist[1]  # every rank adopted rank 0's decision and its record
    assert hist[0][0]["batch_sizes"] == [16, 16] and 11 <= hist[0][0]["next_batch_sizes"][1] <= 14, hist[0][0]
    assert hist[0][0]["relocation"]["moves"] == [[1, 0]]
    spec = json.loads((out / "restart.json").read_text())
    assert spec["moves"] == [{"rank": 1, "to_free_slot": 0}] and "checkpoint" not in spec
