"""Lightning strategies. Importing this package registers ``Trainer(strategy="flagscale")``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_flagscale.strategies.flagscale import FlagScaleStrategy

__all__ = ["FlagScaleStrategy"]

if "flagscale" not in StrategyRegistry:
    StrategyRegistry.register(
        "flagscale", FlagScaleStrategy, description="FlagScale hybrid parallelism (DP/ZeRO/TP/SP/PP/CP/EP)"
    )
