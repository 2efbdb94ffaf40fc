"""Llama 2 / 3 / 3.1+ (Llama-3 RoPE scaling): presets (data) and HF converter, registered on import.

The model and its TP plan are the generic decoder's (``models/decoder.py``, ``models/decoder_plan.py``)."""

from lightning_flagscale.config.presets import register_presets
from lightning_flagscale.models.llama.hf import LlamaFamily
from lightning_flagscale.models.llama.presets import PRESETS

register_presets(PRESETS)

__all__ = ["PRESETS", "LlamaFamily"]
