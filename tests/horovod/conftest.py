"""Launch real ``horovodrun`` jobs from pytest, bounded in time.

Horovod missing: the tests skip, unless ``HETERO_PLUGINS_REQUIRE_HOROVOD=1`` (CI), where they fail.
Every job runs in its own process group with a timeout; on timeout the job is killed with every process below
it, and ``HOROVOD_GLOO_TIMEOUT_SECONDS`` / ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` bound a hung collective inside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.distributed import kill_job

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


def run_job(args: list[str], timeout: float, env: dict[str, str] | None = None,
            stop_after: str | None = None) -> subprocess.CompletedProcess:
    """Run ``horovodrun *args`` from the repo root; kill the job (:func:`kill_job`) after ``timeout`` seconds.

    ``stop_after``: once a line of the output contains it, the job gets 2 more seconds to end by itself, then it
    is killed (``returncode`` ``-9``). The freeze tests pass horovodrun's "Terminating remaining
    workers": from there Horovod's teardown of a stopped (``SIGSTOP``) rank waits out two 5 s grace periods
    before its ``SIGKILL``, 10 s a test of Horovod's own code.
    """
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
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if stop_after is not None and stop_after in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not seen.is_set():
        time.sleep(0.1)
    if seen.is_set():
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            kill_job(proc.pid)
    elif proc.poll() is None:
        kill_job(proc.pid)
        proc.wait()
        reader.join(timeout=10)
        out = "".join(lines)
        pytest.fail(f"horovodrun {' '.join(args)} did not finish in {timeout}s; output tail:\n{out[-6000:]}")
    proc.wait()
    reader.join(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), "")


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


#: The plain-script checks (no Lightning) that share one ``horovodrun`` job, in this order (see :func:`plain_checks`).
PLAIN_CHECKS = ["cluster_check", "hooks_check", "aggregation_check", "regressions_check"]


@pytest.fixture(scope="session")
def plain_checks(horovod_available: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scripts/several_checks.py`` over :data:`PLAIN_CHECKS` in one ``horovodrun -np 2`` job (one start-up for
    four scripts); each wrote into ``<returned>/<name>/``. The regressions check's phases record themselves even
    when one crashes, so the job's exit status is not asserted here: each test reads what its check wrote and
    fails with the job's output tail when it is missing."""
    out = tmp_path_factory.mktemp("plain")
    args = ["-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(SCRIPTS / "several_checks.py"), str(out),
            *PLAIN_CHECKS]
    res = run_job(args, timeout=400)
    (out / "job.txt").write_text(f"horovodrun exited {res.returncode}:\n{res.stdout[-8000:]}")
    return out


def job_output(out: Path) -> str:
    """The exit status and output tail of the :func:`plain_checks` job, for a failing assertion's message."""
    return (out / "job.txt").read_text()
