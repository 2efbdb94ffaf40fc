"""Tiny random ``transformers`` models per family, saved with ``save_pretrained`` (the oracle for conversion)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# family -> (config class name, extra config kwargs). vocab 50 is not a multiple of 4: exercises TP padding.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_scaling": _LLAMA3_ROPE, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}),
    "mistral": ("MistralConfig", {"sliding_window": None, "rope_theta": 1e6}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            decoder_sparse_step=2,
        ),  # layer 0 dense, layer 1 MoE
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16, norm_topk_prob=True),
    ),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
BASE = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def make_hf_model(family: str, **overrides: Any):
    """A random HF model (every weight perturbed: norms and biases too, so a mapping mix-up shows)."""
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**BASE, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def save(model, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits
