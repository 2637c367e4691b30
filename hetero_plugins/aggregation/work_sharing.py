"""The micro-batch generators of ``deadline`` and ``wbsp``, now in their modes' modules; importable here for one
release (:func:`~hetero_plugins.aggregation.deadline.deadline_micro_batches`,
:func:`~hetero_plugins.aggregation.wbsp.wbsp_micro_batches`)."""

from hetero_plugins.aggregation.deadline import deadline_micro_batches
from hetero_plugins.aggregation.wbsp import wbsp_micro_batches

__all__ = ["deadline_micro_batches", "wbsp_micro_batches"]
