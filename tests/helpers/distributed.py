"""Run a function on N fresh gloo processes and collect each rank's result or traceback.

Fresh ``spawn`` processes per call contain rank-divergent failures; a bounded timeout turns a hang into a
test failure; the queue is drained before ``join`` so a large result cannot deadlock the child.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


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
    ctx = mp.get_context("spawn")
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
