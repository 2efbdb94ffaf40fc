"""Typed, validated configuration: the parallel layout, the transformer shape and its presets.

Each dataclass validates itself where it lives, before any process group exists, and every user mistake raises
``ValueError``/``TypeError`` naming the value and the fix. Nothing here touches ``torch.distributed`` or imports a
model: the presets are data that the model families register (``presets.py``), read by
``TransformerConfig.from_preset``.
"""

from lightning_flagscale.config.fields import check_known_fields
from lightning_flagscale.config.parallel import ParallelConfig, RecomputeMode
from lightning_flagscale.config.presets import PRESETS, register_presets
from lightning_flagscale.config.transformer import TransformerConfig

__all__ = [
    "PRESETS",
    "ParallelConfig",
    "RecomputeMode",
    "TransformerConfig",
    "check_known_fields",
    "register_presets",
]
