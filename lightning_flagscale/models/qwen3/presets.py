"""Qwen3 presets as data: name -> ``TransformerConfig`` fields, each with the Hugging Face model it mirrors.

Tiny presets train on CPU in tests; real shapes are for planning, memory estimates and auto-tuning. Pure data:
nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-tiny": dict(
        hf_source="Qwen/Qwen3-0.6B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_seq_len=256,
        rope_theta=1000000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    "qwen3-8b": dict(
        hf_source="Qwen/Qwen3-8B",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_seq_len=40960,
        rope_theta=1000000.0,
        qk_norm=True,
        rms_norm_eps=1e-6,
    ),
}
