"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (q/k norm) with routed experts, no shared expert."""

from __future__ import annotations

from lightning_flagscale.convert.registry import register_family
from lightning_flagscale.models.qwen2_moe.hf import QwenMoEFamily

__all__ = ["Qwen3MoEFamily"]


@register_family
class Qwen3MoEFamily(QwenMoEFamily):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    implied = {"qk_norm": True}
