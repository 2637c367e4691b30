"""Per step: how the ranks' work of one step becomes one update (torch, no training framework).

The modes are described in :mod:`hetero_plugins.aggregation.options`.
"""

from hetero_plugins.aggregation.options import AGGREGATION_MODES, AggregationOptions, resolve_aggregation

__all__ = ["AGGREGATION_MODES", "AggregationOptions", "resolve_aggregation"]
