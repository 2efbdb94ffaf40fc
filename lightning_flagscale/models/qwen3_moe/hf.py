"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (q/k norm) with routed experts, no shared expert."""

from __future__ import annotations

from lightning_flagscale.convert.families._qwen_moe import QwenMoEFamily
from lightning_flagscale.convert.registry import register_family

__all__ = ["Qwen3MoEFamily"]


@register_family
class Qwen3MoEFamily(QwenMoEFamily):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    implied = {"qk_norm": True}
