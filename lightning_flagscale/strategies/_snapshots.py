"""The strategy's side of in-memory checkpoints (``callbacks.MemoryCheckpoint``): taking a snapshot through Lightning's
public ``Trainer.save_checkpoint``, and the collective choice, at restart, between the newest snapshot and the newest
complete disk checkpoint.

A snapshot is ``trainer.save_checkpoint(folder, storage_options=MemorySnapshot())``: Lightning assembles its
checkpoint dict (loops, schedulers, callbacks, precision, data position, the strategy's shards) exactly as for
``ModelCheckpoint``, and ``CheckpointHooks.save_checkpoint`` writes it as an asynchronous sharded (DCP) checkpoint:
training waits only for the shards to be copied to CPU memory; a background thread writes them. ZeRO-1/2 slices are
not gathered into per-parameter tensors as for a disk checkpoint: each rank saves its flat slices as they lie, cut
into rectangular blocks at their global offsets (``LocalChunks``), which DCP stores and reshards like any shard.

The launcher cannot choose (no process group yet), so with a ``MemoryCheckpoint`` callback a resume
(``resume="auto"`` or ``ckpt_path="last"``) goes through ``load_checkpoint(NEWEST)``, where every rank takes part:
rank 0 finds the newest complete snapshot and the newest complete disk checkpoint, the newer one is loaded by the
ordinary (resharding) path, so a snapshot resumes under any layout. A snapshot some rank cannot see (another node's
``/dev/shm``) is skipped with a warning naming the ranks.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_flagscale.callbacks.memory_checkpoint import MemoryCheckpoint
from lightning_flagscale.checkpoint.in_memory import LocalChunks, flat_blocks, list_snapshots, snapshot_path
from lightning_flagscale.checkpoint.layout import is_sharded_checkpoint, read_meta
from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer
from lightning_flagscale.strategies._state import auto_resume_path, model_state

__all__ = [
    "NEWEST",
    "MemorySnapshot",
    "choose",
    "ensure_checkpoint_group",
    "local_model_state",
    "local_optimizer_state",
    "memory_callback",
    "restore_newest",
    "take",
]

NEWEST = "flagscale:newest-of-memory-and-disk"
"""The ``ckpt_path`` the launcher passes when a ``MemoryCheckpoint`` callback is present and a resume is asked."""


@dataclass(frozen=True, kw_only=True)
class MemorySnapshot:
    """``storage_options`` of ``Trainer.save_checkpoint`` asking ``FlagScaleStrategy`` for an in-memory snapshot:
    an asynchronous save (the strategy's checkpoint process group) whose non-tensor part is copied at once."""


def memory_callback(trainer: Any) -> Any:
    """The trainer's ``MemoryCheckpoint`` callback, or None."""
    found = [cb for cb in trainer.callbacks if isinstance(cb, MemoryCheckpoint)]
    if len(found) > 1:
        raise ValueError("Give the Trainer one MemoryCheckpoint callback, not several.")
    return found[0] if found else None


def ensure_checkpoint_group(strategy: Any) -> None:
    """Collectively: the process group asynchronous saves run their collectives on (never interleaved with
    training's), created by the strategy for ``async_checkpoint=True``, else here."""
    if strategy._checkpoint_group is None:
        strategy._checkpoint_group = dist.new_group(backend="gloo")


def take(trainer: Any, folder: Path) -> float:
    """Collectively start the snapshot of the current step in ``folder``; returns the seconds training was blocked
    (waiting for the previous snapshot's write, building the checkpoint dict, staging the shards)."""
    start = time.perf_counter()
    strategy = trainer.strategy
    strategy._snapshot_local = True  # the strategy's state hooks hand ZeRO-1/2 slices as `LocalChunks`: no gathers
    try:
        # weights_only=False said, not defaulted: a snapshot resumes training (Lightning logs the default on every rank)
        path = snapshot_path(folder, trainer.global_step)
        trainer.save_checkpoint(path, weights_only=False, storage_options=MemorySnapshot())
    finally:
        strategy._snapshot_local = False
    return time.perf_counter() - start


def _chunks_of(dopt: DistributedOptimizer, bucket: Any, shard: Tensor) -> dict[str, LocalChunks]:
    """A ZeRO bucket's flat slice ``shard`` (main weights or one optimizer state) as per-parameter ``LocalChunks``:
    each parameter's part of the slice cut into rectangular blocks at their global offsets (TP/EP shards included)."""
    lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_numel
    out = {}
    for p, offset, numel, shape in zip(bucket.params, bucket.offsets, bucket.numels, bucket.shapes):
        start, stop = max(offset, lo), min(offset + numel, hi)
        if start >= stop:
            continue  # another rank's slice holds this parameter
        origin = [0] * len(shape)
        if isinstance(p, DTensor):
            # Private torch helper (as DCP uses): this rank's shard offset in the global parameter.
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, origin = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        chunks = []
        for block_offsets, sizes, flat in flat_blocks(shape, start - offset, stop - offset):
            first = offset + flat - lo
            block = shard[first : first + math.prod(sizes)].detach().view(sizes).to("cpu", copy=True)
            chunks.append((tuple(o + g for o, g in zip(block_offsets, origin)), block))
        out[dopt.names[p]] = LocalChunks(p.shape, shard.dtype, chunks)
    return out


def _local(dopt: Any) -> bool:
    # Flat ZeRO-3 and plain DDP take the usual path, and so do ETP-split experts (issue 39 item 4): their gate/up
    # chunk is two row blocks, not one box at one global offset.
    return (
        type(dopt) is DistributedOptimizer and dopt.master_weights
        and not any(_strided(p) for bucket in dopt.buckets for p in bucket.params)
    )  # fmt: skip


def _strided(p: Tensor) -> bool:
    return isinstance(p, DTensor) and any(isinstance(pl, _StridedShard) for pl in p.placements)


def local_model_state(model: torch.nn.Module, dopts: Any) -> dict[str, Any]:
    """``model_state`` for a snapshot: the ZeRO main weights as this rank's ``LocalChunks`` instead of gathered."""
    state = model_state(model, [d for d in dopts if not _local(d)])
    for dopt in filter(_local, dopts):
        for bucket in dopt.buckets:
            for p in bucket.params:  # the live weight, also where another rank's slice holds the parameter
                state.pop(dopt.names[p], None)
            state.update(_chunks_of(dopt, bucket, bucket.main_param))
    return state


def local_optimizer_state(dopt: Any) -> dict[str, Any] | None:
    """``DistributedOptimizer.state_dict`` for a snapshot, per-element states as ``LocalChunks`` (None: not ZeRO)."""
    if not _local(dopt):
        return None
    opt = dopt.optimizer
    state: dict[str, dict[str, Any]] = defaultdict(dict)
    groups = []
    for group, buckets in zip(opt.param_groups, dopt.group_buckets):
        names = []
        for bucket in buckets:
            names.extend(dopt.names[p] for p in bucket.params)
            for key, value in opt.state.get(bucket.main_param, {}).items():
                if isinstance(value, Tensor) and value.numel() == bucket.shard_numel:
                    for name, chunks in _chunks_of(dopt, bucket, value).items():
                        state[name][key] = chunks
                else:  # scalars such as Adam's `step`: every parameter of the bucket, as `state_dict` does
                    for p in bucket.params:
                        state[dopt.names[p]][key] = value.clone() if isinstance(value, Tensor) else value
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": dict(state), "param_groups": groups}


def _disk_candidate(trainer: Any) -> tuple[str | None, int | None]:
    """Rank 0: the newest complete checkpoint of the ModelCheckpoint folders and its step (None without one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if not any(isinstance(cb, ModelCheckpoint) and cb.dirpath for cb in trainer.callbacks):
        return None, None
    path = auto_resume_path(trainer)
    return (str(path), int(read_meta(path).get("global_step", -1))) if path is not None else (None, None)


def choose(memory_step: int | None, disk_step: int | None, missing: list[int]) -> tuple[bool, str]:
    """Whether to restore the snapshot of ``memory_step`` (newer than the disk checkpoint and seen by every rank;
    ``missing``: the ranks that cannot see it), and a warning when a newer snapshot is skipped."""
    if memory_step is None or (disk_step is not None and memory_step <= disk_step):
        return False, ""
    if missing:
        return False, (
            f"The in-memory snapshot of step {memory_step} is not visible on rank(s) {missing} (a node-local"
            " /dev/shm?): resuming from the newest disk checkpoint instead. Give MemoryCheckpoint a `dirpath` every"
            " rank sees."
        )
    return True, ""


def restore_newest(strategy: Any) -> dict[str, Any]:
    """Collectively restore the newest state: the newest complete memory snapshot if it is newer than the newest disk
    checkpoint, else that checkpoint, else nothing (a fresh start). Returns Lightning's checkpoint dict."""
    trainer = strategy.lightning_module.trainer
    folder = memory_callback(trainer).folder(trainer)
    candidates = None
    if strategy.is_global_zero:
        steps = list_snapshots(folder)
        candidates = (steps[-1] if steps else None, *_disk_candidate(trainer))
    memory_step, disk_path, disk_step = strategy.broadcast(candidates)
    missing: list[int] = []
    if memory_step is not None:
        seen: list[Any] = [None] * strategy.world_size
        dist.all_gather_object(seen, is_sharded_checkpoint(snapshot_path(folder, memory_step)))
        missing = [rank for rank, ok in enumerate(seen) if not ok]
    use_memory, warning = choose(memory_step, disk_step, missing)
    if warning:
        rank_zero_warn(warning)
    if use_memory:
        rank_zero_info(f"Resuming from the in-memory snapshot of step {memory_step} (newest disk: {disk_path}).")
        return strategy.load_checkpoint(snapshot_path(folder, memory_step))
    if disk_path is not None:
        rank_zero_info(f"Resuming from {disk_path} (step {disk_step}): no newer in-memory snapshot.")
        return strategy.load_checkpoint(Path(disk_path))
    rank_zero_info("No in-memory snapshot and no complete checkpoint to resume from: training starts from scratch.")
    return _nothing(trainer)


def _nothing(trainer: Any) -> dict[str, Any]:
    """A checkpoint dict that restores nothing: no loops, callbacks or datamodule state; the schedulers' own."""
    import lightning

    return {
        "pytorch-lightning_version": lightning.__version__,
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
