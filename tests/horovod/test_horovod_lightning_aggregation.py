"""``HeteroHorovodStrategy(aggregation=...)`` under a real ``horovodrun -np 2 --gloo`` job."""

from __future__ import annotations

import json
import sys

import pytest

from tests.horovod.conftest import SCRIPTS

pytestmark = pytest.mark.horovod


def test_lightning_strategy_aggregation_modes(horovodrun, tmp_path):
    out = tmp_path / "aggregation.json"
    horovodrun(["-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                str(SCRIPTS / "lightning_aggregation_check.py"), str(out)], timeout=240)
    res = json.loads(out.read_text())  # every rank asserted exactly-once coverage per epoch and mode
    assert res["ok"]
    assert res["wbsp"]["stolen"][0] > res["wbsp"]["stolen"][1] and res["wbsp"]["max_diff"] < 1e-9
    assert res["deadline"]["carried"][1] > 0
    assert res["local_sgd"]["identical"] and res["local_sgd"]["rounds"] == 4  # 13 steps, H=4: 4 averages
    assert all(res[m]["identical"] for m in ("wbsp", "deadline", "pseudo_sync"))
