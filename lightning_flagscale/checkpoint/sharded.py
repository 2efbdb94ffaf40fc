"""Sharded, reshardable, atomic checkpoints on top of ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint folder::

    ckpt/
      .metadata, __*_*.distcp    DCP: model weights and optimizer states, keyed by parameter name, stored as the
                                 union of every rank's shards (DTensor/TP/FSDP2/ZeRO layouts all save the same keys)
      meta.pt                    everything else Lightning saves (loops, schedulers, callbacks, precision, data
                                 position, per-rank RNG), written by rank 0
      COMPLETE                   written last

Expert tensor parallelism stores each expert's gate/up chunk as two row blocks (``_StridedShard``), which DCP cannot
describe (one box per rank and key): those tensors are saved with their shard moved to the hidden dim
(``Shard(2)``, one box), and loaded through such a copy, so every layout reads and writes the same global tensor.

All ranks write into ``ckpt.tmp-<id>/``; rank 0 renames it to ``ckpt/`` only after every rank finished and the
marker is written, so a crash leaves a ``*.tmp-*`` folder that is never mistaken for a checkpoint. Asynchronous
saves (DCP ``async_save``: tensors staged to CPU memory, written by a background thread, as in the seeds' flash
checkpoint) follow the same rule: the rename happens when the background write has finished on every rank.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_flagscale.checkpoint.layout import COMPLETE_MARKER, META_FILE, is_sharded_checkpoint, read_meta
from lightning_flagscale.checkpoint.recovery import clean_interrupted

__all__ = [
    "PendingSave",
    "check_shard_files",
    "consolidate_checkpoint",
    "load_sharded",
    "remove_checkpoint_path",
    "save_sharded",
]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_object(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _boxed_placements(value: Any) -> tuple | None:
    """Placements DCP can write for ``value``: an ETP-split ``gate_up_proj`` (``Shard(0)`` over ep, gate and up rows
    of chunk s as ``_StridedShard(1, split_factor=2)`` over etp) gets its etp shard on the hidden dim; None: as is."""
    if not isinstance(value, DTensor) or len(value.placements) != 2 or value.ndim != 3:
        return None
    first, second = value.placements
    if first == Shard(0) and isinstance(second, _StridedShard) and second.dim == 1 and second.split_factor == 2:
        return (Shard(0), Shard(2))
    return None


def _slots(obj: Any) -> Any:
    """Every (container, key, value) of the nested dicts and lists of a state."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield obj, key, value
        yield from _slots(value)


def _box_strided(state: dict[str, Any]) -> list[tuple[Any, Any, DTensor, DTensor]]:
    """Replace, in place, every tensor of ``state`` DCP cannot write by a copy it can (:func:`_boxed_placements`);
    returns (container, key, original, copy) to undo it with :func:`_unbox_strided`."""
    swapped = []
    for container, key, value in list(_slots(state)):
        placements = _boxed_placements(value)
        if placements is not None:
            boxed = value.redistribute(value.device_mesh, placements)
            container[key] = boxed
            swapped.append((container, key, value, boxed))
    return swapped


def _unbox_strided(swapped: list[tuple[Any, Any, DTensor, DTensor]], *, copy_back: bool) -> None:
    for container, key, original, boxed in swapped:
        if copy_back:
            values = boxed.redistribute(original.device_mesh, original.placements).to_local()
            original.to_local().copy_(values)
        container[key] = original


def save_sharded(
    path: str | os.PathLike,
    state: dict[str, Any],
    meta: dict[str, Any],
    *,
    async_group: dist.ProcessGroup | None = None,
    async_stager: Any = None,
) -> PendingSave | None:
    """Collectively save ``state`` (DCP, every rank) and ``meta`` (rank 0) to ``path``, atomically.

    With ``async_group`` (a process group used only by checkpointing, so the writer thread's collectives never mix
    with training's) the tensors are staged to CPU memory, written by a background thread, and the checkpoint is
    renamed into place when the write has finished on every rank; the returned ``PendingSave`` waits for that.
    ``async_stager``: DCP's staging to use instead of the writer's (a copy of every tensor).
    """
    path = Path(path)
    tmp = Path(_broadcast_object(str(path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}"))))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        clean_interrupted(path.parent)  # leftovers of a crashed save; none of ours is in flight (one at a time)
        tmp.mkdir(parents=True, exist_ok=False)
    _barrier()
    _save_event("tmp_created", tmp)
    state = dict(state)  # the boxed copies replace entries of this copy's nested containers
    swapped = _box_strided(state)
    if async_group is None:
        dcp.save(state, checkpoint_id=tmp)
        _unbox_strided(swapped, copy_back=False)
        _save_event("data_written", tmp)
        if rank == 0:
            _finalize(tmp, path, meta)
        _barrier()
        return None
    future = dcp.async_save(state, checkpoint_id=tmp, process_group=async_group, async_stager=async_stager)
    _save_event("async_started", tmp)
    return PendingSave(future, (lambda: _finalize(tmp, path, meta)) if rank == 0 else None, path)


def _save_event(event: str, path: Path) -> None:
    """Called at each step of a save (``tmp_created``, ``data_written``, ``async_started``, ``meta_written``,
    ``old_moved_aside``, ``renamed``); does nothing. The fault-injection tests replace it to kill the process there."""


class PendingSave:
    """A checkpoint being written in the background; ``wait()`` returns once it is complete and renamed.

    ``remove_after(old)`` defers the deletion of an older checkpoint (retention: ``save_top_k``, ``last``) until this
    one is complete, so a crash during the write never leaves zero checkpoints; if the write fails the old one stays.
    """

    def __init__(self, future: Any, finalize: Any, path: Path) -> None:
        self.path = path
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._to_remove: list[Path] = []

        def _on_done(fut: Any) -> None:
            try:
                fut.result()  # rank 0's future resolves after every rank's data and the DCP metadata are written
                if finalize is not None:
                    finalize()
            except BaseException as err:  # reported by wait(), on the training thread
                self._error = err
            finally:
                with self._lock:
                    self._done.set()
                    to_remove, self._to_remove = self._to_remove, []
                if self._error is None:
                    for old in to_remove:
                        remove_checkpoint_path(old)

        future.add_done_callback(_on_done)

    def done(self) -> bool:
        return self._done.is_set()

    def remove_after(self, old: str | os.PathLike) -> None:
        """Delete ``old`` once this save is complete (at once if it already is; never if it failed)."""
        old = Path(old)
        with self._lock:
            if not self._done.is_set():
                self._to_remove.append(old)
                return
        if self._error is None:
            remove_checkpoint_path(old)

    def wait(self) -> Path:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"Asynchronous checkpoint {self.path} failed: {self._error}") from self._error
        return self.path


def _finalize(tmp: Path, path: Path, meta: dict[str, Any]) -> None:
    """Rank 0: write the non-tensor part and the marker, then move the folder into place."""
    torch.save(meta, tmp / META_FILE)
    _save_event("meta_written", tmp)
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    _fsync_dir(tmp)
    old = None
    if path.exists() or path.is_symlink():
        old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
        path.rename(old)
        _save_event("old_moved_aside", old)  # a crash here is undone by `recovery.clean_interrupted`
    tmp.rename(path)
    _fsync_dir(path.parent)
    _save_event("renamed", path)
    if old is not None:
        remove_checkpoint_path(old)


def remove_checkpoint_path(path: str | os.PathLike) -> None:
    """Delete a checkpoint folder (or file); a missing one is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def load_sharded(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Collectively fill ``state`` (tensors/DTensors of the CURRENT layout) in place from checkpoint ``path``."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        read_meta(path)  # raises the descriptive error
    check_shard_files(path)
    swapped = _box_strided(state)
    try:
        dcp.load(state, checkpoint_id=path)
        _unbox_strided(swapped, copy_back=True)
    except (Exception, CheckpointException) as err:  # CheckpointException derives from BaseException
        # DCP reports e.g. "PytorchStreamReader failed reading zip archive" without the file: name the shards.
        files = sorted(p.name for p in path.glob("*.distcp"))
        raise RuntimeError(
            f"Reading checkpoint {path} failed: {err}. One of its shard files may be corrupt: {files}."
            " Resume from an earlier checkpoint."
        ) from err


def check_shard_files(path: str | os.PathLike) -> None:
    """Raise naming every shard file of checkpoint ``path`` that is missing or shorter than its DCP metadata says."""
    path = Path(path)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise RuntimeError(
            f"Checkpoint {path}: its DCP metadata file {path / '.metadata'} is unreadable ({err})."
        ) from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    bad = []
    for name, size in sorted(needed.items()):
        file = path / name
        actual = file.stat().st_size if file.exists() else None
        if actual is None or actual < size:
            bad.append(f"{file} ({'missing' if actual is None else f'{actual} bytes, expected >= {size}'})")
    if bad:
        raise RuntimeError(
            f"Checkpoint {path} has truncated or missing shard files: {'; '.join(bad)}. Resume from an earlier"
            " checkpoint (e.g. FlagScaleStrategy(resume='auto') after removing this one)."
        )


def checkpoint_keys(path: str | os.PathLike) -> dict[str, Any]:
    """Flattened DCP keys -> storage metadata (shape/dtype for tensors) of a checkpoint."""
    reader = dcp.FileSystemReader(str(path))
    return dict(reader.read_metadata().state_dict_metadata)


def consolidate_checkpoint(path: str | os.PathLike, out_file: str | os.PathLike) -> Path:
    """Merge a sharded checkpoint into one ``torch.save`` file in Lightning's format (single process, no GPU).

    The result loads with ``torch.load`` and ``LightningModule.load_state_dict(ckpt["state_dict"])`` of an
    unparallelised model.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    meta = read_meta(path)
    out_file = Path(out_file)
    tmp_tensors = out_file.with_name(out_file.name + ".tensors.tmp")
    dcp_to_torch_save(path, tmp_tensors)
    tensors = torch.load(tmp_tensors, map_location="cpu", weights_only=False)
    tmp_tensors.unlink()
    checkpoint = dict(meta)
    checkpoint.pop("rng_states_per_rank", None)
    checkpoint["state_dict"] = tensors.get("state_dict", {})
    optimizer_states = [tensors[k] for k in sorted(tensors) if k.startswith("optimizer_")]
    if optimizer_states:
        checkpoint["optimizer_states"] = optimizer_states
    tmp = out_file.with_name(out_file.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, out_file)
    return out_file


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
