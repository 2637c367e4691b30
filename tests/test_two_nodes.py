"""Two "nodes" on one host: two launches of HeteroDDPStrategy (``devices=1, num_nodes=2``, gloo) with the
environment a cluster's job script sets (MASTER_ADDR/MASTER_PORT/WORLD_SIZE/NODE_RANK/LOCAL_RANK), each process
bounded by ``timeout``: batches are balanced per global rank and every sample runs once per epoch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.balancer_jobs import N, epoch_indices, plan_at, step_logs
from tests.lightning_jobs import read_reports

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
#: Variables by which Lightning would detect another cluster environment than the hand-set one.
_CLUSTER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "LSB_", "KUBERNETES_", "GROUP_RANK", "RANK",
                     "LOCAL_WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "PL_")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_host_balance_per_global_rank(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith(_CLUSTER_PREFIXES)}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_RANK="0",
                PYTHONPATH=os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]), PYTHONWARNINGS="ignore")
    script = str(ROOT / "tests" / "scripts" / "two_nodes_job.py")
    procs = [subprocess.Popen(["timeout", "-s", "KILL", "150", sys.executable, script, str(tmp_path)],
                              env=dict(base, NODE_RANK=str(node)), cwd=str(ROOT), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for node, p in enumerate(procs):
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{outputs[node][-3000:]}"
    reports = read_reports(str(tmp_path), 2)
    assert [rep["rank"] for rep in reports] == [0, 1]
    hist = reports[0]["plan_history"]
    assert len(hist) == 2 and hist == reports[1]["plan_history"]
    assert hist[1]["batch_sizes"][1] < 16 and sum(hist[1]["batch_sizes"]) == 32  # global rank 1 is the slow one
    logs = step_logs(str(tmp_path), 2)
    for epoch in range(2):
        assert sorted(epoch_indices(logs, epoch)) == list(range(N))  # every sample once per epoch
        for r in range(2):  # each global rank ran its planned batch at every step
            steps = [s for s in logs[r] if s["epoch"] == epoch]
            assert len(steps) == N // 32
            for s in steps:
                assert len(s["idx"]) == plan_at(hist[epoch], s["step"])[r], (epoch, s["step"], r)
