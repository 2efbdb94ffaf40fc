"""Sharded, reshardable, atomic checkpoints."""

from lightning_flagscale.checkpoint.sharded import (
    consolidate_checkpoint,
    is_sharded_checkpoint,
    load_sharded,
    read_meta,
    save_sharded,
)

__all__ = ["consolidate_checkpoint", "is_sharded_checkpoint", "load_sharded", "read_meta", "save_sharded"]
