"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``): q/k/v bias and a sigmoid-gated shared expert."""

from __future__ import annotations

from typing import Any

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.families._qwen_moe import QwenMoEFamily
from lightning_flagscale.convert.registry import HFConversionError, register_family

__all__ = ["Qwen2MoEFamily"]


@register_family
class Qwen2MoEFamily(QwenMoEFamily):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    attention_bias_key = "qkv_bias"  # transformers 5 field; older configs omit it (always on)
    attention_bias_default = True
    has_shared_expert = True

    def extra_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(
            **super().extra_from_hf(hf),
            num_shared_experts=1,
            shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
            shared_expert_gate=True,
        )

    def check_ours(self, config: TransformerConfig) -> None:
        super().check_ours(config)
        if config.num_shared_experts != 1 or not config.shared_expert_gate:
            raise HFConversionError(
                "qwen2_moe has exactly one sigmoid-gated shared expert block; got num_shared_experts="
                f"{config.num_shared_experts}, shared_expert_gate={config.shared_expert_gate}."
            )

    def extra_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        shared = config.shared_expert_intermediate_size or config.moe_intermediate_size * config.num_shared_experts
        return {**super().extra_to_hf(config), "shared_expert_intermediate_size": shared}
