"""A relocation applied for real: torchrun (2 CPU ranks, one restart allowed) stops and restarts the workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torchrun_relocation.py")


def _torchrun(tmp_path, share_store: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", SCRIPT, "--out", str(tmp_path)]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0" if share_store else "1")
    p = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: kill every process of this job by its --out.
        import psutil

        for proc in psutil.process_iter(["cmdline"]):
            if str(tmp_path) in " ".join(proc.info["cmdline"] or []):
                proc.kill()
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"torchrun did not finish in 240 s:\n{out[-3000:]}{err[-3000:]}")
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_torchrun_restart_applies_a_relocation_and_resumes(tmp_path):
    proc = _torchrun(tmp_path, share_store=False)
    assert "RelocationRestart" in proc.stderr  # the first attempt stopped on purpose
    spec = json.loads((tmp_path / "hetero_restart.json").read_text())
    assert spec["moves"] == [{"rank": 1, "to_free_slot": 0}] and spec["restart_count"] == 0 and spec["epoch"] == 1
    assert spec["ranks"][1]["device"] == "v100" and spec["ranks"][1]["from"] == "free_slots[0]"
    assert os.path.isfile(spec["checkpoint"])
    runs = [json.loads((tmp_path / f"attempt_rank{r}.json").read_text()) for r in (0, 1)]
    for run in runs:
        assert run["restart_count"] == "1" and run["resumed"] == spec["checkpoint"]
        assert run["epochs"] == [1, 2] and run["final_epoch"] == 3  # resumed after epoch 0, not repeated
    hist = runs[0]["plan_history"]
    assert hist == runs[1]["plan_history"] and [h["epoch"] for h in hist] == [0, 1, 2]
    # Before the move rank 1 (0.4x) was given less work; after it, the NCF-predicted v100 line of its new slot
    # balances it with rank 0 from the first step of epoch 1, and the measurements agree.
    assert hist[0]["next_batch_sizes"][1] <= 12
    assert hist[0]["relocation"]["moves"] == [[1, 0]]
    assert all(abs(h["batch_sizes"][1] - 16) <= 2 for h in hist[1:]), hist
    assert not any(h["relocation"]["moves"] for h in hist[1:])  # nothing better left: no second restart


def test_no_restart_while_torchrun_shares_its_store(tmp_path):
    """With torchrun's shared rendezvous store a restart can hang on stale addresses (PyTorch #135712): the
    balancer writes the spec, warns with the fix, and trains on in place."""
    proc = _torchrun(tmp_path, share_store=True)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in proc.stderr and "RelocationRestart" not in proc.stderr
    spec = json.loads((tmp_path / "hetero_restart.json").read_text())
    assert spec["moves"] == [{"rank": 1, "to_free_slot": 0}] and "checkpoint" not in spec
    runs = [json.loads((tmp_path / f"attempt_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["restart_count"] == "0" and r["resumed"] is None and r["epochs"] == [0, 1, 2] for r in runs)
    # Rank 1 stayed on its slow slot: it keeps the smaller share.
    assert all(h["batch_sizes"][1] <= 12 for h in runs[0]["plan_history"][1:])
