"""The Horovod example as the README runs it (``--accelerator auto``: the CPU here, one GPU per rank where
there are GPUs), and the report of what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetero_plugins.apps import report
from tests.horovod.conftest import REPO

pytestmark = pytest.mark.timeout(240)


@pytest.mark.horovod
def test_horovod_example_runs_where_it_is_and_its_json_reports(horovodrun, tmp_path):
    out = tmp_path / "hvd.json"
    res = horovodrun(["-np", "2", "-H", "localhost:2", "--gloo", "python", "examples/horovod_train.py",
                      "--accelerator", "auto", "--speeds", "1,0.25", "--epochs", "3", "--json-out", str(out)])
    result = json.loads(out.read_text())
    assert result["accelerator"] == "cpu" and result["world_size"] == 2  # no GPU on the test machines
    assert result["epochs"][-1]["plan"][1] < result["epochs"][-1]["plan"][0]  # the 4x slower rank got less
    assert f"hetero-plugins report {out}" in res.stdout
    record = report.load_run(out)
    # The sampler records an epoch when the next one starts (set_epoch is where it plans): 3 epochs, 2 entries.
    assert record.kind == "json" and len(record.history) == 2 and record.world_size == 2
    assert "batch size per rank: [32, 32] at epoch 0" in report.summarize(record)


def test_horovod_example_refuses_gpu_indices_on_the_cpu(horovod_available, tmp_path):
    """Checked before Horovod starts: the script alone answers, no horovodrun needed."""
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "horovod_train.py"), "--accelerator", "cpu",
                           "--devices", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--devices 0 picks GPUs, but the accelerator is the CPU" in proc.stderr
