"""Qwen2.5-VL: the vision tower (``vision.py``: window-attention ViT, 2D RoPE, patch merger) feeding the generic
decoder with multimodal RoPE (``model.py``), its config and presets (``config.py``, ``presets.py``), image-text data
and batching (``image.py``, ``data.py``, ``batching.py``, ``prealloc.py``, ``datamodule.py``), the LightningModule
(``module.py``) and the HF converter (``hf.py``, registered on import). ``lightning_flagscale.multimodal``
re-exports the public names."""

from lightning_flagscale.models.qwen2_5_vl.config import VisionConfig, VLMConfig
from lightning_flagscale.models.qwen2_5_vl.datamodule import VLMDataModule
from lightning_flagscale.models.qwen2_5_vl.hf import Qwen2_5_VLFamily
from lightning_flagscale.models.qwen2_5_vl.model import VisionLanguageModel, mrope_position_ids
from lightning_flagscale.models.qwen2_5_vl.module import VLMModule, vlm_param_groups
from lightning_flagscale.models.qwen2_5_vl.prealloc import pad_batch_to_max
from lightning_flagscale.models.qwen2_5_vl.presets import VLM_PRESETS
from lightning_flagscale.models.qwen2_5_vl.vision import VisionTower, apply_vision_recompute

__all__ = [
    "VLM_PRESETS",
    "Qwen2_5_VLFamily",
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
