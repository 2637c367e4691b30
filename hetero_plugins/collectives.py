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

Every collective and store operation is bounded in time. A rank that freezes or dies must not leave the others
waiting forever, and the error should say who and what: a failed or timed-out operation raises
:class:`CollectiveError`, which names this rank, the operation and, where it can be told, the rank that did
not answer. A ``torch.distributed`` store client cannot bound all of its operations itself (an ``add`` against
a stopped server waits forever), so :class:`BoundedStore` runs each on a watchdog thread with a deadline.
:func:`open_store` gives the engines a store whose keys live under a per-job secret, on the job's own
rendezvous store where there is one (no second listener), else on one rank 0 serves on the job's address.
:class:`Liveness` lets a rank tell, after a collective failed, which ranks stopped beating (the
reasoning of PyTorch's ``TORCH_NCCL_DUMP_ON_TIMEOUT`` and Horovod's stall inspector: name the missing rank).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "BoundedStore",
    "CollectiveError",
    "Collectives",
    "CompletedHandle",
    "Liveness",
    "ReduceHandle",
    "TorchCollectives",
    "WorkHandle",
    "default_timeout",
    "is_transport_failure",
    "open_store",
    "open_tcp_store",
]

T = TypeVar("T")

#: Seconds a collective or store operation may take before it is given up (the strategies' default, 10 minutes).
DEFAULT_TIMEOUT = 600.0
#: Environment variable with that bound in seconds for ``horovodrun`` / ``mpirun`` scripts (no strategy there).
TIMEOUT_ENV = "HETERO_PLUGINS_TIMEOUT"


def default_timeout() -> float:
    """The bound on collectives where no strategy sets one: ``$HETERO_PLUGINS_TIMEOUT`` seconds, else 600.

    Example::

        >>> default_timeout() > 0
        True
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw in (None, ""):
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds. HINT: e.g. {TIMEOUT_ENV}=600.")
    return value


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _gist(text: str) -> str:
    """The transport error's telling line (gloo and Horovod wrap theirs in several lines and source paths)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = next((ln for ln in lines if any(w in ln.lower() for w in _TRANSPORT_WORDS)), lines[0] if lines else "")
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|py):\d+\]\s*", "", line)
    return line[-300:]


class CollectiveError(RuntimeError):
    """A collective or store operation failed or ran past its deadline: a rank froze, died or is unreachable.

    Args:
        rank: this rank (the one that gave up).
        operation: what it was doing, e.g. ``"all_reduce 'hetero_plugins.aggregation.deadline'"``.
        suspects: the ranks that did not answer, where they can be told (``None``: unknown).
        timeout: the deadline that passed, in seconds (``None``: the operation failed before it).
        cause: the transport's own error text.

    Example::

        >>> str(CollectiveError(1, "store add('k')", [0], timeout=10.0)).split(":")[1].strip()
        "rank 1 gave up on store add('k') after 10 s"
    """

    def __init__(self, rank: int, operation: str, suspects: Sequence[int] | None = None,
                 timeout: float | None = None, cause: str | None = None) -> None:
        self.rank, self.operation, self.timeout, self.cause = rank, operation, timeout, cause
        self.suspects = None if suspects is None else [int(r) for r in suspects]
        what = (f"rank {rank} gave up on {operation} after {timeout:g} s" if timeout is not None
                else f"{operation} failed on rank {rank}")
        who = (f"{_ranks(self.suspects)} did not answer (frozen, dead or unreachable)" if self.suspects
               else "another rank did not answer (frozen, dead, unreachable, or in a different collective)")
        detail = f" [{_gist(cause)}]" if cause and cause.strip() else ""
        super().__init__(
            f"hetero_plugins: {what}: {who}.{detail} HINT: look at that rank's log and host (a stopped, killed or "
            "swapped-out process); if it is only slow, raise the bound: the strategy's `timeout`, or "
            f"{TIMEOUT_ENV} (seconds) for horovodrun scripts."
        )


_TRANSPORT_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                    "connection refused", "horovod has been shut down", "socket", "peer", "nccl")


def is_transport_failure(err: BaseException) -> bool:
    """Whether ``err`` is a transport's failure (a peer gone, a deadline passed), not a bug in the caller."""
    if isinstance(err, (CollectiveError, TimeoutError, ConnectionError)):
        return True
    try:
        import torch.distributed as dist

        if isinstance(err, dist.DistError):
            return True
    except (ImportError, AttributeError):  # pragma: no cover - torch without distributed
        pass
    if type(err).__name__ == "HorovodInternalError":
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(w in text for w in _TRANSPORT_WORDS)


class _Watchdog:
    """Runs blocking calls on one daemon thread while the caller waits at most a deadline.

    A call that passes its deadline is abandoned (a thread blocked in C++ cannot be interrupted); the thread
    stays blocked on it, so every later call fails at once. Daemon: a blocked thread never holds up exit.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.stuck: str | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                box["error"] = err
            done.set()

    def call(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        """``fn()``'s result or exception; ``TimeoutError`` once ``timeout`` seconds pass."""
        with self._lock:
            if self.stuck is not None:
                raise TimeoutError(f"still waiting on {self.stuck}")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        box: dict[str, Any] = {}
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(timeout):
            with self._lock:
                self.stuck = what
            raise TimeoutError(f"{what} did not return within {timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]  # type: ignore[no-any-return]


class BoundedStore:
    """A ``torch.distributed`` store whose every operation ends within ``timeout`` seconds.

    Each operation runs on a watchdog thread; past the deadline, or when the connection breaks, it raises
    :class:`CollectiveError` naming this rank, the operation and the rank that serves the store.

    Args:
        store: the store (a ``TCPStore``, ``PrefixStore``, ... or anything with the same methods).
        timeout: seconds each operation may take.
        rank: this rank.
        owner: the rank whose process serves the store (``None``: the launcher serves it, e.g. torchrun's agent).
        address: ``(host, port)`` of the server, for the messages and for tests.
        label: how messages name the store.
    """

    def __init__(self, store: Any, timeout: float, rank: int, owner: int | None = 0,
                 address: tuple[str, int] | None = None, label: str = "store") -> None:
        self.store, self.timeout, self.rank, self.owner = store, float(timeout), int(rank), owner
        self.address = address
        self.label = label
        self._watchdog = _Watchdog(f"hetero_plugins.{label}")

    def _where(self) -> str:
        at = f" at {self.address[0]}:{self.address[1]}" if self.address else ""
        who = f"served by rank {self.owner}" if self.owner is not None else "served by the launcher"
        return f"{self.label} ({who}{at})"

    def call(self, op: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` (an operation on :attr:`store`, described by ``op``) under the deadline."""
        limit = self.timeout if timeout is None else float(timeout)
        suspects = [self.owner] if self.owner is not None and self.owner != self.rank else None
        try:
            return self._watchdog.call(fn, limit, op)
        except TimeoutError as err:
            raise CollectiveError(self.rank, f"{op} on the {self._where()}", suspects, timeout=limit) from err
        except CollectiveError:
            raise
        except RuntimeError as err:
            if not is_transport_failure(err):
                raise
            raise CollectiveError(self.rank, f"{op} on the {self._where()}", suspects, cause=str(err)) from err

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        return int(self.call(f"add({key!r})", lambda: self.store.add(key, int(amount)), timeout))

    def set(self, key: str, value: str | bytes) -> None:
        self.call(f"set({key!r})", lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        return self.call(f"get({key!r})", lambda: self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        return bool(self.call(f"check({keys!r})", lambda: self.store.check(list(keys))))

    def delete_key(self, key: str) -> bool:
        return bool(self.call(f"delete_key({key!r})", lambda: self.store.delete_key(key)))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.call(f"compare_set({key!r})", lambda: self.store.compare_set(key, expected, desired))

    def num_keys(self) -> int:
        return int(self.call("num_keys()", lambda: self.store.num_keys()))


class Liveness:
    """Every rank bumps a counter in a shared store every ``period`` seconds; after a collective failed,
    :meth:`silent` names the ranks whose counters stood still (frozen or dead), or the store's owner when the
    store itself does not answer.

    Args:
        store: a :class:`BoundedStore` every rank opened alike (:func:`open_store`).
        size: the number of ranks.
        period: seconds between beats.
    """

    def __init__(self, store: BoundedStore, size: int, period: float) -> None:
        self.store, self.size, self.period = store, int(size), float(period)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int) -> str:
        return f"alive/{rank}"

    def start(self) -> Liveness:
        """Beat from a daemon thread until :meth:`stop` (or until the store fails)."""
        if self._thread is None:
            self.store.add(self._key(self.store.rank), 1)

            def beat() -> None:
                while not self._stop.wait(self.period):
                    try:
                        self.store.add(self._key(self.store.rank), 1)
                    except Exception:  # noqa: BLE001 - a dead store ends the beats; silent() reports it
                        return

            self._thread = threading.Thread(target=beat, name="hetero_plugins.liveness", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def silent(self) -> list[int] | None:
        """The other ranks that did not beat over the next ~2.5 periods (``None``: none found)."""
        rank, limit = self.store.rank, max(5.0, 2 * self.period)
        try:
            first = [self.store.add(self._key(r), 0, timeout=limit) for r in range(self.size)]
            time.sleep(2.5 * self.period)
            second = [self.store.add(self._key(r), 0, timeout=limit) for r in range(self.size)]
        except CollectiveError:
            owner = self.store.owner
            return [owner] if owner is not None and owner != rank else None
        quiet = [r for r in range(self.size) if r != rank and second[r] <= first[r]]
        return quiet or None


def _names_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str) -> tuple[socket.socket, str]:
    """A listening socket on ``host``'s address (not every interface), and the address clients connect to.

    A host name that resolves to a loopback address on its own host (``127.0.1.1`` for the machine's name on
    some distributions) may still be reached from other hosts under another address, so it listens on every
    interface then; the keys are protected by the secret namespace of :func:`open_store` either way.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        ip = str(sockaddr[0])
    except OSError:
        family, ip = socket.AF_INET, ""
    if ip and ipaddress.ip_address(ip).is_loopback and not _names_loopback(host):
        ip = ""
    sock = socket.socket(family if ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, 0))
    sock.listen(128)
    return sock, ip or host


def open_tcp_store(comm: Collectives, timeout: float, name: str = "hetero_plugins.store") -> Any:
    """A ``torch.distributed.TCPStore`` served by rank 0 on ``comm.store_host()``'s address; collective.

    Rank 0 listens on the address ``comm.store_host()`` resolves to (not every interface), broadcasts it
    through ``comm``, and every other rank connects as a client. The raw store's own ``timeout`` bounds
    ``get``/``wait`` only; :func:`open_store` bounds every operation and adds a secret key namespace.
    """
    store, _ = _open_tcp(comm, timeout, name, payload=None)
    return store


def _open_tcp(comm: Collectives, timeout: float, name: str, payload: Any) -> tuple[Any, tuple[Any, tuple[str, int]]]:
    import torch.distributed as dist

    wait = timedelta(seconds=float(timeout))
    store, message = None, None
    host = comm.store_host()  # on every rank: Horovod's and MPI's transports learn rank 0's host collectively
    if comm.rank() == 0:
        sock, address = _listen(host)
        port = int(sock.getsockname()[1])
        store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=wait,
                              master_listen_fd=sock.detach())
        message = (payload, (address, port))
    message = comm.broadcast_object(message, name=name)
    address = message[1]
    if store is None:
        watchdog = _Watchdog("hetero_plugins.store.connect")
        try:
            store = watchdog.call(lambda: dist.TCPStore(address[0], int(address[1]), is_master=False, timeout=wait),
                                  float(timeout), "connect")
        except (TimeoutError, RuntimeError) as err:
            raise CollectiveError(comm.rank(), f"connecting to the store of rank 0 at {address[0]}:{address[1]}",
                                  [0], timeout=float(timeout) if isinstance(err, TimeoutError) else None,
                                  cause=None if isinstance(err, TimeoutError) else str(err)) from err
    return store, message


def open_store(comm: Collectives, timeout: float, namespace: str = "hetero_plugins") -> BoundedStore:
    """A key-value store every rank shares, for coordination outside the collectives; collective.

    Keys live under ``{namespace}/{secret}/``, the secret drawn by rank 0 and sent over the job's own
    collective, so a client that reaches the store's port but not the job's collectives cannot name them in
    advance. Where the transport has a rendezvous store (``torch.distributed``'s default store, which
    Lightning's and torchrun's launches create), it is reused through a connection of its own; otherwise rank
    0 serves one on the job's address (:func:`open_tcp_store`). Every operation ends within ``timeout``
    seconds (:class:`BoundedStore`).

    Args:
        comm: the transport (every rank calls this alike).
        timeout: seconds each store operation may take.
        namespace: the first part of every key (one per use).
    """
    import torch.distributed as dist

    shared = getattr(comm, "shared_store", None)
    base = shared() if callable(shared) else None
    rank = comm.rank()
    if base is not None:
        secret = comm.broadcast_object(secrets.token_hex(16) if rank == 0 else None, name=f"{namespace}.secret")
        store, owner, address = base, getattr(comm, "store_owner", 0), getattr(comm, "store_address", None)
    else:
        store, (secret, address) = _open_tcp(comm, timeout, f"{namespace}.store",
                                             payload=secrets.token_hex(16) if rank == 0 else None)
        owner = 0
    return BoundedStore(dist.PrefixStore(f"{namespace}/{secret}", store), timeout, rank, owner=owner,
                        address=address, label=f"{namespace} store")




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

    Collectives are bounded by the process group's own timeout (gloo; NCCL's watchdog), async waits by
    ``timeout``; a failure raises :class:`CollectiveError` naming the operation and the rank that did not
    answer (the other one of two ranks; with more, the ranks that stopped beating once :meth:`start_liveness`
    runs).

    Args:
        device: where tensors travel (``cuda`` under NCCL, ``cpu`` under gloo); arrays are moved there and back.
        main_address: rank 0's address as the launcher knows it (``MASTER_ADDR``); default this host's name.
        timeout: seconds a collective or store operation may take (the strategy's ``timeout``; default
            :func:`default_timeout`).
    """

    kind = "torch"

    def __init__(self, device: torch.device | str = "cpu", main_address: str | None = None,
                 timeout: float | None = None) -> None:
        self.device = torch.device(device)
        self.main_address = main_address
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        self.liveness: Liveness | None = None
        #: The rank whose process serves the shared store (``None``: the launcher's agent, under torchrun).
        self.store_owner: int | None = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        self.store_address: tuple[str, int] | None = None

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
        self._guard(f"all_gather {name!r}", lambda: dist.all_gather(out, local))
        return torch.stack(out).cpu().numpy()

    def broadcast_object(self, obj: T, name: str, root: int = 0) -> T:
        import torch.distributed as dist

        if self.size() == 1:
            return obj
        box = [obj]
        device = self.device if self.device.type == "cuda" else None
        self._guard(f"broadcast {name!r}", lambda: dist.broadcast_object_list(box, src=root, device=device))
        return box[0]  # type: ignore[return-value]

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        import torch.distributed as dist

        if self.size() > 1:
            self._guard(f"all_reduce {name!r}", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))
        return tensor

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> ReduceHandle:
        import torch.distributed as dist

        if self.size() == 1:
            return CompletedHandle(tensor)
        work = self._guard(f"all_reduce {name!r}",
                           lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True))
        return _BoundedWork(self, work, tensor, f"all_reduce {name!r}")

    def store_host(self) -> str:
        return self.main_address or socket.gethostname()

    # ------------------------------------------------------------------ bounds and diagnosis
    def shared_store(self) -> Any:
        """A connection of its own to the job's rendezvous store (``None`` before ``init_process_group``)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            self.store_address = (str(store.host), int(store.port))
            return store.clone()  # c10d keeps its own connection; a stuck operation of ours never holds it
        return store

    def start_liveness(self) -> Liveness | None:
        """Start this rank's heartbeat in the shared store (collective; once). With it, a failed collective
        names the ranks that stopped beating."""
        if self.liveness is None and self.size() > 2:
            store = open_store(self, self.timeout, namespace="hetero_plugins/alive")
            self.liveness = Liveness(store, self.size(), period=min(5.0, max(0.5, self.timeout / 10))).start()
        return self.liveness

    def unresponsive(self) -> list[int] | None:
        """The ranks that did not answer, where they can be told (after a failed collective)."""
        rank, size = self.rank(), self.size()
        if size == 2:
            return [1 - rank]
        return self.liveness.silent() if self.liveness is not None else None

    def failure(self, operation: str, err: BaseException | None = None) -> CollectiveError:
        """The :class:`CollectiveError` for ``operation`` that failed with ``err`` (the transport's error)."""
        text = "" if err is None else str(err).lower()
        timed_out = err is None or isinstance(err, TimeoutError) or "timed out" in text or "timeout" in text
        return CollectiveError(self.rank(), operation, self.unresponsive(),
                               timeout=self.timeout if timed_out else None,
                               cause=None if err is None else str(err))

    def _guard(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except CollectiveError:
            raise
        except RuntimeError as err:
            if not is_transport_failure(err):
                raise
            raise self.failure(operation, err) from err


class _BoundedWork:
    """A ``torch.distributed`` ``Work`` as a :class:`ReduceHandle` whose ``wait()`` ends within the timeout."""

    def __init__(self, comm: TorchCollectives, work: Any, tensor: torch.Tensor, operation: str) -> None:
        self.comm, self.work, self.tensor, self.operation = comm, work, tensor, operation

    def wait(self) -> torch.Tensor:
        self.comm._guard(self.operation, lambda: self.work.wait(timedelta(seconds=self.comm.timeout)))
        return self.tensor
