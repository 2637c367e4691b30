"""Lightning strategies; importing this package registers ``"hetero_ddp"`` and ``"hetero_ddp_spawn"``."""

from lightning.pytorch.strategies import StrategyRegistry

from hetero_plugins.strategies.hetero_ddp import HeteroDDPStrategy

HeteroDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["HeteroDDPStrategy"]
