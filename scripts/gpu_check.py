"""GPU check: what hetero_plugins does on one NVIDIA GPU, in under five minutes, as a table.

    python scripts/gpu_check.py            # or: make gpu-check

Checks (each in its own process, each process under ``timeout -k 5 N``: a stock DDP run under MPS once
hung and ignored SIGTERM):

1. NVML under load: :class:`~hetero_plugins.telemetry.UtilisationSampler` averages utilisation and memory while
   matrix products run; passes when the mean utilisation is above zero (a single reading at the end, what the
   epoch-end snapshot used to report, is shown beside it).
2. One-GPU training over NCCL with ``hetero_ddp``.
3. Two ranks sharing the GPU as two Lightning nodes on one host (``MASTER_ADDR``/``MASTER_PORT``,
   ``WORLD_SIZE=2``, ``NODE_RANK``, ``LOCAL_RANK=0``; ``devices=1``, ``num_nodes=2``, gloo) at emulated speeds
   1 and 0.25: stock ``ddp``, then ``hetero_ddp`` with ``weighted`` and ``wbsp`` aggregation; the speed-up over
   stock DDP is compared with the ideal 2.5x (equal split: the slow rank's half; balanced: B / 1.25).
4. The memory cap from real peak memory: peaks measured at two batch sizes, the cap extrapolated from the
   smaller (:func:`~hetero_plugins.telemetry.memory_cap`) and its per-sample cost checked against the larger.
5. Where ``nvidia-cuda-mps-control`` exists: an MPS daemon of its own (private pipe and log directories), two
   nodes with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` 100 and 25 (real, not emulated, speeds), stock ``ddp``
   against ``hetero_ddp``, on a matrix-product model.

Without an NVIDIA GPU (no ``nvidia-smi``, no GPU listed, or a torch without CUDA) it says so and exits 0.
The exit status is 1 when a check fails or times out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEEDS = (1.0, 0.25)


# -- detection ------------------------------------------------------------------------------------------------


def gpu_present() -> tuple[bool, str]:
    """Whether this machine has an NVIDIA GPU that torch can use, and what was found."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False, "no nvidia-smi on PATH (no NVIDIA driver)"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"nvidia-smi -L failed ({err})"
    gpus = [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]
    if listed.returncode != 0 or not gpus:
        return False, f"nvidia-smi lists no GPU ({(listed.stderr or listed.stdout).strip()[:200]})"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, f"{gpus[0]} is listed, but torch {torch.__version__} cannot use CUDA"
    return True, gpus[0]


# -- workers (run in their own processes) ---------------------------------------------------------------------


def _emit(result: dict[str, Any]) -> None:
    print("GPU-CHECK-RESULT " + json.dumps(result), flush=True)


def worker_nvml(seconds: float) -> None:
    import torch

    from hetero_plugins.telemetry import SystemMonitor, UtilisationSampler

    sampler = UtilisationSampler(gpu_index=0, interval=0.1)
    if not sampler.active:
        _emit({"ok": False, "detail": "NVML could not be opened (nvidia-ml-py installed? driver?)"})
        return
    x = torch.randn(4096, 4096, device="cuda")
    sampler.start()
    end = time.time() + seconds
    while time.time() < end:
        y = x @ x
        torch.cuda.synchronize()
    sampler.stop()
    means = sampler.epoch_means()
    del y
    torch.cuda.synchronize()
    snapshot = SystemMonitor(0).read()
    util = means.get("gpu_util", 0.0)
    _emit({"ok": util > 0 and means.get("samples", 0) >= 5,
           "detail": f"mean utilisation {util:.0f}% over {means.get('samples', 0)} readings, memory used "
                     f"{means.get('gpu_mem_used_max', 0) / 2**30:.2f} GiB at most; one reading after the load: "
                     f"{snapshot.get('gpu_util', float('nan')):.0f}%"})


class _MatmulMLP:
    """A compute-bound model (matrix products dominate) for the MPS check; built lazily (imports torch)."""

    @staticmethod
    def build(batch_size: int) -> Any:
        import lightning.pytorch as pl
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        class MatmulMLP(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                         nn.Linear(4096, 10))

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                x, y = batch
                return nn.functional.cross_entropy(self.net(x), y)

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

            def train_dataloader(self) -> Any:
                g = torch.Generator().manual_seed(0)
                data = TensorDataset(torch.randn(8192, 1024, generator=g), torch.randint(0, 10, (8192,), generator=g))
                return DataLoader(data, batch_size=batch_size, shuffle=True)

        return MatmulMLP()


class _EpochTimes:
    """Wall time of every training epoch (a Lightning callback; built lazily)."""

    @staticmethod
    def build() -> Any:
        from lightning.pytorch.callbacks import Callback

        class EpochTimes(Callback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self._t0 = 0.0

            def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
                self._t0 = time.perf_counter()

            def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
                self.times.append(time.perf_counter() - self._t0)

        return EpochTimes()


def worker_train(strategy: str, aggregation: str, backend: str, nodes: int, epochs: int, model: str,
                 emulate: bool, accelerator: str = "gpu") -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from hetero_plugins.apps.digits import DigitsCNN
    from hetero_plugins.callbacks import HeterogeneityEmulator
    from hetero_plugins.strategies import HeteroDDPStrategy

    timer = _EpochTimes.build()
    callbacks: list[Any] = [timer]
    if emulate:
        callbacks.append(HeterogeneityEmulator(list(SPEEDS[:nodes]), cost_per_sample=0.002))
    if strategy == "ddp":
        strat: Any = DDPStrategy(process_group_backend=backend)
    else:
        strat = HeteroDDPStrategy(process_group_backend=backend, aggregation=aggregation, relocation=False)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, num_nodes=nodes, strategy=strat, max_epochs=epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=callbacks, default_root_dir=tempfile.mkdtemp(prefix="gpu-check-"))
    net = DigitsCNN(batch_size=64) if model == "digits" else _MatmulMLP.build(batch_size=256)
    trainer.fit(net)
    if trainer.is_global_zero:
        plan = getattr(trainer.strategy, "batch_plan", None)
        history = getattr(trainer.strategy, "plan_history", None) or []
        system = [h.get("system") for h in history if h.get("system")]
        device = torch.cuda.get_device_name(0) if accelerator == "gpu" else accelerator
        _emit({"ok": trainer.state.finished and len(timer.times) == epochs, "epoch_times": timer.times,
               "plan": plan, "device": device, "system": system[-1:]})


def worker_memory_cap(small: int, large: int) -> None:
    import torch
    from torch import nn

    from hetero_plugins.telemetry import memory_cap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).cuda()
    total = torch.cuda.get_device_properties(0).total_memory

    def peak(batch: int) -> tuple[int, int]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        x = torch.randn(batch, 3, 128, 128, device="cuda")
        model(x).sum().backward()
        torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated()
        del x
        model.zero_grad(set_to_none=True)
        return base, out

    peak(small)  # warm-up: cuDNN workspaces, allocator pools
    base, p_small = peak(small)
    _, p_large = peak(large)
    cap = memory_cap(small, p_small, base, total)
    per_small = (p_small - base) / small
    per_large = (p_large - base) / large
    ok = abs(per_large / per_small - 1) < 0.25
    _emit({"ok": ok, "detail": f"peak {p_small / 2**20:.0f} MiB at batch {small}, {p_large / 2**20:.0f} MiB at "
                               f"{large}; per sample {per_small / 2**20:.2f} vs {per_large / 2**20:.2f} MiB; cap "
                               f"{cap} samples in 90% of {total / 2**30:.0f} GiB"})


def worker_step_timer() -> None:
    """``StepTimer`` with CUDA events against a synchronised wall-clock reference, at two batch sizes."""
    import statistics

    import torch

    from hetero_plugins.telemetry import StepTimer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
    timer = StepTimer(device="cuda:0")
    for p in model.parameters():
        p.register_hook(lambda g: (timer.mark_gradients_ready(), g)[1])

    def step(b: int) -> float:
        x = torch.randn(b, 2048, device="cuda")
        timer.start_step(b)
        model(x).sum().backward()
        rec = timer.end_step()
        model.zero_grad(set_to_none=True)
        return rec.compute_time  # the host's stamps (what the timer measured before it used events)

    def reference(b: int) -> float:
        x = torch.randn(b, 2048, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(x).sum().backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for b in (2048, 8192):
        step(b), reference(b)  # warm-up
    timer.pop_records()
    rows, ok = [], True
    for b in (2048, 8192):
        host = [step(b) for _ in range(8)]
        events = [r.compute_time for r in timer.pop_records()]
        ref = [reference(b) for _ in range(8)]
        h, e, r = statistics.median(host), statistics.median(events), statistics.median(ref)
        ok = ok and abs(e / r - 1) < 0.25
        rows.append(f"batch {b}: events {e * 1e3:.1f} ms, synchronised {r * 1e3:.1f} ms, host stamps {h * 1e3:.1f} ms")
    _emit({"ok": ok, "detail": "; ".join(rows)})


# -- orchestration --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str], timeout: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = ["timeout", "-k", "5", str(timeout), sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})


def _collect(procs: list[subprocess.Popen[str]], timeout: int) -> dict[str, Any]:
    """The result line of the first process (rank 0), or why there is none."""
    outputs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout + 15)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out or "")
        codes.append(p.returncode)
    for line in outputs[0].splitlines():
        if line.startswith("GPU-CHECK-RESULT "):
            return json.loads(line[len("GPU-CHECK-RESULT "):])
    if any(c in (124, 137) for c in codes):
        return {"ok": False, "timeout": True, "detail": f"timed out after {timeout} s (exit codes {codes})"}
    tail = " | ".join(outputs[0].strip().splitlines()[-3:])[-300:]
    return {"ok": False, "detail": f"exit codes {codes}: {tail}"}


def _nodes(args: list[str], timeout: int, extra_env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """Two processes as two Lightning nodes with one device each, on this host."""
    port = str(_free_port())
    procs = []
    for r in range(2):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "NODE_RANK": str(r),
               "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        env.update((extra_env or [{}, {}])[r])
        procs.append(_run(args, timeout, env))
    return _collect(procs, timeout)


def _steady(times: list[float]) -> float:
    rest = times[1:] or times
    return sum(rest) / len(rest)


def _mps(timeout: int, rows: list[tuple[str, str, str]]) -> None:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        rows.append(("MPS: stock ddp vs hetero_ddp at 100% / 25% SMs", "SKIP", "no nvidia-cuda-mps-control"))
        return
    tmp = tempfile.mkdtemp(prefix="gpu-check-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{tmp}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{tmp}/log"}
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
    full_env = {**os.environ, **env}
    started = subprocess.run(["timeout", "-k", "5", "20", control, "-d"], env=full_env, capture_output=True, text=True)
    if started.returncode != 0:
        rows.append(("MPS: stock ddp vs hetero_ddp at 100% / 25% SMs", "SKIP",
                     f"could not start an MPS daemon: {(started.stderr or started.stdout).strip()[:200]}"))
        return
    try:
        shares = [{**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"},
                  {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}]
        results = {}
        for strategy in ("ddp", "hetero_ddp"):
            results[strategy] = _nodes(["train", "--strategy", strategy, "--aggregation", "weighted", "--backend",
                                        "gloo", "--nodes", "2", "--epochs", "3", "--model", "matmul"], timeout, shares)
        for strategy, res in results.items():
            status = "PASS" if res.get("ok") else ("TIMEOUT" if res.get("timeout") else "FAIL")
            detail = res.get("detail") or (f"steady epoch {_steady(res['epoch_times']):.2f} s, plan {res.get('plan')}")
            rows.append((f"MPS 100% / 25% SMs: {strategy}", status, detail))
        if results["ddp"].get("ok") and results["hetero_ddp"].get("ok"):
            speedup = _steady(results["ddp"]["epoch_times"]) / _steady(results["hetero_ddp"]["epoch_times"])
            rows.append(("MPS: hetero_ddp vs stock ddp", "INFO", f"{speedup:.2f}x faster per epoch"))
    finally:
        subprocess.run(["timeout", "-k", "5", "20", control], input="quit\n", env=full_env, capture_output=True,
                       text=True)


def main_check(timeout: int) -> int:
    present, what = gpu_present()
    if not present:
        print(f"No usable NVIDIA GPU on this machine: {what}. Nothing to check; exiting 0.")
        return 0
    print(f"GPU: {what}. Checks run in separate processes, each under `timeout -k 5 {timeout}`.", flush=True)
    t0 = time.time()
    rows: list[tuple[str, str, str]] = []

    def status(res: dict[str, Any]) -> str:
        return "PASS" if res.get("ok") else ("TIMEOUT" if res.get("timeout") else "FAIL")

    res = _collect([_run(["nvml", "--seconds", "4"], timeout)], timeout)
    rows.append(("NVML under load (epoch mean)", status(res), res.get("detail", "")))

    single = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    res = _collect([_run(["train", "--strategy", "hetero_ddp", "--backend", "nccl", "--nodes", "1", "--epochs", "2",
                          "--model", "digits"], timeout, single)], timeout)
    means = f"; epoch means {res['system'][-1]}" if res.get("system") else ""
    rows.append(("one GPU, NCCL, hetero_ddp", status(res),
                 res.get("detail") or f"epochs {[round(t, 2) for t in res.get('epoch_times', [])]} s on "
                                      f"{res.get('device')}{means}"))

    shared: dict[str, dict[str, Any]] = {}
    for strategy, agg in (("ddp", "weighted"), ("hetero_ddp", "weighted"), ("hetero_ddp", "wbsp")):
        name = "ddp" if strategy == "ddp" else f"hetero_ddp/{agg}"
        shared[name] = res = _nodes(["train", "--strategy", strategy, "--aggregation", agg, "--backend", "gloo",
                                     "--nodes", "2", "--epochs", "4", "--model", "digits", "--emulate"], timeout)
        detail = res.get("detail") or f"steady epoch {_steady(res['epoch_times']):.2f} s, plan {res.get('plan')}"
        rows.append((f"2 nodes on 1 GPU (gloo), speeds {SPEEDS}: {name}", status(res), detail))
    if shared["ddp"].get("ok"):
        base = _steady(shared["ddp"]["epoch_times"])
        for name in ("hetero_ddp/weighted", "hetero_ddp/wbsp"):
            if shared[name].get("ok"):
                speedup = base / _steady(shared[name]["epoch_times"])
                rows.append((f"  {name} vs stock ddp", "INFO", f"{speedup:.2f}x faster ({speedup / 2.5:.2f} of the "
                                                                f"ideal 2.5x)"))

    res = _collect([_run(["steptimer"], timeout)], timeout)
    rows.append(("step timer on CUDA (events vs synchronised)", status(res), res.get("detail", "")))

    res = _collect([_run(["memcap", "--small", "32", "--large", "128"], timeout)], timeout)
    rows.append(("memory cap from real peak memory", status(res), res.get("detail", "")))

    _mps(timeout, rows)

    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  result   detail")
    print(f"{'-' * width}  -------  ------")
    for name, st, detail in rows:
        print(f"{name:<{width}}  {st:<7}  {detail}")
    print(f"\n{time.time() - t0:.0f} s in all.")
    return 1 if any(st in ("FAIL", "TIMEOUT") for _, st, _ in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=int, default=75, help="seconds each process may run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=4.0, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="hetero_ddp", help=argparse.SUPPRESS)
    parser.add_argument("--aggregation", default="weighted", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="digits", help=argparse.SUPPRESS)
    parser.add_argument("--emulate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--accelerator", default="gpu", help=argparse.SUPPRESS)
    parser.add_argument("--small", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--large", type=int, default=128, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        return main_check(args.timeout)
    if args.worker == "nvml":
        worker_nvml(args.seconds)
    elif args.worker == "train":
        worker_train(args.strategy, args.aggregation, args.backend, args.nodes, args.epochs, args.model, args.emulate,
                     args.accelerator)
    elif args.worker == "steptimer":
        worker_step_timer()
    elif args.worker == "memcap":
        worker_memory_cap(args.small, args.large)
    else:
        parser.error(f"unknown worker {args.worker!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
