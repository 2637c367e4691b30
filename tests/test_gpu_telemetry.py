"""GPU utilisation averaged over an epoch (tested on CPU with an injected reading), and the GPU check's
no-GPU path."""

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.telemetry import UtilisationSampler

ROOT = Path(__file__).resolve().parent.parent


class FakeGPU:
    """Readings of a GPU that is busy while `busy` is set, as NVML reports them."""

    def __init__(self) -> None:
        self.busy = threading.Event()
        self.calls = 0

    def read(self) -> dict:
        self.calls += 1
        util = 100.0 if self.busy.is_set() else 0.0
        return {"gpu_util": util, "gpu_mem_used": 1e9 + 1e9 * util / 100, "gpu_mem_total": 8e9}


def test_epoch_means_from_the_sampling_thread():
    gpu = FakeGPU()
    sampler = UtilisationSampler(interval=0.01, read=gpu.read)
    assert sampler.active
    with sampler:
        gpu.busy.set()
        time.sleep(0.3)
        gpu.busy.clear()
        time.sleep(0.1)  # the epoch ends idle: a reading now would say 0%
    means = sampler.epoch_means()
    assert gpu.read()["gpu_util"] == 0.0
    assert means["samples"] >= 10 and 40 < means["gpu_util"] < 95
    assert means["gpu_mem_used_max"] == 2e9 and means["gpu_mem_total"] == 8e9
    assert sampler.epoch_means() == {}  # reset after reading
    calls = gpu.calls
    time.sleep(0.05)
    assert gpu.calls == calls  # the thread stopped


def test_manual_readings_and_failed_readings():
    values = iter([{"gpu_util": 10.0}, RuntimeError("NVML_ERROR_UNKNOWN"), {"gpu_util": 30.0, "x": float("nan")}])

    def read():
        v = next(values)
        if isinstance(v, Exception):
            raise v
        return v

    s = UtilisationSampler(read=read)
    for _ in range(3):
        s.sample()
    assert s.epoch_means(reset=False) == {"gpu_util": 20.0, "samples": 2}
    assert s.epoch_means() == {"gpu_util": 20.0, "samples": 2}


def test_without_nvml_the_sampler_is_a_no_op():
    s = UtilisationSampler(gpu_index=0)  # no NVIDIA driver here
    assert not s.active
    s.start()
    s.sample()
    s.stop()
    assert s.epoch_means() == {}
    assert not any(t.name == "hetero-utilisation" for t in threading.enumerate())
    with pytest.raises(ValueError, match="interval"):
        UtilisationSampler(interval=0)


def test_the_planner_keeps_per_rank_epoch_means_in_its_history():
    p = BalancePlanner(2, 64)
    rec = np.array([[[32, 0.032, 0.0]] * 5, [[32, 0.128, 0.0]] * 5])
    means = [{"gpu_util": 80.0, "gpu_mem_used": 3e9, "samples": 20}, None]
    entry = p.end_epoch(0, rec, system=means)
    assert entry["system"] == means and p.history[0]["system"] is not means
    assert p.end_epoch(1, rec)["system"] is None
    q = BalancePlanner(2, 64)
    q.load_state_dict(p.state_dict())
    assert q.history[0]["system"] == means


def run_check(path_dirs):
    env = {**os.environ, "PATH": os.pathsep.join(path_dirs)}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                          env=env, timeout=120)


def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    out = run_check([str(tmp_path), "/usr/bin", "/bin"])
    assert out.returncode == 0, out.stderr
    assert "No usable NVIDIA GPU" in out.stdout and "nvidia-smi" in out.stdout


def test_gpu_check_with_a_driver_but_no_cuda_torch_exits_0(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-fake)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = run_check([str(tmp_path), "/usr/bin", "/bin"])
    assert out.returncode == 0, out.stderr
    assert "No usable NVIDIA GPU" in out.stdout and "cannot use CUDA" in out.stdout
