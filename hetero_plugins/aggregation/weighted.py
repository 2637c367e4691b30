"""``aggregation="weighted"``: the framework's own all-reduce sums sample-weighted gradients.

Every rank processes its planned share, and its gradients are scaled by its share b_i / B of the step while
they are computed (a DDP comm hook, or tensor hooks ahead of Horovod's own), so the framework's summing
all-reduce yields the mean gradient over the step's samples (LBB, Yao et al. 2024; DBS, Ye et al. 2020): exact
DDP maths with per-rank batch sizes. The reduction happens during the backward pass, so
:class:`WeightedAggregator` only accounts for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hetero_plugins.aggregation.base import Aggregator, StepContext
from hetero_plugins.aggregation.microbatch import MicroBatch
from hetero_plugins.aggregation.options import AggregationOptions  # noqa: F401 - the doctest uses it

__all__ = ["WeightedAggregator"]


class WeightedAggregator(Aggregator):
    """``aggregation="weighted"``: :meth:`exchange` counts the gradient bytes the framework reduced (one round
    per optimizer step, uncompressed) and always lets the optimizer step.

    Example::

        >>> from hetero_plugins.collectives import TorchCollectives
        >>> agg = WeightedAggregator(AggregationOptions(), TorchCollectives(), [torch.zeros(4, requires_grad=True)])
        >>> agg.exchange(StepContext(step=0, counts=(3, 5), rank=0)), agg.stats.bytes, agg.stats.rounds
        (True, 16, 1)
    """

    mode = "weighted"

    def _init_state(self, buffers: Iterable[torch.Tensor]) -> None:
        self._gradient_bytes = sum(p.numel() * p.element_size() for p in self.params)

    def micro_batches(self, batch: Any, ctx: StepContext) -> Iterator[MicroBatch]:
        """The batch whole, its gradient weighted by this rank's share b_i / B (the framework sums)."""
        yield MicroBatch(batch, samples=ctx.counts[ctx.rank], owner=ctx.rank, step=ctx.step, weight=ctx.weight)

    def exchange(self, ctx: StepContext) -> bool:
        self.stats.bytes += self._gradient_bytes
        self.stats.rounds += 1
        return True
