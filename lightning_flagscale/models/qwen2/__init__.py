"""Qwen2 / Qwen2.5 (q/k/v bias): presets (data) and HF converter, registered on import.

The model and its TP plan are the generic decoder's (``models/decoder.py``, ``models/decoder_plan.py``)."""

from lightning_flagscale.config.presets import register_presets
from lightning_flagscale.models.qwen2.hf import Qwen2Family
from lightning_flagscale.models.qwen2.presets import PRESETS

register_presets(PRESETS)

__all__ = ["PRESETS", "Qwen2Family"]
