"""Qwen2.5-VL presets as data: name -> ``VLMConfig`` fields (the nested ``vision`` tower as a dict).

Kept apart from the ``TransformerConfig`` registry (``config/presets.py``): these build a ``VLMConfig``
(``VLMConfig.from_preset``, ``VLMModule("qwen2.5-vl-tiny")``). Pure data: nothing here imports torch or a model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["VLM_PRESETS"]

# Presets as data. The tiny one trains on CPU in tests and the recipe: byte vocabulary + 6 special tokens (see
# ``models.qwen2_5_vl.data.VLMByteTokenizer``), a 4-block ViT with one full-attention block and 28-pixel windows.
VLM_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-tiny": dict(
        hf_source="Qwen/Qwen2.5-VL-3B-Instruct (shape family)",
        vocab_size=264,
        hidden_size=64,
        intermediate_size=160,
        num_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_seq_len=256,
        rope_theta=1000000.0,
        attention_bias=True,
        rms_norm_eps=1e-6,
        mrope_section=[2, 3, 3],
        image_token_id=260,
        video_token_id=261,
        vision_start_token_id=258,
        vision_end_token_id=259,
        vision=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            window_size=56,
            fullatt_block_indexes=[3],
        ),
    ),
}
