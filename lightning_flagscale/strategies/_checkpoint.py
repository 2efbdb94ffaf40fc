"""Checkpoint I/O of ``FlagScaleStrategy``: its checkpoint hooks (:class:`CheckpointHooks`), model/optimizer shards in
and out of DCP folders, per-rank RNG state and the rest of the training state."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from typing_extensions import override

from lightning_flagscale.checkpoint.in_memory import ChunkStager
from lightning_flagscale.checkpoint.layout import read_meta
from lightning_flagscale.checkpoint.recovery import clean_interrupted
from lightning_flagscale.checkpoint.sharded import (
    PendingSave,
    remove_checkpoint_path,
    save_sharded,
)
from lightning_flagscale.models.lora import check_base_weights
from lightning_flagscale.parallel.hetero_dp.shares import resume_shares
from lightning_flagscale.strategies._snapshots import (
    NEWEST,
    MemorySnapshot,
    ensure_checkpoint_group,
    local_model_state,
    local_optimizer_state,
    restore_newest,
    take,
)
from lightning_flagscale.strategies._state import (
    base_reference,
    load_training_state,
    model_state,
    optimizer_state,
    restore_training_meta,
    training_meta,
)

__all__ = [
    "CheckpointHooks",
]

MEASURED_CHUNK_COSTS = "pipeline_chunk_costs_measured"
"""Checkpoint key: the F, I, W chunk costs ``pipeline_chunk_costs="auto"`` measured (``PipelineRunner.measured_costs``)."""


class CheckpointHooks:
    """The strategy's checkpoint hooks: every rank writes its shards of one DCP folder (optionally in the
    background, ``async_checkpoint``) and reads any layout's folder back in place (``load_checkpoint``). Mixed into
    ``FlagScaleStrategy``, whose ``setup`` builds ``model``, ``optimizers`` and ``_dist_optimizers``."""

    _pending_save: PendingSave | None = None
    _last_checkpoint: Path | None = None  # newest complete checkpoint this run wrote (the rollback target)
    _async_checkpoint: bool = False
    _snapshot_local: bool = False  # set while `_memory.take` runs: ZeRO-1/2 slices as they lie, no gathers
    _checkpoint_group: dist.ProcessGroup | None = None  # async saves: collectives never interleaved with training's

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if trainer.global_step == 0:
            return
        # Resumed at step S: Lightning's ModelCheckpoint forgets that S is saved, and with gradient accumulation the
        # first micro-batch of the next window (still at step S) saves S again, mid-window, over `last` (the window's
        # first gradients are not in a checkpoint): a kill before S + 1 then resumes inexactly (issue 14).
        from lightning.pytorch.callbacks import ModelCheckpoint

        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                callback._last_global_step_saved = max(callback._last_global_step_saved, trainer.global_step)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_params()
        if self._snapshot_local:  # MemoryCheckpoint: ZeRO slices saved as they lie (`_memory.local_model_state`)
            return local_model_state(self.model, list(self._dist_optimizers.values()))
        return model_state(self.model, self._dist_optimizers.values())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done collectively in `load_checkpoint`

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        dopt = self._dist_opt(opt)
        if self._snapshot_local and dopt is not None:
            local = local_optimizer_state(dopt)
            if local is not None:
                return local
        return optimizer_state(self.model, opt, dopt)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done collectively in `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        snapshot = isinstance(storage_options, MemorySnapshot)  # MemoryCheckpoint: asynchronous, into host memory
        if storage_options is not None and not snapshot:
            raise TypeError("FlagScaleStrategy.save_checkpoint does not take storage_options (it writes DCP folders).")
        self._mark("save_checkpoint: DCP write, all_gather_object, barriers")
        path = Path(self.broadcast(str(filepath)))
        state = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = opt_state
        checkpoint.update(training_meta(self.lightning_module, self.optimizers, self.world_size))
        checkpoint["parallel_config"] = vars(self.parallel).copy()
        measured = getattr(getattr(getattr(self, "_pipeline", None), "runner", None), "measured_costs", None)
        if measured is not None:  # pipeline_chunk_costs="auto": the order the run went on with
            checkpoint[MEASURED_CHUNK_COSTS] = list(measured)
        base = base_reference(self)  # LoRA: the checkpoint holds the adapters, this names (and hashes) the base
        if base is not None:
            checkpoint["base_weights"] = base
        self.wait_for_checkpoint()  # one save in flight at a time
        group = self._checkpoint_group if snapshot or self._async_checkpoint else None
        if group is not None:  # meta.pt is written in the background: not the live objects training goes on changing
            checkpoint = copy.deepcopy(checkpoint)
        stager = ChunkStager() if snapshot else None  # copies all but the `LocalChunks`, already private copies
        self._pending_save = save_sharded(path, state, checkpoint, async_group=group, async_stager=stager)
        if self._pending_save is None:
            self._last_checkpoint = path

    def ensure_checkpoint_group(self) -> None:
        """``MemoryCheckpoint``'s group (collective): see ``_snapshots.ensure_checkpoint_group``."""
        ensure_checkpoint_group(self)

    def take_memory_snapshot(self, folder: Path) -> float:
        """``MemoryCheckpoint``'s snapshot of the current step into ``folder`` (collective); returns the seconds
        training was blocked."""
        return take(self.lightning_module.trainer, folder)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint in flight is complete (renamed into place)."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            self._last_checkpoint = pending.wait()

    @override
    def remove_checkpoint(self, filepath) -> None:
        # Retention (save_top_k, last) asks right after `save_checkpoint` returns: with an asynchronous save still
        # in flight the old checkpoint is deleted only once the new one is complete (never if it fails).
        if not self.is_global_zero:
            return
        if self._pending_save is not None:
            self._pending_save.remove_after(filepath)
        else:
            remove_checkpoint_path(filepath)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if checkpoint_path == NEWEST:  # a MemoryCheckpoint callback: memory snapshot or disk, chosen collectively
            return restore_newest(self)
        self.wait_for_checkpoint()
        self._mark("load_checkpoint: DCP read, barriers")
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.is_global_zero:
            clean_interrupted(path.parent)  # saves a crash interrupted: removed (or restored) with a warning
        self.barrier()
        meta = read_meta(path)
        check_base_weights(meta.pop("base_weights", None), base_reference(self), path)  # before any shard is read
        strict = getattr(self.lightning_module, "strict_loading", True)
        load_training_state(path, self.model, self.optimizers, self._dist_opt, strict=strict)
        restore_training_meta(meta, self.lightning_module, self.optimizers, self.global_rank, self.world_size)
        saved_config = meta.pop("parallel_config", None) or {}
        measured = meta.pop(MEASURED_CHUNK_COSTS, None)
        runner = getattr(getattr(self, "_pipeline", None), "runner", None)
        if measured is not None and getattr(runner, "order_auto", False):  # the same order as the saved run, at once
            runner.use_measured_costs(tuple(measured))

        resume_shares(self.parallel, saved_config.get("hetero_dp_batch_sizes"), self.meshes.size("dp"))
        return meta
