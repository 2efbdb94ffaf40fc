"""Qwen3 (q/k norm): presets (data) and HF converter, registered on import.

The model and its TP plan are the generic decoder's (``models/decoder.py``, ``models/decoder_plan.py``)."""

from lightning_flagscale.config.presets import register_presets
from lightning_flagscale.models.qwen3.hf import Qwen3Family
from lightning_flagscale.models.qwen3.presets import PRESETS

register_presets(PRESETS)

__all__ = ["PRESETS", "Qwen3Family"]
