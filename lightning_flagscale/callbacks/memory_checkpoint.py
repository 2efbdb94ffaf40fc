"""``MemoryCheckpoint``: in-memory ("flash") checkpoints every N optimizer steps, beside ``ModelCheckpoint``'s disk
checkpoints every M steps.

Usage (re-running the same command after a crash continues from the newest state, in memory or on disk)::

    trainer = Trainer(
        strategy=FlagScaleStrategy(..., resume="auto"),
        callbacks=[MemoryCheckpoint(every_n_train_steps=1),                     # cheap: host memory
                   ModelCheckpoint(dirpath="ckpt", every_n_train_steps=100, save_last=True)],  # persisted
    )
    trainer.fit(model, data)          # or fit(..., ckpt_path="last") without resume="auto"

Each rank snapshots what a disk checkpoint holds for it (its model/optimizer shards, Lightning's loop, scheduler,
callback and data-position state, its RNG, MoE router state, param-group hyperparameters) into ``/dev/shm`` (see
``checkpoint/memory.py``): training is blocked for Lightning's checkpoint dict (ZeRO-1/2 shards taken as they are,
without the gathers a disk checkpoint needs) and a copy into CPU staging buffers; a background thread writes the file. ``FlagScaleStrategy`` restores the newest snapshot that every rank holds completely when it is newer than the
newest complete disk checkpoint (``strategies/_memory.py``), else the disk checkpoint. A snapshot survives a crash of
the training processes, not of the machine: persist with ``ModelCheckpoint``. Snapshots are removed when ``fit`` ends
successfully.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_flagscale.checkpoint.memory import (
    SnapshotWriter,
    default_snapshot_root,
    layout_tag,
    list_snapshots,
    remove_snapshots,
    snapshot_folder,
)

__all__ = ["MemoryCheckpoint"]


class MemoryCheckpoint(L.Callback):
    """Snapshot the full training state of every rank to host memory every ``every_n_train_steps`` optimizer steps.

    Args:
        every_n_train_steps: snapshot interval in optimizer steps (1: every step).
        dirpath: folder of this run's snapshots. Default: ``/dev/shm`` (or ``$FLAGSCALE_MEMORY_CHECKPOINT_DIR``) /
            ``lightning-flagscale-<hash of the ModelCheckpoint folder, else of default_root_dir>``. Two runs writing
            to the same folder would restore each other's snapshots: give concurrent runs different folders.
    """

    def __init__(self, every_n_train_steps: int = 1, dirpath: str | os.PathLike | None = None) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise ValueError(f"MemoryCheckpoint(every_n_train_steps={every_n_train_steps!r}) must be an int >= 1.")
        self.every_n_train_steps = every_n_train_steps
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.blocking_seconds: list[float] = []  # per snapshot: how long training waited (for benchmarks)
        self._writer: SnapshotWriter | None = None
        self._last_step = -1

    # ------------------------------------------------------------------ where
    def rank_folder(self, trainer: Any) -> Path:
        """This rank's snapshot folder (same on every run of the same job)."""
        rank = trainer.global_rank
        if self.dirpath is not None:
            return self.dirpath / f"rank-{rank:05d}"
        ckpt = trainer.checkpoint_callback
        key = ckpt.dirpath if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath else trainer.default_root_dir
        return snapshot_folder(default_snapshot_root(), str(Path(key).resolve()), rank)

    def tag(self, trainer: Any) -> str:
        """Snapshots restore only into the layout that took them: same world size, same per-rank layout."""
        strategy = trainer.strategy
        return layout_tag(trainer.world_size, repr(vars(strategy.parallel)), type(trainer.lightning_module).__name__)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from lightning_flagscale.strategies._checkpoint import CheckpointHooks

        if not isinstance(trainer.strategy, CheckpointHooks):
            raise TypeError(
                f"MemoryCheckpoint snapshots the shards of FlagScaleStrategy; got {type(trainer.strategy).__name__}."
                " Use `strategy=FlagScaleStrategy(...)` or remove the callback."
            )

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        folder, tag = self.rank_folder(trainer), self.tag(trainer)
        # Snapshots of other steps are stale from here on (a fresh start, or a resume from disk): only the one this
        # run may have been restored from stays, until the next snapshot replaces it.
        remove_snapshots(folder, keep={trainer.global_step}, tag=tag)
        self._writer = SnapshotWriter(folder, tag)
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._writer is None or step == self._last_step or step % self.every_n_train_steps:
            return  # not at the end of an optimizer step that is due (micro-batches of a window share the step)
        from lightning_flagscale.strategies._memory import snapshot_state

        self._last_step = step
        self.blocking_seconds.append(self._writer.snapshot(step, snapshot_state(trainer)))

    def wait(self) -> None:
        """Block until every snapshot taken so far is written (benchmarks, tests)."""
        if self._writer is not None:
            self._writer.wait()

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        # A successful end: the disk checkpoints (and the caller's final save) carry on; free the host memory.
        folder = self.rank_folder(trainer)
        self._close()
        remove_snapshots(folder)

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()  # finish the writes in flight: the snapshots are what a restart resumes from

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def complete_steps(self, trainer: Any) -> list[int]:
        """Steps of this rank's complete snapshots."""
        return list_snapshots(self.rank_folder(trainer), self.tag(trainer))
