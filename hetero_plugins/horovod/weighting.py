"""Sample-weighted gradients under Horovod's own all-reduce: hooks scaling each gradient by b_i / B as it is
accumulated into ``.grad``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hetero_plugins.telemetry import StepTimer

__all__ = ["GradientWeighting"]


class GradientWeighting:
    """Scales every parameter's incoming gradient by this rank's share of the step and time-stamps it.

    Registered as pre-hooks of each parameter's gradient accumulator (its ``AccumulateGrad`` node, as Horovod
    registers its own all-reduce hook there), which run just before the gradient is accumulated into ``.grad``
    and before Horovod's hook launches the all-reduce, so each backward pass (also each accumulated
    micro-batch) contributes ``weight * grad``; summed over ranks (``op=hvd.Sum``) this is sum_i (b_i / B) g_i.
    Only accumulation into ``.grad`` is weighted and counted as a backward pass: ``torch.autograd.grad`` (a
    gradient penalty, for instance) returns the gradients unscaled and does not advance the step.

    Args:
        params: the parameters whose gradients are weighted.
        timer: notified (``mark_gradients_ready``) at every gradient; the last one of a step counts.
        weight_fn: called at the first gradient of each backward pass for the weight (else :meth:`set_weight`).
        on_backward_end: called once at the end of each backward pass.

    Example::

        >>> p = torch.ones(2, requires_grad=True)
        >>> w = GradientWeighting([p]); w.set_weight(0.25)
        >>> (3 * p).sum().backward(); p.grad.tolist()
        [0.75, 0.75]
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        timer: StepTimer | None = None,
        weight_fn: Callable[[], float] | None = None,
        on_backward_end: Callable[[], None] | None = None,
    ) -> None:
        self.weight = 1.0
        self.timer = timer
        self.weight_fn = weight_fn
        self.on_backward_end = on_backward_end
        self._in_backward = False
        # The accumulators are kept alive here (as Horovod keeps its ``_grad_accs``): a parameter holds its own
        # weakly, so a new one, without the hook, would replace it once nothing else refers to it.
        self._accumulators: list[torch.autograd.graph.Node] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        with torch.enable_grad():  # a view made under no_grad has no grad_fn to reach the accumulator from
            for p in params:
                if p.requires_grad:
                    accumulator = _accumulator(p)
                    self._handles.append(accumulator.register_prehook(self._hook))
                    self._accumulators.append(accumulator)

    def set_weight(self, weight: float) -> None:
        """The factor of the coming backward pass's gradients: this rank's share b_i / B of the step
        (``BatchBalancer`` calls it), or a micro-batch's n_j / B."""
        self.weight = float(weight)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._accumulators = []

    def _hook(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        """The accumulator's pre-hook: ``grads`` holds the gradient about to be added to ``.grad``."""
        if not self._in_backward:
            self._in_backward = True
            if self.weight_fn is not None:
                self.weight = float(self.weight_fn())
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self.timer is not None:
            self.timer.mark_gradients_ready()
        return tuple(None if g is None else g * self.weight for g in grads)

    def _backward_done(self) -> None:
        self._in_backward = False
        if self.on_backward_end is not None:
            self.on_backward_end()


def _accumulator(p: torch.Tensor) -> torch.autograd.graph.Node:
    """The ``AccumulateGrad`` node that adds ``p``'s gradients into ``p.grad`` (what Horovod hooks as well)."""
    if not p.is_leaf:
        raise ValueError(
            f"a tensor of shape {tuple(p.shape)} computed from others (grad_fn={p.grad_fn!r}) was given as a "
            "parameter: only a leaf tensor accumulates its gradient into .grad. HINT: pass the model's parameters."
        )
    return p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
