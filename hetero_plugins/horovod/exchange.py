"""Collectives for plain ``horovodrun`` / ``mpirun`` scripts: Horovod's own, or ``mpi4py``.

Both implement :class:`hetero_plugins.collectives.Collectives`. Horovod's collectives run asynchronously, and
``mpi4py``'s are MPI's non-blocking ones; both are polled against a deadline (``timeout``, default
``$HETERO_PLUGINS_TIMEOUT`` or 600 s), so a rank that never joins one ends the wait with a
:class:`~hetero_plugins.collectives.CollectiveError` naming the collective, like a failure Horovod reports (a
frozen rank stops Horovod's background loop after ``HOROVOD_GLOO_TIMEOUT_SECONDS``).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import sys
import time
from typing import Any

import numpy as np
import torch

from hetero_plugins._validation import check_choice
from hetero_plugins.collectives import CollectiveError, ReduceHandle, check_timeout, probe_silent, probe_window
from hetero_plugins.horovod.runtime import horovod_torch as _hvd

__all__ = ["HorovodExchange", "MPIExchange", "get_exchange"]

log = logging.getLogger(__name__)

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


class HorovodExchange:
    """Collectives for the epoch-end statistics and the aggregation modes through Horovod, each bounded in time.

    Every call names its tensors explicitly: Horovod matches collectives by name, and
    ``hvd.broadcast_object``'s default name (the object's type) differs between ranks whenever the root
    passes an object and the others ``None`` - a silent hang. Objects travel as pickled byte tensors (as in
    ``hvd.broadcast_object`` / ``hvd.allgather_object``), through the asynchronous collectives, so every wait
    is bounded.

    Args:
        timeout: seconds a collective may wait for the other ranks (default :func:`default_timeout`:
            ``$HETERO_PLUGINS_TIMEOUT``, else 600); past it, or when Horovod reports a failure, it raises
            :class:`~hetero_plugins.collectives.CollectiveError` naming the collective and the rank that did not
            answer: the other one of two; of more, the ranks that missed a liveness probe (:meth:`probe`). In an
            elastic job the error is also a ``HorovodInternalError``, so ``hvd.elastic.run`` still resets.
    """

    kind = "horovod"

    def __init__(self, timeout: float | None = None) -> None:
        self._store_host: str | None = None
        self.timeout = check_timeout(timeout)
        self._pending: list[Any] = []  # the MPI probe's open requests

    def rank(self) -> int:
        return int(_hvd().rank())

    def size(self) -> int:
        return int(_hvd().size())

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Stack every rank's ``array`` (same shape on all ranks) along a new leading rank axis."""
        hvd = _hvd()
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64)).unsqueeze(0)
        return self.wait(hvd.allgather_async(t, name=name), f"allgather {name!r}").numpy()

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        hvd = _hvd()
        mine = hvd.rank() == root
        data = _pickled(obj) if mine else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64)
        size = self.wait(hvd.broadcast_async_(size, root, name=f"{name}.sz"), f"broadcast {name!r}")
        if not mine:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        data = self.wait(hvd.broadcast_async_(data, root, name=f"{name}.t"), f"broadcast {name!r}")
        return obj if mine else pickle.loads(data.numpy().tobytes())

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        hvd = _hvd()
        data = _pickled(obj)
        sizes = self.wait(hvd.allgather_async(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz"),
                          f"allgather_object {name!r}")
        joined = self.wait(hvd.allgather_async(data, name=f"{name}.t"), f"allgather_object {name!r}").numpy()
        out, start = [], 0
        for n in sizes.tolist():
            out.append(pickle.loads(joined[start : start + int(n)].tobytes()))
            start += int(n)
        return out

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        hvd = _hvd()
        return self.wait(hvd.allreduce_async(tensor, op=hvd.Sum, name=name), f"allreduce {name!r}")

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        hvd = _hvd()
        return _HorovodHandle(self, hvd.allreduce_async(tensor, op=hvd.Sum, name=name), f"allreduce {name!r}")

    def store_host(self) -> str:
        """An address of rank 0 the other ranks reach, as every rank learns it (collective on first use): the
        address rank 0 reaches Horovod's rendezvous server from (the job's network), else its host name."""
        if self._store_host is None:
            mine = _address_towards(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")) or socket.gethostname()
            self._store_host = self.broadcast_object(mine, name="hetero_plugins.store_host")
        return self._store_host

    # ------------------------------------------------------------------ bounds
    def wait(self, handle: Any, operation: str) -> Any:
        """The result of Horovod's asynchronous ``handle``, waiting at most :attr:`timeout` seconds."""
        self.wait_all([handle], operation)
        return self._synchronize(handle, operation)

    def wait_all(self, handles: list[Any], operation: str) -> None:
        """Wait until every one of Horovod's ``handles`` is done (or failed), at most :attr:`timeout` seconds."""
        hvd = _hvd()
        deadline = time.monotonic() + self.timeout
        pause = 5e-5
        for handle in handles:
            while not hvd.poll(handle):
                if time.monotonic() > deadline:
                    raise self.failure(operation)
                time.sleep(pause)
                pause = min(2 * pause, 2e-3)

    def _synchronize(self, handle: Any, operation: str) -> Any:
        try:
            return _hvd().synchronize(handle)
        except RuntimeError as err:
            raise self.failure(operation, err) from err

    def failure(self, operation: str, err: BaseException | None = None) -> CollectiveError:
        """The error for ``operation`` that timed out (``err`` None) or failed with Horovod's ``err``; in an elastic
        job (or for Horovod's own failure) it is also a ``HorovodInternalError``, which ``hvd.elastic.run`` handles."""
        hvd = _hvd()
        rank, size = int(hvd.rank()), int(hvd.size())
        suspects: list[int] | None = [1 - rank] if size == 2 else None
        answered = None
        timeout = self.timeout if err is None else None
        cause = None if err is None else str(err)
        internal = _internal_error_type()
        elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        if size > 2 and (err is None or not elastic):  # an elastic job resets on Horovod's own failures at once
            suspects, answered = self.probe(operation)
            answered = [rank] if answered is None else answered  # no probe: say so, every other rank is suspect
        if internal is not None and (isinstance(err, internal) or (err is None and elastic)):
            return _HorovodCollectiveError(rank, operation, suspects or None, timeout=timeout, cause=cause,
                                           answered=answered)
        return CollectiveError(rank, operation, suspects or None, timeout=timeout, cause=cause, answered=answered)

    def probe(self, operation: str) -> tuple[list[int] | None, list[int] | None]:
        """After a failed collective: which other ranks are silent, and which answered (this one included), by a
        liveness probe of :func:`~hetero_plugins.collectives.probe_window` seconds at most
        (:func:`~hetero_plugins.collectives.probe_silent`), over the side channel the job has: the key-value
        store of Horovod's rendezvous server (``horovodrun --gloo``, served by the launcher, so it answers
        whichever rank froze), else MPI's point-to-point messages (Horovod on MPI, with ``mpi4py``).
        ``(None, None)`` where neither is there."""
        hvd = _hvd()
        rank, size, window = int(hvd.rank()), int(hvd.size()), probe_window(self.timeout)
        address = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        if address and port:
            try:
                return _rendezvous_probe(address, int(port), rank, size, window)
            except (OSError, ValueError) as err:
                log.warning("hetero_plugins: the liveness probe after %s could not reach Horovod's rendezvous "
                            "server at %s:%s (%s)", operation, address, port, err)
                return None, None
        try:
            mpi = bool(hvd.mpi_enabled())
            from mpi4py import MPI
        except (ImportError, AttributeError, ValueError):
            return None, None
        if not mpi or not MPI.Is_initialized():
            return None, None
        return _mpi_probe(MPI.COMM_WORLD, rank, size, window, self._pending)


class MPIExchange:
    """The same collectives through ``mpi4py`` (for ``mpirun`` launches, where Horovod runs on MPI), each bounded.

    Every collective is MPI's non-blocking one (``Iallreduce``, ``Iallgather``, ``Iallgatherv``, ``Ibcast``),
    its request tested against a deadline, so a rank that never joins ends the wait with a
    :class:`~hetero_plugins.collectives.CollectiveError` naming this rank, the collective and the rank that did
    not answer: the other one of two ranks; with more, the ranks that did not answer a liveness probe the
    survivors run over point-to-point messages (:func:`~hetero_plugins.collectives.probe_silent`). Objects
    travel pickled, as ``comm.bcast`` / ``comm.allgather`` send them.

    A collective given up on cannot be finished, and ``MPI_Finalize`` would wait for the missing rank at exit,
    so from then on the process ends the MPI job when it exits (``MPI_Abort`` with exit code 1, after Python's
    own exit handlers): ``mpirun`` then stops every rank, the frozen one included.

    Args:
        timeout: seconds a collective may wait for the other ranks (default :func:`default_timeout`:
            ``$HETERO_PLUGINS_TIMEOUT``, else 600).
        comm: the communicator (default ``MPI.COMM_WORLD``).
    """

    kind = "mpi"

    def __init__(self, timeout: float | None = None, comm: Any = None) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.timeout = check_timeout(timeout)
        self._pending: list[Any] = []  # buffers of requests given up on (MPI may still write into them)

    def rank(self) -> int:
        return int(self.comm.Get_rank())

    def size(self) -> int:
        return int(self.comm.Get_size())

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Stack every rank's ``array`` (same shape on all ranks) along a new leading rank axis."""
        mine = np.ascontiguousarray(array, dtype=np.float64)
        out = np.empty((self.size(), *mine.shape), dtype=np.float64)
        self.wait(self.comm.Iallgather(mine, out), f"allgather {name!r}", (mine, out))
        return out

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        mine = self.rank() == root
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if mine else np.empty(0, dtype=np.uint8)
        size = np.array([data.size if mine else 0], dtype=np.int64)
        self.wait(self.comm.Ibcast(size, root=root), f"broadcast {name!r}", size)
        if not mine:
            data = np.empty(int(size[0]), dtype=np.uint8)
        self.wait(self.comm.Ibcast(data, root=root), f"broadcast {name!r}", data)
        return obj if mine else pickle.loads(data.tobytes())

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        from mpi4py import MPI

        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        mine = np.array([data.size], dtype=np.int64)
        sizes = np.empty(self.size(), dtype=np.int64)
        self.wait(self.comm.Iallgather(mine, sizes), f"allgather_object {name!r}", (mine, sizes))
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        joined = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.wait(self.comm.Iallgatherv(data, [joined, sizes.tolist(), offsets.tolist(), MPI.BYTE]),
                  f"allgather_object {name!r}", (data, joined))
        return [pickle.loads(joined[o : o + n].tobytes()) for o, n in zip(offsets.tolist(), sizes.tolist())]

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.allreduce_sum_async(tensor, name).wait()

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        from mpi4py import MPI

        buf = np.ascontiguousarray(tensor.detach().cpu().numpy().copy())
        request = self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return _MPIHandle(self, request, buf, tensor, f"allreduce {name!r}")

    def store_host(self) -> str:
        return str(self.broadcast_object(socket.gethostname(), name="hetero_plugins.store_host"))

    # ------------------------------------------------------------------ bounds
    def wait(self, request: Any, operation: str, buffers: Any = None) -> None:
        """Wait for MPI's non-blocking ``request`` at most :attr:`timeout` seconds (``buffers``: what it reads and
        writes, kept alive if it is given up on)."""
        from mpi4py import MPI

        deadline = time.monotonic() + self.timeout
        pause = 5e-5
        while True:
            try:
                if request.Test():
                    return
            except MPI.Exception as err:  # a peer gone (mpi4py raises MPI's errors)
                self._pending.append((request, buffers))
                _abort_at_exit(self.comm)
                raise self.failure(operation, err) from err
            if time.monotonic() > deadline:
                self._pending.append((request, buffers))
                _abort_at_exit(self.comm)
                raise self.failure(operation)
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)

    def failure(self, operation: str, err: BaseException | None = None) -> CollectiveError:
        """The error for ``operation`` that timed out (``err`` None) or failed: it names the other rank of two;
        with more, the ranks that did not answer a liveness probe over point-to-point messages."""
        rank, size = self.rank(), self.size()
        suspects: list[int] | None = [1 - rank] if size == 2 else None
        answered = None
        if size > 2:
            suspects, answered = _mpi_probe(self.comm, rank, size, probe_window(self.timeout), self._pending)
            answered = [rank] if answered is None else answered
        return CollectiveError(rank, operation, suspects or None, timeout=self.timeout if err is None else None,
                               cause=None if err is None else str(err), answered=answered)


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
    """``hvd.allreduce_async``'s handle as a :class:`~hetero_plugins.collectives.ReduceHandle` (bounded wait)."""

    def __init__(self, exchange: HorovodExchange, handle: Any, operation: str) -> None:
        self._exchange, self._handle, self._operation = exchange, handle, operation

    def wait(self) -> torch.Tensor:
        return self._exchange.wait(self._handle, self._operation)  # type: ignore[no-any-return]


class _MPIHandle:
    """An ``Iallreduce`` in flight as a :class:`~hetero_plugins.collectives.ReduceHandle` (bounded wait); the sum
    lands in ``tensor``."""

    def __init__(self, exchange: MPIExchange, request: Any, buf: np.ndarray, tensor: torch.Tensor,
                 operation: str) -> None:
        self._exchange, self._request, self._buf, self._tensor = exchange, request, buf, tensor
        self._operation = operation

    def wait(self) -> torch.Tensor:
        self._exchange.wait(self._request, self._operation, self._buf)
        self._tensor.copy_(torch.from_numpy(self._buf))
        return self._tensor


_ABORTING: list[Any] = []


def _abort_at_exit(comm: Any) -> None:
    """Once a collective was given up on: abort the MPI job when Python exits (``MPI_Finalize`` would hang)."""
    if _ABORTING:
        return
    _ABORTING.append(comm)

    def abort() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep the job alive
                pass
        comm.Abort(1)

    atexit.register(abort)


#: The tag of the liveness probe's point-to-point messages (no collective of MPI uses tags).
_PROBE_TAG = 0x4850


def _mpi_probe(comm: Any, rank: int, size: int, window: float,
               keep: list[Any]) -> tuple[list[int] | None, list[int] | None]:
    """Who answers over ``comm``'s point-to-point messages within ``window`` seconds (``probe_silent``); the
    requests left open go to ``keep`` (MPI owns their buffers). ``(None, None)`` when MPI cannot send."""
    try:
        token = np.array([rank], dtype=np.int64)
        inbox = {r: np.empty(1, dtype=np.int64) for r in range(size) if r != rank}
        receives: dict[int, Any] = {}
        sends: list[Any] = []

        def announce() -> None:
            receives.update({r: comm.Irecv(buf, source=r, tag=_PROBE_TAG) for r, buf in inbox.items()})
            sends.extend(comm.Isend(token, dest=r, tag=_PROBE_TAG) for r in inbox)

        def heard() -> list[int]:
            return [r for r, request in receives.items() if request.Test()]

        silent, answered = probe_silent(rank, size, announce, heard, window)
        keep.append((token, inbox, list(receives.values()), sends))
        return silent, answered
    except Exception:  # noqa: BLE001 - no probe: the error says so instead of naming anyone
        return None, None


#: The scope of the liveness probe's keys in Horovod's rendezvous server (one key per rank that answered).
_PROBE_SCOPE = "hetero_plugins_alive"


def _rendezvous_probe(address: str, port: int, rank: int, size: int,
                      window: float) -> tuple[list[int], list[int]]:
    """:func:`probe_silent` over the key-value store of Horovod's rendezvous server: a rank answers by putting
    its key (the server clears its keys at every elastic rendezvous, so a key is this world's)."""
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    base = f"http://{address}:{port}/{_PROBE_SCOPE}"
    limit = max(1.0, min(3.0, window / 2))

    def announce() -> None:
        request = Request(f"{base}/{rank}", data=b"1", method="PUT")
        with urlopen(request, timeout=limit) as reply:
            reply.read()

    def present(r: int) -> bool:
        try:
            with urlopen(f"{base}/{r}", timeout=limit) as reply:
                reply.read()
                return True
        except HTTPError as err:
            if err.code == 404:
                return False
            raise

    def heard() -> list[int]:
        return [r for r in range(size) if r != rank and present(r)]

    return probe_silent(rank, size, announce, heard, window, poll=0.2)


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _address_towards(peer: str | None) -> str | None:
    """This host's address on the route to ``peer`` (no packet is sent), or ``None``."""
    if not peer:
        return None
    try:
        family = socket.getaddrinfo(peer, 1, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 1))
            return str(s.getsockname()[0])
    except OSError:
        return None


def _internal_error_type() -> type[BaseException] | None:
    try:
        from horovod.common.exceptions import HorovodInternalError
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return HorovodInternalError


_internal = _internal_error_type()
if _internal is not None:

    class _HorovodCollectiveError(CollectiveError, _internal):  # type: ignore[valid-type,misc]
        """A :class:`CollectiveError` that is also Horovod's ``HorovodInternalError`` (elastic jobs reset on it)."""

else:  # pragma: no cover - without Horovod no such error is raised
    _HorovodCollectiveError = CollectiveError  # type: ignore[misc,assignment]
