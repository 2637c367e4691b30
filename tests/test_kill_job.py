"""``tests.helpers.distributed.kill_job``, what bounds a hung horovodrun or torchrun job in the tests: it must take
the workers a launcher starts in sessions of their own, and a worker its launcher's death left orphaned."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.helpers.distributed import kill_job

SLEEP = "import time; time.sleep(300)"
LAUNCHER = f"""
import subprocess, sys, time
marker = sys.argv[1]
# a worker in a session of its own (as torchrun starts them), and one left behind: its parent exits at once
subprocess.Popen([sys.executable, "-c", {SLEEP!r}, marker + "-worker"], start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SLEEP!r}, "
                  "sys.argv[1]], start_new_session=True)", marker + "-orphan"])
time.sleep(300)
"""


def _marked(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


def _wait(condition, seconds: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_kill_job_takes_workers_in_their_own_sessions_and_orphans_named_by_the_marker(tmp_path):
    marker = f"kill-job-{tmp_path.name}"
    job = subprocess.Popen([sys.executable, "-c", LAUNCHER, marker], start_new_session=True)
    try:
        def started() -> bool:  # the worker, and the orphan once the process that started it is gone
            workers = [p for p in _marked(marker) if p.info["cmdline"][-1] == marker + "-worker"]
            orphans = [p for p in _marked(marker) if p.info["cmdline"][-1] == marker + "-orphan"]
            return len(workers) == 1 and len(orphans) == 1 and orphans[0].info["cmdline"][1] == "-c" \
                and SLEEP in orphans[0].info["cmdline"] and job.pid not in [q.pid for q in orphans[0].parents()]

        assert _wait(started), [p.info["cmdline"] for p in _marked(marker)]
        kill_job(job.pid, marker=marker)
        job.wait(timeout=10)
        assert _wait(lambda: not _marked(marker), 10), [p.info["cmdline"] for p in _marked(marker)]
        kill_job(job.pid)  # a job already gone: nothing to do, no error
    finally:
        for p in _marked(marker):
            p.kill()
