"""Per epoch: step records in, per-rank batch sizes out (numpy and torch data only, no training framework)."""

from hetero_plugins.balancing.allocators import ALLOCATORS, Allocator, Bounds, get_allocator
from hetero_plugins.balancing.coordinator import EpochAdvisor, PlanCoordinator
from hetero_plugins.balancing.options import BalancingOptions
from hetero_plugins.balancing.partition import epoch_layout, epoch_shards
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.sampler import HeteroBatchSampler, HeteroDistributedSampler
from hetero_plugins.balancing.time_model import LinearTimeModel, TimeModelParams

__all__ = [
    "ALLOCATORS",
    "Allocator",
    "BalancePlanner",
    "BalancingOptions",
    "Bounds",
    "EpochAdvisor",
    "HeteroBatchSampler",
    "HeteroDistributedSampler",
    "LinearTimeModel",
    "PlanCoordinator",
    "TimeModelParams",
    "epoch_layout",
    "epoch_shards",
    "get_allocator",
]
