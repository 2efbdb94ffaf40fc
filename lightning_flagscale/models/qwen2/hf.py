"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): q/k/v projections always carry a bias."""

from __future__ import annotations

from typing import Any

from lightning_flagscale.convert.decoder_family import DenseDecoderFamily
from lightning_flagscale.convert.registry import register_family

__all__ = ["Qwen2Family"]


@register_family
class Qwen2Family(DenseDecoderFamily):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    implied = {"attention_bias": True}
    attention_bias_key = None  # implied by the architecture, not a config.json field

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        return {**super().config_to_hf(config), "use_sliding_window": False, "sliding_window": None}
