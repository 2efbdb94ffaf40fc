"""Llama 2/3/3.1+ (``LlamaForCausalLM``), including Llama-3 RoPE scaling.

``pretraining_tp > 1`` only makes transformers compute the same matmuls in slices, so it is accepted.
"""

from __future__ import annotations

from lightning_flagscale.convert.decoder_family import DenseDecoderFamily
from lightning_flagscale.convert.registry import register_family

__all__ = ["LlamaFamily"]


@register_family
class LlamaFamily(DenseDecoderFamily):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
