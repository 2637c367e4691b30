"""Learning rate for elastic ``horovodrun`` scripts when the world (and so the global batch) changes.

An :class:`~hetero_plugins.lr_scaling.LRScaler` follows the global batch: give it to
``hvd.elastic.TorchState`` (so rank 0's scaler state reaches workers that join) and register the function
:func:`elastic_lr_callback` returns as a reset callback::

    import horovod.torch as hvd
    from hetero_plugins.horovod.lr import elastic_lr_callback
    from hetero_plugins.lr_scaling import LRScaler

    scaler = LRScaler(rule="linear", ramp_steps=8, reference_batch=32 * 4)   # lr tuned for 4 ranks x 32
    on_reset = elastic_lr_callback(scaler, optimizer, lambda: 32 * hvd.size())  # before building the state
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, lr_scaler=scaler, step=0, epoch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward()
            with scaler.scaled(optimizer, state.step):   # lr x factor during this step only
                optimizer.step()
            state.step += 1
            state.commit()

After a reset Horovod calls the function (before it syncs the state from rank 0); if the global batch
differs from the scaler's, it calls ``scaler.on_global_batch_change(new, step=None)``: the ramp starts at the
next :meth:`~hetero_plugins.lr_scaling.LRScaler.apply`, from the factor of that step. Rank 0's scaler state
is then broadcast to every worker, new ones included, so all ranks apply the same factor.

``import hetero_plugins.horovod.lr`` works without Horovod; only the elastic registration needs it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch

from hetero_plugins._validation import check_int
from hetero_plugins.lr_scaling import LRScaler

log = logging.getLogger(__name__)

__all__ = ["elastic_lr_callback", "register_elastic_handler"]

_REGISTERED = False


def register_elastic_handler() -> bool:
    """Let ``hvd.elastic.TorchState`` commit, restore and sync an :class:`LRScaler` passed to it as a keyword.

    Idempotent; returns whether Horovod's elastic state is available. Must run before the ``TorchState`` is
    built (:func:`elastic_lr_callback` calls it, and importing this module after ``horovod.torch`` does).
    Horovod's ``SamplerStateHandler`` is reused: it deep-copies ``state_dict()`` at commit, loads it at
    restore and broadcasts rank 0's at sync.
    """
    global _REGISTERED
    if _REGISTERED:
        return True
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:
        return False
    registry = elastic_state.get_handler_registry()
    if not any(t is LRScaler for t, _ in registry):
        elastic_state.set_handler_registry([(LRScaler, elastic_state.SamplerStateHandler), *registry])
    _REGISTERED = True
    return True


def elastic_lr_callback(
    scaler: LRScaler,
    optimizer: torch.optim.Optimizer | None,
    global_batch_fn: Callable[[], int],
    step_fn: Callable[[], int] | None = None,
    gain_fn: Callable[[int], float | None] | None = None,
) -> Callable[[], None]:
    """A function for ``state.register_reset_callbacks([...])`` that starts the learning-rate ramp after a reset.

    Args:
        scaler: the scaler that the training loop applies (give it to the ``TorchState`` too).
        optimizer: its learning rates are put back to the schedule's values at a reset (a step interrupted
            between :meth:`~LRScaler.apply` and :meth:`~LRScaler.restore` may have left scaled ones); ``None``
            skips that.
        global_batch_fn: returns the global batch after the reset (e.g. ``lambda: 32 * hvd.size()``; with
            ``hetero_plugins.horovod.HeteroBatchSampler`` the global batch stays fixed and nothing changes).
        step_fn: returns the first optimizer step under the new world; ``None`` (default): the step of the
            next ``scaler.apply``, which is what elastic jobs want, because the reset callback runs before the
            state (and the step counter in it) is synced.
        gain_fn: for ``rule="adascale"``: returns the gain for the new global batch (``None``: the scaler's
            observed gradient statistics decide).

    Example::

        >>> s = LRScaler(rule="linear", ramp_steps=2, reference_batch=64)
        >>> on_reset = elastic_lr_callback(s, None, lambda: 32)
        >>> on_reset(); s.target_factor
        0.5
    """
    if not isinstance(scaler, LRScaler):
        raise ValueError(f"`scaler` must be an LRScaler, got {scaler!r}. HINT: build LRScaler(rule=...) first.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"`optimizer` must be a torch optimizer or None, got {type(optimizer).__name__}.")
    for name, fn in (("global_batch_fn", global_batch_fn), ("step_fn", step_fn), ("gain_fn", gain_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"`{name}` must be a callable, got {fn!r}. HINT: e.g. lambda: 32 * hvd.size().")
    if global_batch_fn is None:
        raise ValueError("`global_batch_fn` must be a callable returning the global batch, got None.")
    register_elastic_handler()

    def on_reset() -> None:
        if optimizer is not None:
            scaler.restore(optimizer)
        new = check_int("global_batch_fn()", global_batch_fn(), minimum=1, hint="return samples per step, all ranks")
        if scaler.reference_batch is None:
            scaler.set_reference(new)
            return
        if new == scaler.global_batch:
            return
        step = None if step_fn is None else check_int("step_fn()", step_fn(), minimum=0)
        gain = None if gain_fn is None else gain_fn(new)
        old = scaler.global_batch
        target = scaler.on_global_batch_change(new, step=step, gain=gain)
        log.info(f"elastic reset: global batch {old} -> {new}, learning-rate factor -> {target:.4g}")

    return on_reset


if "horovod.torch" in sys.modules:  # imported after horovod.torch: register now, before any TorchState
    register_elastic_handler()
