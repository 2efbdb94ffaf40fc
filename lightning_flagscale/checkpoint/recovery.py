"""Crash recovery of checkpoint folders: clean up interrupted saves, find the newest complete checkpoint.

A save writes ``<name>.tmp-<id>/`` and renames it to ``<name>/`` once complete (``sharded.py``); replacing an
existing ``<name>/`` first moves it aside to ``<name>.old-<id>/``. A crash can therefore leave:

- ``*.tmp-*``: an unfinished save, never a checkpoint: deleted (with a warning);
- ``*.old-*`` while ``<name>/`` is missing: the crash hit between the two renames, and the old folder is the only
  complete copy: renamed back (with a warning); with ``<name>/`` present it is a leftover: deleted.

Folders without the ``COMPLETE`` marker that are neither (written by something else, or damaged) are skipped by
:func:`find_latest_checkpoint` with a warning, never deleted.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

from lightning_flagscale.checkpoint.layout import COMPLETE_MARKER, is_sharded_checkpoint, read_meta

__all__ = ["clean_interrupted", "find_latest_checkpoint", "list_checkpoints"]

_TMP = re.compile(r"^(?P<base>.+)\.tmp-[0-9a-f]+$")
_OLD = re.compile(r"^(?P<base>.+)\.old-[0-9a-f]+$")


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


def clean_interrupted(folder: str | os.PathLike) -> list[Path]:
    """Delete unfinished ``*.tmp-*`` saves and settle ``*.old-*`` folders in ``folder``; returns what it removed.

    Call it on one process (rank 0) while no save into ``folder`` is in flight.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed: list[Path] = []
    for entry in sorted(folder.iterdir()):
        if _TMP.match(entry.name):
            _warn(f"Removing {entry}: a checkpoint save that was interrupted before it completed.")
            _remove(entry)
            removed.append(entry)
            continue
        match = _OLD.match(entry.name)
        if match is None:
            continue
        target = folder / match["base"]
        if not (target.exists() or target.is_symlink()) and is_sharded_checkpoint(entry):
            _warn(f"Restoring {target} from {entry.name}: a crash interrupted its replacement.")
            entry.rename(target)
        else:
            _remove(entry)
            removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def list_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete FlagScale checkpoints directly in ``folder`` as ``(global_step, path)``, oldest first.

    Incomplete folders (no ``COMPLETE`` marker) and unreadable ones are skipped with a warning naming them.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found: list[tuple[int, float, Path]] = []
    for entry in folder.iterdir():
        if not entry.is_dir() or _TMP.match(entry.name) or _OLD.match(entry.name):
            continue
        if not (entry / ".metadata").exists() and not (entry / COMPLETE_MARKER).exists():
            continue  # not a checkpoint folder at all (e.g. a logger's)
        if not is_sharded_checkpoint(entry):
            _warn(f"Skipping {entry}: an incomplete checkpoint (no {COMPLETE_MARKER!r} marker or DCP '.metadata').")
            continue
        try:
            step = int(read_meta(entry).get("global_step", -1))
        except Exception as err:  # a damaged meta.pt: another checkpoint may still be good
            _warn(f"Skipping {entry}: its meta.pt cannot be read ({err}).")
            continue
        found.append((step, (entry / COMPLETE_MARKER).stat().st_mtime, entry))
    found.sort(key=lambda item: (item[0], item[1]))
    return [(step, path) for step, _, path in found]


def find_latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The complete checkpoint of ``folder`` with the highest ``global_step`` (the newest among equals), or None."""
    checkpoints = list_checkpoints(folder)
    return checkpoints[-1][1] if checkpoints else None
