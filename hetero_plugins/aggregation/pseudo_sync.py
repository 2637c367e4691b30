"""Pseudo-synchronous updates: step k's gradient all-reduce overlaps step k+1's compute.

Wen et al. 2023, "Accelerating Massively Distributed Deep Learning Through Efficient Pseudo-Synchronous
Update Method" (IJPP, DOI 10.1007/s10766-023-00759-4): a step applies the newest *already reduced*
gradient while its own gradient is still being all-reduced, and corrects the one-step staleness with an
adaptive exponential-smoothing predicted gradient whose confidence in the newest gradient is adapted.
The paper's exact formula was not available; the rule here is a reconstruction that takes the cosine
agreement of consecutive gradients as the confidence.
Relatives: OD-SGD (one-step-delay SGD, arXiv 2005.06728) and DC-ASGD (delay-compensated asynchronous SGD,
Zheng et al. 2017).

Framework-free: :class:`DelayedExchange` receives the asynchronous all-reduce as an injected callable, and
:class:`PseudoSyncCorrector` only does tensor arithmetic on the flat reduced gradient.
:class:`PseudoSyncAggregator` is the mode's engine: each rank's flat gradient is multiplied by its share
b_i / B before the exchange, so the reduced sum is the sample-weighted mean gradient of the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from hetero_plugins._validation import check_float
from hetero_plugins.aggregation.base import Aggregator, StepContext
from hetero_plugins.aggregation.grad_sync import (
    _digits,
    _undigits,
    check_layouts,
    count_slots,
    exchange_dtype,
    flat_gradients,
    has_gradients,
    set_flat_gradients,
)
from hetero_plugins.collectives import CompletedHandle, ReduceHandle

__all__ = ["CompletedHandle", "DelayedExchange", "PseudoSyncAggregator", "PseudoSyncCorrector", "ReduceHandle"]


class PseudoSyncCorrector:
    """Adaptive exponential-smoothing predicted gradient for one-step-delayed (pseudo-synchronous) updates.

    Each call receives ``G``, the all-reduced (sample-weighted mean) flat gradient of the *previous* step,
    and returns the gradient to apply now::

        s <- beta * s + (1 - beta) * G            (s starts at G; G is folded in before it is used)
        a  = clip(cos(G, G_prev), min_confidence, 1)  (a = 1 at the first call)
        g_hat = a * G + (1 - a) * s

    When consecutive gradients agree (cosine near 1) the newest one is trusted; when they disagree the
    update leans on the smoothed history, which damps the error of applying a stale gradient
    (Wen et al. 2023, reconstructed). ``min_confidence=1.0`` gives the
    plain one-step-delayed update of OD-SGD: ``G`` is returned unchanged and no history is kept.

    A ``G`` containing inf/NaN (an AMP overflow step) is returned unchanged and leaves the state untouched,
    so a ``GradScaler`` still sees the overflow and skips the step. Everything stays on the device: no
    host synchronisation happens unless :attr:`confidence` is read.

    Args:
        smoothing: ``beta`` in ``[0, 1)``, the weight of the old history in the smoothed gradient.
        min_confidence: lower clip ``a_min`` in ``[0, 1]`` of the confidence in the newest gradient.

    Example::

        >>> c = PseudoSyncCorrector(smoothing=0.5, min_confidence=0.0)
        >>> c.combine(torch.tensor([1.0, 0.0])).tolist()  # first call: a = 1
        [1.0, 0.0]
        >>> c.combine(torch.tensor([0.0, 1.0])).tolist()  # orthogonal: a = 0, s = [0.5, 0.5]
        [0.5, 0.5]
        >>> c.confidence
        0.0
    """

    def __init__(self, smoothing: float = 0.9, min_confidence: float = 0.5) -> None:
        self.smoothing = check_float(
            "smoothing", smoothing, minimum=0.0, hint="use a value in [0, 1), e.g. 0.9; 0 keeps no history"
        )
        if self.smoothing >= 1.0:
            raise ValueError(
                f"`smoothing` must be < 1, got {self.smoothing}. HINT: with 1 the history never absorbs a new "
                "gradient; use a value in [0, 1), e.g. 0.9."
            )
        self.min_confidence = check_float(
            "min_confidence",
            min_confidence,
            minimum=0.0,
            maximum=1.0,
            hint="use a value in [0, 1]; 1.0 gives the plain one-step-delayed update",
        )
        self._smoothed: torch.Tensor | None = None
        self._previous: torch.Tensor | None = None
        self._confidence: torch.Tensor | float = 1.0
        self.calls = 0

    @property
    def confidence(self) -> float:
        """The last confidence ``a`` (1.0 before the first call); reading it synchronises with the device."""
        return float(self._confidence)

    def combine(self, reduced: torch.Tensor) -> torch.Tensor:
        """Return ``g_hat`` for the reduced flat gradient ``reduced`` of the previous step (see the class doc).

        ``reduced`` itself is returned when ``min_confidence == 1`` or it is non-finite; it is never modified.
        """
        if not isinstance(reduced, torch.Tensor) or reduced.dim() != 1 or not reduced.is_floating_point():
            raise ValueError(
                f"`reduced` must be a 1-D floating-point tensor, got {_describe(reduced)}. "
                "HINT: flatten the reduced gradients into one buffer first, e.g. torch.cat([g.reshape(-1) ...])."
            )
        self.calls += 1
        if self.min_confidence >= 1.0:
            self._confidence = 1.0
            return reduced
        g = reduced.detach()
        if self._smoothed is None or self._previous is None:
            if not bool(torch.isfinite(g).all()):
                return reduced
            self._smoothed, self._previous, self._confidence = g.clone(), g.clone(), 1.0
            return reduced
        if self._smoothed.shape != g.shape:
            raise ValueError(
                f"`reduced` has {g.numel()} elements but the history has {self._smoothed.numel()}. "
                "HINT: the set of parameters with gradients changed; call reset() when the model changes."
            )
        s = self._smoothed.to(device=g.device, dtype=g.dtype)
        prev = self._previous.to(device=g.device, dtype=g.dtype)
        acc = torch.promote_types(g.dtype, torch.float32)
        g_acc, prev_acc = g.to(acc), prev.to(acc)
        dot = torch.dot(g_acc, prev_acc)
        norm2 = torch.dot(g_acc, g_acc)
        ok = torch.isfinite(norm2)
        denom = torch.sqrt(norm2 * torch.dot(prev_acc, prev_acc))
        cos = torch.where(denom > 0, dot / denom.clamp_min(torch.finfo(acc).tiny), torch.zeros_like(dot))
        a = cos.clamp(self.min_confidence, 1.0)
        new_s = torch.where(ok, self.smoothing * s + (1.0 - self.smoothing) * g, s)
        g_hat = torch.where(ok, a.to(g.dtype) * g + (1.0 - a).to(g.dtype) * new_s, g)
        self._smoothed = new_s
        self._previous = torch.where(ok, g, prev)
        old = self._confidence if isinstance(self._confidence, torch.Tensor) else torch.tensor(self._confidence)
        self._confidence = torch.where(ok, a, old.to(a))
        return g_hat

    def reset(self) -> None:
        """Forget the history (e.g. after the parameter set or the world changed); the next call has a = 1."""
        self._smoothed, self._previous, self._confidence = None, None, 1.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "smoothing": self.smoothing,
            "min_confidence": self.min_confidence,
            "smoothed": None if self._smoothed is None else self._smoothed.detach().clone(),
            "previous": None if self._previous is None else self._previous.detach().clone(),
            "confidence": self.confidence,
            "calls": self.calls,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the history; the options stay those given to the constructor.

        The history tensors are moved to the device of the next ``reduced`` lazily.
        """
        missing = {"smoothed", "previous", "confidence", "calls"} - set(state)
        if missing:
            raise ValueError(
                f"`state` lacks {sorted(missing)}. HINT: pass a dict produced by PseudoSyncCorrector.state_dict()."
            )
        s, p = state["smoothed"], state["previous"]
        if (s is None) != (p is None) or (s is not None and s.shape != p.shape):
            raise ValueError(
                "`state` has inconsistent 'smoothed'/'previous' entries. "
                "HINT: pass a dict produced by PseudoSyncCorrector.state_dict()."
            )
        self._smoothed = None if s is None else s.detach().clone()
        self._previous = None if p is None else p.detach().clone()
        self._confidence = float(state["confidence"])
        self.calls = int(state["calls"])


class DelayedExchange:
    """One-step-delay bookkeeping for pseudo-synchronous updates around an injected asynchronous all-reduce.

    ``launch(flat_local)`` must start an asynchronous reduce of ``flat_local`` and return a
    :class:`ReduceHandle`. :meth:`exchange` launches this step's reduce and returns the newest reduced
    gradient already available, i.e. the previous step's; the previous handle is waited *after* the new
    launch, so both may be in flight together. The launched tensor must not be modified by the caller
    until its result has come back (it is not copied here).

    With nothing pending (the very first call, or the first after :meth:`flush`) :meth:`exchange` returns
    ``None``, unless ``first_step_sync=True``: then it waits for this step's reduce at once and returns it,
    and the next call returns that same gradient again (still the newest available while its own reduce
    is in flight), so every step has an update but the first gradient is applied twice. Without
    ``first_step_sync`` every reduced gradient is returned exactly once, provided the caller applies what
    :meth:`flush` returns at the end (or drops it, documented). Handles cannot be checkpointed: flush
    before saving.

    Args:
        launch: starts the asynchronous all-reduce of a flat tensor and returns its handle.
        first_step_sync: see above.

    Example::

        >>> ex = DelayedExchange(lambda t: CompletedHandle(2 * t))  # a 2-rank sum of identical tensors
        >>> print(ex.exchange(torch.tensor([1.0])))
        None
        >>> ex.exchange(torch.tensor([3.0])).tolist()
        [2.0]
        >>> ex.flush().tolist()
        [6.0]
    """

    def __init__(self, launch: Callable[[torch.Tensor], ReduceHandle], first_step_sync: bool = False) -> None:
        if not callable(launch):
            raise ValueError(
                f"`launch` must be callable, got {launch!r}. HINT: pass a function that starts an async "
                "all-reduce of a flat tensor and returns an object whose wait() returns the reduced tensor."
            )
        if not isinstance(first_step_sync, bool):
            raise ValueError(f"`first_step_sync` must be a bool, got {first_step_sync!r}.")
        self._launch = launch
        self.first_step_sync = first_step_sync
        self._pending: ReduceHandle | None = None
        self.launched = 0

    @property
    def pending(self) -> bool:
        """Whether a reduce (or a kept first-step result) waits to be returned."""
        return self._pending is not None

    def exchange(self, flat_local: torch.Tensor) -> torch.Tensor | None:
        """Launch this step's reduce of ``flat_local``; return the previous step's reduced tensor (see class)."""
        handle = self._launch(flat_local)
        self.launched += 1
        previous, self._pending = self._pending, handle
        if previous is not None:
            return previous.wait()
        if not self.first_step_sync:
            return None
        result = handle.wait()
        self._pending = CompletedHandle(result.clone())
        return result

    def flush(self) -> torch.Tensor | None:
        """Wait for the pending reduce and return its result (``None`` if nothing is pending)."""
        previous, self._pending = self._pending, None
        return None if previous is None else previous.wait()

    def settle(self) -> torch.Tensor | None:
        """Wait for the pending reduce and keep its result pending (for a checkpoint); ``None`` if none is."""
        if self._pending is None:
            return None
        result = self._pending.wait()
        self._pending = CompletedHandle(result)
        return result

    def restore(self, reduced: torch.Tensor | None) -> None:
        """Make ``reduced`` (a :meth:`settle` result from a checkpoint) the pending result."""
        self._pending = None if reduced is None else CompletedHandle(reduced)


class PseudoSyncAggregator(Aggregator):
    """``aggregation="pseudo_sync"``: step k launches the all-reduce of its weighted gradient and applies step
    k-1's reduced gradient, corrected by a :class:`PseudoSyncCorrector`; the first step only launches
    (:meth:`exchange` returns ``False``), and :meth:`flush` applies the last one after training.

    The launched buffer holds the gradients (true gradients: divided by the step's ``grad_scale``, multiplied by
    the rank's share b_i / B), one has-gradient flag per parameter and every rank's layout fingerprint; it is
    applied to the parameters it was launched for (a parameter unfrozen since gets no gradient in that step, and
    the corrector's history restarts), multiplied by the applying step's ``grad_scale``. A parameter no rank had a
    gradient for keeps ``p.grad = None``. :meth:`state_dict` holds the reduced gradient in flight.

    Attributes:
        corrector: the :class:`PseudoSyncCorrector`.
        delayed: the :class:`DelayedExchange` (two all-reduces may be in flight, under two names).
    """

    mode = "pseudo_sync"

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        opts = self.options
        assert opts.smoothing is not None and opts.min_confidence is not None  # filled per mode
        self.corrector = PseudoSyncCorrector(smoothing=opts.smoothing, min_confidence=opts.min_confidence)
        self.delayed = DelayedExchange(self._launch)
        self._pending_meta: dict[str, Any] | None = None  # how to read the buffer in flight
        self._corrected_layout: int | None = None  # the layout of the corrector's history

    def setup(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        super().setup(optimizers)
        momentum = max((float(g.get("momentum", 0.0) or 0.0) for o in optimizers for g in o.param_groups), default=0.0)
        if momentum > 0.5 and self.comm.rank() == 0:
            # Heavy-ball SGD on a quadratic of curvature h is stable for lr*h < 2(1 + momentum); with the
            # gradient one step late the bound drops to lr*h < 1 - momentum (0.1 at momentum 0.9).
            warnings.warn(
                f"aggregation='pseudo_sync' applies each gradient one step late, and with SGD momentum {momentum} "
                f"that is stable only for learning rates about {2 * (1 + momentum) / (1 - momentum):.0f}x smaller "
                "than without the delay (the digits CNN at lr 0.1, momentum 0.9 diverges). HINT: use momentum <= "
                "0.5 or a smaller learning rate with pseudo_sync.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _launch(self, flat: torch.Tensor) -> ReduceHandle:
        name = f"hetero_plugins.aggregation.pseudo_sync.{self.delayed.launched % 2}"  # two may be in flight
        return self._allreduce_sum_async(flat, name)

    def _params_changed(self) -> None:
        pass  # the corrector restarts when a gradient of the new layout is applied (_apply)

    def _pack(self, params: list[torch.Tensor], ctx: StepContext) -> tuple[torch.Tensor, dict[str, Any]]:
        """This step's buffer: weighted true gradients, has-gradient flags, every rank's layout fingerprint."""
        dtype = exchange_dtype(params)
        base, digits = count_slots(dtype)
        world = len(ctx.counts)
        flat = flat_gradients(params, extra=len(params) + world * digits, dtype=dtype)
        n = flat.numel() - len(params) - world * digits
        scale = float(ctx.grad_scale)
        flat[:n].mul_(ctx.weight if scale == 1.0 else ctx.weight / scale)
        if params:
            flat[n : n + len(params)] = torch.tensor(has_gradients(params), dtype=dtype, device=flat.device)
        for i, digit in enumerate(_digits(self.layout, base, digits)):
            flat[n + len(params) + ctx.rank * digits + i] = digit
        candidates = self.candidates()
        index = {id(p): i for i, p in reversed(list(enumerate(candidates)))}
        meta = {"params": params, "positions": [index.get(id(p), -1) for p in params], "size": n, "world": world,
                "base": base, "digits": digits, "layout": self.layout}
        return flat, meta

    def _apply(self, reduced: torch.Tensor, meta: dict[str, Any], grad_scale: float) -> None:
        """Set the gradients of ``meta``'s parameters from their reduced buffer (corrected, scaled by
        ``grad_scale``); every other trainable parameter's gradient is dropped (it was not exchanged)."""
        params, n, base, digits = meta["params"], meta["size"], meta["base"], meta["digits"]
        tail = reduced[n:].tolist()
        flags = [v > 0 for v in tail[: len(params)]]
        slots = tail[len(params) :]
        check_layouts([_undigits(slots[r * digits : (r + 1) * digits], base) for r in range(meta["world"])],
                      self.mode)
        if meta["layout"] != self._corrected_layout:
            if self._corrected_layout is not None:
                self.corrector.reset()  # the history belongs to another set of parameters
            self._corrected_layout = meta["layout"]
        applied = {id(p) for p in params}
        for p in self.params:
            if id(p) not in applied:
                p.grad = None  # unfrozen after the launch: no exchanged gradient yet (a local one would diverge)
        grads = self.corrector.combine(reduced[:n])
        if grad_scale != 1.0:
            grads = grads * grad_scale
        set_flat_gradients(params, grads, flags)

    def exchange(self, ctx: StepContext) -> bool:
        flat, meta = self._pack(self.params, ctx)
        previous_meta, self._pending_meta = self._pending_meta, meta
        previous = self.delayed.exchange(flat)
        if previous is None:  # the very first step only launches: there is no earlier gradient yet
            return False
        assert previous_meta is not None
        self._apply(previous, previous_meta, float(ctx.grad_scale))
        return True

    def flush(self, grad_scale: float = 1.0) -> bool:
        last, meta = self.delayed.flush(), self._pending_meta
        self._pending_meta = None
        if last is None or meta is None:
            return False
        self._apply(last, meta, float(grad_scale))
        return True

    def state_dict(self) -> dict[str, Any]:
        """The reduced gradient in flight (waited for: the same on every rank) with how to read it, and the
        corrector's history. Collective: every rank calls it (each waits for its own reduce)."""
        reduced = self.delayed.settle()
        meta = self._pending_meta
        pending = None
        if reduced is not None and meta is not None:
            pending = {"reduced": reduced.detach().cpu().clone(),
                       **{k: meta[k] for k in ("positions", "size", "world", "base", "digits", "layout")},
                       "shapes": [tuple(p.shape) for p in meta["params"]]}
        return {"mode": self.mode, "pending": pending, "corrector": self.corrector.state_dict(),
                "corrected_layout": self._corrected_layout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the saved reduced gradient back in flight (it is applied by the next step) and restore the
        corrector. A saved gradient whose parameters no longer match the optimizer's raises a ``ValueError``."""
        self.corrector.load_state_dict(state["corrector"])
        self._corrected_layout = state.get("corrected_layout")
        pending = state.get("pending")
        if pending is None:
            self.delayed.restore(None)
            self._pending_meta = None
            return
        candidates = self.candidates()
        positions = list(pending["positions"])
        ok = all(0 <= i < len(candidates) for i in positions)
        params = [candidates[i] for i in positions] if ok else []
        if not ok or [tuple(p.shape) for p in params] != [tuple(s) for s in pending["shapes"]]:
            raise ValueError(
                "aggregation='pseudo_sync': the checkpoint's gradient in flight was reduced for parameters of shapes "
                f"{pending['shapes']}, which the optimizer's parameters do not match. HINT: resume with the model "
                "and optimizer the checkpoint was saved with."
            )
        device = params[0].device if params else torch.device("cpu")
        self.delayed.restore(pending["reduced"].to(device))
        self._pending_meta = {"params": params, **{k: pending[k] for k in
                                                   ("positions", "size", "world", "base", "digits", "layout")}}


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"
