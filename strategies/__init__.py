"""Lightning strategies; importing this package registers ``"hetero_ddp"``, ``"hetero_ddp_spawn"`` and ``"hetero_horovod"``."""

from lightning.pytorch.strategies import StrategyRegistry

from hetero_plugins.strategies.hetero_ddp import HeteroDDPStrategy
from hetero_plugins.strategies.hetero_horovod import HeteroHorovodStrategy, HorovodEnvironment

HeteroDDPStrategy.register_strategies(StrategyRegistry)
HeteroHorovodStrategy.register_strategies(StrategyRegistry)

__all__ = ["HeteroDDPStrategy", "HeteroHorovodStrategy", "HorovodEnvironment"]
