"""What both balanced strategies share: the bundled ``BatchBalancer`` and its public surface."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl

from hetero_plugins.balancing.options import BalancingOptions, check_keywords
from hetero_plugins.callbacks.batch_balancer import BatchBalancer

__all__ = ["BalancedStrategyMixin", "check_strategy_keywords"]

#: Parameters a strategy's keywords never set: ``self``, the catch-all, and what Lightning passes to DDP itself.
_NOT_KEYWORDS = {"self", "args", "kwargs", "module", "device_ids"}


def check_strategy_keywords(owner: str, kwargs: Mapping[str, Any], *takers: Callable[..., Any]) -> None:
    """Raise a ``TypeError`` for a keyword of ``kwargs`` that none of ``takers`` (the strategy's own
    ``__init__``, its base strategy's, the wrapper it passes the rest to) accepts, nor ``BalancingOptions``.

    Run at construction: a mistyped option (``allocater=``) would otherwise reach ``DistributedDataParallel``
    in every rank and fail there.
    """
    accepted = {f.name for f in dataclasses.fields(BalancingOptions)} | {"policy"}
    for taker in takers:
        accepted |= {n for n, p in inspect.signature(taker).parameters.items()
                     if n not in _NOT_KEYWORDS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    check_keywords(owner, kwargs, accepted, "BalancingOptions, the strategy and what it passes the rest to "
                   f"({', '.join(getattr(t, '__qualname__', str(t)) for t in takers)})")


class BalancedStrategyMixin:
    """Holds ``self.balancer`` (a :class:`~hetero_plugins.callbacks.BatchBalancer`), exposes ``batch_plan`` and
    ``plan_history``, installs the balanced samplers in the loaders Lightning prepares (from the first epoch,
    so plans can change mid-epoch), and puts the balancer among the Trainer's callbacks when the model is
    connected (before checkpoint state is restored, so the balancer's state comes back on resume)."""

    balancer: BatchBalancer

    @property
    def batch_plan(self) -> list[int] | None:
        """Current per-rank batch sizes, global-rank order (``None`` before training starts)."""
        return self.balancer.batch_plan

    @property
    def plan_history(self) -> list[dict[str, Any]]:
        """One dict per epoch (see :class:`~hetero_plugins.callbacks.BatchBalancer`)."""
        return self.balancer.plan_history

    def process_dataloader(self, dataloader: object) -> object:
        """Install per-rank batch sizes (the balanced sampler) in every loader Lightning prepared."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        return self.balancer.prepare_dataloader(dataloader, self.lightning_module.trainer)  # type: ignore[attr-defined]

    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)  # type: ignore[misc]
        trainer = model.trainer
        if not any(cb is self.balancer for cb in trainer.callbacks):
            trainer.callbacks.append(self.balancer)
