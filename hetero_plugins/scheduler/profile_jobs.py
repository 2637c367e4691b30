"""The jobs :mod:`hetero_plugins.scheduler.profile` measures: training workloads and co-runners.

Workloads (the NCF's users) are real training steps, each built by :func:`build_workload` and stepped in
the measuring process: ``digits_cnn`` (the demo's CNN on scikit-learn's digits, or random 8x8 images
without scikit-learn), ``mlp`` (a three-layer perceptron), ``convnet`` (a small 32x32 conv net) and
``dataload`` (a linear model whose every step reads and decompresses its batch from ``.npz`` files,
dropping them from the page cache first where the OS allows, so that it waits on the disk).

Co-runners (the NCF's items, with the device) are separate processes started by :func:`corunner_command`
(``python -m hetero_plugins.scheduler.profile_jobs NAME ...``): ``compute`` (in-cache matrix products),
``membw`` (copies of arrays far larger than the caches), ``io`` (writes, syncs and re-reads a file past
the page cache), ``train`` (another training job, the MLP) and, on a GPU, ``gpu`` (large matrix products on
the device). Every job runs with one thread (torch, OpenMP, BLAS), so that a two-core machine already
shows contention. A co-runner prints ``ready`` when set up, then works until its parent dies (Linux: the
kernel kills it; elsewhere it checks its parent between units of work) or ``--max-seconds`` pass.

The co-runner classes follow the resource-pressure view of co-location interference of Zhang, Geng, Ma
(IEEE TPDS 2021) and of Paragon (Delimitrou & Kozyrakis, ASPLOS 2013): compute, memory bandwidth, IO.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CORUNNERS", "GPU_CORUNNERS", "WORKLOADS", "build_workload", "corunner_command", "single_thread_env"]

#: Workload names and what they are.
WORKLOADS = {
    "digits_cnn": "the demo's digits CNN (2 conv + 2 linear layers, 8x8 images), SGD with momentum",
    "mlp": "a 784-512-256-10 perceptron on random inputs, SGD",
    "convnet": "a 3-layer conv net on random 3x32x32 images, SGD",
    "dataload": "a linear model whose batches are read and decompressed from .npz files each step (page cache dropped)",
}
#: Default batch size of each workload.
DEFAULT_BATCH = {"digits_cnn": 32, "mlp": 128, "convnet": 32, "dataload": 64}
#: Co-runner names and what they are (any device).
CORUNNERS = {
    "compute": "in-cache float64 matrix products (numpy, one thread)",
    "membw": "copies between two 64 MB arrays (memory bandwidth)",
    "io": "writes 32 MB, fsyncs, drops it from the page cache and reads it back",
    "train": "another training job (the MLP workload, on the measured device)",
}
#: Co-runners that exist only where the workloads run on a GPU.
GPU_CORUNNERS = {"gpu": "4096x4096 matrix products on the GPU"}

ENV_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def single_thread_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with every thread-count variable set to 1."""
    env = dict(os.environ if base is None else base)
    env.update({k: "1" for k in ENV_THREADS})
    return env


# ---------------------------------------------------------------------------------------------- workloads
def _digits(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        return (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), y.astype(np.int64)
    except ImportError:  # scikit-learn is a demo extra; random images cost the same per step
        return rng.random((1797, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 1797)


def _write_shards(folder: Path, rng: np.random.Generator, batch: int, shards: int = 16) -> list[Path]:
    """Compressed ``.npz`` shards of ``batch`` 3x32x32 uint8 images (noisy, so zlib has work to do)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(shards):
        base = rng.integers(0, 256, (batch, 3, 1, 32), dtype=np.uint8)
        img = np.clip(base + rng.integers(0, 16, (batch, 3, 32, 32)), 0, 255).astype(np.uint8)
        p = folder / f"shard{k:03d}.npz"
        np.savez_compressed(p, x=img, y=rng.integers(0, 10, batch))
        paths.append(p)
    return paths


def _drop_cache(path: Path) -> None:
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def build_workload(name: str, device: str = "cpu", batch: int | None = None, seed: int = 0,
                   workdir: str | Path | None = None) -> Callable[[], None]:
    """A function running one training step of workload ``name`` (see :data:`WORKLOADS`) on ``device``.

    Args:
        name: a key of :data:`WORKLOADS`.
        device: ``"cpu"`` or ``"cuda"``; on ``"cuda"`` each step ends with a synchronisation, so that its
            time is the device's.
        batch: samples per step (default :data:`DEFAULT_BATCH`).
        seed: data and initialisation seed.
        workdir: folder for the ``dataload`` workload's files (default: a new temporary folder).
    """
    import torch
    from torch import nn

    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}. HINT: use one of {sorted(WORKLOADS)}.")
    batch = DEFAULT_BATCH[name] if batch is None else int(batch)
    if batch < 1:
        raise ValueError(f"`batch`={batch} must be >= 1. HINT: e.g. batch={DEFAULT_BATCH[name]}.")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if name == "digits_cnn":
        model: nn.Module = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
        xs, ys = _digits(rng)
        x_all, y_all = torch.from_numpy(xs).to(dev), torch.from_numpy(ys).to(dev)
    elif name == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
        x_all, y_all = torch.randn(2048, 784, device=dev), torch.randint(0, 10, (2048,), device=dev)
    elif name == "convnet":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(32, 10))
        x_all, y_all = torch.randn(512, 3, 32, 32, device=dev), torch.randint(0, 10, (512,), device=dev)
    else:
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
        folder = Path(tempfile.mkdtemp(prefix="hp_profile_") if workdir is None else workdir)
        shards = _write_shards(folder, rng, batch)
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    state = {"k": 0}

    def step() -> None:
        k = state["k"]
        state["k"] = k + 1
        if name == "dataload":
            path = shards[k % len(shards)]
            _drop_cache(path)
            with np.load(path) as z:
                x = torch.from_numpy(z["x"].astype(np.float32) / 255.0).to(dev)
                y = torch.from_numpy(z["y"]).to(dev)
        else:
            idx = torch.from_numpy(rng.integers(0, len(x_all), batch)).to(dev)
            x, y = x_all[idx], y_all[idx]
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        sync()

    return step


# ---------------------------------------------------------------------------------------------- co-runners
def corunner_command(name: str, device: str = "cpu", max_seconds: float = 600.0,
                     workdir: str | Path | None = None) -> list[str]:
    """The command line starting co-runner ``name`` as its own process (run it with :func:`single_thread_env`)."""
    if name not in CORUNNERS and name not in GPU_CORUNNERS:
        raise ValueError(f"unknown co-runner {name!r}. HINT: use one of {sorted(CORUNNERS | GPU_CORUNNERS)}.")
    cmd = [sys.executable, "-m", "hetero_plugins.scheduler.profile_jobs", name, "--device", device,
           "--max-seconds", f"{max_seconds:.0f}"]
    return cmd + (["--workdir", str(workdir)] if workdir is not None else [])


def _die_with_parent() -> Callable[[], bool]:
    """Ask Linux to kill this process when its parent dies; return a check for other systems."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: also reaches a stopped process
        except (OSError, AttributeError):
            pass
    return lambda: os.getppid() == parent


def _corunner_unit(name: str, device: str, workdir: Path) -> Callable[[], None]:
    """One unit of co-runner work (a fraction of a second)."""
    if name == "compute":
        a = np.random.default_rng(0).random((96, 96))

        def unit() -> None:
            b = a
            for _ in range(200):
                b = np.tanh(b @ a)
        return unit
    if name == "membw":
        src, dst = np.ones(8 << 20), np.empty(8 << 20)  # 64 MB each

        def unit() -> None:
            for _ in range(4):
                np.copyto(dst, src)
                np.copyto(src, dst)
        return unit
    if name == "io":
        path = workdir / f"io_{os.getpid()}.bin"
        block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()

        def unit() -> None:
            with open(path, "wb") as f:
                for _ in range(32):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            _drop_cache(path)
            with open(path, "rb") as f:
                while f.read(1 << 20):
                    pass
        return unit
    if name == "train":
        import torch

        torch.set_num_threads(1)
        step = build_workload("mlp", device=device, seed=1)

        def unit() -> None:
            for _ in range(5):
                step()
        return unit
    import torch  # "gpu"

    a = torch.randn(4096, 4096, device=device)

    def unit() -> None:
        for _ in range(5):
            a.copy_(torch.tanh(a @ a * 1e-3))
        torch.cuda.synchronize()
    return unit


def _corunner_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetero_plugins.scheduler.profile_jobs",
                                     description="Run one interference co-runner until its parent dies.")
    parser.add_argument("name", choices=sorted(CORUNNERS | GPU_CORUNNERS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    alive = _die_with_parent()
    deadline = time.monotonic() + args.max_seconds
    made = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="hp_corunner_") if made else args.workdir)
    unit = _corunner_unit(args.name, args.device, workdir)
    unit()  # warm
    print("ready", flush=True)
    try:
        while alive() and time.monotonic() < deadline:
            unit()
    finally:
        for p in workdir.glob(f"io_{os.getpid()}.bin"):
            p.unlink(missing_ok=True)
        if made:
            try:
                workdir.rmdir()
            except OSError:
                pass
    return 0


def _main() -> Any:
    return _corunner_main()


if __name__ == "__main__":
    raise SystemExit(_main())
