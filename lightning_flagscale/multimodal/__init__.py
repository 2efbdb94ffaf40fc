"""Vision-language models: the Qwen2.5-VL vision tower, the VLM around our decoder, its LightningModule and data."""

from lightning_flagscale.multimodal.config import VLM_PRESETS, VisionConfig, VLMConfig
from lightning_flagscale.multimodal.datamodule import VLMDataModule
from lightning_flagscale.multimodal.module import VLMModule, vlm_param_groups
from lightning_flagscale.multimodal.prealloc import pad_batch_to_max
from lightning_flagscale.multimodal.qwen2_5_vl import VisionLanguageModel, mrope_position_ids
from lightning_flagscale.multimodal.vision import VisionTower, apply_vision_recompute

__all__ = [
    "VLM_PRESETS",
    "VLMConfig",
    "VLMDataModule",
    "VLMModule",
    "VisionConfig",
    "VisionLanguageModel",
    "VisionTower",
    "apply_vision_recompute",
    "mrope_position_ids",
    "pad_batch_to_max",
    "vlm_param_groups",
]
