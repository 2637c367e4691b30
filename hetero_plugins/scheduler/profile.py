"""``hetero-plugins profile-interference``: measure co-location slowdowns on this machine and write a table.

Stage 2 of the scheduler (Zhang, Geng, Ma, IEEE TPDS 2021, IAWP) predicts how much a co-runner slows a
training workload down. This module measures it: each workload of
:mod:`~hetero_plugins.scheduler.profile_jobs` (the NCF's users, optionally at several batch sizes) trains
in this process with one thread, and its per-step time is measured alone and beside each co-runner
(separate processes, optionally several copies: the co-runner's intensity). All co-runner processes are
started once, stopped (``SIGSTOP``) and only continued (``SIGCONT``) for their own windows; solo and shared
windows alternate (solo, shared with A, solo, shared with B, solo, ...; the co-runner order shuffled on
every repeat) and each shared window is compared with the mean of the solo windows on either side, which
cancels a drift of the machine's speed. The slowdown of a pair is the geometric mean of its repeats'
ratios. The result is the table of :mod:`hetero_plugins.scheduler.measured` (``format`` 1), with the
machine's description (CPU model, cores, load average, torch version, GPU name).

Co-runner processes are always killed: on return, on an error, on Ctrl-C and on ``SIGTERM``; on Linux the
kernel also kills them if this process dies, and each stops on its own after ``--max-seconds``.
Needs a POSIX system (``SIGSTOP`` / ``SIGCONT``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from hetero_plugins.progress import progress, set_quiet
from hetero_plugins.scheduler.profile_jobs import (
    CORUNNERS, DEFAULT_BATCH, GPU_CORUNNERS, WORKLOADS, build_workload, corunner_command, single_thread_env,
)

__all__ = ["describe_machine", "profile_interference", "profile_main"]

TABLE_FORMAT = 1


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(device: str = "cpu") -> dict[str, Any]:
    """What the table was measured on: CPU model, cores, memory, load, OS, Python, torch, numpy, GPU."""
    import torch

    out: dict[str, Any] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(),
                           "os": platform.platform(), "python": platform.python_version(),
                           "torch": torch.__version__, "numpy": np.__version__}
    if hasattr(os, "sched_getaffinity"):
        out["usable_cores"] = len(os.sched_getaffinity(0))
    try:
        out["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if hasattr(os, "getloadavg"):
        out["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    out["gpu"] = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None
    return out


def _resolve_device(device: str) -> str:
    import torch

    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"`device`={device!r} is not cpu, cuda or auto. HINT: e.g. device='auto'.")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("`device`='cuda' but torch sees no CUDA device. HINT: use device='cpu' or 'auto'.")
    return device


def _names(given: Sequence[str] | None, known: dict[str, str], what: str) -> list[str]:
    names = list(known) if given is None else [n for n in given if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"`{what}`={list(given or [])!r}: unknown or empty ({bad}). "
                         f"HINT: choose from {sorted(known)}.")
    return names


def _positive_ints(values: Sequence[int], what: str) -> list[int]:
    out = sorted({int(v) for v in values})
    if not out or out[0] < 1:
        raise ValueError(f"`{what}`={list(values)!r} must be integers >= 1. HINT: e.g. {what}=(1, 2).")
    return out


class _Corunners:
    """The co-runner processes: started once, stopped between their windows, always killed."""

    def __init__(self) -> None:
        self.procs: dict[str, list[subprocess.Popen[str]]] = {}
        self.logs: dict[int, Path] = {}

    def start(self, names: Sequence[str], copies: int, device: str, workdir: Path, max_seconds: float,
              timeout: float = 180.0) -> None:
        env = single_thread_env()
        for name in names:
            self.procs[name] = []
            for k in range(copies):
                log = workdir / f"corunner_{name}_{k}.log"  # a file: a chatty co-runner cannot fill a pipe
                with open(log, "w") as err:
                    p = subprocess.Popen(corunner_command(name, device, max_seconds, workdir), stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env, start_new_session=True)
                self.procs[name].append(p)
                self.logs[p.pid] = log
        deadline = time.monotonic() + timeout
        for name, procs in self.procs.items():
            for p in procs:
                self._wait_ready(name, p, deadline)
                os.kill(p.pid, signal.SIGSTOP)

    def _wait_ready(self, name: str, p: subprocess.Popen[str], deadline: float) -> None:
        assert p.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if p.poll() is not None:
                err = self.logs[p.pid].read_text(errors="replace")
                raise RuntimeError(
                    f"co-runner {name!r} exited with code {p.returncode} before it was ready: {err.strip()[-800:]}. "
                    f"HINT: run `python -m hetero_plugins.scheduler.profile_jobs {name} --max-seconds 5` to see why, "
                    f"or leave {name!r} out of `corunners`.")
            if left <= 0:
                raise RuntimeError(f"co-runner {name!r} was not ready within the start-up timeout. HINT: the machine "
                                   "may be overloaded; retry on a quieter machine or with fewer co-runners.")
            ready, _, _ = select.select([p.stdout], [], [], min(left, 1.0))
            if ready and p.stdout.readline().strip() == "ready":
                return

    def send(self, name: str, copies: int, sig: int) -> None:
        for p in self.procs[name][:copies]:
            if p.poll() is not None:
                raise RuntimeError(f"co-runner {name!r} (pid {p.pid}) exited early with code {p.returncode}. "
                                   "HINT: it stops after a time budget; lower --seconds / --repeats, or profile "
                                   "fewer workloads per run.")
            os.kill(p.pid, sig)

    def kill_all(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                if p.stdout is not None:
                    p.stdout.close()
        self.procs = {}


def _window(step: Any, seconds: float) -> float:
    """Mean seconds per step over a window of about ``seconds`` (at least two steps)."""
    n, t0 = 0, time.perf_counter()
    while True:
        step()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds and n >= 2:
            return dt / n


def profile_interference(workloads: Sequence[str] | None = None, corunners: Sequence[str] | None = None, *,
                         device: str = "cpu", seconds: float = 0.1, repeats: int = 10,
                         batch_scales: Sequence[int] = (1, 4), intensities: Sequence[int] = (1, 2), seed: int = 0,
                         note: str | None = None) -> dict[str, Any]:
    """Measure the slowdown of each workload beside each co-runner on this machine; return the table.

    Args:
        workloads: names from :data:`~hetero_plugins.scheduler.profile_jobs.WORKLOADS` (default: all).
        corunners: co-runner names (default: all for ``device``; ``"gpu"`` only on ``cuda``).
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda where torch sees one): where the workloads run.
        seconds: length of one measurement window (solo or shared), in seconds. Many short windows
            (0.1 s x 10 repeats) measured less noisily on a loaded machine than fewer long ones.
        repeats: measurements per (workload, co-runner) pair (each against its neighbouring solo windows).
        batch_scales: batch-size multiples of each workload's default batch; with more than one, each
            workload at each batch is its own row (``mlp_b128``, ``mlp_b512``).
        intensities: co-runner copies running at once; with more than one, ``compute_x2`` is two copies.
        seed: data, initialisation and window-order seed.
        note: free text stored in the machine description (e.g. the machine's load during the run).

    Returns:
        The table (``format`` 1) described in :mod:`hetero_plugins.scheduler.measured`.
    """
    import torch

    t_start = time.perf_counter()
    device = _resolve_device(device)
    wl = _names(workloads, WORKLOADS, "workloads")
    known = CORUNNERS | (GPU_CORUNNERS if device == "cuda" else {})
    cr = _names(corunners, known, "corunners")
    scales, levels = _positive_ints(batch_scales, "batch_scales"), _positive_ints(intensities, "intensities")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"`seconds`={seconds!r} must be > 0. HINT: e.g. seconds=0.5.")
    if repeats < 1:
        raise ValueError(f"`repeats`={repeats!r} must be >= 1. HINT: e.g. repeats=2.")
    if not hasattr(signal, "SIGSTOP"):
        raise RuntimeError("profile-interference needs POSIX signals (SIGSTOP/SIGCONT). "
                           "HINT: run it on Linux or macOS.")
    users = [(w, DEFAULT_BATCH[w] * s) for w in wl for s in scales]
    uname = {(w, b): (w if len(scales) == 1 else f"{w}_b{b}") for w, b in users}
    items = [(c, k) for c in cr for k in levels]
    iname = {(c, k): (c if k == 1 else f"{c}_x{k}") for c, k in items}
    windows = len(users) * repeats * (2 * len(items) + 1)
    budget = 20 * windows * seconds + 120 * len(users) + 1800  # a safety net: co-runners stop on their own
    machine = describe_machine(device)
    if note:
        machine["note"] = note
    rng = np.random.default_rng(seed)
    threads = torch.get_num_threads()
    ratios: dict[tuple[str, str], list[float]] = {}
    solo_t: dict[tuple[str, str], list[float]] = {}
    shared_t: dict[tuple[str, str], list[float]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="hp_interference_"))
    pool = _Corunners()
    settle = min(0.1, seconds / 4)
    try:
        torch.set_num_threads(1)
        pool.start(cr, max(levels), device, tmp, budget)
        bar = progress(total=windows, desc="profile-interference", unit="window")
        for w, b in users:
            step = build_workload(w, device=device, batch=b, seed=seed, workdir=tmp / f"data_{w}_{b}")
            _window(step, min(0.5, seconds))  # warm up
            for _ in range(repeats):
                before = _window(step, seconds)
                bar.update()
                for j in rng.permutation(len(items)):
                    c, k = items[j]
                    pool.send(c, k, signal.SIGCONT)
                    try:
                        time.sleep(settle)
                        shared = _window(step, seconds)
                    finally:
                        pool.send(c, k, signal.SIGSTOP)
                    after = _window(step, seconds)
                    bar.update(2)
                    key = (uname[(w, b)], iname[(c, k)])
                    solo = 0.5 * (before + after)
                    ratios.setdefault(key, []).append(shared / solo)
                    solo_t.setdefault(key, []).append(solo)
                    shared_t.setdefault(key, []).append(shared)
                    before = after
        bar.close()
    finally:
        pool.kill_all()
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    if hasattr(os, "getloadavg"):
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    rows = [{"workload": u, "device": device, "corunner": c, "solo_s": float(np.mean(solo_t[(u, c)])),
             "shared_s": float(np.mean(shared_t[(u, c)])),
             "slowdown": float(np.exp(np.mean(np.log(ratios[(u, c)])))), "repeats": repeats,
             "ratios": [round(r, 4) for r in ratios[(u, c)]]}
            for u in [uname[x] for x in users] for c in [iname[x] for x in items]]
    return {
        "format": TABLE_FORMAT, "machine": machine, "device": device,
        "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "settings": {"seconds": seconds, "repeats": repeats, "batch_scales": scales, "intensities": levels,
                     "seed": seed, "threads_per_job": 1, "runtime_s": round(time.perf_counter() - t_start, 1)},
        "workloads": {uname[(w, b)]: f"{WORKLOADS[w]}; batch {b}" for w, b in users},
        "corunners": {iname[(c, k)]: known[c] + ("" if k == 1 else f"; {k} copies") for c, k in items},
        "rows": rows,
    }


def _csv(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def _int_list(text: str, flag: str, example: str) -> list[int]:
    """``--batch-scales`` / ``--intensities``: comma-separated ints >= 1; ``ValueError`` naming ``flag``."""
    try:
        values = [int(x) for x in _csv(text) or []]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"`{flag}`={text!r} must be comma-separated integers >= 1. HINT: e.g. {flag} {example}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-plugins profile-interference", description=profile_main.__doc__)
    p.add_argument("--out", default=None, help="table JSON to write (default interference_<device>.json)")
    p.add_argument("--seconds", type=float, default=0.1, help="seconds per measurement window (solo or shared)")
    p.add_argument("--repeats", type=int, default=10, help="measurements per (workload, co-runner) pair")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto", help="where the workloads run")
    p.add_argument("--workloads", default=None, help=f"comma-separated, from {','.join(WORKLOADS)} (default all)")
    p.add_argument("--corunners", default=None,
                   help=f"comma-separated, from {','.join(CORUNNERS | GPU_CORUNNERS)} (default all; gpu only on cuda)")
    p.add_argument("--batch-scales", default="1,4", help="batch multiples per workload (one row each; 1: one)")
    p.add_argument("--intensities", default="1,2", help="co-runner copies at once (one row each; 1: one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default=None, help="free text for the machine description (e.g. other load)")
    p.add_argument("--from", dest="source", default=None, metavar="TABLE",
                   help="measure nothing: read this table (for --evaluate / --train-ncf)")
    p.add_argument("--evaluate", action="store_true",
                   help="leave-pairs-out: NCF vs additive baseline, mean relative error on held-out pairs")
    p.add_argument("--folds", type=int, default=0, help="--evaluate: folds of pairs (0: one pair per fold)")
    p.add_argument("--train-ncf", default=None, metavar="MODEL", help="train the NCF on the table, write MODEL (.npz)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def profile_main(argv: list[str] | None = None) -> int:
    """Measure training workloads' slowdowns beside co-runners on this machine and write the JSON table."""
    from hetero_plugins.scheduler import measured

    from hetero_plugins._files import check_output_path, write_atomic

    args = _parser().parse_args(argv)
    if args.source is not None and not os.path.isfile(args.source):
        print(f"error: --from {args.source!r} is not a file. HINT: write a table with `hetero-plugins "
              "profile-interference --out FILE`, or leave --from out to measure this machine.", file=sys.stderr)
        return 2
    if args.source is not None and not (args.evaluate or args.train_ncf):
        print(f"error: --from {args.source!r} measures nothing, and neither --evaluate nor --train-ncf was given, so "
              "there is nothing to do. HINT: add --evaluate and/or --train-ncf MODEL, or leave --from out to "
              "measure this machine.", file=sys.stderr)
        return 2
    if args.seed < 0:
        print(f"error: `--seed` must be an int >= 0, got {args.seed}. HINT: e.g. --seed 0", file=sys.stderr)
        return 2
    try:  # checked before the measurement, so a bad value or path is not found after it
        scales = _int_list(args.batch_scales, "--batch-scales", "1,4")
        levels = _int_list(args.intensities, "--intensities", "1,2")
        if args.source is None:
            check_output_path(args.out if args.out is not None else "interference_cpu.json", "--out")
        if args.train_ncf:
            check_output_path(args.train_ncf, "--train-ncf")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.quiet:
        set_quiet(True)
    try:  # SIGTERM runs the clean-up of the co-runners too (only the main thread may set handlers)
        old = signal.signal(signal.SIGTERM, _raise_exit)
    except ValueError:
        old = None
    try:
        if args.source is not None:
            table = measured.load_table(args.source)
        else:
            table = profile_interference(
                _csv(args.workloads), _csv(args.corunners), device=args.device, seconds=args.seconds,
                repeats=args.repeats, batch_scales=scales, intensities=levels, seed=args.seed, note=args.note)
            table["settings"]["command"] = "hetero-plugins profile-interference " + " ".join(argv or sys.argv[2:])
            out = Path(args.out or f"interference_{table['device']}.json")
            measured.validate_table(table, str(out))
            write_atomic(out, json.dumps(table, indent=1) + "\n")
            print(measured.format_table(table))
            print(f"wrote {out} ({table['settings']['runtime_s']:.0f} s)", file=sys.stderr)
        if args.evaluate:
            ev = measured.leave_pairs_out(table, folds=args.folds or None)
            print(json.dumps({k: v for k, v in ev.items() if k != "pairs"}, indent=1))
        if args.train_ncf:
            _, stats = measured.train_ncf(table, out=args.train_ncf)
            print(json.dumps(stats, indent=1))
            print(f"wrote {args.train_ncf}", file=sys.stderr)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a co-runner failed; they are all killed by now
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return 0


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
