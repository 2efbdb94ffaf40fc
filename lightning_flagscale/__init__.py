"""lightning-flagscale: FlagScale/Megatron-class hybrid parallelism behind the standard Lightning Trainer."""

from lightning_flagscale.config import ParallelConfig, TransformerConfig

__all__ = ["ParallelConfig", "TransformerConfig"]
__version__ = "0.1.0"
