"""The installable wheel: built from a copy of the checkout, installed into a fresh virtual environment, used
from a folder outside the checkout.

The fresh environment reaches the project environment's dependencies (torch, Lightning, ...) through a
``.pth`` line, so nothing is downloaded; the wheel itself goes in with ``pip install --no-deps``. A path
line in a ``.pth`` file adds that folder to ``sys.path`` without running the ``.pth`` files inside it, so
the editable install of the checkout stays out, and the test asserts that every module came from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)  # one process at a time (pip, then the check): the parallel pass
#: Source folders and the package names they install as (pyproject.toml's package-dir).
SOURCES = {"hetero_plugins": "hetero_plugins", "callbacks": "hetero_plugins/callbacks",
           "strategies": "hetero_plugins/strategies"}

CHECK = r"""
import importlib, json, sys
import hetero_plugins, hetero_plugins.strategies, hetero_plugins.callbacks
from hetero_plugins.callbacks import BatchBalancer
from hetero_plugins.strategies import HeteroDDPStrategy
from hetero_plugins.scheduler.dqn import QNetwork
from hetero_plugins.scheduler.ncf import InterferencePredictor
import hetero_plugins.apps.report, hetero_plugins.progress, hetero_plugins.scheduler.sim
dqn, ncf = QNetwork.load(), InterferencePredictor.load()  # the shipped default models
print(json.dumps({
    "modules": {m: sys.modules[m].__file__ for m in sys.modules
                if m == "hetero_plugins" or m.startswith("hetero_plugins.")},
    "dqn_layers": len(dqn.layers), "ncf_devices": list(ncf.devices),
}))
"""


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_installs_in_a_fresh_venv_and_runs_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", ".gl", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*_output",
        "lightning_logs"))
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("hetero_plugins-*.whl")

    # Every source module of the three package folders, and the shipped models, are in the wheel.
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{target}/{p.relative_to(ROOT / folder).as_posix()}" for folder, target in SOURCES.items()
                for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert expected - names == set()
    assert {"hetero_plugins/scheduler/models/dqn_v1.npz", "hetero_plugins/scheduler/models/ncf_v1.npz",
            "hetero_plugins/scheduler/models/ncf_measured_cpu.npz",
            "hetero_plugins/scheduler/models/interference_cpu.json"} <= names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    fresh_site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()] or [sysconfig.get_paths()["purelib"]]
    (fresh_site / "_project_deps.pth").write_text("\n".join(deps) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PYTHONWARNINGS="ignore")
    out = json.loads(_run([str(py), "-c", CHECK], cwd=elsewhere, env=env).stdout.strip().splitlines()[-1])
    assert out["dqn_layers"] >= 2 and out["ncf_devices"]
    for module, path in out["modules"].items():  # all from the fresh environment, none from the checkout
        assert Path(path).resolve().is_relative_to(fresh_site.resolve()), (module, path)
    assert {"hetero_plugins.callbacks.batch_balancer", "hetero_plugins.strategies.hetero_ddp",
            "hetero_plugins.scheduler.sim"} <= set(out["modules"])

    proc = _run([str(venv / "bin" / "hetero-plugins"), "simulate", "--scenario", "paper_mix"], cwd=elsewhere, env=env)
    assert "scenario paper_mix: 8 ranks" in proc.stdout and "policy / oracle" in proc.stdout
