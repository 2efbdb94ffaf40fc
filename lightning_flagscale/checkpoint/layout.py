"""The on-disk layout of a sharded checkpoint folder: DCP's shards and ``.metadata``, our ``meta.pt`` (the
non-tensor state) and the ``COMPLETE`` marker written last, so a folder without it is never taken for a checkpoint.
Read by the atomic save (``sharded.py``) and the crash recovery (``recovery.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

META_FILE = "meta.pt"
COMPLETE_MARKER = "COMPLETE"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A finished sharded checkpoint folder written by ``save_sharded``."""
    path = Path(path)
    return path.is_dir() and (path / COMPLETE_MARKER).is_file() and (path / ".metadata").is_file()


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The non-tensor part of a checkpoint; raises a clear error for anything that is not a finished checkpoint."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if not path.is_dir():
        raise ValueError(
            f"{path} is a file, not a FlagScale sharded checkpoint folder; load single-file checkpoints with"
            " `torch.load`, or consolidate/convert them first."
        )
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a complete FlagScale checkpoint (missing {COMPLETE_MARKER!r} or DCP '.metadata'):"
            " it may be a checkpoint whose writing was interrupted. Use an earlier checkpoint."
        )
    try:
        return torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    except Exception as err:
        raise RuntimeError(f"Checkpoint file {path / META_FILE} is corrupt or truncated ({err}).") from err
