"""Sharded, reshardable, atomic checkpoints."""

from lightning_flagscale.checkpoint.layout import is_sharded_checkpoint, read_meta
from lightning_flagscale.checkpoint.recovery import clean_interrupted, find_latest_checkpoint, list_checkpoints
from lightning_flagscale.checkpoint.sharded import consolidate_checkpoint, load_sharded, save_sharded

__all__ = [
    "clean_interrupted",
    "consolidate_checkpoint",
    "find_latest_checkpoint",
    "is_sharded_checkpoint",
    "list_checkpoints",
    "load_sharded",
    "read_meta",
    "save_sharded",
]
