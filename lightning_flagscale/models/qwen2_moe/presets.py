"""Qwen2-MoE / Qwen1.5-MoE presets as data: name -> ``TransformerConfig`` fields, each with the Hugging Face model it mirrors.

Tiny presets train on CPU in tests; real shapes are for planning, memory estimates and auto-tuning. Pure data:
nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-moe-tiny": dict(
        hf_source="Qwen/Qwen1.5-MoE-A2.7B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_seq_len=256,
        rope_theta=1000000.0,
        attention_bias=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_shared_experts=1,
        shared_expert_intermediate_size=64,
        shared_expert_gate=True,
        router_type="softmax",
        norm_topk_prob=False,
        moe_aux_loss_coeff=0.001,
    ),
}
