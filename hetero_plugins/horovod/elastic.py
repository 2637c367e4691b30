"""Elastic Horovod: the sampler's state handler and the host-discovery file rewrite for relocations."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["move_host_slots", "register_state_handler"]


def move_host_slots(path: str, moves: Sequence[tuple[str, str]]) -> None:
    """Rewrite a host-discovery file (``host:slots`` lines): one slot fewer on each ``from`` host, one more on
    each ``to`` host (appended if new); hosts left with no slot are dropped. Replaced atomically."""
    order: list[str] = []
    slots: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            host, _, n = line.partition(":")
            if host not in slots:
                order.append(host)
                slots[host] = 0
            slots[host] += int(n or 1)
    for src, dst in moves:
        if slots.get(src, 0) > 0:
            slots[src] -= 1
        if dst not in slots:
            order.append(dst)
            slots[dst] = 0
        slots[dst] += 1
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{h}:{slots[h]}\n" for h in order if slots[h] > 0))
    os.replace(tmp, path)



_ELASTIC_REGISTERED = False


def register_state_handler(sampler_cls: Any) -> None:
    """Let ``hvd.elastic.TorchState`` commit, restore and sync a :class:`sampler_cls` (idempotent)."""
    global _ELASTIC_REGISTERED
    if _ELASTIC_REGISTERED:
        return
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:  # pragma: no cover - Horovod without elastic support
        return
    registry = elastic_state.get_handler_registry()
    if not any(t is sampler_cls for t, _ in registry):
        # Horovod's SamplerStateHandler deep-copies state_dict() on commit, loads it on restore, and
        # broadcasts rank 0's on sync; load_state_dict re-splits the epoch for a new world size.
        elastic_state.set_handler_registry([(sampler_cls, elastic_state.SamplerStateHandler), *registry])
    _ELASTIC_REGISTERED = True
