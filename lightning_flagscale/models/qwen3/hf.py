"""Qwen3 (``Qwen3ForCausalLM``): RMSNorm over each q/k head before RoPE, explicit ``head_dim``."""

from __future__ import annotations

from typing import Any

from lightning_flagscale.convert.decoder_family import DenseDecoderFamily
from lightning_flagscale.convert.registry import register_family

__all__ = ["Qwen3Family"]


@register_family
class Qwen3Family(DenseDecoderFamily):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    implied = {"qk_norm": True}

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        return {**super().config_to_hf(config), "use_sliding_window": False, "sliding_window": None}
