"""Parallel-aware reference models: the shared building blocks, and one folder per model family.

Shared: the generic decoder LM (``decoder.py``) and its TP plan (``decoder_plan.py``), attention backends and layers,
layout-independent init, the weight-source registry and the LightningModule. Each family folder (``llama/``,
``qwen2_5_vl/``, the MoE families, ...) holds its presets (data), its model code and TP plan where they are its own,
and its HF converter, and registers them when imported here: a new family is one new folder (plus its tests) and
one name in the import below."""

from lightning_flagscale.config import TransformerConfig

# Importing a family registers its presets (config/presets.py) and its HF converter (convert/registry.py).
from lightning_flagscale.models import (
    deepseek_v3,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_5_vl,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from lightning_flagscale.models.attention import Attention, CoreAttention
from lightning_flagscale.models.decoder import CausalLM, DecoderBlock
from lightning_flagscale.models.layers import MLP, RMSNorm, RotaryEmbedding
from lightning_flagscale.models.lightning import CausalLMModule

__all__ = [
    "MLP",
    "Attention",
    "CausalLM",
    "CausalLMModule",
    "CoreAttention",
    "DecoderBlock",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerConfig",
    # the family packages
    "deepseek_v3",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_5_vl",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
]
