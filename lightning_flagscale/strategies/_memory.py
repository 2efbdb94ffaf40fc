"""The strategy's side of in-memory checkpoints (``callbacks.MemoryCheckpoint``): what a snapshot holds, and the
collective choice, at restart, between the newest snapshot every rank holds and the newest complete disk checkpoint.

The launcher cannot make that choice (no process group yet, and on several nodes each node sees only its own
``/dev/shm``), so with a ``MemoryCheckpoint`` callback a resume (``resume="auto"`` or ``ckpt_path="last"``) goes through
``load_checkpoint(NEWEST)``, where every rank takes part: the ranks all-gather the steps of their complete snapshots,
take the newest step all of them hold, and restore it if it is newer than the disk checkpoint rank 0 finds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_flagscale.checkpoint.memory import read_snapshot
from lightning_flagscale.strategies._checkpoint import (
    moe_router_state,
    optimizer_hparams,
    restore_local_training_state,
    restore_moe_router_state,
    restore_optimizer_hparams,
    rng_state,
    set_rng_state,
)

__all__ = [
    "NEWEST",
    "choose_snapshot",
    "load_local_buckets",
    "local_buckets",
    "memory_callback",
    "restore_newest",
    "snapshot_state",
]

NEWEST = "flagscale:newest-of-memory-and-disk"
"""The ``ckpt_path`` the launcher passes when a ``MemoryCheckpoint`` callback is present and a resume is asked."""
_EXTRAS = "flagscale_memory"


def memory_callback(trainer: Any) -> Any:
    """The trainer's ``MemoryCheckpoint`` callback, or None."""
    from lightning_flagscale.callbacks.memory_checkpoint import MemoryCheckpoint

    found = [cb for cb in trainer.callbacks if isinstance(cb, MemoryCheckpoint)]
    if len(found) > 1:
        raise ValueError("Give the Trainer one MemoryCheckpoint callback, not several.")
    return found[0] if found else None


def snapshot_state(trainer: Any) -> dict[str, Any]:
    """This rank's full training state, as a disk checkpoint holds it (Lightning's dict from the same hooks
    ``ModelCheckpoint`` calls, with this rank's shards), plus this rank's RNG, router state and param groups."""
    strategy = trainer.strategy
    # Lightning's own assembly of a checkpoint dict (loops, schedulers, callbacks, precision, datamodule, the
    # strategy's shards); `trainer.save_checkpoint` would add a barrier and a file write we do not want here. The
    # strategy hands its ZeRO shards as they are (no gathers: a snapshot restores into the same layout only).
    strategy._snapshot_local = True
    try:
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    finally:
        strategy._snapshot_local = False
    state[_EXTRAS] = {
        "rng": rng_state(),
        "moe_router_state": moe_router_state(trainer.lightning_module),
        "optimizer_param_groups": optimizer_hparams(strategy.optimizers),
    }
    return state


def local_buckets(dopt: Any) -> list[dict[str, Any]]:
    """A ZeRO-1/2 optimizer's own shards: each bucket's main (fp32) weight slice and its optimizer state."""
    state = dopt.optimizer.state
    return [{"main": b.main_param.detach(), "state": dict(state.get(b.main_param, {}))} for b in dopt.buckets]


def load_local_buckets(dopt: Any, saved: list[dict[str, Any]]) -> None:
    """Put :func:`local_buckets` back (same layout), then all-gather the weights into the model."""
    if len(saved) != len(dopt.buckets):
        raise ValueError(f"The snapshot has {len(saved)} gradient buckets, this layout {len(dopt.buckets)}.")
    for bucket, shard in zip(dopt.buckets, saved):
        main = bucket.main_param
        with torch.no_grad():
            main.copy_(shard["main"])
        # Per-element states go where the main slice lives; scalars (Adam's `step`) stay where the optimizer keeps them.
        dopt.optimizer.state[main] = {
            k: (v.to(main.device).clone() if v.dim() > 0 else v.clone()) if isinstance(v, torch.Tensor) else v
            for k, v in shard["state"].items()
        }
    dopt.sync_params()


def _disk_candidate(trainer: Any) -> tuple[str | None, int | None]:
    """Rank 0: the newest complete checkpoint of the ModelCheckpoint folders and its step (None without one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_flagscale.checkpoint.sharded import read_meta
    from lightning_flagscale.strategies._resilience import auto_resume_path

    if not any(isinstance(cb, ModelCheckpoint) and cb.dirpath for cb in trainer.callbacks):
        return None, None
    path = auto_resume_path(trainer)
    return (str(path), int(read_meta(path).get("global_step", -1))) if path is not None else (None, None)


def choose_snapshot(steps_per_rank: list[list[int]], disk_step: int | None) -> tuple[int | None, str]:
    """The snapshot step to restore (the newest one every rank holds, if newer than the disk checkpoint) or None,
    and a warning naming the ranks that miss a newer snapshot some rank holds."""
    common = set(steps_per_rank[0]).intersection(*map(set, steps_per_rank[1:]))
    newest_common = max(common) if common else None
    newest = max((s for steps in steps_per_rank for s in steps), default=None)
    warning = ""
    if newest is not None and newest != newest_common:
        missing = [r for r, steps in enumerate(steps_per_rank) if newest not in steps]
        warning = (
            f"In-memory snapshot of step {newest} is missing or incomplete on rank(s) {missing};"
            f" the newest step every rank holds is {newest_common}."
        )
    if newest_common is not None and (disk_step is None or newest_common > disk_step):
        return newest_common, warning
    return None, warning


def restore_newest(strategy: Any) -> dict[str, Any]:
    """Collectively restore the newest state: a memory snapshot complete on every rank if newer than the newest disk
    checkpoint, else that checkpoint, else nothing (a fresh start). Returns Lightning's checkpoint dict."""
    trainer = strategy.lightning_module.trainer
    callback = memory_callback(trainer)
    folder, tag = callback.rank_folder(trainer), callback.tag(trainer)
    every: list[Any] = [None] * strategy.world_size
    dist.all_gather_object(every, callback.complete_steps(trainer))
    disk_path, disk_step = strategy.broadcast(_disk_candidate(trainer) if strategy.is_global_zero else None)
    memory_step, warning = choose_snapshot(every, disk_step)
    if warning:
        rank_zero_warn(warning)
    if memory_step is not None:
        rank_zero_info(f"Resuming from the in-memory snapshot of step {memory_step} (newest disk: {disk_path}).")
        return _load_snapshot(strategy, folder, memory_step, tag)
    if disk_path is not None:
        rank_zero_info(f"Resuming from {disk_path} (step {disk_step}): no newer in-memory snapshot held by every rank.")
        return strategy.load_checkpoint(Path(disk_path))
    rank_zero_info("No in-memory snapshot and no complete checkpoint to resume from: training starts from scratch.")
    return _nothing(trainer)


def _load_snapshot(strategy: Any, folder: Path, step: int, tag: str) -> dict[str, Any]:
    checkpoint = read_snapshot(folder, step, tag)
    extras = checkpoint.pop(_EXTRAS)
    module = strategy.lightning_module
    restore_local_training_state(
        checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", []), strategy.model, strategy.optimizers,
        strategy._dist_opt, strict=getattr(module, "strict_loading", True),
    )  # fmt: skip
    set_rng_state(extras["rng"])
    if strategy.optimizers:
        restore_optimizer_hparams(strategy.optimizers, extras["optimizer_param_groups"])
    restore_moe_router_state(module, extras["moe_router_state"])
    strategy.barrier()
    return checkpoint


def _nothing(trainer: Any) -> dict[str, Any]:
    """A checkpoint dict that restores nothing: no loops, callbacks or datamodule state; the schedulers' own."""
    import lightning

    return {
        "pytorch-lightning_version": lightning.__version__,
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
