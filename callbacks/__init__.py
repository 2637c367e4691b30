"""Lightning callbacks: drop-in balancing beside the stock ``"ddp"`` strategy, straggler measurement, and a
heterogeneity emulator."""

from hetero_plugins.callbacks.batch_balancer import BatchBalancer
from hetero_plugins.callbacks.comm_hook import WeightedAllreduceState, weighted_allreduce_hook
from hetero_plugins.callbacks.heterogeneity_emulator import HeterogeneityEmulator
from hetero_plugins.callbacks.lr_adapter import LRAdapter
from hetero_plugins.callbacks.straggler_monitor import StragglerMonitor

__all__ = [
    "BatchBalancer",
    "HeterogeneityEmulator",
    "LRAdapter",
    "StragglerMonitor",
    "WeightedAllreduceState",
    "weighted_allreduce_hook",
]
