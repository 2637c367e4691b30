"""Collectives for plain ``horovodrun`` / ``mpirun`` scripts: Horovod's own, or ``mpi4py``.

Both implement :class:`hetero_plugins.collectives.Collectives`.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import torch

from hetero_plugins._validation import check_choice
from hetero_plugins.collectives import CompletedHandle, ReduceHandle
from hetero_plugins.horovod.runtime import horovod_torch as _hvd

__all__ = ["HorovodExchange", "MPIExchange", "get_exchange"]

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


class HorovodExchange:
    """Collectives for the epoch-end statistics through Horovod (``hvd.allgather``, ``hvd.broadcast_object``).

    Every call names its tensors explicitly: Horovod matches collectives by name, and
    ``hvd.broadcast_object``'s default name (the object's type) differs between ranks whenever the root
    passes an object and the others ``None`` - a silent hang.
    """

    kind = "horovod"

    def __init__(self) -> None:
        self._store_host: str | None = None

    def rank(self) -> int:
        return int(_hvd().rank())

    def size(self) -> int:
        return int(_hvd().size())

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Stack every rank's ``array`` (same shape on all ranks) along a new leading rank axis."""
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64)).unsqueeze(0)
        return _hvd().allgather(t, name=name).numpy()

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        return _hvd().broadcast_object(obj, root_rank=root, name=name)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        return list(_hvd().allgather_object(obj, name=name))

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        hvd = _hvd()
        return hvd.allreduce(tensor, op=hvd.Sum, name=name)

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        hvd = _hvd()
        return _HorovodHandle(hvd, hvd.allreduce_async(tensor, op=hvd.Sum, name=name))

    def store_host(self) -> str:
        """Rank 0's host name, as every rank learns it (collective on first use)."""
        if self._store_host is None:
            self._store_host = self.broadcast_object(socket.gethostname(), name="hetero_plugins.store_host")
        return self._store_host


class MPIExchange:
    """The same collectives through ``mpi4py`` (for ``mpirun`` launches, where Horovod runs on MPI)."""

    kind = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD

    def rank(self) -> int:
        return int(self.comm.Get_rank())

    def size(self) -> int:
        return int(self.comm.Get_size())

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return np.stack(self.comm.allgather(np.asarray(array, dtype=np.float64)))

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return list(self.comm.allgather(obj))

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        from mpi4py import MPI

        buf = tensor.detach().cpu().numpy().copy()
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        tensor.copy_(torch.from_numpy(buf))
        return tensor

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        return CompletedHandle(self.allreduce_sum(tensor, name))

    def store_host(self) -> str:
        return self.comm.bcast(socket.gethostname(), root=0)


def get_exchange(kind: str = "auto") -> HorovodExchange | MPIExchange:
    """The collective backend for epoch statistics.

    Args:
        kind: ``"horovod"``, ``"mpi"`` (``mpi4py``) or ``"auto"``: Horovod under ``horovodrun`` (which sets
            ``HOROVOD_*`` variables), ``mpi4py`` under a bare ``mpirun`` when it is installed, else Horovod.

    Example::

        >>> get_exchange("horovod").kind
        'horovod'
    """
    check_choice("exchange", kind, ("auto", "horovod", "mpi"))
    if kind == "auto":
        under_horovodrun = any(k.startswith("HOROVOD_") for k in os.environ)
        under_mpirun = any(k in os.environ for k in _MPI_RANK_VARS)
        kind = "horovod"
        if under_mpirun and not under_horovodrun:
            try:
                import mpi4py  # noqa: F401

                kind = "mpi"
            except ImportError:
                kind = "horovod"
    return MPIExchange() if kind == "mpi" else HorovodExchange()


class _HorovodHandle:
    """``hvd.allreduce_async``'s handle as a :class:`~hetero_plugins.collectives.ReduceHandle`."""

    def __init__(self, hvd: Any, handle: Any) -> None:
        self._hvd, self._handle = hvd, handle

    def wait(self) -> torch.Tensor:
        return self._hvd.synchronize(self._handle)
