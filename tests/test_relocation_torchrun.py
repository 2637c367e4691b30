"""A relocation applied for real: torchrun (2 CPU ranks, one restart allowed) stops and restarts the workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.distributed import run_torchrun

pytestmark = pytest.mark.distributed

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "relocation_review_job.py")


def _torchrun(tmp_path, share_store: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", SCRIPT, "--out", str(tmp_path)]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0" if share_store else "1")
    p = run_torchrun(cmd, tmp_path, env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_torchrun_restart_applies_a_relocation_and_resumes(tmp_path):
    proc = _torchrun(tmp_path, share_store=False)
    assert "RelocationRestart" in proc.stderr  # the first attempt stopped on purpose
    spec = json.loads((tmp_path / "hetero_restart.json").read_text())
    assert spec["moves"] == [{"rank": 1, "to_free_slot": 0}] and spec["restart_count"] == 0 and spec["epoch"] == 1
    assert spec["ranks"][1]["device"] == "v100" and spec["ranks"][1]["from"] == "free_slots[0]"
    assert os.path.isfile(spec["checkpoint"])
    # Each rank of each attempt that ends its fit writes attempt{TORCHELASTIC_RESTART_COUNT}_rank{r}.json: the
    # stopped attempt 0 wrote none, the restarted attempt 1 was the last.
    written = sorted(p.name for p in tmp_path.glob("attempt*_rank*.json"))
    assert written == ["attempt1_rank0.json", "attempt1_rank1.json"], written
    runs = [json.loads((tmp_path / f"attempt1_rank{r}.json").read_text()) for r in (0, 1)]
    for run in runs:
        assert run["resumed"] == spec["checkpoint"]
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
    written = sorted(p.name for p in tmp_path.glob("attempt*_rank*.json"))
    assert written == ["attempt0_rank0.json", "attempt0_rank1.json"], written
    runs = [json.loads((tmp_path / f"attempt0_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["resumed"] is None and r["epochs"] == [0, 1, 2] for r in runs)
    # Rank 1 stayed on its slow slot: it keeps the smaller share.
    assert all(h["batch_sizes"][1] <= 12 for h in runs[0]["plan_history"][1:])
