"""Lightning callbacks: drop-in balancing beside the stock ``"ddp"`` strategy, and a heterogeneity emulator."""

from hetero_plugins.callbacks.batch_balancer import BatchBalancer
from hetero_plugins.callbacks.comm_hook import WeightedAllreduceState, weighted_allreduce_hook
from hetero_plugins.callbacks.heterogeneity_emulator import HeterogeneityEmulator

__all__ = ["BatchBalancer", "HeterogeneityEmulator", "WeightedAllreduceState", "weighted_allreduce_hook"]
