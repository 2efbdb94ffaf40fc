"""The strategy's side of in-memory checkpoints (``callbacks.MemoryCheckpoint``): taking a snapshot through Lightning's
public ``Trainer.save_checkpoint``, and the collective choice, at restart, between the newest snapshot and the newest
complete disk checkpoint.

A snapshot is ``trainer.save_checkpoint(folder, storage_options=MemorySnapshot())``: Lightning assembles its
checkpoint dict (loops, schedulers, callbacks, precision, data position, the strategy's shards) exactly as for
``ModelCheckpoint``, and ``CheckpointHooks.save_checkpoint`` writes it as an asynchronous sharded (DCP) checkpoint:
training waits only for the shards to be staged in CPU memory; a background thread writes them.

The launcher cannot choose (no process group yet), so with a ``MemoryCheckpoint`` callback a resume
(``resume="auto"`` or ``ckpt_path="last"``) goes through ``load_checkpoint(NEWEST)``, where every rank takes part:
rank 0 finds the newest complete snapshot and the newest complete disk checkpoint, the newer one is loaded by the
ordinary (resharding) path, so a snapshot resumes under any layout. A snapshot some rank cannot see (another node's
``/dev/shm``) is skipped with a warning naming the ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_flagscale.checkpoint.memory import list_snapshots, snapshot_path
from lightning_flagscale.checkpoint.sharded import is_sharded_checkpoint

__all__ = ["NEWEST", "MemorySnapshot", "choose", "ensure_checkpoint_group", "memory_callback", "restore_newest", "take"]

NEWEST = "flagscale:newest-of-memory-and-disk"
"""The ``ckpt_path`` the launcher passes when a ``MemoryCheckpoint`` callback is present and a resume is asked."""


@dataclass(frozen=True, kw_only=True)
class MemorySnapshot:
    """``storage_options`` of ``Trainer.save_checkpoint`` asking ``FlagScaleStrategy`` for an in-memory snapshot:
    an asynchronous save (the strategy's checkpoint process group) whose non-tensor part is copied at once."""


def memory_callback(trainer: Any) -> Any:
    """The trainer's ``MemoryCheckpoint`` callback, or None."""
    from lightning_flagscale.callbacks.memory_checkpoint import MemoryCheckpoint

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
    trainer.save_checkpoint(snapshot_path(folder, trainer.global_step), storage_options=MemorySnapshot())
    return time.perf_counter() - start


def _disk_candidate(trainer: Any) -> tuple[str | None, int | None]:
    """Rank 0: the newest complete checkpoint of the ModelCheckpoint folders and its step (None without one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_flagscale.checkpoint.sharded import read_meta
    from lightning_flagscale.strategies._resilience import auto_resume_path

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
