"""Launch real ``horovodrun`` jobs from pytest, bounded in time.

Horovod missing: the tests skip, unless ``HETERO_PLUGINS_REQUIRE_HOROVOD=1`` (CI), where they fail.
Every job runs in its own process group with a timeout; on timeout the whole group is killed, and
``HOROVOD_GLOO_TIMEOUT_SECONDS`` / ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` bound a hung collective inside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent


def _horovod_problem() -> str | None:
    horovodrun = shutil.which("horovodrun", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if horovodrun is None:
        return "horovodrun not found"
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"horovod.torch does not import: {probe.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="session")
def horovod_available() -> None:
    problem = _horovod_problem()
    if problem is None:
        return
    if os.environ.get("HETERO_PLUGINS_REQUIRE_HOROVOD") == "1":
        pytest.fail(f"Horovod is required (HETERO_PLUGINS_REQUIRE_HOROVOD=1) but {problem}. HINT: run `make horovod`.")
    pytest.skip(f"Horovod not installed ({problem}); run `make horovod`")


def run_job(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``horovodrun *args`` from the repo root; kill its process group after ``timeout`` seconds."""
    full_env = dict(os.environ)
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "60")
    full_env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90")
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    proc = subprocess.Popen(
        [str(BIN / "horovodrun"), *args], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"horovodrun {' '.join(args)} did not finish in {timeout}s; output tail:\n{out[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.fixture
def horovodrun(horovod_available: None) -> Callable[..., subprocess.CompletedProcess]:
    """``horovodrun(args, timeout)``: a finished job; fails the test with the output tail on a non-zero exit."""

    def _run(args: list[str], timeout: float = 150.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        res = run_job(args, timeout, env)
        assert res.returncode == 0, f"horovodrun {' '.join(args)} exited {res.returncode}:\n{res.stdout[-8000:]}"
        return res

    return _run


def several_checks(out: Path, names: list[str], timeout: float) -> Path:
    """Run ``scripts/several_checks.py`` (the named check scripts one after another in one ``horovodrun -np 2``
    job: one start-up instead of one a script); fail with the output tail on a non-zero exit. Returns ``out``,
    under which each check wrote into its own folder."""
    args = ["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "several_checks.py"), str(out),
            *names]
    res = run_job(args, timeout)
    assert res.returncode == 0, f"horovodrun {' '.join(args)} exited {res.returncode}:\n{res.stdout[-8000:]}"
    return out
