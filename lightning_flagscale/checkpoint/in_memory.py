"""Where in-memory ("flash") snapshots live: one sharded (DCP) checkpoint folder per step in host memory that outlives
the training processes.

A snapshot is a checkpoint like the disk ones (``sharded.py``: model and optimizer shards keyed by parameter name,
``meta.pt``, ``COMPLETE``), written asynchronously into a folder of ``/dev/shm`` (RAM-backed on Linux, so it survives
a crash of the training processes but not a reboot of the machine)::

    /dev/shm/lightning-flagscale-<run>/step-000000012/

Being an ordinary sharded checkpoint, a snapshot resumes under any layout (DCP reshards it, as a disk checkpoint),
and a folder with its final name is complete (``sharded.py`` renames it into place once every rank has written).
``LocalChunks`` lets a rank save the part of a tensor it holds as any set of rectangular blocks (a ZeRO slice cut
along the flattened parameter), without gathering it. Nothing here is collective: taking and choosing snapshots is
``strategies/_snapshots.py``'s.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from lightning_flagscale.checkpoint.layout import is_sharded_checkpoint

__all__ = [
    "ChunkStager",
    "LocalChunks",
    "SnapshotStrategy",
    "default_snapshot_root",
    "flat_blocks",
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


# ---------------------------------------------------------------------------------------------------- local chunks
def flat_blocks(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The rectangular blocks (offsets, sizes, flat start) that cover the row-major flat range ``[start, stop)`` of a
    tensor of ``shape``: at most two partial blocks per dimension around one block of whole rows."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)
    zeros = (0,) * (len(shape) - 1)

    def in_row(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_blocks(shape[1:], a, b)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    blocks = in_row(r0, c0, inner) if c0 else []
    first = r0 + 1 if c0 else r0
    if r1 > first:
        blocks.append(((first, *zeros), (r1 - first, *shape[1:]), first * inner))
    return blocks + (in_row(r1, 0, c1) if c1 else [])


class LocalChunks(Tensor):
    """A tensor of global shape ``size`` of which this rank saves only ``chunks`` (global offsets, block: a private
    CPU copy). It speaks DCP's checkpointable protocol (as DTensor does), so a ZeRO-1/2 slice is saved as it lies,
    without gathering it into per-parameter tensors first, and any layout reads it back like a gathered one. Holds
    data only: no tensor operation runs on it."""

    chunks: list[tuple[tuple[int, ...], Tensor]]

    @staticmethod
    def __new__(cls, size: Sequence[int], dtype: torch.dtype, chunks: list[tuple[tuple[int, ...], Tensor]]):
        tensor = Tensor._make_wrapper_subclass(cls, tuple(size), dtype=dtype, device="cpu")
        tensor.chunks = chunks
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"LocalChunks only carries checkpoint data; {func} does not apply to it.")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.shape),
                    properties=TensorProperties.create_from_tensor(block),
                    size=self.shape,
                ),
            )
            for offsets, block in self.chunks
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=b.shape) for o, b in self.chunks]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        for offsets, block in self.chunks:
            if torch.Size(offsets) == index.offset:
                return block
        raise ValueError(f"LocalChunks {index.fqn}: no chunk at offset {tuple(index.offset)}.")


def _stage(tree: Any) -> Any:
    if isinstance(tree, LocalChunks):
        return tree  # its blocks are private copies already
    if isinstance(tree, DTensor):
        local = tree.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape,
                                  stride=tree.stride())  # fmt: skip
    if isinstance(tree, Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: _stage(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_stage(value) for value in tree)
    return copy.deepcopy(tree)


class ChunkStager(AsyncStager):
    """``dcp.async_save``'s staging for snapshots: a CPU copy of every tensor (training goes on changing the live
    ones) except ``LocalChunks``, whose blocks were copied when they were cut."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _stage(state_dict)

    def synchronize_staging(self) -> None:
        pass  # staging is synchronous

    def close(self) -> None:
        pass


@runtime_checkable
class SnapshotStrategy(Protocol):
    """What ``MemoryCheckpoint`` needs of a strategy: the process group snapshots write on, and a collective
    snapshot of the current step into a folder (``FlagScaleStrategy`` implements it)."""

    def ensure_checkpoint_group(self) -> None: ...

    def take_memory_snapshot(self, folder: Path) -> float: ...

    def wait_for_checkpoint(self) -> None: ...
