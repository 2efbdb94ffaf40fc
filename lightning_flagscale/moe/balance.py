"""Between-step load balancing: DeepSeek-V3 router-bias updates and hot-expert replica selection.

Both act on the per-expert load a layer accumulated over the step's forwards (``MoELayer.load_accum``), summed
over the layer's token group so the decision is identical on every rank and equal to one process's on the whole
batch. :func:`update_moe_state` runs once per optimizer step, after ``optimizer.step()``, outside autograd: the model
triggers it itself (``CausalLMModule.optimizer_step``, or :func:`balance_after_step` in a plain loop), so balancing
works under any strategy and in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_flagscale.moe.layer import DEFAULT_GROUP, HotExpertReplication, MoELayer

__all__ = [
    "HotExpertReplication",
    "balance_after_step",
    "moe_layers",
    "select_hot_experts",
    "set_moe_aux_loss_scale",
    "set_moe_sequence_group",
    "update_moe_state",
]


def select_hot_experts(load: Tensor, cfg: HotExpertReplication, current: tuple[int, ...]) -> tuple[int, ...]:
    """The experts to replicate next step, from the step's global per-expert ``load`` [E]."""
    imbalance = float(load.max() / load.mean().clamp_min(1e-9))
    if imbalance >= cfg.enable_imbalance:
        k = min(cfg.num_replicas, load.numel())
        return tuple(sorted(int(i) for i in torch.topk(load, k).indices))
    if imbalance <= cfg.disable_imbalance:
        return ()
    return current


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """Every MoE layer of ``model`` with its qualified name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def set_moe_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Scale of the aux-loss gradients: set it to the factor the main loss gets (e.g. ``1 / num_microbatches``)."""
    for _, layer in moe_layers(model):
        layer.aux_loss_scale = scale


def set_moe_sequence_group(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Tell every MoE layer of ``model`` which ranks hold the other shards of its sequences (the context-parallel
    group; ``None``: every rank holds whole sequences). The sequence-wise balance loss sums its per-sequence
    statistics over it. Returns ``model``."""
    for _, layer in moe_layers(model):
        layer.sequence_group = group
    return model


@torch.no_grad()
def update_moe_state(model: nn.Module, group: dist.ProcessGroup | str | None = DEFAULT_GROUP) -> None:
    """Consume the step's load: update router biases and hot-expert sets, then reset the accumulators.

    The load is summed over each layer's token group (``MoELayer.token_group``, set by
    ``parallel.expert.set_moe_token_group``) unless ``group`` is given; every rank of that group must call this, once
    per optimizer step. Summing over ranks that hold the same tokens (TP replicas) scales every count alike and
    changes no decision. Layers with neither a bias update nor hot experts read no load: they only reset it, without
    a collective. ``CausalLMModule`` calls it after each optimizer step; :func:`balance_after_step` does it
    for plain PyTorch loops.
    """
    layers = [layer for _, layer in moe_layers(model)]
    batches: dict[int, tuple[dist.ProcessGroup | None, list[MoELayer]]] = {}
    for layer in layers:  # module order: the same collective sequence on every rank
        if not _uses_load(layer):  # configuration, the same on every rank: no collective for a load nobody reads
            layer.load_accum.zero_()
            continue
        g = layer.resolved_token_group() if isinstance(group, str) else group
        batches.setdefault(id(g), (g, []))[1].append(layer)
    for g, members in batches.values():
        loads = torch.stack([layer.load_accum for layer in members])
        if g is not None:
            dist.all_reduce(loads, group=g)  # one collective for all layers of the group
        for layer, load in zip(members, loads):
            _apply_load(layer, load)


def _uses_load(layer: MoELayer) -> bool:
    """Whether the step's load changes anything in ``layer``: a router bias to update, or hot experts to choose."""
    bias_update = layer.bias_update_rate > 0 and layer.gate.e_score_correction_bias is not None
    return bias_update or layer.hot_expert_config is not None


def _apply_load(layer: MoELayer, load: Tensor) -> None:
    bias = layer.gate.e_score_correction_bias
    if layer.bias_update_rate > 0 and bias is not None and load.sum() > 0:
        # DeepSeek-V3: raise the bias of under-loaded experts, lower it for over-loaded ones.
        bias += layer.bias_update_rate * torch.sign(load.mean() - load).to(bias)
    if layer.hot_expert_config is not None and load.sum() > 0:
        layer.replicated_experts = select_hot_experts(load, layer.hot_expert_config, layer.replicated_experts)
    layer.load_accum.zero_()


def balance_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> RemovableHandle:
    """Run :func:`update_moe_state` on ``model`` after every ``optimizer.step()`` (plain loops, manual optimization).

    Returns the hook handle (``.remove()`` to detach). Lightning modules built on ``CausalLMModule`` need not call it.
    """
    return optimizer.register_step_post_hook(lambda *_: update_moe_state(model))
