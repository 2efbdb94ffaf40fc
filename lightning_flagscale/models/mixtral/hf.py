"""Mixtral (``MixtralForCausalLM``): every block is MoE, softmax top-k router renormalised over the chosen experts.

HF names: ``block_sparse_moe.gate`` and per expert ``w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

from typing import Any

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.decoder_family import max_seq_len_ok, reject_unless
from lightning_flagscale.convert.moe_family import MoEDecoderFamily
from lightning_flagscale.convert.registry import HFConversionError, register_family

__all__ = ["MixtralFamily"]


@register_family
class MixtralFamily(MoEDecoderFamily):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    attention_bias_key = None
    moe_prefix = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
    default_rms_norm_eps = 1e-5
    default_rope_theta = 1e6

    def check_hf(self, hf: dict[str, Any], max_seq_len: int) -> None:
        super().check_hf(hf, max_seq_len)
        reject_unless(hf, "router_jitter_noise", (0, 0.0, None), "no router jitter")
        if not max_seq_len_ok(hf.get("sliding_window"), max_seq_len):
            raise HFConversionError(
                f"config.json field 'sliding_window'={hf['sliding_window']} is shorter than max_seq_len="
                f"{max_seq_len}; our attention has no sliding window, so pass max_seq_len<={hf['sliding_window']}."
            )

    def extra_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        # Mixtral's intermediate_size is the expert width; it has no dense MLP.
        return {**self.moe_extra_from_hf(hf), "moe_intermediate_size": int(hf["intermediate_size"])}

    def check_ours(self, config: TransformerConfig) -> None:
        super().check_ours(config)
        if config.first_k_dense_layers or config.moe_layer_freq != 1 or not config.norm_topk_prob:
            raise HFConversionError(
                "mixtral needs every layer MoE (first_k_dense_layers=0, moe_layer_freq=1) and norm_topk_prob=True."
            )

    def extra_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        return dict(
            intermediate_size=config.moe_intermediate_size,
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            router_aux_loss_coef=config.moe_aux_loss_coeff,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
