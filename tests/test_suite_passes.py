"""`make test` runs the single-process tests in pytest-xdist workers and the multi-process ones alone: a
multi-process test collected in a worker fails at once with the commands to use, instead of timing its ranks on
cores that other tests take."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_multi_process_test_in_an_xdist_worker_fails_naming_the_serial_pass(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
         "tests/test_two_nodes.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "must not run in a pytest-xdist worker" in proc.stdout, proc.stdout[-3000:]
    assert "pytest -m 'distributed or horovod'" in proc.stdout and "1 error" in proc.stdout, proc.stdout[-3000:]
    assert not list((tmp_path / "t").rglob("fork_server.log"))  # failed before any rank started
