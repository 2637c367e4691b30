"""Key-value stores for the engines (the ``wbsp`` claim counters): bounded operations, liveness, where they live.

Part of the collectives seam: every store operation ends within its deadline with a
:class:`~hetero_plugins.collectives.CollectiveError` naming the rank and the operation.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

from hetero_plugins.collectives import Collectives, CollectiveError, check_timeout, is_transport_failure

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["BoundedStore", "Liveness", "open_store", "open_tcp_store", "probe_silent", "probe_window"]


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
        self.store, self.timeout, self.rank, self.owner = store, check_timeout(timeout), int(rank), owner
        self.address = address
        self.label = label
        self._watchdog = _Watchdog(f"hetero_plugins.{label}")

    def _where(self) -> str:
        at = f" at {self.address[0]}:{self.address[1]}" if self.address else ""
        who = f"served by rank {self.owner}" if self.owner is not None else "served by the launcher"
        return f"{self.label} ({who}{at})"

    def call(self, op: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` (an operation on :attr:`store`, described by ``op``) under the deadline."""
        limit = self.timeout if timeout is None else check_timeout(timeout)
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


def probe_window(timeout: float) -> float:
    """Seconds a liveness probe after a timed-out collective waits for the other ranks: half the collective's
    ``timeout``, at least 3 and at most 15 (the survivors of a frozen rank give up within about a step of each
    other, so they meet in the probe)."""
    return min(15.0, max(3.0, float(timeout) / 2))


def probe_silent(rank: int, size: int, announce: Callable[[], None], heard: Callable[[], Iterable[int]],
                 window: float, poll: float = 0.05) -> tuple[list[int], list[int]]:
    """A liveness probe with no set-up, for a rank whose collective failed: who else is still alive?

    ``announce()`` tells every other rank, over some side channel, that this one is alive (a key in a store
    every rank reaches, a point-to-point message); ``heard()`` returns the ranks heard from so far. Every
    surviving rank runs the probe once its own collective fails, so the ranks that never announce within
    ``window`` seconds are the frozen, dead or stuck ones (Horovod's stall inspector and PyTorch's NCCL
    flight recorder name the missing rank the same way: by who did not show up). Returns early once every
    other rank was heard.

    Returns:
        ``(silent, answered)``: the other ranks not heard from, and the ranks heard from (this one included).

    Example (every other rank already announced)::

        >>> probe_silent(1, 3, announce=lambda: None, heard=lambda: [0, 2], window=1.0)
        ([], [0, 1, 2])
    """
    others = set(range(int(size))) - {int(rank)}
    announce()
    deadline = time.monotonic() + float(window)
    seen: set[int] = set()
    while True:
        seen |= set(heard()) & others
        if seen >= others or time.monotonic() > deadline:
            break
        time.sleep(poll)
    return sorted(others - seen), sorted(seen | {int(rank)})


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

    timeout = check_timeout(timeout)
    wait = timedelta(seconds=timeout)
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

    timeout = check_timeout(timeout)
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
