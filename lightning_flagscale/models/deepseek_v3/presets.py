"""DeepSeek-V3 presets as data: name -> ``TransformerConfig`` fields, each with the Hugging Face model it mirrors.

Tiny presets train on CPU in tests; real shapes are for planning, memory estimates and auto-tuning. Pure data:
nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

# DeepSeek-V3's router and expert layout: sigmoid scores, group-limited top-k, bias balancing, shared expert.
_ROUTING_TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_attention_heads=4,
    max_seq_len=256,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_shared_experts=1,
    router_type="sigmoid",
    norm_topk_prob=True,
    first_k_dense_layers=1,
    moe_router_bias_update_rate=1e-3,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_scaling_factor=2.5,
    # The complementary sequence-wise balance loss: DeepSeek-V3's config.json (``seq_aux: true``,
    # ``aux_loss_alpha: 0.001``); the report trains with alpha = 1e-4.
    moe_seq_aux_loss_coeff=1e-3,
)

# DeepSeek-V3's YaRN settings (its config.json); mscale == mscale_all_dim leaves cos/sin unscaled.
_YARN: dict[str, Any] = dict(rope_type="yarn", beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3-tiny": dict(
        hf_source="deepseek-ai/DeepSeek-V3 (shape family: MLA with low-rank q, YaRN, interleaved RoPE)",
        **_ROUTING_TINY,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_interleave=True,
        rope_scaling={**_YARN, "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "deepseek-v3-routing-tiny": dict(
        hf_source="deepseek-ai/DeepSeek-V3 (router/expert layout only; standard attention instead of MLA)",
        **_ROUTING_TINY,
        num_key_value_heads=4,
    ),
    "deepseek-v3": dict(
        hf_source="deepseek-ai/DeepSeek-V3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_attention_heads=128,
        max_seq_len=163840,
        rope_theta=10000.0,
        rope_scaling={**_YARN, "factor": 40.0, "original_max_position_embeddings": 4096},
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        router_type="sigmoid",
        norm_topk_prob=True,
        first_k_dense_layers=3,
        moe_router_bias_update_rate=1e-3,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_scaling_factor=2.5,
        moe_seq_aux_loss_coeff=1e-3,
        # The published checkpoint's one MTP module (config.json ``num_nextn_predict_layers: 1``, weights at
        # ``model.layers.61.*``): 11.6B parameters more (671.0B main model + 11.6B = 682.6B as this package holds
        # them; the report's "14B" counts the module's own embedding and head copies, which ours shares).
        num_nextn_predict_layers=1,
    ),
}
