"""Sample-weighted gradients under Horovod's own all-reduce: tensor hooks scaling each gradient by b_i / B."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hetero_plugins.telemetry import StepTimer

__all__ = ["GradientWeighting"]


class GradientWeighting:
    """Scales every parameter's incoming gradient by this rank's share of the step and time-stamps it.

    Registered as tensor hooks, which run before the gradient is accumulated into ``.grad`` and before
    Horovod's own hook launches the all-reduce, so each backward pass (also each accumulated micro-batch)
    contributes ``weight * grad``; summed over ranks (``op=hvd.Sum``) this is sum_i (b_i / B) g_i.

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
        self._handles = [p.register_hook(self._hook) for p in params if p.requires_grad]

    def set_weight(self, weight: float) -> None:
        """The factor of the coming backward pass's gradients: this rank's share b_i / B of the step
        (``BatchBalancer`` calls it), or a micro-batch's n_j / B."""
        self.weight = float(weight)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._in_backward:
            self._in_backward = True
            if self.weight_fn is not None:
                self.weight = float(self.weight_fn())
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self.timer is not None:
            self.timer.mark_gradients_ready()
        return grad * self.weight

    def _backward_done(self) -> None:
        self._in_backward = False
        if self.on_backward_end is not None:
            self.on_backward_end()
