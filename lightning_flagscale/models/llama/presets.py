"""Llama 3 / 3.1 presets as data: name -> ``TransformerConfig`` fields, each with the Hugging Face model it mirrors.

Tiny presets train on CPU in tests; real shapes are for planning, memory estimates and auto-tuning. Pure data:
nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(
        hf_source="meta-llama/Llama-3.2-1B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_seq_len=256,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 64},
        rms_norm_eps=1e-5,
    ),
    "llama3-8b": dict(
        hf_source="meta-llama/Meta-Llama-3-8B",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "llama3.1-8b": dict(
        hf_source="meta-llama/Llama-3.1-8B",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5,
    ),
    "llama3-70b": dict(
        hf_source="meta-llama/Meta-Llama-3-70B",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
}
