"""Vision-language models: the Qwen2.5-VL vision tower, the VLM around our decoder, its LightningModule and data."""

from lightning_flagscale.multimodal.config import VLM_PRESETS, VisionConfig, VLMConfig
from lightning_flagscale.multimodal.qwen2_5_vl import VisionLanguageModel, mrope_position_ids
from lightning_flagscale.multimodal.vision import VisionTower

__all__ = [
    "VLM_PRESETS",
    "VLMConfig",
    "VisionConfig",
    "VisionLanguageModel",
    "VisionTower",
    "mrope_position_ids",
]
