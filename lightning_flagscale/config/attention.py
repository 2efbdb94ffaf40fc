"""The core-attention kernels a ``TransformerConfig.attn_backend`` can name (data, no import of any kernel)."""

from __future__ import annotations

__all__ = ["ATTENTION_BACKENDS"]

ATTENTION_BACKENDS: tuple[str, ...] = ("torch", "flash_attn", "transformer_engine")
"""``torch`` runs anywhere; ``flash_attn`` (FlashAttention-2) and ``transformer_engine`` need their package and a GPU."""
