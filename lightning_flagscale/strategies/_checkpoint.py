"""Checkpoint I/O of ``FlagScaleStrategy``: its checkpoint hooks (:class:`CheckpointHooks`), model/optimizer shards in
and out of DCP folders, per-rank RNG state and the rest of the training state."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from typing_extensions import override

from lightning_flagscale.checkpoint.in_memory import ChunkStager
from lightning_flagscale.checkpoint.recovery import clean_interrupted
from lightning_flagscale.checkpoint.sharded import (
    PendingSave,
    checkpoint_keys,
    load_sharded,
    read_meta,
    remove_checkpoint_path,
    save_sharded,
)
from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer
from lightning_flagscale.parallel.data_parallel.zero3_flat_state import FlatZero3Optimizer

__all__ = [
    "CheckpointHooks",
    "load_training_state",
    "model_state",
    "moe_router_state",
    "optimizer_hparams",
    "optimizer_state",
    "optimizer_template",
    "restore_moe_router_state",
    "restore_optimizer_hparams",
    "restore_training_meta",
    "rng_state",
    "set_rng_state",
    "training_meta",
]


def optimizer_template(dopt: DistributedOptimizer, keys: Iterable[str]) -> dict[str, Any]:
    """A template holding exactly the optimizer-state ``keys`` a checkpoint has, in this rank's layout."""
    keys = set(keys)
    tensor_keys = sorted(k for k in keys if k != "step")
    template = dopt.state_dict_template(tensor_keys)
    if "step" not in keys:
        for s in template["state"].values():
            s.pop("step", None)
    return template


def _checkpoint_state_keys(path: Path, index: int) -> set[str]:
    prefix = f"optimizer_{index}.state."
    return {key.rsplit(".", 1)[-1] for key in checkpoint_keys(path) if key.startswith(prefix)}


def optimizer_hparams(optimizers: Sequence[torch.optim.Optimizer]) -> list[list[dict[str, Any]]]:
    """Every param group's hyperparameters (lr, betas, weight decay, ``initial_lr``...), without the parameters.

    They are the same on every rank and under any layout (the distributed optimizers rewrite only ``params``), so
    rank 0's copy in ``meta.pt`` restores them anywhere; without it the first resumed step would run at the LR the
    scheduler set when it was built (the warmup LR of step 0), as LR schedulers restore only their own counters.
    """
    return [[_hparams(group) for group in opt.param_groups] for opt in optimizers]


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}


def restore_optimizer_hparams(optimizers: Sequence[torch.optim.Optimizer], saved: list[list[dict[str, Any]]]) -> None:
    """Set each param group's hyperparameters from ``optimizer_hparams`` of the checkpoint."""
    if len(saved) != len(optimizers):
        raise ValueError(
            f"The checkpoint holds {len(saved)} optimizer(s) but `configure_optimizers` returned {len(optimizers)};"
            " resume with the same optimizers."
        )
    for index, (opt, groups) in enumerate(zip(optimizers, saved)):
        if len(groups) != len(opt.param_groups):
            raise ValueError(
                f"Optimizer {index} has {len(opt.param_groups)} param groups but the checkpoint has {len(groups)};"
                " resume with the same `configure_optimizers`."
            )
        for group, hparams in zip(opt.param_groups, groups):
            for key, value in hparams.items():
                current = group.get(key)
                if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                    current.copy_(value)  # tensor LRs (capturable optimizers) are updated in place
                else:
                    group[key] = value


def moe_router_state(model: torch.nn.Module) -> dict[str, list[int]]:
    """Router state outside the state dict: each MoE layer's replicated hot experts (the biases are buffers)."""
    from lightning_flagscale.moe.balance import moe_layers

    return {name: list(layer.replicated_experts) for name, layer in moe_layers(model)}


def restore_moe_router_state(model: torch.nn.Module, state: dict[str, list[int]]) -> None:
    from lightning_flagscale.moe.balance import moe_layers

    for name, layer in moe_layers(model):
        if name in state:
            layer.replicated_experts = tuple(state[name])


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_state(model: torch.nn.Module, dist_optimizers: Iterable[DistributedOptimizer]) -> dict[str, Any]:
    """This rank's shard of the model state; under mixed precision the fp32 master weights are the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    for dopt in dist_optimizers:
        state.update(dopt.master_state_dict())
    return state


def optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, dopt: DistributedOptimizer | None
) -> dict[str, Any]:
    """This rank's shard of an optimizer's state: our ZeRO optimizer's, or DCP's view of a plain/FSDP2 one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if dopt is not None:
        return dopt.state_dict()
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))


def _state_templates(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    dist_opt: Callable[[torch.optim.Optimizer], DistributedOptimizer | None],
    state_keys: Callable[[int], set[str]],
) -> dict[str, Any]:
    """Model and optimizer state in this rank's layout, to be filled in place (``state_keys(i)``: the keys of
    optimizer ``i``'s per-parameter state in the source)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, _init_optim_state, get_optimizer_state_dict

    dopts = [d for d in (dist_opt(o) for o in optimizers) if d is not None]
    state: dict[str, Any] = {"state_dict": model_state(model, dopts)}  # fp32 templates where masters exist
    for i, opt in enumerate(optimizers):
        dopt = dist_opt(opt)
        if dopt is not None:
            state[f"optimizer_{i}"] = optimizer_template(dopt, state_keys(i))
        else:
            _init_optim_state(opt)
            state[f"optimizer_{i}"] = get_optimizer_state_dict(
                model, opt, options=StateDictOptions(full_state_dict=False)
            )
    return state


def _apply_state(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    dist_opt: Callable[[torch.optim.Optimizer], DistributedOptimizer | None],
    strict: bool,
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for dopt in (d for d in (dist_opt(o) for o in optimizers) if d is not None):
        if isinstance(dopt, FlatZero3Optimizer):  # flat shards are not parameter-shaped: set from the Shard(0) rows
            state["state_dict"] = dopt.load_model_state(state["state_dict"])
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        dopt = dist_opt(opt)
        if dopt is not None:
            dopt.load_master_state_dict(state["state_dict"])
            dopt.load_state_dict(state[f"optimizer_{i}"])
            dopt.sync_params()
        else:
            set_optimizer_state_dict(
                model, opt, state[f"optimizer_{i}"], options=StateDictOptions(full_state_dict=False)
            )


def load_training_state(
    path: Path,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    dist_opt: Callable[[torch.optim.Optimizer], DistributedOptimizer | None],
    *,
    strict: bool,
) -> None:
    """Read model and optimizer shards from the DCP folder ``path`` into this rank's (any) layout."""
    state = _state_templates(model, optimizers, dist_opt, lambda i: _checkpoint_state_keys(path, i))
    load_sharded(path, state)
    _apply_state(state, model, optimizers, dist_opt, strict)


def training_meta(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], world_size: int) -> dict:
    """Collectively: what a checkpoint's ``meta.pt`` needs beyond Lightning's dict for an exact resume (per-rank RNG,
    MoE router state of every pipeline stage, param-group hyperparameters)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (rng_state(), moe_router_state(module)))
    return {
        "rng_states_per_rank": [rng for rng, _ in gathered],
        "moe_router_state": {k: v for _, routers in gathered for k, v in routers.items()},
        "optimizer_param_groups": optimizer_hparams(optimizers),
    }


def restore_training_meta(
    meta: dict, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], rank: int, world_size: int
) -> None:
    """Pop and apply what :func:`training_meta` added (RNG only when the world size is unchanged)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rngs = meta.pop("rng_states_per_rank", None)
    if rngs is not None and len(rngs) == world_size:
        set_rng_state(rngs[rank])
    elif rngs is not None:
        rank_zero_warn("Resuming under a different world size: RNG states are re-seeded, not restored per rank.")
    hparams = meta.pop("optimizer_param_groups", None)
    if hparams is not None and optimizers:
        restore_optimizer_hparams(optimizers, hparams)
    restore_moe_router_state(module, meta.pop("moe_router_state", {}))


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
            from lightning_flagscale.strategies._snapshots import local_model_state

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
            from lightning_flagscale.strategies._snapshots import local_optimizer_state

            local = local_optimizer_state(dopt)
            if local is not None:
                return local
        return optimizer_state(self.model, opt, dopt)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done collectively in `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        from lightning_flagscale.strategies._snapshots import MemorySnapshot

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
        self.wait_for_checkpoint()  # one save in flight at a time
        group = self._checkpoint_group if snapshot or self._async_checkpoint else None
        if group is not None:  # meta.pt is written in the background: not the live objects training goes on changing
            checkpoint = copy.deepcopy(checkpoint)
        stager = ChunkStager() if snapshot else None  # copies all but the `LocalChunks`, already private copies
        self._pending_save = save_sharded(path, state, checkpoint, async_group=group, async_stager=stager)
        if self._pending_save is None:
            self._last_checkpoint = path

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
        from lightning_flagscale.strategies._snapshots import NEWEST, restore_newest

        if checkpoint_path == NEWEST:  # a MemoryCheckpoint callback: memory snapshot or disk, chosen collectively
            return restore_newest(self)
        self.wait_for_checkpoint()
        self._mark("load_checkpoint: DCP read, barriers")
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.is_global_zero:
            clean_interrupted(path.parent)  # saves a crash interrupted: removed (or restored) with a warning
        self.barrier()
        meta = read_meta(path)
        strict = getattr(self.lightning_module, "strict_loading", True)
        load_training_state(path, self.model, self.optimizers, self._dist_opt, strict=strict)
        restore_training_meta(meta, self.lightning_module, self.optimizers, self.global_rank, self.world_size)
        saved_config = meta.pop("parallel_config", None) or {}
        from lightning_flagscale.parallel.hetero_dp.shares import resume_shares

        resume_shares(self.parallel, saved_config.get("hetero_dp_batch_sizes"), self.meshes.size("dp"))
        return meta
