"""Mixtral (every block MoE, softmax top-k router): presets (data) and HF converter, registered on import.

The model and its TP plan are the generic decoder's (``models/decoder.py``, ``models/decoder_plan.py``)."""

from lightning_flagscale.config.presets import register_presets
from lightning_flagscale.models.mixtral.hf import MixtralFamily
from lightning_flagscale.models.mixtral.presets import PRESETS

register_presets(PRESETS)

__all__ = ["PRESETS", "MixtralFamily"]
