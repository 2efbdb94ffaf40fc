"""Between-step load balancing: DeepSeek-V3 router-bias updates and hot-expert replica selection.

Both act on the per-expert load a layer accumulated over the step's forwards (``MoELayer.load_accum``), summed
over every rank that holds a replica of the router so the decision is identical everywhere. Call
:func:`update_moe_state` once per optimizer step, after ``optimizer.step()`` (the telemetry callback in
``callbacks/moe.py`` does it), outside autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_flagscale.moe.layer import MoELayer

__all__ = ["HotExpertReplication", "moe_layers", "select_hot_experts", "set_moe_aux_loss_scale", "update_moe_state"]


@dataclass(kw_only=True)
class HotExpertReplication:
    """When routing is skewed, give the most-loaded experts a replica on every EP rank (MXMACA seed, +8%)."""

    num_replicas: int = 1
    """How many of the most-loaded experts to replicate."""
    enable_imbalance: float = 1.5
    """Replicate when max/mean tokens per expert reaches this."""
    disable_imbalance: float = 1.2
    """Drop the replicas once max/mean falls to this (hysteresis below ``enable_imbalance``)."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas={self.num_replicas} must be >= 1.")
        if not 1.0 <= self.disable_imbalance <= self.enable_imbalance:
            raise ValueError(
                f"Need 1 <= disable_imbalance ({self.disable_imbalance}) <= enable_imbalance ({self.enable_imbalance})."
            )


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


@torch.no_grad()
def update_moe_state(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Consume the step's load: update router biases and hot-expert sets, then reset the accumulators.

    ``group`` must span every rank that holds a copy of these layers' routers (a pipeline stage's dp x cp x tp
    ranks; ``None`` = the default group, right without pipeline parallelism). Every rank of the group must call it.
    """
    layers = moe_layers(model)
    if not layers:
        return
    loads = torch.stack([layer.load_accum for _, layer in layers])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(loads, group=group)  # one collective for all layers
    for (_, layer), load in zip(layers, loads):
        bias = layer.gate.e_score_correction_bias
        if layer.bias_update_rate > 0 and bias is not None and load.sum() > 0:
            # DeepSeek-V3: raise the bias of under-loaded experts, lower it for over-loaded ones.
            bias += layer.bias_update_rate * torch.sign(load.mean() - load).to(bias)
        if layer.hot_expert_config is not None and load.sum() > 0:
            layer.replicated_experts = select_hot_experts(load, layer.hot_expert_config, layer.replicated_experts)
        layer.load_accum.zero_()
