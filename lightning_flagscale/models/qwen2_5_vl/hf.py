"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2 decoder with M-RoPE + the window-attention ViT.

Checkpoint names (as ``transformers`` 4.x/5.x write them and as the Hub checkpoints hold them): the language model
under ``model.`` (``model.embed_tokens``, ``model.layers.N.*``, ``model.norm``), the head as ``lm_head.weight``, the
tower under ``visual.`` with our names verbatim. ``config.json`` comes either nested (``text_config`` /
``vision_config``, transformers 5) or flat (text fields at the top level, Hub checkpoints); both are read, nested
is written. ``rope_scaling``/``rope_parameters`` carry ``mrope_section`` (type ``mrope`` or ``default``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.decoder_family import DenseDecoderFamily, field, reject_unless, rope_to_hf
from lightning_flagscale.convert.registry import HFConversionError, register_family
from lightning_flagscale.convert.specs import Direct, Spec
from lightning_flagscale.models.qwen2_5_vl.config import VisionConfig, VLMConfig
from lightning_flagscale.models.qwen2_5_vl.model import VisionLanguageModel
from lightning_flagscale.models.qwen2_5_vl.module import VLMModule

__all__ = ["Qwen2_5_VLFamily"]

_TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_TEXT_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig) if f.init}


def _text_hf(hf: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """The text part of ``config.json`` with M-RoPE taken out of its RoPE dicts (rest is plain RoPE)."""
    text = dict(hf.get("text_config") or hf)
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = dict(text.get(key) or {})
        if "mrope_section" in rope:
            section = [int(s) for s in rope.pop("mrope_section")]
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text[key] = rope or None
    if section is None:
        raise HFConversionError("config.json has no 'mrope_section' in rope_scaling/rope_parameters.")
    if "tie_word_embeddings" in hf:  # transformers 5 keeps it at the top level
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text, section


def _vision_from_hf(vision: dict[str, Any], text_hidden: int) -> VisionConfig:
    reject_unless(vision, "hidden_act", ("silu",), "the vision MLP is SwiGLU")
    if int(field(vision, "out_hidden_size")) != text_hidden:
        raise HFConversionError(
            f"vision_config.out_hidden_size={vision['out_hidden_size']} differs from the text hidden_size={text_hidden}."
        )
    rope = dict(vision.get("rope_parameters") or {})
    return VisionConfig(
        depth=int(field(vision, "depth")),
        hidden_size=int(field(vision, "hidden_size")),
        intermediate_size=int(field(vision, "intermediate_size")),
        num_heads=int(field(vision, "num_heads")),
        in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        patch_size=int(vision.get("patch_size", 14)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        window_size=int(vision.get("window_size", 112)),
        fullatt_block_indexes=[int(i) for i in vision.get("fullatt_block_indexes", [7, 15, 23, 31])],
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        initializer_range=float(vision.get("initializer_range", 0.02)),
    )


def vision_weight_names(vision: VisionConfig) -> list[str]:
    """Every parameter of the tower, relative to ``visual.`` (same names in HF and here)."""
    names = ["patch_embed.proj.weight"]
    for i in range(vision.depth):
        p = f"blocks.{i}."
        names += [p + "norm1.weight", p + "norm2.weight"]
        for lin in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names += [f"{p}{lin}.weight", f"{p}{lin}.bias"]
    names += ["merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias"]
    names += ["merger.mlp.2.weight", "merger.mlp.2.bias"]
    return names


@register_family
class Qwen2_5_VLFamily(DenseDecoderFamily):
    model_type = "qwen2_5_vl"
    architecture = "Qwen2_5_VLForConditionalGeneration"
    model_class = VisionLanguageModel
    config_class = VLMConfig
    lightning_module = VLMModule
    implied = {"attention_bias": True}
    attention_bias_key = None  # q/k/v bias is fixed by the architecture
    default_rope_theta = 1000000.0
    default_rms_norm_eps = 1e-6

    def config_from_hf(self, hf: dict[str, Any], **overrides: Any) -> VLMConfig:
        text, section = _text_hf(hf)
        text_overrides = {k: v for k, v in overrides.items() if k in _TEXT_FIELDS}
        base = super().config_from_hf(text, **text_overrides)
        vision = _vision_from_hf(dict(field(hf, "vision_config")), base.hidden_size)
        values = {**dataclasses.asdict(base), "vision": vision, "mrope_section": section}
        values.update({k: int(hf[k]) for k in _TOKEN_IDS if k in hf})
        values.update({k: v for k, v in overrides.items() if k not in _TEXT_FIELDS})
        try:
            return VLMConfig(**values)
        except (TypeError, ValueError) as err:
            raise HFConversionError(f"config.json cannot be expressed as a VLMConfig: {err}") from err

    def check_ours(self, config: TransformerConfig) -> None:
        if not isinstance(config, VLMConfig):
            raise HFConversionError(f"{self.model_type} needs a VLMConfig (a vision tower), got a plain decoder.")
        super().check_ours(config)

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        text = super().config_to_hf(config)  # also runs check_ours
        for key in ("architectures", "rope_scaling"):
            text.pop(key)
        text.update(model_type="qwen2_5_vl_text", use_sliding_window=False, sliding_window=None)
        rope = rope_to_hf(config)["rope_parameters"]
        text["rope_parameters"] = {**rope, "mrope_section": list(config.mrope_section)}
        v = config.vision
        vision = dict(
            model_type="qwen2_5_vl_vision", depth=v.depth, hidden_size=v.hidden_size, hidden_act="silu",
            intermediate_size=v.intermediate_size, num_heads=v.num_heads, in_channels=v.in_channels,
            patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
            spatial_merge_size=v.spatial_merge_size, window_size=v.window_size, out_hidden_size=config.hidden_size,
            fullatt_block_indexes=list(v.fullatt_block_indexes), initializer_range=v.initializer_range,
            rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
        )  # fmt: skip
        return dict(
            architectures=[self.architecture],
            model_type=self.model_type,
            text_config=text,
            vision_config=vision,
            tie_word_embeddings=config.tie_word_embeddings,
            **{k: getattr(config, k) for k in _TOKEN_IDS},
        )

    def weight_specs(self, config: TransformerConfig) -> dict[str, Spec]:
        if not isinstance(config, VLMConfig):
            raise HFConversionError(f"{self.model_type} needs a VLMConfig (a vision tower), got a plain decoder.")
        specs = super().weight_specs(config)
        specs.update({f"visual.{n}": Direct(f"visual.{n}") for n in vision_weight_names(config.vision)})
        return specs
