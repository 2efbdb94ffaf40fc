"""Mixtral presets as data: name -> ``TransformerConfig`` fields, each with the Hugging Face model it mirrors.

Tiny presets train on CPU in tests; real shapes are for planning, memory estimates and auto-tuning. Pure data:
nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-tiny": dict(
        hf_source="mistralai/Mixtral-8x7B-v0.1 (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_seq_len=256,
        rope_theta=1000000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        router_type="softmax",
        norm_topk_prob=True,
        moe_aux_loss_coeff=0.01,
    ),
    "mixtral-8x7b": dict(
        hf_source="mistralai/Mixtral-8x7B-v0.1",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_seq_len=32768,
        rope_theta=1000000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        rms_norm_eps=1e-5,
    ),
}
