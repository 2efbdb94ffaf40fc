"""Mixture-of-experts layers: routers, stacked SwiGLU experts, capacity/dropless dispatch, load balancing.

``build_moe(config, layer_idx)`` returns the block the decoder puts at ``layers.{i}.mlp`` for MoE layers;
``parallel.expert.apply_ep`` shards it over an expert-parallel group.

Parameter / buffer names under ``layers.{i}.mlp`` (for the HF converters; shapes for E experts, hidden H,
expert width I, shared width S):

================================== ================ ====================================================
native name                         shape            HF v5 name (Mixtral / Qwen2-MoE / DeepSeek-V3)
================================== ================ ====================================================
gate.weight                         [E, H]           ``mlp.gate.weight`` (Mixtral: ``block_sparse_moe.gate``)
gate.e_score_correction_bias        [E] (buffer)     ``mlp.gate.e_score_correction_bias`` (sigmoid routers)
experts.gate_up_proj                [E, 2I, H]       ``mlp.experts.gate_up_proj`` (rows [:I] gate, [I:] up);
                                                     HF v4 per-expert ``experts.{e}.gate_proj|w1`` /
                                                     ``up_proj|w3`` are its row blocks
experts.down_proj                   [E, H, I]        ``mlp.experts.down_proj`` (v4: ``experts.{e}.down_proj|w2``)
shared_experts.{gate,up,down}_proj  [S,H] [S,H] [H,S] DeepSeek-V3 ``mlp.shared_experts.*`` (no gate)
shared_expert.{gate,up,down}_proj   same             Qwen2-MoE ``mlp.shared_expert.*`` (gated)
shared_expert_gate.weight           [1, H]           Qwen2-MoE ``mlp.shared_expert_gate.weight``
================================== ================ ====================================================

Under expert parallelism ``experts.*`` are DTensors ``Shard(0)`` with the same global shapes and keys.
"""

from lightning_flagscale.moe.balance import (
    HotExpertReplication,
    balance_after_step,
    moe_layers,
    select_hot_experts,
    set_moe_aux_loss_scale,
    set_moe_sequence_group,
    update_moe_state,
)
from lightning_flagscale.moe.experts import GroupedExperts, SwiGLUMLP, grouped_linear
from lightning_flagscale.moe.layer import RECOMPUTE_LEVELS, LocalDispatcher, MoELayer, apply_moe_recompute, build_moe
from lightning_flagscale.moe.router import AttachAuxLoss, RouterOutput, TopKRouter

__all__ = [
    "RECOMPUTE_LEVELS",
    "AttachAuxLoss",
    "GroupedExperts",
    "HotExpertReplication",
    "LocalDispatcher",
    "MoELayer",
    "RouterOutput",
    "SwiGLUMLP",
    "TopKRouter",
    "apply_moe_recompute",
    "balance_after_step",
    "build_moe",
    "grouped_linear",
    "moe_layers",
    "select_hot_experts",
    "set_moe_aux_loss_scale",
    "set_moe_sequence_group",
    "update_moe_state",
]
