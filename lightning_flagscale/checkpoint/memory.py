"""Where in-memory ("flash") snapshots live: one sharded (DCP) checkpoint folder per step in host memory that outlives
the training processes.

A snapshot is a checkpoint like the disk ones (``sharded.py``: model and optimizer shards keyed by parameter name,
``meta.pt``, ``COMPLETE``), written asynchronously into a folder of ``/dev/shm`` (RAM-backed on Linux, so it survives
a crash of the training processes but not a reboot of the machine)::

    /dev/shm/lightning-flagscale-<run>/step-000000012/

Being an ordinary sharded checkpoint, a snapshot resumes under any layout (DCP reshards it, as a disk checkpoint),
and a folder with its final name is complete (``sharded.py`` renames it into place once every rank has written).
Nothing here is collective: taking and choosing snapshots is ``strategies/_memory.py``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from lightning_flagscale.checkpoint.sharded import is_sharded_checkpoint

__all__ = [
    "default_snapshot_root",
    "list_snapshots",
    "remove_snapshots",
    "run_folder",
    "snapshot_path",
]

ENV_ROOT = "FLAGSCALE_MEMORY_CHECKPOINT_DIR"
_NAME = re.compile(r"^step-(\d{9})$")


def default_snapshot_root() -> Path:
    """``$FLAGSCALE_MEMORY_CHECKPOINT_DIR``, else ``/dev/shm`` (RAM), else the temporary folder."""
    if os.environ.get(ENV_ROOT):
        return Path(os.environ[ENV_ROOT])
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def run_folder(root: str | os.PathLike, run_key: str) -> Path:
    """The snapshot folder of the run identified by ``run_key`` (e.g. the absolute checkpoint folder) and the user."""
    digest = hashlib.sha1(f"{os.getuid() if hasattr(os, 'getuid') else 0}:{run_key}".encode()).hexdigest()[:12]
    return Path(root) / f"lightning-flagscale-{digest}"


def snapshot_path(folder: str | os.PathLike, step: int) -> Path:
    """The checkpoint folder of the snapshot taken after optimizer step ``step``."""
    return Path(folder) / f"step-{step:09d}"


def list_snapshots(folder: str | os.PathLike) -> list[int]:
    """Steps of the complete snapshots in ``folder``, ascending (unfinished ``*.tmp-*`` folders are not listed)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match and is_sharded_checkpoint(path):
            steps.append(int(match.group(1)))
    return sorted(steps)


def remove_snapshots(folder: str | os.PathLike, keep: set[int] | None = None) -> None:
    """Remove the snapshots (and unfinished saves) in ``folder`` except the steps in ``keep``; with ``keep=None`` the
    whole folder."""
    folder = Path(folder)
    if keep is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match and int(match.group(1)) in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
