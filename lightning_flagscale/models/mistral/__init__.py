"""Mistral (no sliding window beyond ``max_seq_len``): HF converter, registered on import.

The model and its TP plan are the generic decoder's (``models/decoder.py``, ``models/decoder_plan.py``)."""

from lightning_flagscale.models.mistral.hf import MistralFamily

__all__ = ["MistralFamily"]
