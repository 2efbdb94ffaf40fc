"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``): q/k/v bias and a sigmoid-gated shared expert.

``QwenMoEFamily`` holds the config fields Qwen2-MoE shares with Qwen3-MoE, which builds on it (as the
``transformers`` Qwen3-MoE code is copied from Qwen2-MoE).
"""

from __future__ import annotations

from typing import Any

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.moe_family import MoEDecoderFamily, moe_layers_from_hf
from lightning_flagscale.convert.registry import HFConversionError, register_family

__all__ = ["Qwen2MoEFamily", "QwenMoEFamily"]


class QwenMoEFamily(MoEDecoderFamily):
    """``decoder_sparse_step`` / ``mlp_only_layers`` pick the MoE blocks; the others use ``intermediate_size``."""

    def extra_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        layers = moe_layers_from_hf(
            int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
        )
        return dict(
            **self.moe_extra_from_hf(hf),
            **layers,
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )

    def extra_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        # sparse step 1 + an explicit dense list expresses any of our layouts exactly.
        dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
        return dict(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            router_aux_loss_coef=config.moe_aux_loss_coeff,
            use_sliding_window=False,
            sliding_window=None,
        )


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
