"""Configuration of the Qwen2.5-VL-class vision-language model: the vision tower and the VLM around the decoder.

``VLMConfig`` *is* a :class:`~lightning_flagscale.config.TransformerConfig` (the language model's shape, inherited
field by field) plus the vision tower, the M-RoPE sections and the special token ids. Being a ``TransformerConfig``
is what lets the unchanged strategy validate a TP/ZeRO layout against the language model, and what lets the HF
converter machinery (``weight_specs(config)``) and ``apply_tp``'s divisibility checks read it as they read any
decoder's config. The vision tower is replicated across TP (see ``model.py``), so it needs no TP checks.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lightning_flagscale.config import TransformerConfig, check_known_fields
from lightning_flagscale.models.qwen2_5_vl.presets import VLM_PRESETS

__all__ = ["VLMConfig", "VisionConfig"]


@dataclass(kw_only=True)
class VisionConfig:
    """Shape of the Qwen2.5-VL vision tower (ViT with window attention and a 2x2 patch merger)."""

    depth: int = 4
    """Number of vision blocks."""
    hidden_size: int = 32
    """ViT width."""
    intermediate_size: int = 64
    """SwiGLU inner width of the vision MLPs (they carry biases)."""
    num_heads: int = 2
    """Attention heads of the ViT."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 14
    """Spatial patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (a still image is repeated to fill it)."""
    spatial_merge_size: int = 2
    """The merger concatenates ``m x m`` neighbouring patches into one LLM token."""
    window_size: int = 112
    """Side of the attention windows in pixels (``window_size // patch_size // spatial_merge_size`` merged tokens)."""
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [3])
    """Blocks that attend over the whole image instead of a window."""
    rope_theta: float = 10000.0
    """Base of the 2D (height, width) rotary embedding."""
    initializer_range: float = 0.02
    """Std of the normal init of the tower's weights."""

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"VisionConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"VisionConfig.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}."
            )
        if self.head_dim % 4:
            raise ValueError(
                f"The vision head_dim={self.head_dim} must be a multiple of 4 (2D RoPE over height and width halves)."
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"fullatt_block_indexes {bad} are outside the {self.depth} vision blocks.")
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size < unit:
            raise ValueError(f"window_size={self.window_size} is smaller than one merged patch ({unit} pixels).")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch row of ``pixel_values``: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per LLM token."""
        return self.spatial_merge_size**2


@dataclass(kw_only=True)
class VLMConfig(TransformerConfig):
    """A decoder LM (the inherited fields) with a Qwen2.5-VL vision tower and multimodal RoPE."""

    hf_model_type: ClassVar[str] = "qwen2_5_vl"
    """HF family that expresses this config (read by the converter registry on export)."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    """The vision tower."""
    mrope_section: list[int] = field(default_factory=lambda: [2, 3, 3])
    """Rotary frequency bands for (temporal, height, width); sums to ``head_dim // 2``."""
    image_token_id: int = 260
    """``<|image_pad|>``: one per merged image token, replaced by the vision features."""
    video_token_id: int = 261
    """``<|video_pad|>`` (videos are not supported yet; kept for HF round trips)."""
    vision_start_token_id: int = 258
    """``<|vision_start|>``."""
    vision_end_token_id: int = 259
    """``<|vision_end|>``."""

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):  # YAML / JSON / LightningCLI give the nested config as a dict
            check_known_fields(VisionConfig, self.vision)
            self.vision = VisionConfig(**self.vision)
        super().__post_init__()
        if sum(self.mrope_section) != self.head_dim // 2 or len(self.mrope_section) != 3:
            raise ValueError(
                f"mrope_section={self.mrope_section} must have 3 entries summing to head_dim // 2 = {self.head_dim // 2}."
            )
        if self.is_moe:
            raise ValueError("VLMConfig supports a dense language model only (num_experts=0).")
        ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"Special token ids {bad} are outside the vocabulary (vocab_size={self.vocab_size}).")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> VLMConfig:
        """A registered VLM preset (``qwen2.5-vl-tiny``) with optional overrides (``vision`` may be a dict)."""
        if name not in VLM_PRESETS:
            close = difflib.get_close_matches(name, list(VLM_PRESETS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown VLM preset {name!r}.{hint} Available: {', '.join(sorted(VLM_PRESETS))}.")
        check_known_fields(cls, overrides)
        fields = {**VLM_PRESETS[name], "name": name, **overrides}
        vision = fields.pop("vision", {})
        if isinstance(vision, dict):
            vision = VisionConfig(**{**VLM_PRESETS[name].get("vision", {}), **vision})
        return cls(vision=vision, **fields)

    @classmethod
    def owns(cls, value: str | dict[str, Any]) -> bool:
        """Whether a config a checkpoint stored (a preset name or a dict of fields) is a ``VLMConfig``'s: one of its
        presets, or fields with a vision tower. Read by the HF export to rebuild the config without naming it."""
        if isinstance(value, str):
            return value in VLM_PRESETS
        return "vision" in dict(value) or dict(value).get("preset") in VLM_PRESETS

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> VLMConfig:
        """Inverse of ``to_dict`` (also accepts ``{"preset": name, **overrides}``)."""
        fields = dict(fields)
        preset = fields.pop("preset", None)
        if preset is not None:
            return cls.from_preset(preset, **fields)
        fields.pop("hf_model_type", None)
        check_known_fields(cls, fields)
        return cls(**fields)
