"""Top-k routers (softmax / sigmoid, optional group-limited routing) and their auxiliary losses.

The router scores every token against every expert, picks ``top_k`` experts and returns the weights the expert
outputs are mixed with. Load-balancing terms:

- Switch-Transformer balance loss ``coeff * E * sum_e f_e * P_e`` (f: fraction of assignments, P: mean probability);
- router z-loss ``coeff * mean(logsumexp(logits) ** 2)`` (ST-MoE) that keeps logits small;
- DeepSeek-V3's complementary sequence-wise balance loss ``alpha * sum_i f_i P_i`` with ``f`` and ``P`` taken per
  sequence (report eq. 17-20), averaged over sequences (:func:`sequence_balance_loss`);
- DeepSeek-V3 aux-loss-free balancing: a per-expert bias (buffer ``e_score_correction_bias``) added to the scores
  only for the *selection*, nudged after each step towards the under-loaded experts (see ``moe.balance``).

Scope of the statistics (``TransformerConfig.moe_aux_loss_scope``): ``"global"`` (default) computes ``f`` and ``P``
(and the z-loss token mean) over every token of the step's micro-batch held by the ranks of the layer's token group
(Megatron-Core's "global" aux loss; :func:`global_balance_losses`), so the model trained does not depend on the
data/context-parallel layout; ``"local"`` uses this rank's tokens only (per-micro-batch, per-rank statistics). The
step's micro-batches each have their own statistics (as in Megatron-Core): a pipeline with several micro-batches per
step trains what one process trains on the same micro-batches, not on the whole batch at once. The sequence-wise
loss has no such dependence: its statistics are per sequence (gathered over the context-parallel shards of each).

Aux losses reach the total loss through :class:`AttachAuxLoss` (Megatron's ``MoEAuxLossAutoScaler`` trick): the
layer output passes through an identity whose backward also emits the gradient of the aux loss, so the loss term
works under pipeline parallelism where the last stage never sees the layer's aux value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "AttachAuxLoss",
    "RouterOutput",
    "TopKRouter",
    "global_balance_losses",
    "sequence_balance_loss",
    "switch_aux_loss",
    "z_loss",
]


@dataclass
class RouterOutput:
    """What the router hands the dispatcher; ``scores`` are the un-biased per-expert scores [T, E] (fp32)."""

    logits: Tensor
    scores: Tensor
    topk_idx: Tensor
    topk_weight: Tensor


def switch_aux_loss(scores: Tensor, topk_idx: Tensor, num_experts: int, normalize: bool) -> Tensor:
    """Switch balance loss without the coefficient: ``E * sum_e f_e * P_e``.

    ``f_e`` = assignments to e / (T * k), ``P_e`` = mean over tokens of the routing probability of e. Sigmoid
    scores are normalised per token first (``normalize``) so that P is a distribution, as in DeepSeek-V3's
    sequence-wise loss.
    """
    probs = scores / scores.sum(-1, keepdim=True) if normalize else scores
    counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).to(probs.dtype)
    f = counts / topk_idx.numel()
    p = probs.mean(0)
    return num_experts * torch.sum(f * p)


def z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss without the coefficient: ``mean_t logsumexp(logits_t) ** 2``."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def global_balance_losses(
    logits: Tensor,
    scores: Tensor,
    topk_idx: Tensor,
    *,
    aux_coeff: float,
    z_coeff: float,
    normalize: bool,
    group: dist.ProcessGroup | None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Balance and z losses over the tokens of every rank of ``group``: (global values, this rank's share).

    With ``T`` the group's token count, ``f_e`` the group's fraction of assignments to e and ``p_te`` this rank's
    (normalised) routing probabilities, this rank's share is ``aux_coeff * E * sum_e f_e * sum_t p_te / T`` plus
    ``z_coeff * sum_t lse_t^2 / T``; the shares of the group's ranks sum to the single-process losses on all their
    tokens, value and gradient. Only detached statistics cross ranks (one all-reduce): the counts are not
    differentiable anyway, and the probabilities of other ranks' tokens get their gradient on those ranks, so no
    collective is needed in backward. The caller scales the share for the gradient reduction (see ``MoELayer``).
    """
    num_experts = scores.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True) if normalize else scores
    lse_sq = torch.logsumexp(logits, dim=-1).square() if z_coeff > 0 else logits.new_zeros(0)
    counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).to(probs.dtype)
    # [counts (E) | sum of probabilities (E) | tokens | sum of lse^2]: one collective for every statistic.
    stats = torch.cat([counts, probs.detach().sum(0), probs.new_tensor([topk_idx.shape[0], lse_sq.detach().sum()])])
    if group is not None:
        dist.all_reduce(stats, group=group)
    g_counts, g_prob_sum, (g_tokens, g_lse_sq) = stats[:num_experts], stats[num_experts:-2], stats[-2:]
    tokens = g_tokens.clamp_min(1)
    values: dict[str, Tensor] = {}
    share = probs.new_zeros(())
    if aux_coeff > 0:
        f = g_counts / (tokens * topk_idx.shape[1])
        values["aux_loss"] = aux_coeff * num_experts * torch.sum(f * g_prob_sum) / tokens
        share = share + aux_coeff * num_experts * torch.sum(f * probs.sum(0)) / tokens
    if z_coeff > 0:
        values["z_loss"] = z_coeff * g_lse_sq / tokens
        share = share + z_coeff * lse_sq.sum() / tokens
    return values, share


def sequence_balance_loss(
    scores: Tensor,
    topk_idx: Tensor,
    num_sequences: int,
    *,
    coeff: float,
    normalize: bool,
    sequence_group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None = None,
    token_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's sequence-wise balance loss over the token group's sequences: (global value, this rank's share).

    For sequence ``b`` of ``T_b`` tokens, ``f_bi = E / (k T_b) * #{t: i in topk(t)}`` and ``P_bi = 1/T_b sum_t s'_ti``
    (``s'`` the affinities normalised over all experts when ``normalize``); the loss is ``coeff * mean_b sum_i f_bi
    P_bi`` over the sequences of every rank of ``token_group`` (DeepSeek-V3 report, eq. 17-20). ``scores`` [T, E] hold
    ``num_sequences`` equal slices of this rank's tokens, one per sequence; the ranks of ``sequence_group`` (context
    parallel; a tuple of groups whose product holds the shards, e.g. (cp, tp) when MoE blocks route their sequence-
    parallel chunks) hold other tokens of the same sequences, and their counts, probability sums and token counts are
    summed per sequence first (one all-reduce per group), then the sum of ``sum_i f_bi P_bi`` and the sequence count over
    ``token_group`` (another). This rank's share ``coeff / B sum_b sum_i f_bi sum_{t here} s'_ti / T_b`` carries the
    gradient: the shares of all ranks sum to the loss, value and gradient (cf. :func:`global_balance_losses`).
    """
    num_experts, k = scores.shape[-1], topk_idx.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True) if normalize else scores
    probs = probs.reshape(num_sequences, -1, num_experts)
    idx = topk_idx.reshape(num_sequences, -1)
    counts = probs.new_zeros(num_sequences, num_experts).scatter_add_(1, idx, torch.ones_like(idx, dtype=probs.dtype))
    tokens = probs.new_full((num_sequences, 1), probs.shape[1])
    # [counts (E) | sum of probabilities (E) | tokens] per sequence, summed over its context-parallel shards.
    stats = torch.cat([counts, probs.detach().sum(1), tokens], dim=1)
    shards = 1
    groups = sequence_group if isinstance(sequence_group, tuple) else (sequence_group,)
    for group in (g for g in groups if g is not None):  # a sum over a product of groups: one after the other
        dist.all_reduce(stats, group=group)
        shards *= dist.get_world_size(group)
    g_counts, g_prob_sum, g_tokens = stats[:, :num_experts], stats[:, num_experts:-1], stats[:, -1:]
    f = num_experts * g_counts / (k * g_tokens)
    per_sequence = (f * g_prob_sum).sum(1) / g_tokens.squeeze(1)
    # [sum over this rank's sequences | their count]: each sequence is counted once per context-parallel shard.
    total = torch.stack([per_sequence.sum(), probs.new_tensor(float(num_sequences))])
    if token_group is not None:
        dist.all_reduce(total, group=token_group)
    sequences = (total[1] / shards).clamp_min(1)
    share = coeff * torch.sum(f * probs.sum(1) / g_tokens) / sequences
    return coeff * total[0] / total[1].clamp_min(1), share


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output`` whose backward also sends ``scale`` as the gradient of the scalar ``aux_loss``.

    Why: under pipeline parallelism the scalar aux loss of a layer on stage 0 cannot be added to the loss computed
    on the last stage; attaching it to the activations makes ``d(total)/d(aux) = scale`` flow in the same backward.
    ``scale`` is the factor the main loss is multiplied by (e.g. ``1 / num_microbatches``).
    """

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.aux_shape_dtype = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.aux_shape_dtype
        return grad_output, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class TopKRouter(nn.Module):
    """``weight`` [E, H] (HF ``gate.weight``); buffer ``e_score_correction_bias`` [E] when the router has a bias.

    Routing runs in fp32 whatever the activation dtype: top-k ties and softmax tails are precision sensitive.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        norm_topk_prob: bool = True,
        scaling_factor: float = 1.0,
        num_groups: int | None = None,
        group_topk: int | None = None,
        use_bias: bool = False,
    ) -> None:
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} is larger than num_experts={num_experts}; lower the top-k.")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={score_func!r} is unknown; use 'softmax' or 'sigmoid'.")
        if (num_groups is None) != (group_topk is None):
            raise ValueError("Group-limited routing needs both moe_router_num_groups and moe_router_group_topk.")
        if num_groups is not None and group_topk is not None:
            if num_experts % num_groups:
                raise ValueError(f"num_experts={num_experts} is not divisible by moe_router_num_groups={num_groups}.")
            if group_topk > num_groups or group_topk * (num_experts // num_groups) < top_k:
                raise ValueError(
                    f"moe_router_group_topk={group_topk} of {num_groups} groups leaves fewer than top_k={top_k}"
                    " experts to choose from; raise the group top-k."
                )
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob, self.scaling_factor = score_func, norm_topk_prob, scaling_factor
        self.num_groups, self.group_topk = num_groups, group_topk
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if use_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _group_mask(self, choice: Tensor) -> Tensor:
        """Mask [T, E] keeping only experts of the ``group_topk`` best groups (DeepSeek-V3 node-limited routing)."""
        t = choice.shape[0]
        grouped = choice.view(t, self.num_groups, -1)
        if self.score_func == "sigmoid":  # DeepSeek-V3: a group scores the sum of its two best experts
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:  # DeepSeek-V2: the best expert of the group
            group_score = grouped.amax(-1)
        top_groups = group_score.topk(self.group_topk, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
        return mask.unsqueeze(-1).expand_as(grouped).reshape(t, -1)

    def compute_logits(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """Router logits [T, E] in fp32 (the router's only GEMM; what "router" recompute re-runs); ``weight``: a
        stand-in for ``self.weight`` (e.g. one whose gradient is summed over ranks, ``MoELayer``)."""
        return F.linear(x.float(), (self.weight if weight is None else weight).float())

    def forward(self, x: Tensor) -> RouterOutput:
        return self.select(self.compute_logits(x))

    def select(self, logits: Tensor) -> RouterOutput:
        """Scores, top-k choice (bias and group limits apply to the choice only) and mixing weights."""
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.num_groups is not None:
            choice = choice.masked_fill(~self._group_mask(choice), float("-inf"))
        topk_idx = choice.topk(self.top_k, dim=-1).indices
        weight = scores.gather(1, topk_idx)
        if self.norm_topk_prob and self.top_k > 1:
            weight = weight / (weight.sum(-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        if self.scaling_factor != 1.0:
            weight = weight * self.scaling_factor
        return RouterOutput(logits=logits, scores=scores, topk_idx=topk_idx, topk_weight=weight)
