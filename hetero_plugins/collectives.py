"""The one seam between the engines and a transport: the collectives the balancing and aggregation engines use.

The engines (:mod:`hetero_plugins.balancing`, :mod:`hetero_plugins.aggregation`) never call a training
framework or ``torch.distributed`` themselves: they take an object that satisfies :class:`Collectives`. Three
transports implement it:

- :class:`TorchCollectives` here, over ``torch.distributed`` (what ``HeteroDDPStrategy`` runs on, gloo or NCCL);
- ``hetero_plugins.horovod.exchange.HorovodExchange`` and ``MPIExchange`` (``horovodrun`` / ``mpirun`` scripts
  and ``HeteroHorovodStrategy``);
- ``hetero_plugins.callbacks`` wraps any Lightning strategy's public ``all_gather`` / ``broadcast`` for the
  callbacks that run beside a stock strategy.

This module is the only one of the core that imports ``torch.distributed``. Every call carries a ``name``:
Horovod matches collectives by name, and the others ignore it.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

__all__ = [
    "Collectives",
    "CompletedHandle",
    "ReduceHandle",
    "TorchCollectives",
    "WorkHandle",
    "open_tcp_store",
]

T = TypeVar("T")


@runtime_checkable
class ReduceHandle(Protocol):
    """An all-reduce in flight: ``wait()`` blocks until it is done and returns the reduced tensor."""

    def wait(self) -> torch.Tensor: ...


class CompletedHandle:
    """A :class:`ReduceHandle` whose result is already known (wraps a synchronous collective)."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


class WorkHandle:
    """A ``torch.distributed`` ``Work`` (whose own ``wait()`` returns a bool) as a :class:`ReduceHandle`."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


@runtime_checkable
class Collectives(Protocol):
    """What the engines need from a transport. Every method is collective unless it says otherwise."""

    def rank(self) -> int:
        """This process's rank (not collective)."""
        ...

    def size(self) -> int:
        """The number of ranks (not collective)."""
        ...

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Every rank's ``array`` (same shape on all ranks), stacked along a new leading rank axis (float64)."""
        ...

    def broadcast_object(self, obj: T, name: str, root: int = 0) -> T:
        """``root``'s picklable ``obj`` on every rank."""
        ...

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The sum of ``tensor`` over ranks (``tensor`` may be summed in place)."""
        ...

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        """Start summing ``tensor`` over ranks; the handle's ``wait()`` returns the sum."""
        ...

    def store_host(self) -> str:
        """An address of rank 0's host that every rank can reach, for a key-value store rank 0 serves. Some
        transports learn it collectively, so every rank calls it."""
        ...


class TorchCollectives:
    """:class:`Collectives` over the default ``torch.distributed`` process group.

    Args:
        device: where tensors travel (``cuda`` under NCCL, ``cpu`` under gloo); arrays are moved there and back.
        main_address: rank 0's address as the launcher knows it (``MASTER_ADDR``); default this host's name.
    """

    kind = "torch"

    def __init__(self, device: torch.device | str = "cpu", main_address: str | None = None) -> None:
        self.device = torch.device(device)
        self.main_address = main_address

    def rank(self) -> int:
        import torch.distributed as dist

        return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0

    def size(self) -> int:
        import torch.distributed as dist

        return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        import torch.distributed as dist

        local = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64))
        if self.size() == 1:
            return local.numpy()[None].copy()
        local = local.to(self.device)
        out = [torch.empty_like(local) for _ in range(self.size())]
        dist.all_gather(out, local)
        return torch.stack(out).cpu().numpy()

    def broadcast_object(self, obj: T, name: str, root: int = 0) -> T:
        import torch.distributed as dist

        if self.size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=root, device=self.device if self.device.type == "cuda" else None)
        return box[0]  # type: ignore[return-value]

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        import torch.distributed as dist

        if self.size() > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        import torch.distributed as dist

        if self.size() == 1:
            return CompletedHandle(tensor)
        return WorkHandle(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True), tensor)

    def store_host(self) -> str:
        return self.main_address or socket.gethostname()


def open_tcp_store(comm: Collectives, timeout: float, name: str = "hetero_plugins.store") -> Any:
    """A ``torch.distributed.TCPStore`` served by rank 0 on a free port of ``comm.store_host()``; collective.

    Rank 0 starts the server, broadcasts its address through ``comm``, and every other rank connects as a
    client. ``timeout`` (seconds) bounds every store operation.
    """
    import torch.distributed as dist

    wait = timedelta(seconds=float(timeout))
    store, address = None, None
    host = comm.store_host()  # on every rank: Horovod's and MPI's transports learn rank 0's host collectively
    if comm.rank() == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=wait)
        address = (host, int(store.port))
    address = comm.broadcast_object(address, name=name)
    if store is None:
        store = dist.TCPStore(address[0], int(address[1]), is_master=False, timeout=wait)
    return store
