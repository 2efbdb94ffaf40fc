"""In-memory ("flash") snapshots of one rank's training state, kept in host memory that outlives the process.

A snapshot is what a disk checkpoint holds for this rank (its model and optimizer shards, Lightning's loop, scheduler,
callback and data-position state, its RNG), written as one file per rank and step into a folder of ``/dev/shm``
(RAM-backed on Linux, so it survives a crash of the training process but not a reboot of the machine)::

    /dev/shm/lightning-flagscale-<run>/rank-00001/step-000000012-<layout>.pt

Taking a snapshot blocks training only for a copy of the tensors into CPU staging buffers (:meth:`SnapshotWriter.
snapshot`); a background thread serialises the staged copy to ``*.tmp`` and renames it into place, so a file with its
final name is always complete. Two staging buffers alternate (double buffering): the copy of snapshot ``k`` waits only
for the write of snapshot ``k - 2``. The two newest complete snapshots are kept, so when a crash interrupts a write,
every rank still holds the previous step and the ranks can agree on a common one (``newest_common_step``).

DLRover's flash checkpoint does the same with shared memory kept by an agent process; files in ``/dev/shm`` need no
agent. Nothing here is collective: the restore decision (which step every rank holds, memory vs disk) is made by the
caller.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "SnapshotWriter",
    "default_snapshot_root",
    "fill_state",
    "layout_tag",
    "list_snapshots",
    "read_snapshot",
    "remove_snapshots",
    "snapshot_folder",
]

ENV_ROOT = "FLAGSCALE_MEMORY_CHECKPOINT_DIR"
_NAME = re.compile(r"^step-(\d{9})-([0-9a-f]+)\.pt$")
KEEP = 2  # complete snapshots kept per rank: a write interrupted by a crash still leaves the previous step everywhere


def default_snapshot_root() -> Path:
    """``$FLAGSCALE_MEMORY_CHECKPOINT_DIR``, else ``/dev/shm`` (RAM), else the temporary folder."""
    if os.environ.get(ENV_ROOT):
        return Path(os.environ[ENV_ROOT])
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def snapshot_folder(root: str | os.PathLike, run_key: str, rank: int) -> Path:
    """This rank's folder for the run identified by ``run_key`` (e.g. the absolute checkpoint folder) and the user."""
    digest = hashlib.sha1(f"{os.getuid() if hasattr(os, 'getuid') else 0}:{run_key}".encode()).hexdigest()[:12]
    return Path(root) / f"lightning-flagscale-{digest}" / f"rank-{rank:05d}"


def layout_tag(*parts: Any) -> str:
    """A short tag of what a snapshot can only be restored into (world size, this rank's layout)."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:10]


def list_snapshots(folder: str | os.PathLike, tag: str) -> list[int]:
    """Steps of the complete snapshots in ``folder`` taken under ``tag``, ascending."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match and match.group(2) == tag:
            steps.append(int(match.group(1)))
    return sorted(steps)


def _path(folder: Path, step: int, tag: str) -> Path:
    return folder / f"step-{step:09d}-{tag}.pt"


def remove_snapshots(folder: str | os.PathLike, keep: set[int] | None = None, tag: str | None = None) -> None:
    """Remove this rank's snapshots (and unfinished ``*.tmp`` files) except the steps in ``keep`` taken under ``tag``;
    with ``keep=None`` the whole folder, and its run folder when no other rank's folder is left."""
    folder = Path(folder)
    if keep is None:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the last rank to finish removes the run folder
        return
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match and match.group(2) == tag and int(match.group(1)) in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ---------------------------------------------------------------------------------------------------- staging
class _Ref:
    """Where a tensor sat in the state tree (its index in the flat tensor list)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (_Ref, (self.index,))


def _split(tree: Any, tensors: list[Tensor]) -> Any:
    """The tree with every tensor replaced by a ``_Ref`` (tensors appended to ``tensors``), other leaves deep-copied:
    training may mutate them (a callback's live dict) while the background thread writes."""
    if isinstance(tree, Tensor):
        tensors.append(tree.to_local() if hasattr(tree, "to_local") else tree)
        return _Ref(len(tensors) - 1)
    if isinstance(tree, dict):
        out = copy.copy(tree)  # shallow, keeps the type (OrderedDict, defaultdict...)
        for k, v in tree.items():
            out[k] = _split(v, tensors)
        return out
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_split(v, tensors) for v in tree)
    return copy.deepcopy(tree)


def _join(tree: Any, tensors: list[Tensor]) -> Any:
    if isinstance(tree, _Ref):
        return tensors[tree.index]
    if isinstance(tree, dict):
        out = copy.copy(tree)
        for k, v in tree.items():
            out[k] = _join(v, tensors)
        return out
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_join(v, tensors) for v in tree)
    return tree


@dataclass(kw_only=True)
class _Buffer:
    """CPU staging tensors reused across snapshots with the same structure; ``free`` is set once written."""

    tensors: list[Tensor] = field(default_factory=list)
    free: threading.Event = field(default_factory=threading.Event)

    def stage(self, sources: list[Tensor]) -> None:
        same = len(sources) == len(self.tensors) and all(
            s.shape == t.shape and s.dtype == t.dtype for s, t in zip(sources, self.tensors)
        )
        if not same:  # first use, or the state grew (optimizer states appear at the first step)
            self.tensors = [torch.empty(s.shape, dtype=s.dtype, device="cpu") for s in sources]
        with torch.no_grad():
            for src, dst in zip(sources, self.tensors):
                dst.copy_(src.detach())


class SnapshotWriter:
    """Takes this rank's snapshots: a blocking copy into a staging buffer, then a background write and rename."""

    def __init__(self, folder: str | os.PathLike, tag: str, keep: int = KEEP) -> None:
        self.folder = Path(folder)
        self.tag = tag
        self.keep = keep
        self.folder.mkdir(parents=True, exist_ok=True)
        self._buffers = [_Buffer(), _Buffer()]
        for buffer in self._buffers:
            buffer.free.set()
        self._count = 0
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.last_write_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="flagscale-memory-checkpoint", daemon=True)
        self._thread.start()

    def snapshot(self, step: int, state: dict[str, Any]) -> float:
        """Stage ``state`` (tensors copied to CPU, the rest deep-copied) and queue its write; returns the seconds
        training was blocked."""
        start = time.perf_counter()
        self._raise_if_failed()
        buffer = self._buffers[self._count % 2]
        self._count += 1
        buffer.free.wait()  # the write of the snapshot two before this one, which used the same buffer
        self._raise_if_failed()
        sources: list[Tensor] = []
        skeleton = _split(state, sources)
        buffer.free.clear()
        buffer.stage(sources)
        self._jobs.put((step, skeleton, buffer))
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until every queued snapshot is written."""
        for buffer in self._buffers:
            buffer.free.wait()
        self._raise_if_failed()

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self.wait()
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"Writing an in-memory snapshot to {self.folder} failed") from self._error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            step, skeleton, buffer = job
            try:
                start = time.perf_counter()
                final = _path(self.folder, step, self.tag)
                tmp = final.with_name(final.name + ".tmp")
                torch.save({"skeleton": skeleton, "tensors": buffer.tensors}, tmp)
                os.replace(tmp, final)  # atomic: a file with its final name is complete
                steps = list_snapshots(self.folder, self.tag)
                remove_snapshots(self.folder, keep=set(steps[-self.keep :]), tag=self.tag)
                self.last_write_seconds = time.perf_counter() - start
            except BaseException as error:  # reported to the training thread at the next snapshot
                self._error = error
            finally:
                buffer.free.set()


def read_snapshot(folder: str | os.PathLike, step: int, tag: str) -> dict[str, Any]:
    """The state tree of a complete snapshot, tensors on the CPU."""
    path = _path(Path(folder), step, tag)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise RuntimeError(f"Cannot read the in-memory snapshot {path}: {error}") from error
    return _join(saved["skeleton"], saved["tensors"])


def fill_state(template: Any, saved: Any) -> Any:
    """``template`` (this rank's live layout: DTensors, device tensors) with the values of ``saved`` (the same tree
    as a snapshot stored it: local shards on the CPU) copied in place into its tensors; non-tensor leaves from
    ``saved``. Template keys missing from ``saved`` keep the template's value."""
    if isinstance(template, Tensor):
        if not isinstance(saved, Tensor):
            return saved
        local = template.to_local() if hasattr(template, "to_local") else template
        if local.shape != saved.shape:
            raise ValueError(f"In-memory snapshot tensor of shape {tuple(saved.shape)} != {tuple(local.shape)}.")
        with torch.no_grad():
            local.copy_(saved)
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        out = copy.copy(saved)
        for key, value in template.items():
            out[key] = fill_state(value, saved[key]) if key in saved else value
        return out
    if isinstance(template, (list, tuple)) and isinstance(saved, (list, tuple)) and len(template) == len(saved):
        return type(saved)(fill_state(t, s) for t, s in zip(template, saved))
    return saved
