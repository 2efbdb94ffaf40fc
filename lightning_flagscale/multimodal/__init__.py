"""Vision-language models, re-exported from their family folder ``models/qwen2_5_vl/`` (issue 38): the Qwen2.5-VL
vision tower, the VLM around our decoder, its LightningModule and data. Recipes name ``lightning_flagscale.multimodal.
VLMModule`` / ``VLMDataModule``; both paths stay."""

from lightning_flagscale.models.qwen2_5_vl import (
    VLM_PRESETS,
    VisionConfig,
    VisionLanguageModel,
    VisionTower,
    VLMConfig,
    VLMDataModule,
    VLMModule,
    apply_vision_recompute,
    mrope_position_ids,
    pad_batch_to_max,
    vlm_param_groups,
)

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
