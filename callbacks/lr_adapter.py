"""``LRAdapter``: the learning rate follows the global batch when the world or the batch changes.

Add it to any run whose global batch may change: a torchrun elastic restart (or any resume from a checkpoint)
with another number of processes, or a user who changes the batch between epochs::

    trainer = Trainer(strategy="ddp", devices=4, callbacks=[LRAdapter(rule="linear", ramp_steps=8)])

The global batch (samples per optimizer step over all ranks) is the sum of ``trainer.strategy.batch_plan``
under ``HeteroDDPStrategy`` / ``HeteroHorovodStrategy`` (or of a ``BatchBalancer`` callback's plan), else the
train loader's per-rank batch size x ``trainer.world_size``, times ``accumulate_grad_batches``. The first one
seen is the reference the learning rates are tuned for; it and the scaler's ramp are saved in the checkpoint,
so a run resumed with another world size changes the learning rate by the rule, smoothly over
``ramp_steps`` optimizer steps, with momentum compensation (Dynamic mini-batch SGD, Lin et al. 2019; see
:mod:`hetero_plugins.lr_scaling`). The global batch is checked at every epoch start.

The factor multiplies the learning rate the user's optimizer and schedulers set: it is written into every
param group in ``on_train_batch_start`` and taken out again right after ``optimizer.step()`` (a torch step
post-hook), before Lightning steps the schedulers, so schedulers, ``LearningRateMonitor`` at epoch level and
checkpoints see the schedule's own values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from hetero_plugins._validation import check_bool
from hetero_plugins.collectives import release_process_group_at_exit
from hetero_plugins.lr_scaling import LRScaler

log = logging.getLogger(__name__)

__all__ = ["LRAdapter"]

GradientStatsFn = Callable[[pl.Trainer, pl.LightningModule], tuple[float, float] | None]


class LRAdapter(Callback):
    """Scales the learning rate with the global batch by a rule, ramped, with momentum compensation.

    Args:
        rule: ``"linear"`` (default), ``"sqrt"``, ``"adascale"`` or ``"none"``.
        ramp_steps: optimizer steps over which the learning rate moves to its new value (0: at once).
        momentum_compensation: rescale SGD momentum buffers at a change so the accumulated history keeps its
            update size.
        reference_batch: the global batch the configured learning rates are tuned for; ``None``: the global
            batch of the first run. A checkpoint's reference wins over both.
        gradient_stats: for ``rule="adascale"``: called after every optimizer step's backward
            (``on_before_optimizer_step``) as ``gradient_stats(trainer, pl_module)``, returns
            ``(sigma2, mu2)`` (see :func:`~hetero_plugins.lr_scaling.adascale_gain` and
            :func:`~hetero_plugins.lr_scaling.gradient_noise_stats`) or ``None``; the latest values are kept in
            the checkpoint, so a resumed run's gain uses the statistics measured before the restart.
        log_metrics: log ``hetero/lr_scale`` (the factor of every step) through the LightningModule.

    Attributes:
        scaler: the :class:`~hetero_plugins.lr_scaling.LRScaler` (reference, current global batch, ramp).
        changes: one dict per detected change in this process: ``step``, ``old``, ``new`` (global batches),
            ``target_factor``.

    Example::

        >>> adapter = LRAdapter(rule="sqrt", ramp_steps=4)
        >>> adapter.scaler.rule, adapter.scaler.ramp_steps
        ('sqrt', 4)
    """

    def __init__(
        self,
        rule: str = "linear",
        ramp_steps: int = 8,
        momentum_compensation: bool = True,
        reference_batch: int | None = None,
        gradient_stats: GradientStatsFn | None = None,
        log_metrics: bool = True,
    ) -> None:
        self.scaler = LRScaler(
            rule=rule, ramp_steps=ramp_steps, momentum_compensation=momentum_compensation,
            reference_batch=reference_batch,
        )
        if gradient_stats is not None and not callable(gradient_stats):
            raise ValueError(
                f"`gradient_stats` must be a callable (trainer, pl_module) -> (sigma2, mu2), got {gradient_stats!r}. "
                "HINT: pass a function, or None."
            )
        if gradient_stats is not None and rule != "adascale":
            raise ValueError(
                f"`gradient_stats` is only used by rule='adascale', got rule={rule!r}. HINT: drop `gradient_stats` "
                "or use rule='adascale'."
            )
        self.gradient_stats = gradient_stats
        self.log_metrics = check_bool("log_metrics", log_metrics, hint="False logs no metrics")
        self.changes: list[dict[str, Any]] = []
        self._hooks: list[Any] = []
        self._warned: set[str] = set()

    @property
    def state_key(self) -> str:
        return "LRAdapter"

    # ------------------------------------------------------------------ global batch
    def global_batch(self, trainer: pl.Trainer) -> int | None:
        """Samples per optimizer step over all ranks (``None`` when it cannot be told)."""
        plan = getattr(trainer.strategy, "batch_plan", None)
        if plan is None:
            plans = (getattr(cb, "batch_plan", None) for cb in trainer.callbacks)
            plan = next((p for p in plans if p is not None), None)  # a BatchBalancer beside stock DDP
        if plan is not None:
            per_step = int(sum(plan))
        else:
            dl = trainer.train_dataloader
            bs = dl.batch_sampler if isinstance(dl, DataLoader) else None
            sampler_plan = getattr(bs, "plan", None)
            if sampler_plan is not None:  # a user-supplied HeteroBatchSampler
                per_step = int(sum(sampler_plan))
            else:
                local = getattr(bs, "batch_size", None) if bs is not None else None
                if not isinstance(local, int):
                    return None
                per_step = local * trainer.world_size
        return per_step * int(trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        release_process_group_at_exit()
        for opt in trainer.optimizers:
            self._hooks.append(self.scaler.restore_after_step(opt))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batch = self.global_batch(trainer)
        if batch is None:
            self._warn_once("batch", "LRAdapter: cannot tell the global batch (the train loader is not a batched "
                            "DataLoader); the learning rate is not adapted.")
            return
        scaler = self.scaler
        if scaler.reference_batch is None:
            scaler.set_reference(batch)
            rank_zero_info(f"LRAdapter: reference global batch {batch} (the configured learning rates are tuned to it)")
            return
        if batch == scaler.global_batch:
            return
        old, step = scaler.global_batch, trainer.global_step
        gain = None
        if scaler.rule == "adascale" and scaler.gradient_stats is None:
            self._warn_once("stats", "LRAdapter(rule='adascale'): no gradient statistics yet; gain 1 (learning "
                            "rate kept). HINT: pass gradient_stats=... to the callback.")
            gain = 1.0
        target = scaler.on_global_batch_change(batch, step=step, gain=gain)
        self.changes.append({"step": step, "old": old, "new": batch, "target_factor": target})
        rank_zero_info(
            f"LRAdapter: global batch {old} -> {batch} (reference {scaler.reference_batch}) at step {step}: "
            f"learning rate x{target:.4g} of the schedule by rule {scaler.rule!r}, ramped over "
            f"{scaler.ramp_steps} steps{' with momentum compensation' if scaler.momentum_compensation else ''}"
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.scaler.reference_batch is None:
            return
        factor = 1.0
        for opt in trainer.optimizers:
            factor = self.scaler.apply(opt, trainer.global_step)
        if self.log_metrics:
            pl_module.log("hetero/lr_scale", factor, on_step=True, on_epoch=False, batch_size=1)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.gradient_stats is None:
            return
        stats = self.gradient_stats(trainer, pl_module)
        if stats is not None:
            self.scaler.observe_gradient_stats(*stats)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])

    # ------------------------------------------------------------------ helpers
    def _detach(self, trainer: pl.Trainer) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for opt in trainer.optimizers:
            self.scaler.restore(opt)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)
