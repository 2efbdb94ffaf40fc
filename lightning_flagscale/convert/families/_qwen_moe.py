"""Config fields shared by Qwen2-MoE and Qwen3-MoE: expert widths, sparse-layer layout, top-k renormalisation."""

from __future__ import annotations

from typing import Any

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.families._moe import MoEDecoderFamily, moe_layers_from_hf

__all__ = ["QwenMoEFamily"]


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
