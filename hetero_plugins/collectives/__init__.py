"""The one seam between the engines and a transport: the collectives the balancing and aggregation engines use.

The engines (:mod:`hetero_plugins.balancing`, :mod:`hetero_plugins.aggregation`) never call a training
framework or ``torch.distributed`` themselves: they take an object that satisfies :class:`Collectives`. Three
transports implement it:

- :class:`TorchCollectives` here, over ``torch.distributed`` (what ``HeteroDDPStrategy`` runs on, gloo or NCCL);
- ``hetero_plugins.horovod.exchange.HorovodExchange`` and ``MPIExchange`` (``horovodrun`` / ``mpirun`` scripts
  and ``HeteroHorovodStrategy``);
- ``hetero_plugins.callbacks`` wraps any Lightning strategy's public ``all_gather`` / ``broadcast`` for the
  callbacks that run beside a stock strategy.

This package is the only part of the core that imports ``torch.distributed`` (its ``store`` module holds the
key-value stores). Every call carries a ``name``:
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

import atexit
import logging
import math
import os
import re
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "TIMEOUT_ENV",
    "BoundedStore",
    "CollectiveError",
    "Collectives",
    "CompletedHandle",
    "Liveness",
    "ReduceHandle",
    "TorchCollectives",
    "WorkHandle",
    "check_timeout",
    "default_timeout",
    "is_transport_failure",
    "open_store",
    "open_tcp_store",
    "probe_silent",
    "probe_window",
    "release_process_group_at_exit",
]

T = TypeVar("T")

#: Seconds a collective or store operation may take before it is given up (the strategies' default, 10 minutes).
DEFAULT_TIMEOUT = 600.0
#: Environment variable with that bound in seconds for ``horovodrun`` / ``mpirun`` scripts (no strategy there).
TIMEOUT_ENV = "HETERO_PLUGINS_TIMEOUT"
#: The largest bound accepted, in seconds (about 31 years; Python's thread waits overflow far above it).
MAX_TIMEOUT = 1e9


def default_timeout() -> float:
    """The bound on collectives where no strategy sets one: ``$HETERO_PLUGINS_TIMEOUT`` seconds, else 600.

    The value must be a positive, finite number of seconds (at most :data:`MAX_TIMEOUT`): ``inf``, ``nan``, ``0``,
    a negative number or text raise ``ValueError`` naming the variable, since every wait must stay bounded.

    Example::

        >>> default_timeout() > 0
        True
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive, finite number of seconds (at most "
                         f"{MAX_TIMEOUT:g}): every wait for another rank stays bounded. HINT: e.g. {TIMEOUT_ENV}=600, "
                         f"or unset it for the default {DEFAULT_TIMEOUT:g} s.")
    return value


def check_timeout(value: Any, name: str = "timeout") -> float:
    """``value`` as seconds to wait for other ranks (``None``: :func:`default_timeout`); a positive, finite number
    up to :data:`MAX_TIMEOUT`, else ``ValueError`` naming ``name`` (``inf`` or ``nan`` would leave a wait unbounded).

    Example::

        >>> check_timeout(30), check_timeout(None) > 0
        (30.0, True)
    """
    if value is None:
        return default_timeout()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"`{name}` must be a number of seconds, got {value!r} ({type(value).__name__}). "
                         f"HINT: e.g. {name}=600, or leave it out for ${TIMEOUT_ENV} / {DEFAULT_TIMEOUT:g} s.")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT):
        raise ValueError(f"`{name}` must be a positive, finite number of seconds (at most {MAX_TIMEOUT:g}), got "
                         f"{value!r}: every wait for another rank stays bounded. HINT: e.g. {name}=600.")
    return seconds


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _gist(text: str) -> str:
    """The transport error's telling line (gloo and Horovod wrap theirs in several lines and source paths)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = next((ln for ln in lines if any(w in ln.lower() for w in _TRANSPORT_WORDS)), lines[0] if lines else "")
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|py):\d+\]\s*", "", line)
    if len(line) <= 300:
        return line
    return f"{line[:150].rstrip()} ... {line[-145:].lstrip()}"  # both ends: what failed, and the peer's address


class CollectiveError(RuntimeError):
    """A collective or store operation failed or ran past its deadline: a rank froze, died or is unreachable.

    Args:
        rank: this rank (the one that gave up).
        operation: what it was doing, e.g. ``"all_reduce 'hetero_plugins.aggregation.deadline'"``.
        suspects: the ranks that did not answer, where they can be told (``None``: unknown).
        timeout: the deadline that passed, in seconds (``None``: the operation failed before it).
        cause: the transport's own error text.
        answered: where ``suspects`` cannot be told, the ranks known to be alive (they answered a liveness
            probe; ``[rank]`` alone: no probe could run); the message then names them and calls the rest suspect.

    Example::

        >>> str(CollectiveError(1, "store add('k')", [0], timeout=10.0)).split(":")[1].strip()
        "rank 1 gave up on store add('k') after 10 s"
    """

    def __init__(self, rank: int, operation: str, suspects: Sequence[int] | None = None,
                 timeout: float | None = None, cause: str | None = None,
                 answered: Sequence[int] | None = None) -> None:
        self.rank, self.operation, self.timeout, self.cause = rank, operation, timeout, cause
        self.suspects = None if suspects is None else [int(r) for r in suspects]
        self.answered = None if answered is None else sorted({int(r) for r in answered} | {int(rank)})
        what = (f"rank {rank} gave up on {operation} after {timeout:g} s" if timeout is not None
                else f"{operation} failed on rank {rank}")
        if self.suspects:
            who = f"{_ranks(self.suspects)} did not answer (frozen, dead or unreachable)"
        elif self.answered == [int(rank)]:
            who = (f"only rank {rank} (this one) is known to be alive: no liveness probe could reach the other ranks, "
                   "so every other rank is suspect (frozen, dead, unreachable, or in a different collective)")
        elif self.answered is not None:
            who = (f"{_ranks(self.answered)} answered a liveness probe; any other rank is suspect (frozen, dead, "
                   "unreachable, or in a different collective)")
        else:
            who = "another rank did not answer (frozen, dead, unreachable, or in a different collective)"
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


_EXIT_HOOK = [False]


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def release_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits (registered once per process).

    Left to static destructors, gloo's threads occasionally abort a worker at exit ("terminate called without an
    active exception", SIGABRT) after training has finished, and ``ddp_spawn`` then reports the run as failed.
    The strategies call this when they set up; the callbacks too, for the stock ``"ddp"`` / ``"ddp_spawn"``."""
    if not _EXIT_HOOK[0]:
        atexit.register(_destroy_process_group)
        _EXIT_HOOK[0] = True


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
        self.timeout = check_timeout(timeout)
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


# The store half of the seam (after every name it uses is defined).
from hetero_plugins.collectives.store import (  # noqa: E402
    BoundedStore,
    Liveness,
    open_store,
    open_tcp_store,
    probe_silent,
    probe_window,
)
