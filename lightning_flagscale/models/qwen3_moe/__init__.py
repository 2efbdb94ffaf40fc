"""Qwen3-MoE (q/k norm, routed experts only): HF converter, registered on import.

The model and its TP plan are the generic decoder's (``models/decoder.py``, ``models/decoder_plan.py``)."""

from lightning_flagscale.models.qwen3_moe.hf import Qwen3MoEFamily

__all__ = ["Qwen3MoEFamily"]
