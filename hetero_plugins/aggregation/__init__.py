"""Per step: how the ranks' work of one step becomes one update (torch, no training framework).

The modes and their options are described in :mod:`hetero_plugins.aggregation.options`. Each mode is one
:class:`~hetero_plugins.aggregation.base.Aggregator` in its own module (``weighted``, ``deadline``, ``wbsp``,
``pseudo_sync``, ``local_sgd``), registered in :data:`AGGREGATORS`; :func:`make_aggregator` builds the one an
``aggregation=`` value names. The Lightning strategies and ``hetero_plugins.horovod.DistributedOptimizer`` are
thin adapters over them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hetero_plugins.aggregation.base import AggregationStats, Aggregator, StepContext
from hetero_plugins.aggregation.deadline import DeadlineAggregator
from hetero_plugins.aggregation.local_sgd import LocalSGDAggregator
from hetero_plugins.aggregation.options import AGGREGATION_MODES, AggregationOptions, resolve_aggregation
from hetero_plugins.aggregation.pseudo_sync import PseudoSyncAggregator
from hetero_plugins.aggregation.wbsp import WBSPAggregator
from hetero_plugins.aggregation.weighted import WeightedAggregator
from hetero_plugins.collectives import Collectives

__all__ = [
    "AGGREGATION_MODES",
    "AGGREGATORS",
    "AggregationOptions",
    "AggregationStats",
    "Aggregator",
    "StepContext",
    "make_aggregator",
    "resolve_aggregation",
]

#: The aggregator of each ``aggregation=`` mode.
AGGREGATORS: dict[str, type[Aggregator]] = {
    cls.mode: cls
    for cls in (WeightedAggregator, DeadlineAggregator, WBSPAggregator, PseudoSyncAggregator, LocalSGDAggregator)
}


def make_aggregator(
    aggregation: str | AggregationOptions | None,
    comm: Collectives,
    params: Iterable[torch.Tensor],
    buffers: Iterable[torch.Tensor] = (),
) -> Aggregator:
    """The :class:`~hetero_plugins.aggregation.base.Aggregator` of ``aggregation`` (a mode name or options).

    Args:
        aggregation: as given to a strategy or optimizer (``None``: ``"weighted"``).
        comm: the transport the exchanges run on.
        params: the parameters the optimizer updates (same order on every rank).
        buffers: other tensors ``local_sgd`` averages (floating module buffers, frozen parameters).

    Example::

        >>> from hetero_plugins.collectives import TorchCollectives
        >>> type(make_aggregator("deadline", TorchCollectives(), [])).__name__
        'DeadlineAggregator'
    """
    options = resolve_aggregation(aggregation)
    return AGGREGATORS[options.mode](options, comm, params, buffers)
