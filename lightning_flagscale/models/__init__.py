"""Parallel-aware reference models: the decoder LM, its layers and attention backends, and the LightningModule."""

from lightning_flagscale.config import TransformerConfig
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
]
