"""Bounded waits for ``hvd.DistributedOptimizer``'s gradient all-reduces, shared by the ``horovodrun`` optimizer
(:class:`~hetero_plugins.horovod.AggregatingOptimizer`) and the Lightning strategy (``HeteroHorovodStrategy``).

Horovod's ``synchronize()`` first starts the all-reduces the backward pass did not (a parameter that got no
gradient, e.g. an unused head, or one whose accumulation is incomplete), then waits for every handle without a
bound: a stalled peer would hang the job there, whatever ``HETERO_PLUGINS_TIMEOUT`` says. :func:`wait_for_gradients`
starts those all-reduces itself, exactly as Horovod 0.28.1's ``synchronize()`` would, then waits for every handle
at most the exchange's timeout; the ``synchronize()`` that follows finds them all done and only collects results.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["GRADIENT_ALLREDUCE", "start_missing_allreduces", "wait_for_gradients"]

#: How a timed-out or failed wait for the gradient all-reduces names the collective.
GRADIENT_ALLREDUCE = "hvd.DistributedOptimizer's gradient allreduce"


def start_missing_allreduces(optimizer: Any) -> bool:
    """Start the gradient all-reduces ``optimizer.synchronize()`` would start itself before waiting.

    That is the first half of Horovod 0.28.1's ``_DistributedOptimizer.synchronize``: every parameter Horovod
    reduces (``_requires_update``) that has no handle yet, alone or in a group, and every handle still ``None``
    (an accumulating pass, or a group not complete), are started through Horovod's own
    ``_allreduce_grad_async`` (a missing gradient becomes zeros; sparse gradients, compression and the process
    set as Horovod does them). Starting one twice would pair it with another rank's next all-reduce, so it
    runs only right before ``synchronize()``.

    Args:
        optimizer: the optimizer ``hvd.DistributedOptimizer`` returned.

    Returns:
        Whether it did: ``False`` for any other optimizer (``hvd.Adasum``'s too, or one of a Horovod release
        without these internals) and where this rank is outside the optimizer's process set (Horovod's
        ``synchronize()`` starts nothing there either); the caller then waits for the handles that exist.
    """
    handles = getattr(optimizer, "_handles", None)
    if not isinstance(handles, dict) or getattr(type(optimizer), "synchronize", None) is not _horovod_synchronize():
        return False
    if not all(hasattr(optimizer, a) for a in ("_requires_update", "_allreduce_grad_async", "process_set")):
        return False  # pragma: no cover - another Horovod release
    if not optimizer.process_set.included():
        return False
    completed: set[Any] = set()
    for key in handles:
        if isinstance(key, tuple):  # a group's one handle
            completed.update(key)
        else:
            completed.add(key)
    required = optimizer._requires_update
    # Horovod walks a set here; the parameter groups' order is the same set, the same on every rank.
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in required and p not in completed:
                handles[p] = optimizer._allreduce_grad_async(p)
                completed.add(p)
    for key, (handle, _) in list(handles.items()):
        if handle is None:
            handles[key] = optimizer._allreduce_grad_async(key)
    return True


def wait_for_gradients(optimizer: Any, exchange: Any, operation: str = GRADIENT_ALLREDUCE,
                       start_missing: bool = True) -> None:
    """Wait, at most ``exchange.timeout`` seconds, for every gradient all-reduce of Horovod's ``optimizer``.

    Call it right before ``optimizer.synchronize()`` (or the ``optimizer.step()`` that synchronizes): past the
    timeout, or when Horovod reports a failure, ``exchange`` raises its
    :class:`~hetero_plugins.collectives.CollectiveError` naming ``operation`` and the rank that did not answer.

    Args:
        optimizer: the optimizer ``hvd.DistributedOptimizer`` returned (anything else: nothing to wait for).
        exchange: a :class:`~hetero_plugins.horovod.HorovodExchange` (its ``wait_all`` bounds the wait).
        operation: how the error names the collective.
        start_missing: first start the all-reduces ``synchronize()`` would start (:func:`start_missing_allreduces`);
            ``False`` where no ``synchronize()`` follows (inside ``optimizer.skip_synchronize()``).
    """
    if start_missing:
        start_missing_allreduces(optimizer)
    handles = getattr(optimizer, "_handles", None)
    if isinstance(handles, dict):
        exchange.wait_all([h for handle, _ in handles.values() for h in _pollable(handle)], operation)


def _pollable(handle: Any) -> list[int]:
    """The handles ``hvd.poll`` takes behind one of ``_handles``: an all-reduce's (a group's) own, or, for a sparse
    gradient, the two all-gathers behind the function ``sparse_allreduce_async`` returns."""
    if isinstance(handle, int):
        return [handle]
    if callable(handle):
        try:
            cells = inspect.getclosurevars(handle).nonlocals
        except (TypeError, ValueError):
            return []
        return [v for k, v in sorted(cells.items()) if k.endswith("_handle") and isinstance(v, int)]
    return []


def _horovod_synchronize() -> Any:
    """``_DistributedOptimizer.synchronize`` of the installed Horovod (its optimizers share the function), or None."""
    try:
        from horovod.torch.optimizer import _DistributedOptimizer
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return _DistributedOptimizer.__dict__.get("synchronize")
