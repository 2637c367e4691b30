"""Collectives over any Lightning strategy, through its public ``all_gather`` / ``broadcast`` / ``reduce``.

The callbacks run beside strategies they do not own (stock ``"ddp"``, ``"ddp_spawn"``, the hetero strategies),
so they reach the other ranks only through the strategy's public collectives; this adapter gives those the
shape of :class:`hetero_plugins.collectives.Collectives`, which the balancing engine takes.
"""

from __future__ import annotations

import socket
from typing import Any, TypeVar

import numpy as np
import torch

from hetero_plugins.collectives import CompletedHandle, ReduceHandle

__all__ = ["StrategyCollectives"]

T = TypeVar("T")


class StrategyCollectives:
    """:class:`~hetero_plugins.collectives.Collectives` over a Lightning strategy's public API.

    Collective names are ignored (the strategy's own collectives match by call order). The sums are synchronous
    (``strategy.reduce(..., reduce_op="sum")``): the aggregation modes that overlap an all-reduce with compute
    use the strategies' own transports instead.

    Args:
        strategy: the Trainer's strategy (``trainer.strategy``).
    """

    kind = "lightning"

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def rank(self) -> int:
        return int(getattr(self.strategy, "global_rank", 0))

    def size(self) -> int:
        return int(getattr(self.strategy, "world_size", 1))

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        local = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64))
        out = self.strategy.all_gather(local.to(self.strategy.root_device))
        out = out.unsqueeze(0) if out.dim() == local.dim() else out  # returned as is without a process group
        return out.cpu().numpy()

    def broadcast_object(self, obj: T, name: str, root: int = 0) -> T:
        return self.strategy.broadcast(obj, src=root)  # type: ignore[no-any-return]

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.strategy.reduce(tensor, reduce_op="sum")  # type: ignore[no-any-return]

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        return CompletedHandle(self.allreduce_sum(tensor, name))

    def store_host(self) -> str:
        env = getattr(self.strategy, "cluster_environment", None)
        return str(env.main_address) if env is not None else socket.gethostname()
