"""Qwen2 / Qwen2.5 presets as data: name -> ``TransformerConfig`` fields, each with the Hugging Face model it mirrors.

Tiny presets train on CPU in tests; real shapes are for planning, memory estimates and auto-tuning. Pure data:
nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-tiny": dict(
        hf_source="Qwen/Qwen2.5-0.5B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_seq_len=256,
        rope_theta=1000000.0,
        attention_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(
        hf_source="Qwen/Qwen2.5-7B",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_seq_len=32768,
        rope_theta=1000000.0,
        attention_bias=True,
        rms_norm_eps=1e-6,
    ),
}
