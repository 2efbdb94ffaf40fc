"""``MemoryCheckpoint``: in-memory ("flash") checkpoints every N optimizer steps, beside ``ModelCheckpoint``'s disk
checkpoints every M steps.

Usage (re-running the same command after a crash continues from the newest state, in memory or on disk)::

    trainer = Trainer(
        strategy=FlagScaleStrategy(..., resume="auto"),
        callbacks=[MemoryCheckpoint(every_n_train_steps=1),                     # cheap: host memory
                   ModelCheckpoint(dirpath="ckpt", every_n_train_steps=100, save_last=True)],  # persisted
    )
    trainer.fit(model, data)          # or fit(..., ckpt_path="last") without resume="auto"

A snapshot is a sharded checkpoint like the disk ones (model and optimizer shards keyed by parameter name, Lightning's
loop, scheduler, callback and data-position state, per-rank RNG, MoE router state, param-group hyperparameters),
saved through Lightning's public ``Trainer.save_checkpoint`` asynchronously into ``/dev/shm`` (``checkpoint/in_memory.py``,
``strategies/_snapshots.py``): training waits for the checkpoint dict and a copy of this rank's shards into CPU memory
(ZeRO-1/2 slices saved as they lie, without the gathers of a disk checkpoint), and for the previous snapshot's write
(one save in flight at a time); a background thread writes the files. The two
newest complete snapshots are kept. At restart ``FlagScaleStrategy`` restores the newest complete snapshot when it is
newer than the newest complete disk checkpoint, under any layout (DCP reshards it like a disk checkpoint). A snapshot
survives a crash of the training processes, not of the machine: persist with ``ModelCheckpoint``. Snapshots are
removed when ``fit`` ends successfully. A snapshot folder is an ordinary checkpoint: ``fit(ckpt_path=<folder>)`` and
``consolidate_checkpoint`` take it. ``on_save_checkpoint`` hooks see the ZeRO-1/2 weights and optimizer states of a
snapshot as ``LocalChunks`` (this rank's blocks; data only, no tensor operations).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_flagscale.checkpoint.in_memory import (
    SnapshotStrategy,
    default_snapshot_root,
    list_snapshots,
    remove_snapshots,
    run_folder,
    snapshot_path,
)

__all__ = ["MemoryCheckpoint"]

KEEP = 2  # complete snapshots kept: the previous one stays until the newest is complete


class MemoryCheckpoint(L.Callback):
    """Snapshot the full training state to host memory every ``every_n_train_steps`` optimizer steps.

    Args:
        every_n_train_steps: snapshot interval in optimizer steps (1: every step).
        dirpath: folder of this run's snapshots. Default: ``/dev/shm`` (or ``$FLAGSCALE_MEMORY_CHECKPOINT_DIR``) /
            ``lightning-flagscale-<hash of the ModelCheckpoint folder, else of default_root_dir>``. Every rank must
            see it: on several nodes give a shared folder. Two runs writing to the same folder would restore each
            other's snapshots: give concurrent runs different folders.
    """

    def __init__(self, every_n_train_steps: int = 1, dirpath: str | os.PathLike | None = None) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise ValueError(f"MemoryCheckpoint(every_n_train_steps={every_n_train_steps!r}) must be an int >= 1.")
        self.every_n_train_steps = every_n_train_steps
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.blocking_seconds: list[float] = []  # per snapshot: how long training waited (for benchmarks)
        self._last_step = -1
        self._strategy: Any = None

    def folder(self, trainer: Any) -> Path:
        """This run's snapshot folder (the same on every run of the same job)."""
        if self.dirpath is not None:
            return self.dirpath
        ckpt = trainer.checkpoint_callback
        key = ckpt.dirpath if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath else trainer.default_root_dir
        return run_folder(default_snapshot_root(), str(Path(key).resolve()))

    def complete_steps(self, trainer: Any) -> list[int]:
        """Steps of the complete snapshots."""
        return list_snapshots(self.folder(trainer))

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not isinstance(trainer.strategy, SnapshotStrategy):
            raise TypeError(
                f"MemoryCheckpoint snapshots the shards of FlagScaleStrategy; got {type(trainer.strategy).__name__}."
                " Use `strategy=FlagScaleStrategy(...)` or remove the callback."
            )
        if trainer.num_nodes > 1 and self.dirpath is None:
            raise ValueError(
                f"MemoryCheckpoint on {trainer.num_nodes} nodes: a snapshot is one checkpoint folder written by every"
                " rank, and /dev/shm is not shared between nodes. Give `MemoryCheckpoint(dirpath=...)` a folder every"
                " node sees (or use it on one node)."
            )

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._strategy = trainer.strategy
        trainer.strategy.ensure_checkpoint_group()
        if trainer.is_global_zero:
            # Snapshots of other steps are stale from here on (a fresh start, or a resume from disk): only the one
            # this run may have been restored from stays, until newer snapshots replace it.
            remove_snapshots(self.folder(trainer), keep={trainer.global_step})
        trainer.strategy.barrier("MemoryCheckpoint.on_train_start")
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_train_steps:
            return  # not at the end of an optimizer step that is due (micro-batches of a window share the step)
        self._last_step = step
        folder = self.folder(trainer)
        self.blocking_seconds.append(trainer.strategy.take_memory_snapshot(folder))
        # This snapshot is in flight; the one before it is complete (one save at a time). Older ones are deleted
        # once this one is complete (`remove_checkpoint` defers while a save is in flight), never before.
        for old in list_snapshots(folder)[: -(KEEP - 1)]:
            trainer.strategy.remove_checkpoint(snapshot_path(folder, old))

    def wait(self) -> None:
        """Block until the snapshot in flight is written (benchmarks, tests)."""
        if self._strategy is not None:
            self._strategy.wait_for_checkpoint()

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        # A successful end (the strategy's teardown has waited for the writes): the disk checkpoints carry on.
        trainer.strategy.wait_for_checkpoint()
        if trainer.is_global_zero:
            remove_snapshots(self.folder(trainer))
