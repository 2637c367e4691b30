"""A frozen rank in a bare ``mpirun`` job (``mpi4py``, no Horovod): ``MPIExchange``'s collectives are bounded.

Real ``mpirun -n N`` jobs (MPICH from the test environment) run ``MPIExchange``'s four collectives in a loop
until one rank stops itself (``SIGSTOP``). The survivors must give up after ``HETERO_PLUGINS_TIMEOUT`` seconds
with a ``CollectiveError`` naming themselves, the collective and the frozen rank (the other one of two; of
three, the one that did not answer the liveness probe), and ``mpirun`` must end: an exit after a given-up
collective aborts the MPI job instead of waiting in ``MPI_Finalize``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "mpi_frozen.py"
BIN = Path(sys.executable).parent
TIMEOUT = 5.0  # HETERO_PLUGINS_TIMEOUT in the jobs


@pytest.fixture(scope="module")
def mpirun() -> str:
    found = shutil.which("mpirun", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    problem = None if found else "mpirun not found"
    if found and subprocess.run([sys.executable, "-c", "import mpi4py.MPI"], capture_output=True,
                                timeout=60).returncode != 0:
        problem = "mpi4py does not import"
    if problem is None:
        return str(found)
    if os.environ.get("HETERO_PLUGINS_REQUIRE_HOROVOD") == "1":
        pytest.fail(f"MPI is required (HETERO_PLUGINS_REQUIRE_HOROVOD=1) but {problem}. HINT: run `make install`.")
    pytest.skip(f"{problem}; `make install` installs mpi4py and MPICH")


@pytest.mark.parametrize(("ranks", "frozen"), [(2, 0), (3, 2)])
def test_a_frozen_rank_ends_a_bare_mpirun_job_with_an_error_naming_it(mpirun, tmp_path, ranks, frozen):
    env = dict(os.environ, HETERO_PLUGINS_TIMEOUT=str(TIMEOUT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env = {k: v for k, v in env.items() if not k.startswith("HOROVOD_")}  # a bare mpirun job picks MPI
    proc = subprocess.Popen([mpirun, "-n", str(ranks), sys.executable, str(SCRIPT), "--freeze-rank", str(frozen),
                             "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT + 90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpirun still ran {TIMEOUT + 90:g} s after the start with rank {frozen} frozen:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stopped rank, should mpirun have left it
        except ProcessLookupError:
            pass
    ended = time.time()
    assert (tmp_path / "frozen").exists(), out[-4000:]
    after = ended - float((tmp_path / "frozen").read_text())
    print(f"\nmpirun -n {ranks}, rank {frozen} frozen: the job ended {after:.1f} s after the freeze "
          f"(timeout {TIMEOUT:g} s)")
    assert proc.returncode != 0
    assert after < TIMEOUT + 20, f"the job ended {after:.0f} s after the freeze"
    survivors = [r for r in range(ranks) if r != frozen]
    messages = {r: (tmp_path / f"error_rank{r}.txt").read_text() for r in survivors
                if (tmp_path / f"error_rank{r}.txt").exists()}
    assert messages, out[-6000:]  # at least one survivor gave up before mpirun ended the job
    for r, message in messages.items():
        assert message.startswith("CollectiveError: "), message
        assert f"rank {r} gave up on allreduce 'test.sum' after {TIMEOUT:g} s" in message, message
        assert f"rank {frozen} did not answer" in message and "HINT" in message, message
