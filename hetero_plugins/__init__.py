"""hetero_plugins: heterogeneity-aware data-parallel training for PyTorch Lightning 2.x and Horovod.

The core is framework-free: ``balancing`` (time models, allocators, the planner, samplers), ``aggregation``,
the learned ``scheduler`` (with its simulator) and the top-level modules (telemetry, metrics, the emulator).
``hetero_plugins.callbacks`` and ``hetero_plugins.strategies`` hold the Lightning integration;
``hetero_plugins.horovod`` the hooks for ``horovodrun`` scripts.
"""

from hetero_plugins.balancing.allocators import ALLOCATORS, Allocator, Bounds, get_allocator
from hetero_plugins.emulation import EmulationModel, RandomStalls, Stall
from hetero_plugins.metrics import idle_fraction, straggler_level
from hetero_plugins.balancing.partition import epoch_layout, epoch_shards
from hetero_plugins.balancing.planner import BalancePlanner
from hetero_plugins.balancing.sampler import HeteroBatchSampler, HeteroDistributedSampler
from hetero_plugins.telemetry import StepRecord, StepTimer, SystemMonitor
from hetero_plugins.balancing.time_model import LinearTimeModel, TimeModelParams

# The learned allocators ("dqn", "auto") register themselves when the scheduler is imported; importing it here
# (Python runs this file before any submodule) makes them available to every allocator= option.
from hetero_plugins import scheduler as _scheduler  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = [
    "ALLOCATORS",
    "Allocator",
    "BalancePlanner",
    "Bounds",
    "EmulationModel",
    "HeteroBatchSampler",
    "HeteroDistributedSampler",
    "LinearTimeModel",
    "RandomStalls",
    "Stall",
    "StepRecord",
    "StepTimer",
    "SystemMonitor",
    "TimeModelParams",
    "__version__",
    "epoch_layout",
    "epoch_shards",
    "get_allocator",
    "idle_fraction",
    "straggler_level",
]
