"""Built-in HF families; importing this package registers them (one file per family)."""

from lightning_flagscale.convert.families import (
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_5_vl,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)

__all__ = ["llama", "mistral", "mixtral", "qwen2", "qwen2_5_vl", "qwen2_moe", "qwen3", "qwen3_moe"]
