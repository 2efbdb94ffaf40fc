"""lightning-flagscale: FlagScale/Megatron-class hybrid parallelism behind the standard Lightning Trainer."""

from lightning_flagscale import (
    convert,  # noqa: F401  (registers the HF weight source for from_hf)
    models,  # noqa: F401  (registers every family's presets and HF converter)
)
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.precision import FlagScalePrecision
from lightning_flagscale.strategies import FlagScaleStrategy

__all__ = ["FlagScalePrecision", "FlagScaleStrategy", "ParallelConfig", "TransformerConfig"]
__version__ = "0.1.0"
