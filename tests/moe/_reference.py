"""Per-token dense oracles for the MoE layer: plain Python loops over tokens and their chosen experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_flagscale.moe.layer import MoELayer


def init_moe(layer: MoELayer, seed: int = 0, std: float = 0.2) -> MoELayer:
    """Deterministic normal init of every parameter (full tensors; call before apply_ep)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(layer.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * std)
        if layer.gate.e_score_correction_bias is not None:
            layer.gate.e_score_correction_bias.copy_(torch.randn(layer.num_experts, generator=g) * 0.05)
    return layer


def reference_route(layer: MoELayer, x: Tensor) -> tuple[list[list[int]], list[list[Tensor]]]:
    """Per-token choice and weights, following the DeepSeek/Mixtral/Qwen2-MoE definitions literally."""
    r = layer.gate
    chosen, weights = [], []
    for t in range(x.shape[0]):
        logits = r.weight @ x[t]
        s = logits.softmax(-1) if r.score_func == "softmax" else logits.sigmoid()
        c = s.detach().clone()
        if r.e_score_correction_bias is not None:
            c = c + r.e_score_correction_bias
        allowed = list(range(layer.num_experts))
        if r.num_groups:
            size = layer.num_experts // r.num_groups
            gscore = []
            for gi in range(r.num_groups):
                vals = sorted(c[gi * size : (gi + 1) * size].tolist(), reverse=True)
                gscore.append(sum(vals[:2]) if r.score_func == "sigmoid" else vals[0])
            best = sorted(range(r.num_groups), key=lambda i: -gscore[i])[: r.group_topk]
            allowed = [e for e in allowed if e // size in best]
        top = sorted(allowed, key=lambda e: -float(c[e]))[: layer.top_k]
        w = [s[e] for e in top]
        if r.norm_topk_prob and layer.top_k > 1:
            total = sum(w)
            w = [wi / total for wi in w]
        chosen.append(top)
        weights.append([wi * r.scaling_factor for wi in w])
    return chosen, weights


def expert_fn(layer: MoELayer, e: int, v: Tensor) -> Tensor:
    w1, w2 = layer.experts.gate_up_proj[e], layer.experts.down_proj[e]
    gate, up = (w1 @ v).chunk(2)
    return w2 @ (F.silu(gate) * up)


def reference_moe(layer: MoELayer, hidden: Tensor, keep: set[tuple[int, int]] | None = None) -> Tensor:
    """Output of ``layer`` computed token by token; ``keep`` limits the (token, slot) assignments (capacity)."""
    x = hidden.reshape(-1, hidden.shape[-1])
    chosen, weights = reference_route(layer, x)
    rows = []
    for t in range(x.shape[0]):
        out = torch.zeros_like(x[t])
        for j, e in enumerate(chosen[t]):
            if keep is None or (t, j) in keep:
                out = out + weights[t][j] * expert_fn(layer, e, x[t])
        if hasattr(layer, "shared_experts"):
            out = out + layer.shared_experts(x[t])
        if hasattr(layer, "shared_expert"):
            out = out + torch.sigmoid(layer.shared_expert_gate(x[t])) * layer.shared_expert(x[t])
        rows.append(out)
    return torch.stack(rows).view(hidden.shape)


def rel_err(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
