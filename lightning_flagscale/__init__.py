"""lightning-flagscale: FlagScale/Megatron-class hybrid parallelism behind the standard Lightning Trainer."""

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.precision import FlagScalePrecision
from lightning_flagscale.strategies import FlagScaleStrategy

__all__ = ["FlagScalePrecision", "FlagScaleStrategy", "ParallelConfig", "TransformerConfig"]
__version__ = "0.1.0"
