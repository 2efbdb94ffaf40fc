"""The training state a checkpoint holds, in and out of DCP folders: model and optimizer shards under any layout
(ZeRO-1/2 slices, flat ZeRO-3, FSDP2, TP), optimizer hyper-parameters, MoE router state, per-rank RNG state, the
loop's counters, and where ``resume="auto"`` finds the newest complete checkpoint. Used by the strategy's checkpoint
hooks (``_checkpoint.py``), the in-memory snapshots (``_snapshots.py``) and the step guard's rollback."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_flagscale.checkpoint.layout import read_meta
from lightning_flagscale.checkpoint.recovery import find_latest_checkpoint
from lightning_flagscale.checkpoint.sharded import checkpoint_keys, load_sharded
from lightning_flagscale.models.init import canonical_fqn
from lightning_flagscale.models.protocol import saves_frozen_weights
from lightning_flagscale.moe.balance import moe_layers
from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer
from lightning_flagscale.parallel.data_parallel.zero3_flat_state import FlatZero3Optimizer


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
    return {name: list(layer.replicated_experts) for name, layer in moe_layers(model)}


def restore_moe_router_state(model: torch.nn.Module, state: dict[str, list[int]]) -> None:
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


def frozen_keys(model: torch.nn.Module) -> set[str]:
    """The state-dict keys a checkpoint of ``model`` leaves out: the frozen parameters of a module that rebuilds
    them itself (``FrozenBaseModule``, LoRA's base weights); none for every other module."""
    if saves_frozen_weights(model):
        return set()
    return {canonical_fqn(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def model_state(
    model: torch.nn.Module, dist_optimizers: Iterable[DistributedOptimizer], *, frozen: bool = False
) -> dict[str, Any]:
    """This rank's shard of the model state; under mixed precision the fp32 master weights are the model. Without
    ``frozen`` the keys of :func:`frozen_keys` are left out (what a checkpoint holds)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    for dopt in dist_optimizers:
        state.update(dopt.master_state_dict())
    skip = set() if frozen else frozen_keys(model)
    return {k: v for k, v in state.items() if k not in skip and canonical_fqn(k) not in skip}


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
    state: dict[str, Any] = {"state_dict": model_state(model, dopts, frozen=True)}  # fp32 where masters exist
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
    # Frozen weights the checkpoint does not hold (LoRA's base) keep the values the module built; set back as they
    # are, so that every layout (flat ZeRO-3 rebuilds whole shards) and the strict key check see the whole model.
    skip = frozen_keys(model)
    kept = {k: v for k, v in state["state_dict"].items() if k in skip or canonical_fqn(k) in skip}
    state["state_dict"] = {k: v for k, v in state["state_dict"].items() if k not in kept}
    load_sharded(path, state)
    state["state_dict"].update(kept)
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


def base_reference(strategy: Any) -> dict[str, Any] | None:
    """Collectively: where the module's frozen base weights come from and their hash, for a module whose checkpoints
    leave them out (``FrozenBaseModule``; None for every other module). Rank 0 computes it (the module caches it),
    the others receive it."""
    module = strategy.lightning_module
    if saves_frozen_weights(module):
        return None
    return strategy.broadcast(module.base_weights_reference() if strategy.is_global_zero else None)


def auto_resume_path(trainer: Any) -> Path | None:
    """The newest complete checkpoint in the ``dirpath`` of the trainer's ``ModelCheckpoint`` callbacks, or None.

    Incomplete checkpoints are skipped with a warning (``checkpoint.recovery``); they are cleaned up by rank 0 when
    the chosen checkpoint is loaded.
    """

    folders = [Path(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if not folders:
        raise ValueError(
            "FlagScaleStrategy(resume='auto') looks for checkpoints in the `dirpath` of a ModelCheckpoint callback;"
            " add `ModelCheckpoint(dirpath=..., every_n_train_steps=N, save_last=True)` to the Trainer's callbacks."
        )
    found = [p for p in (find_latest_checkpoint(f) for f in folders) if p is not None]
    if not found:
        return None

    return max(found, key=lambda p: (int(read_meta(p).get("global_step", -1)), p.stat().st_mtime))
