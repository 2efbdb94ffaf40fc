"""Qwen2-MoE / Qwen1.5-MoE (q/k/v bias, gated shared expert): presets (data) and HF converter, registered on import.

The model and its TP plan are the generic decoder's (``models/decoder.py``, ``models/decoder_plan.py``)."""

from lightning_flagscale.config.presets import register_presets
from lightning_flagscale.models.qwen2_moe.hf import Qwen2MoEFamily
from lightning_flagscale.models.qwen2_moe.presets import PRESETS

register_presets(PRESETS)

__all__ = ["PRESETS", "Qwen2MoEFamily"]
