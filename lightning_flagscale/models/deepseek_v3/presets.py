"""DeepSeek-V3 presets as data: name -> ``TransformerConfig`` fields, each with the Hugging Face model it mirrors.

Tiny presets train on CPU in tests; real shapes are for planning, memory estimates and auto-tuning. Pure data:
nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3-tiny": dict(
        hf_source="deepseek-ai/DeepSeek-V3 (router/expert layout; standard attention instead of MLA)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
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
    ),
}
