"""Run a function on N fresh gloo processes and collect each rank's result or traceback.

Fresh processes per call contain rank-divergent failures; a bounded timeout turns a hang into a test failure;
the queue is drained before ``join`` so a large result cannot deadlock the child.

The ranks of most multi-process tests start from ``multiprocessing``'s fork server (:data:`START_METHOD`:
``run_distributed`` here, ``HeteroDDPStrategy(start_method=START_METHOD)`` in the Lightning tests). The server
imports torch, Lightning and this package once per test session (:func:`start_fork_server`) and runs no test:
each rank is still a fresh process, but two start in 0.1 s where ``spawn`` re-imports Lightning in both (7 s on
two cores, paid by some 30 runs). The registered ``"hetero_ddp_spawn"``, stock ``"ddp_spawn"`` without the
balancer (which leaves a module's weights shared under the fork server) and the ``popen`` launcher (examples,
demo, ``torchrun``) keep their own start methods. The ranks write into the server's log, which
:func:`rank_output` reads for the tests that check what a rank printed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


START_METHOD = "forkserver"
PRELOAD = ("torch", "lightning.pytorch", "hetero_plugins.strategies", "hetero_plugins.callbacks",
           "tests.lightning_jobs")


_started: list[str | None] = []  # the server's log, once started


def start_fork_server(log: str | None = None) -> None:
    """Start the fork server with :data:`PRELOAD` imported (once; later calls return at once). Its environment,
    and so every rank's, is the caller's at the first call: call it before a test changes ``os.environ``. Its
    ranks write to the server's standard output and error: the file ``log`` (appended to) where given, else the
    caller's, at the first call (:func:`rank_output` reads the file)."""
    from multiprocessing import forkserver

    if _started:
        return
    _started.append(log)
    mp.set_forkserver_preload(list(PRELOAD))
    if log is None:
        forkserver.ensure_running()
        return
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


class rank_output:  # noqa: N801 - used as a context manager, like a function
    """What the fork server's ranks write (standard output and error) while the ``with`` block runs: ``.text``
    after it. Needs the server started with a ``log`` (as the test session's is)."""

    def __enter__(self) -> "rank_output":
        if not _started or _started[0] is None:
            raise RuntimeError("the fork server writes no log: start it with start_fork_server(log=...)")
        self._log = _started[0]
        self._start = os.path.getsize(self._log)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        with open(self._log, "rb") as f:
            f.seek(self._start)
            self.text = f.read().decode(errors="replace")


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, args: tuple, out: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes: torch's queue reductions would share tensor memory with a process that exits.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results in rank order."""
    start_fork_server()
    ctx = mp.get_context(START_METHOD)
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, args, out)) for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            while len(results) < world_size:
                try:
                    rank, ok, value = out.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout}s")
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = pickle.loads(value)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world_size)]


def run_torchrun(cmd: list[str], tmp_path: Any, env: dict[str, str],
                 timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run a torchrun (or Lightning) launch ``cmd`` from ``tmp_path`` in a session of its own and return it
    finished. On timeout the job is killed (:func:`kill_job`, its command lines marked by ``tmp_path``, the job's
    ``--out``: torchrun starts each worker in a session of its own) and the test fails with the output's tail."""
    p = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import pytest

        kill_job(p.pid, marker=str(tmp_path))
        out, err = p.communicate()
        pytest.fail(f"the job did not finish in {timeout} s:\n{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def kill_job(pid: int, marker: str | None = None) -> None:
    """SIGKILL a job started in a session of its own (``start_new_session=True``): its process group, every process
    below ``pid`` (launchers such as horovodrun and torchrun start workers in groups or sessions of their own) and,
    with ``marker``, every process whose command line holds it (a worker its launcher's death left orphaned)."""
    import psutil

    try:
        doomed = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        doomed = []
    if marker is not None:
        doomed += [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    for p in doomed:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
