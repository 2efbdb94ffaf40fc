"""Built-in HF families; importing this package registers them (one file per family)."""

from lightning_flagscale.convert.families import llama, mistral, qwen2, qwen3

__all__ = ["llama", "mistral", "qwen2", "qwen3"]
