"""Learning rate when the global batch changes: a scaling rule, a smooth ramp and momentum compensation.

Framework-free (torch only, no collectives). Elastic jobs (torchrun restarts, elastic Horovod) change the
number of ranks, and with it the global batch when the per-rank batch stays; a user may also let the global
batch adapt. The learning rate tuned for a reference global batch ``B_ref`` then follows a rule for the new
batch ``B`` (scale ``S = B / B_ref``):

- ``"linear"``: ``lr = lr_base * S`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD");
- ``"sqrt"``: ``lr = lr_base * sqrt(S)`` (Krizhevsky 2014; Hoffer et al. 2017);
- ``"adascale"``: ``lr = lr_base * r`` with the AdaScale gain ``r = (sigma2 + mu2) / (sigma2 / S + mu2)``
  (Johnson et al. 2020; Pollux/AdaptDL's ``AdaScale``), see :func:`adascale_gain`;
- ``"none"``: the learning rate stays.

The change is not immediate: Dynamic mini-batch SGD (Lin et al. 2019, "Dynamic Mini-batch SGD for Elastic
Distributed Training: Learning in the Limbo of Resources", arXiv 1904.12043) shows that jumping the learning
rate with the batch hurts accuracy, because the momentum still holds gradients of the old batch, and moves
it smoothly over ``T`` iterations (``T = 8`` works well in practice). Here the factor ``f`` that multiplies
the schedule's learning rate goes linearly from its value ``f_0`` at the change to the target ``f_1``: the
k-th optimizer step after a change made at step ``t_0`` (``k = t - t_0 + 1``) uses
``f(t) = f_0 + (f_1 - f_0) * min(1, k / T)``, so step ``t_0 + T - 1`` is the first at the target
(``ramp_steps=0``: at once); ``f_0`` is the factor of step ``t_0 - 1``, so a change in the middle of a ramp
continues from the last factor used.

Momentum compensation (``momentum_compensation=True``), for SGD's ``optimizer.state[p]["momentum_buffer"]``
(torch form ``v <- mu v + g; p <- p - lr v``): whenever the factor applied to a param group changes from
``f_prev`` (the factor of the last step its buffers were used in) to ``f``, every buffer of the group is
rescaled before the step, ``v <- v * f_prev / f``. The first update after the change is then

    ``dp = -lr_u * f * (mu * v * f_prev / f + g) = -lr_u * (mu * f_prev * v + f * g)``

(``lr_u``: the schedule's unscaled learning rate): the accumulated history keeps exactly the update size it
had at the old learning rate and only new gradients get the new one; over a ramp the compensations multiply
to ``f_0 / f_t``, so old-batch history is never amplified by the ramp. Equivalently each gradient enters the
momentum with the learning rate of the step that computed it, the "lr inside" form ``v <- mu v + lr g`` of
Goyal et al. 2017, section 2.1, eq. (9), without their "momentum correction" ``v <- (lr_{t+1} / lr_t) v``,
which is the inverse operation (it makes that form behave like torch's form, whose history follows every
learning-rate change). That amplification of noisy old-batch momentum by a larger learning rate is what
Lin et al. 2019 identify as the cause of the instability of an immediate change (their exact compensation
formula was not readable, see docs/papers.md; this is the implementable form that keeps the history's
update size). The factor the buffers correspond to is kept in the group (key ``lr_scaler_momentum_factor``),
so it travels with the optimizer's checkpoint. Changes made by the user's own schedule (``lr_u``) are not
compensated: they keep torch's semantics. Other optimizers' state (e.g. Adam's moments) is left alone.

Composing with torch learning-rate schedulers: the factor multiplies whatever learning rate the param group
holds, the *unscaled* value. :meth:`LRScaler.apply` writes ``unscaled * f`` into ``group["lr"]`` and
remembers both numbers in the group (keys ``lr_scaler_unscaled`` and ``lr_scaler_written``); if the group
still holds the written value at the next call, the remembered unscaled value is used, otherwise whatever is
there now (a scheduler or the user set it) is the new unscaled value. :meth:`LRScaler.restore` writes the
unscaled value back. torch schedulers fall in two kinds: closed-form ones (``LambdaLR``, ``OneCycleLR``,
``CyclicLR``, ...) write a fresh value and compose with :meth:`~LRScaler.apply` alone, but chainable ones
(``ExponentialLR``, ``StepLR``, ``MultiStepLR``, ``CosineAnnealingLR``, ``ReduceLROnPlateau``, ...) multiply
the value they find, so they must find the unscaled one. Hence the scaled value should live in the group only
during ``optimizer.step()``: call :meth:`~LRScaler.restore` right after the step and before
``scheduler.step()`` (or let :meth:`~LRScaler.restore_after_step` register a torch step post-hook that does
it, or use the :meth:`~LRScaler.scaled` context manager). Then schedulers, ``scheduler.get_last_lr()`` and
checkpoints only ever see the schedule's own values, and the step uses ``schedule value x f(step)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hetero_plugins._validation import check_choice, check_float, check_int

log = logging.getLogger(__name__)

__all__ = ["LR_RULES", "LRScaler", "adascale_gain", "gradient_noise_stats"]

LR_RULES = ("linear", "sqrt", "adascale", "none")

_UNSCALED = "lr_scaler_unscaled"
_WRITTEN = "lr_scaler_written"
_MOMENTUM = "lr_scaler_momentum_factor"


def adascale_gain(sigma2: float, mu2: float, scale: float) -> float:
    """AdaScale's gain ``r = (sigma2 + mu2) / (sigma2 / scale + mu2)`` for a batch ``scale`` times the reference.

    Args:
        sigma2: gradient noise variance at the reference batch, ``tr(Sigma) / B_ref`` (the expected squared
            distance of a reference-batch gradient from the true gradient).
        mu2: squared norm of the true gradient, ``|E g|^2``.
        scale: ``B_new / B_ref``.

    The gain lies between 1 and ``scale`` (pure signal: 1; pure noise: ``scale``, the linear rule); for
    ``scale < 1`` between ``scale`` and 1. Johnson et al. 2020 (AdaScale SGD); the formula of
    ``adaptdl/torch/scaling_rules.py``.

    Example::

        >>> adascale_gain(sigma2=3.0, mu2=1.0, scale=4.0)
        2.2857142857142856
        >>> adascale_gain(sigma2=0.0, mu2=1.0, scale=4.0), adascale_gain(sigma2=1.0, mu2=0.0, scale=4.0)
        (1.0, 4.0)
    """
    sigma2 = check_float("sigma2", sigma2, minimum=0.0, hint="pass the gradient noise variance, tr(Sigma) / B_ref")
    mu2 = check_float("mu2", mu2, minimum=0.0, hint="pass the squared norm of the mean gradient")
    scale = check_float("scale", scale, minimum=0.0, strict_minimum=True, hint="scale is B_new / B_ref")
    if sigma2 + mu2 <= 0.0:
        raise ValueError(
            f"`sigma2` + `mu2` must be > 0, got sigma2={sigma2}, mu2={mu2}. HINT: gradient statistics of an all-zero "
            "gradient carry no information; measure them over a few steps."
        )
    return (sigma2 + mu2) / (sigma2 / scale + mu2)


def gradient_noise_stats(
    local_sqr: float, total_sqr: float, local_batch: int, global_batch: int, reference_batch: int
) -> tuple[float, float]:
    """``(sigma2, mu2)`` for :func:`adascale_gain` from two gradient norms measured in one step.

    ``E|g_b|^2 = mu2 + tr(Sigma) / b`` for the gradient of ``b`` samples, so a rank's local gradient (batch
    ``local_batch``, squared norm ``local_sqr``, averaged over ranks) and the all-reduced gradient (batch
    ``global_batch``, ``total_sqr``) give ``tr(Sigma)`` and ``mu2`` (AdaptDL's estimator; smooth the results
    over steps, e.g. with an exponential moving average). ``sigma2 = tr(Sigma) / reference_batch``. Both
    are clipped at 0 (single-step estimates are noisy).

    Example::

        >>> gradient_noise_stats(local_sqr=1.5, total_sqr=1.125, local_batch=8, global_batch=32, reference_batch=32)
        (0.125, 1.0)
    """
    b = check_int("local_batch", local_batch, minimum=1)
    big = check_int("global_batch", global_batch, minimum=b + 1, hint="it takes two different batch sizes")
    ref = check_int("reference_batch", reference_batch, minimum=1)
    local_sqr = check_float("local_sqr", local_sqr, minimum=0.0)
    total_sqr = check_float("total_sqr", total_sqr, minimum=0.0)
    trace = (local_sqr - total_sqr) / (1.0 / b - 1.0 / big)
    mu2 = (big * total_sqr - b * local_sqr) / (big - b)
    return max(trace, 0.0) / ref, max(mu2, 0.0)


class LRScaler:
    """Learning-rate factor for a changing global batch: rule, smooth ramp, momentum compensation.

    Args:
        rule: ``"linear"`` (default), ``"sqrt"``, ``"adascale"`` or ``"none"`` (see the module docstring).
        ramp_steps: optimizer steps over which the factor moves to a new target (T of Dynamic SGD; 0: at once).
        momentum_compensation: rescale SGD momentum buffers when the factor changes so the accumulated history
            keeps its update size (``v <- v * f_prev / f``).
        reference_batch: the global batch the optimizer's learning rates are tuned for; ``None``: the first
            global batch seen (:meth:`set_reference` or :meth:`on_global_batch_change`).

    The factor is relative to ``reference_batch`` and multiplies the schedule's learning rate of every param
    group (the "base" learning rates, read from the group at each :meth:`apply`, see the module docstring for
    how this composes with torch schedulers).

    Attributes:
        reference_batch: the global batch the learning rates are tuned for (factor 1).
        global_batch: the global batch of the latest change (the current one).
        last_step: the step of the latest :meth:`apply`.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> s = LRScaler(rule="linear", ramp_steps=4, reference_batch=64)
        >>> s.on_global_batch_change(32, step=10)   # half the ranks are gone
        0.5
        >>> [round(s.factor(t), 3) for t in range(9, 15)]
        [1.0, 0.875, 0.75, 0.625, 0.5, 0.5]
        >>> s.apply(opt, step=11), opt.param_groups[0]["lr"]
        (0.75, 0.07500000000000001)
        >>> s.restore(opt); opt.param_groups[0]["lr"]
        0.1
    """

    def __init__(
        self,
        rule: str = "linear",
        ramp_steps: int = 8,
        momentum_compensation: bool = True,
        reference_batch: int | None = None,
    ) -> None:
        self.rule = _check_rule(rule)
        self.ramp_steps = check_int(
            "ramp_steps", ramp_steps, minimum=0, hint="Dynamic SGD uses 8 steps; 0 changes the learning rate at once"
        )
        if not isinstance(momentum_compensation, bool):
            raise ValueError(
                f"`momentum_compensation` must be a bool, got {momentum_compensation!r}. HINT: True (default) "
                "rescales SGD momentum buffers at a change, False leaves them."
            )
        self.momentum_compensation = momentum_compensation
        if reference_batch is not None:
            check_int("reference_batch", reference_batch, minimum=1, hint="the global batch the lr is tuned for")
        self.reference_batch: int | None = reference_batch
        self.global_batch: int | None = reference_batch
        self._start_step: int | None = None
        self._start_factor = 1.0
        self._target_factor = 1.0
        self._pending: float | None = None  # target of a change whose first step is the next apply()
        self._sigma2: float | None = None
        self._mu2: float | None = None
        self.last_step: int | None = None

    # ------------------------------------------------------------------ the factor
    @property
    def target_factor(self) -> float:
        """The factor the current (or pending) ramp goes to, relative to the reference batch."""
        return self._target_factor if self._pending is None else self._pending

    def factor(self, step: int) -> float:
        """The factor of optimizer step ``step`` (a change waiting for its first :meth:`apply` is not yet in)."""
        if self._start_step is None:
            return self._target_factor
        k = step - self._start_step + 1
        if k <= 0:
            return self._start_factor
        if self.ramp_steps == 0 or k >= self.ramp_steps:
            return self._target_factor
        return self._start_factor + (self._target_factor - self._start_factor) * k / self.ramp_steps

    def _last_factor(self, step: int) -> float:
        """The factor of the step before ``step``: where a ramp that starts at ``step`` starts from."""
        return self.factor(step - 1) if step > 0 else self.factor(step)

    def rule_factor(self, global_batch: int, gain: float | None = None) -> float:
        """The target factor of the rule for ``global_batch`` (relative to :attr:`reference_batch`)."""
        global_batch = check_int("global_batch", global_batch, minimum=1)
        if self.reference_batch is None:
            raise ValueError(
                "`reference_batch` is not set. HINT: pass LRScaler(reference_batch=...) or call set_reference() "
                "with the global batch the learning rate is tuned for."
            )
        if gain is not None and self.rule != "adascale":
            raise ValueError(
                f"`gain`={gain!r} is only used by rule='adascale', this scaler's rule is {self.rule!r}. "
                "HINT: drop `gain`, or build LRScaler(rule='adascale')."
            )
        scale = global_batch / self.reference_batch
        if self.rule == "linear":
            return scale
        if self.rule == "sqrt":
            return math.sqrt(scale)
        if self.rule == "none":
            return 1.0
        if gain is not None:
            return check_float("gain", gain, minimum=0.0, strict_minimum=True, hint="the AdaScale gain is > 0")
        if self._sigma2 is None or self._mu2 is None:
            raise ValueError(
                "rule='adascale' needs gradient statistics: `gain` is None and no statistics were observed. "
                "HINT: pass gain=adascale_gain(sigma2, mu2, scale) or call observe_gradient_stats(sigma2, mu2) first."
            )
        return adascale_gain(self._sigma2, self._mu2, scale)

    def set_reference(self, global_batch: int) -> None:
        """Declare the global batch the learning rates are tuned for; it is also the current one (factor 1)."""
        self.reference_batch = check_int("global_batch", global_batch, minimum=1)
        self.global_batch = self.reference_batch
        self._start_step, self._start_factor, self._target_factor, self._pending = None, 1.0, 1.0, None

    def observe_gradient_stats(self, sigma2: float, mu2: float) -> None:
        """Keep the latest gradient statistics (see :func:`adascale_gain`) for the ``"adascale"`` rule."""
        self._sigma2 = check_float("sigma2", sigma2, minimum=0.0)
        self._mu2 = check_float("mu2", mu2, minimum=0.0)

    @property
    def gradient_stats(self) -> tuple[float, float] | None:
        """The last observed ``(sigma2, mu2)``, or ``None``."""
        return None if self._sigma2 is None or self._mu2 is None else (self._sigma2, self._mu2)

    def on_global_batch_change(
        self, new_global_batch: int, step: int | None = None, gain: float | None = None
    ) -> float:
        """Start a ramp from the current factor to the rule's factor for ``new_global_batch``; return the target.

        Args:
            new_global_batch: samples per optimizer step over all ranks from now on.
            step: the first optimizer step that runs with the new batch; ``None``: the step of the next
                :meth:`apply` (what elastic reset callbacks use, where the step is not known yet).
            gain: the AdaScale gain (``rule="adascale"`` only); ``None`` computes it from the statistics given
                to :meth:`observe_gradient_stats`.

        The first global batch ever seen becomes the reference when none was given (factor 1, no ramp); the
        same global batch again changes nothing.
        """
        new_global_batch = check_int("new_global_batch", new_global_batch, minimum=1)
        if step is not None:
            check_int("step", step, minimum=0)
        if self.reference_batch is None:
            self.set_reference(new_global_batch)
            return 1.0
        if new_global_batch == self.global_batch:
            return self.target_factor
        target = self.rule_factor(new_global_batch, gain)
        if step is None:
            self._pending = target  # starts at the next apply(), from the factor of the step before it
        else:
            self._start_step, self._start_factor, self._target_factor = step, self._last_factor(step), target
            self._pending = None
        self.global_batch = new_global_batch
        log.info(
            f"LRScaler: global batch {new_global_batch} (reference {self.reference_batch}), rule {self.rule!r}: "
            f"factor -> {target:.4g} over {self.ramp_steps} steps from step {'next' if step is None else step}"
        )
        return target

    # ------------------------------------------------------------------ the optimizer
    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Write ``unscaled lr x factor(step)`` into every param group of ``optimizer``; return the factor.

        Call it before ``optimizer.step()`` of optimizer step ``step`` (calling it again for the same step, e.g.
        for every micro-batch under gradient accumulation, changes nothing). With ``momentum_compensation``,
        SGD momentum buffers are rescaled by ``f_prev / f`` when the group's factor changed.
        """
        step = check_int("step", step, minimum=0)
        if self._pending is not None:
            # A change from an elastic reset (or any step=None change) starts at the first step it sees.
            self._start_step, self._start_factor, self._target_factor = step, self._last_factor(step), self._pending
            self._pending = None
        f = self.factor(step)
        for group in optimizer.param_groups:
            unscaled = _unscaled_lr(group)
            written = _write_lr(group, unscaled * f)
            group[_UNSCALED], group[_WRITTEN] = unscaled, written
            prev = group.get(_MOMENTUM)
            if prev is None:
                prev = self._last_factor(step)
            if self.momentum_compensation and prev != f:
                ratio = float(prev) / f
                for p in group["params"]:
                    buf = optimizer.state.get(p, {}).get("momentum_buffer")
                    if isinstance(buf, torch.Tensor):
                        buf.mul_(ratio)
            group[_MOMENTUM] = f
        self.last_step = step
        return f

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the unscaled (schedule) learning rates back into ``optimizer``'s param groups.

        A group whose learning rate was changed since :meth:`apply` (by a scheduler or the user) keeps it.
        """
        for group in optimizer.param_groups:
            if _WRITTEN not in group:
                continue
            if _lr_value(group["lr"]) == group[_WRITTEN]:
                _write_lr(group, group[_UNSCALED])
            del group[_WRITTEN], group[_UNSCALED]

    def restore_after_step(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Register a torch step post-hook that calls :meth:`restore` after every ``optimizer.step()``.

        Returns the hook's handle (``handle.remove()`` detaches it).
        """
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: self.restore(opt))

    @contextlib.contextmanager
    def scaled(self, optimizer: torch.optim.Optimizer, step: int) -> Iterator[float]:
        """``with scaler.scaled(optimizer, step): optimizer.step()``: apply, then restore; yields the factor."""
        f = self.apply(optimizer, step)
        try:
            yield f
        finally:
            self.restore(optimizer)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Reference and current global batch, the ramp, gradient statistics and the last applied step."""
        return {
            "rule": self.rule,
            "ramp_steps": self.ramp_steps,
            "reference_batch": self.reference_batch,
            "global_batch": self.global_batch,
            "start_step": self._start_step,
            "start_factor": self._start_factor,
            "target_factor": self._target_factor,
            "pending": self._pending,
            "sigma2": self._sigma2,
            "mu2": self._mu2,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. This scaler's own options (rule, ramp, compensation) stay: a run
        resumed with other options uses them for the next change, the ramp in progress continues."""
        try:
            ref, cur = state["reference_batch"], state["global_batch"]
            self.reference_batch = None if ref is None else int(ref)
            self.global_batch = None if cur is None else int(cur)
            self._start_step = None if state["start_step"] is None else int(state["start_step"])
            self._start_factor = float(state["start_factor"])
            self._target_factor = float(state["target_factor"])
            self._pending = None if state.get("pending") is None else float(state["pending"])
            self._sigma2 = None if state.get("sigma2") is None else float(state["sigma2"])
            self._mu2 = None if state.get("mu2") is None else float(state["mu2"])
            self.last_step = None if state.get("last_step") is None else int(state["last_step"])
        except (KeyError, TypeError, ValueError) as e:  # a field missing, or not a number
            raise ValueError(
                f"`state` is not an LRScaler.state_dict(): {e!r}. HINT: pass the dict LRScaler.state_dict() returned."
            ) from None

    def __repr__(self) -> str:
        return (
            f"LRScaler(rule={self.rule!r}, ramp_steps={self.ramp_steps}, momentum_compensation="
            f"{self.momentum_compensation}, reference_batch={self.reference_batch}, global_batch={self.global_batch})"
        )


def _check_rule(rule: Any) -> str:
    try:
        return check_choice("rule", rule, LR_RULES)
    except ValueError as e:
        raise ValueError(
            f"{e} HINT: 'linear' scales the learning rate with the global batch, 'sqrt' with its square root, "
            "'adascale' by the AdaScale gain, 'none' keeps it."
        ) from None


def _lr_value(lr: Any) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def _unscaled_lr(group: dict[str, Any]) -> float:
    """The schedule's value: remembered if the group still holds what :meth:`LRScaler.apply` wrote."""
    current = _lr_value(group["lr"])
    if _WRITTEN in group and current == group[_WRITTEN]:
        return float(group[_UNSCALED])
    return current


def _write_lr(group: dict[str, Any], value: float) -> float:
    """Set the group's learning rate (in place for a tensor learning rate); return the value as stored."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(value)
        return _lr_value(group["lr"])
    group["lr"] = float(value)
    return float(value)
