"""Stage 2 from measurements: the profiler writes a valid table, tables are validated, the NCF trained on a
table beats the additive baseline on held-out pairs where the table has interactions, and the shipped
measured table and model load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetero_plugins.cli import main as cli_main
from hetero_plugins.scheduler.measured import (
    additive_baseline, leave_pairs_out, load_measured_predictor, load_table, table_samples, table_slowdowns,
    validate_table,
)
from hetero_plugins.scheduler.ncf import InterferencePredictor
from hetero_plugins.scheduler.profile import profile_main


def _children_running(pattern: str, parent: int | None = None) -> list[int]:
    """Pids of the children of ``parent`` (default: this process) whose command line contains ``pattern``."""
    parent = os.getpid() if parent is None else parent
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and pattern in cmd:
            out.append(int(d.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc to see child processes")
def test_tiny_real_profile_run_writes_a_valid_table_and_leaves_no_corunner(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    rc = profile_main(["--out", str(out), "--seconds", "0.05", "--repeats", "2", "--workloads", "mlp",
                       "--corunners", "compute", "--batch-scales", "1", "--intensities", "1,2", "--device", "cpu",
                       "--quiet"])
    assert rc == 0
    table = load_table(out)
    assert table["device"] == "cpu" and table["machine"]["cores"] >= 1 and table["machine"]["torch"]
    assert "load_average_start" in table["machine"] and table["settings"]["repeats"] == 2
    s = table_slowdowns(table)
    assert set(s) == {("mlp", "compute"), ("mlp", "compute_x2")}
    for row in table["rows"]:
        assert row["repeats"] == 2 and len(row["ratios"]) == 2 and row["solo_s"] > 0
        assert row["slowdown"] == pytest.approx(float(np.exp(np.mean(np.log(row["ratios"])))), rel=1e-3)
    assert _children_running("profile_jobs") == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc to see child processes")
def test_sigterm_during_a_profile_run_kills_its_corunners(tmp_path: Path) -> None:
    job = subprocess.Popen([sys.executable, "-m", "hetero_plugins.cli", "profile-interference", "--out",
                            str(tmp_path / "t.json"), "--seconds", "5", "--workloads", "mlp", "--corunners",
                            "compute,membw", "--intensities", "1", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(pids := _children_running("profile_jobs", job.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(pids) == 2, "the co-runners did not start"
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) != 0
    finally:
        job.kill()
        job.wait()
    time.sleep(0.2)
    assert [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in (Path(f"/proc/{p}/stat").read_text()
                                                                        .rsplit(")", 1)[1].split()[:1])] == []


def _table(rows: list[dict]) -> dict:
    return {"format": 1, "machine": {"cpu": "test"}, "device": "cpu", "rows": rows}


ROW = {"workload": "mlp", "device": "cpu", "corunner": "io", "solo_s": 0.01, "shared_s": 0.012, "slowdown": 1.2,
       "repeats": 2}


@pytest.mark.parametrize("change, words", [
    ({"slowdown": -1.0}, ["rows[0].slowdown=-1.0", "> 0"]),
    ({"slowdown": float("nan")}, ["rows[0].slowdown=nan"]),
    ({"repeats": 0}, ["rows[0].repeats=0", ">= 1"]),
    ({"workload": ""}, ["rows[0].workload=''"]),
    ({"corunner": "none"}, ["corunner='none'", "solo"]),
    ({"ratios": [1.2, -0.5]}, ["rows[0].ratios=[1.2, -0.5]", "one per repeat"]),
])
def test_bad_rows_are_named_with_their_value_and_a_fix(change: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        validate_table(_table([{**ROW, **change}]))
    for w in [*words, "HINT"]:
        assert w in str(err.value)


def test_bad_tables_are_named_with_their_field_and_a_fix(tmp_path: Path) -> None:
    cases = [({"format": 2, "machine": {}, "device": "cpu", "rows": [ROW]}, "`format`=2"),
             ({"format": 1, "device": "cpu", "rows": [ROW]}, "`machine`=None"),
             (_table([]), "`rows`=[]"),
             (_table([ROW, dict(ROW)]), "repeats (workload, device, corunner)"),
             (_table([{k: v for k, v in ROW.items() if k != "solo_s"}]), "has no `solo_s`")]
    for table, words in cases:
        with pytest.raises(ValueError, match="HINT") as err:
            validate_table(table)
        assert words in str(err.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_table(bad)
    with pytest.raises(ValueError, match="is not a file"):
        load_table(tmp_path / "missing.json")


def _low_rank_table(seed: int = 0, noise: float = 0.02) -> dict:
    """Slowdowns exp(0.8 * u_w . v_c): each workload's sensitivity to each of three resources times each
    co-runner's pressure on it, so which co-runner hurts most depends on the workload."""
    rng = np.random.default_rng(seed)
    u, v = rng.random((8, 3)) ** 2, rng.random((8, 3)) ** 2
    rows = []
    for i in range(8):
        for j in range(8):
            s = float(np.exp(0.8 * u[i] @ v[j] + rng.normal(0, noise)))
            rows.append({**ROW, "workload": f"w{i}", "corunner": f"c{j}", "shared_s": 0.01 * s, "slowdown": s})
    return _table(rows)


def test_leave_pairs_out_ncf_beats_additive_where_workloads_and_corunners_interact() -> None:
    table = _low_rank_table()
    ev = leave_pairs_out(table, folds=4, settings={"epochs": 200})
    assert ev["folds"] == 4 and ev["pairs_count"] == 64 and len(ev["pairs"]) == 64
    assert ev["ncf_mean_rel_error"] < 0.11  # 9.3% here (2% noise); 7.3% with 8 folds and 400 epochs
    assert ev["ncf_mean_rel_error"] < 0.8 * ev["additive_mean_rel_error"]  # additive: 13.0%


def test_additive_baseline_is_exact_on_an_additive_table() -> None:
    rows = [{**ROW, "workload": f"w{i}", "corunner": f"c{j}", "slowdown": float(np.exp(0.1 * i + 0.2 * j))}
            for i in range(3) for j in range(1, 4)]
    add = additive_baseline(table_samples(_table(rows)))
    assert add("w2", "cpu", "c3") == pytest.approx(float(np.exp(0.8)), rel=1e-9)


def test_shipped_table_and_its_ncf_load_and_predict() -> None:
    table = load_table()
    assert table["device"] == "cpu" and table["machine"]["cpu"] and "note" in table["machine"]
    p = load_measured_predictor()
    rows = table_samples(table)
    pred = p.predict_many([(w, d, c) for w, d, c, _ in rows])
    true = np.array([s for *_, s in rows])
    assert np.all(pred >= 1.0) and float(np.mean(np.abs(pred - true) / true)) < 0.15
    assert p.predict(rows[0][0], "cpu", None) == 1.0
    assert p.meta["trained"]["rows"] == len(rows) and p.meta["table_machine"] == table["machine"]
    assert InterferencePredictor.load().workloads != p.workloads  # it sits beside the default, synthetic-table NCF


def test_cli_trains_an_ncf_from_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "t.json"
    src.write_text(json.dumps(_low_rank_table(seed=1)))
    model = tmp_path / "ncf.npz"
    assert cli_main(["profile-interference", "--from", str(src), "--train-ncf", str(model), "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 64
    p = load_measured_predictor(model)
    assert p.predict("w0", "cpu", "c0") >= 1.0
    assert cli_main(["profile-interference", "--from", str(tmp_path / "missing.json")]) == 2
