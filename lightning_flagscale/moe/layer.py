"""The MoE block: route -> permute -> dispatch -> experts -> combine -> unpermute (+ shared experts).

Dispatch is pluggable: :class:`LocalDispatcher` runs every expert in this process; expert parallelism
(``parallel.expert.apply_ep``) swaps in an all-to-all dispatcher with the same call signature, so the layer
itself does not know whether experts are local or spread over an EP group.

Telemetry, refreshed by every forward (detached, never part of the graph):
``tokens_per_expert`` [E] (summed over the EP group under EP), ``tokens_per_ep_rank`` [ep], ``imbalance``
(max / mean tokens per expert), ``dropped_fraction`` (capacity path), ``last_aux_losses`` (name -> value, coefficients
applied), ``a2a_bytes`` (bytes this rank sent in dispatch + combine). ``load_accum`` [E] sums the per-expert load
over forwards until ``moe.balance.update_moe_state`` consumes it after the optimizer step.

Token group: the ranks whose tokens together form the step's micro-batch (data x context ranks of a pipeline stage,
and its tensor-parallel ranks when the block routes its own sequence-parallel chunk, see ``forward``).
Global aux/z losses and the bias-balancing counts are summed over it. ``parallel.expert.set_moe_token_group`` sets
it; by default it is the default process group when one is initialised (right for Lightning's DDP/FSDP) and nothing
in a single process. Sequence group: the context-parallel ranks holding the other shards of this rank's sequences,
over which the sequence-wise balance loss sums its per-sequence statistics (``moe.balance.set_moe_sequence_group``;
with the sequence-parallel group too when the block routes its own chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.distributed.sequence_parallel import (
    gather_sequence,
    scale_forward,
    scale_grad,
    scatter_sequence,
    sum_grad,
    sum_grads,
)
from lightning_flagscale.moe.experts import GroupedExperts, SwiGLUMLP, maybe_checkpoint
from lightning_flagscale.moe.router import (
    AttachAuxLoss,
    TopKRouter,
    global_balance_losses,
    sequence_balance_loss,
    switch_aux_loss,
    z_loss,
)

__all__ = [
    "DEFAULT_GROUP",
    "RECOMPUTE_LEVELS",
    "Dispatcher",
    "HotExpertReplication",
    "LocalDispatcher",
    "MoELayer",
    "RoutingPlan",
    "apply_moe_recompute",
    "build_moe",
]

RecomputeLevel = Literal["light", "medium", "full"]
AuxLossScope = Literal["global", "local"]
DEFAULT_GROUP = "default"
"""``MoELayer.token_group`` value meaning: the default process group if one is initialised, else no reduction."""
# MXMACA's multi-level MoE recompute: light = activation, permute, router; medium = + shared expert and expert FC1;
# full = the whole layer (including its all-to-alls, re-run in backward).
RECOMPUTE_LEVELS: dict[str, frozenset[str]] = {
    "light": frozenset({"act", "permute", "router"}),
    "medium": frozenset({"act", "permute", "router", "shared", "fc1"}),
    "full": frozenset({"layer"}),
}


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


def _in_backward() -> bool:
    """True while autograd runs a backward pass, i.e. during checkpoint recomputation: skip telemetry updates."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class RoutingPlan:
    """Rows of the permuted token buffer: source token and mixing weight per row, rows grouped by expert.

    ``counts[e]`` rows belong to expert e. Capacity plans have exactly ``C`` rows per expert; padding rows have
    ``valid == False`` and weight 0.
    """

    token_idx: Tensor
    weight: Tensor
    counts: list[int]
    valid: Tensor | None
    dropped_fraction: float


def dropless_plan(topk_idx: Tensor, topk_weight: Tensor, num_experts: int) -> RoutingPlan:
    """Every (token, expert) assignment becomes a row; rows sorted by expert (stable: token order within)."""
    k = topk_idx.shape[1]
    flat_e = topk_idx.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=num_experts).tolist()
    return RoutingPlan(order // k, topk_weight.reshape(-1)[order], counts, None, 0.0)


def _capacity_slots(
    topk_idx: Tensor, topk_weight: Tensor, num_experts: int, capacity: int, policy: Literal["position", "probs"]
) -> tuple[Tensor, Tensor, Tensor]:
    """(assignments in expert order, their position within their expert, kept mask) of a capacity-limited routing."""
    flat_e, flat_w = topk_idx.reshape(-1), topk_weight.reshape(-1)
    order = torch.arange(flat_e.numel(), device=flat_e.device)
    if policy == "probs":
        order = torch.argsort(-flat_w.detach(), stable=True)
    order = order[torch.argsort(flat_e[order], stable=True)]
    sorted_e = flat_e[order]
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    pos = torch.arange(order.numel(), device=order.device) - starts[sorted_e]
    return order, pos, pos < capacity


def capacity_plan(
    topk_idx: Tensor, topk_weight: Tensor, num_experts: int, capacity: int, policy: Literal["position", "probs"]
) -> RoutingPlan:
    """Keep at most ``capacity`` rows per expert, pad short experts with zero rows.

    ``policy="position"`` keeps the earliest assignments in (token, k) order; ``"probs"`` keeps the assignments
    with the largest routing weights (Megatron's ``drop_policy``).
    """
    k = topk_idx.shape[1]
    flat_e, flat_w = topk_idx.reshape(-1), topk_weight.reshape(-1)
    order, pos, keep = _capacity_slots(topk_idx, topk_weight, num_experts, capacity, policy)
    sorted_e = flat_e[order]
    slot = sorted_e[keep] * capacity + pos[keep]
    rows = num_experts * capacity
    src = torch.zeros(rows, dtype=torch.long, device=flat_e.device).index_copy_(0, slot, order[keep])
    valid = torch.zeros(rows, dtype=torch.bool, device=flat_e.device).index_fill_(0, slot, True)
    weight = flat_w[src] * valid
    dropped = 1.0 - float(keep.sum()) / max(flat_e.numel(), 1)
    return RoutingPlan(src // k, weight, [capacity] * num_experts, valid, dropped)


def chunk_capacity_plan(
    topk_idx: Tensor,
    topk_weight: Tensor,
    num_experts: int,
    capacity_factor: float,
    policy: Literal["position", "probs"],
    sequences: int,
    group: dist.ProcessGroup,
) -> RoutingPlan:
    """The capacity decisions of the whole sequence, applied to this rank's sequence chunk (sequence parallelism).

    ``topk_*`` hold this rank's ``sequences`` equal slices of tokens, chunk r of each sequence on rank r of ``group``.
    The choices and (detached) weights of every chunk are all-gathered (``T x k`` each, no gradient), the capacity and
    the kept assignments computed as one process does on the whole sequences, and this rank keeps its own kept
    assignments, grouped by expert (no padding rows: their outputs and gradients are zero anyway).
    """
    n, r, k = dist.get_world_size(group), dist.get_rank(group), topk_idx.shape[1]
    local = topk_idx.view(sequences, -1, k)
    both = torch.cat([local.to(topk_weight.dtype), topk_weight.detach().view(sequences, -1, k)], dim=-1)
    parts = [torch.empty_like(both) for _ in range(n)]
    dist.all_gather(parts, both.contiguous(), group=group)
    whole = torch.cat(parts, dim=1)  # [sequences, S, 2k]: chunk order along the sequence
    idx_all, w_all = whole[..., :k].round().long().reshape(-1, k), whole[..., k:].reshape(-1, k)
    capacity = math.ceil(idx_all.shape[0] * k / num_experts * capacity_factor)
    order, _, keep = _capacity_slots(idx_all, w_all, num_experts, capacity, policy)
    kept = torch.zeros(idx_all.numel(), dtype=torch.bool, device=idx_all.device).index_fill_(0, order[keep], True)
    mine = kept.view(sequences, n, -1)[:, r].reshape(-1)  # this rank's chunk of each sequence, (token, k) order
    flat_e = topk_idx.reshape(-1)
    sel = mine.nonzero().squeeze(1)
    rows = sel[torch.argsort(flat_e[sel], stable=True)]
    counts = torch.bincount(flat_e[sel], minlength=num_experts).tolist()
    dropped = 1.0 - float(keep.sum()) / max(idx_all.numel(), 1)
    return RoutingPlan(rows // k, topk_weight.reshape(-1)[rows], counts, None, dropped)


class Dispatcher(Protocol):
    """Moves the permuted rows to the experts' owners and back: ``(layer, x_perm, counts) -> y_perm``."""

    def __call__(self, layer: MoELayer, x_perm: Tensor, counts: list[int]) -> Tensor: ...


class LocalDispatcher:
    """All experts live in this process: no communication."""

    replicated_experts = True
    """The experts are whole on every rank that holds this layer: under sequence parallelism, where each TP rank runs
    them on its own chunk, their gradients are summed over the TP group (``MoELayer.run_experts``, or the optimizer
    step's reduction under the strategy: ``MoELayer.chunk_grads_at_step``)."""

    def __call__(self, layer: MoELayer, x_perm: Tensor, counts: list[int]) -> Tensor:
        layer.record_dispatch(torch.tensor([counts]), a2a_bytes=0)
        return layer.run_experts(x_perm, counts, tokens_on_busiest_rank=sum(counts))


class MoELayer(nn.Module):
    """Routed SwiGLU experts (+ optional shared experts) with HF-compatible names; ``forward([B, S, H]) -> [B, S, H]``.

    Submodules: ``gate`` (:class:`TopKRouter`), ``experts`` (:class:`GroupedExperts`), and either
    ``shared_experts`` (DeepSeek) or ``shared_expert`` + ``shared_expert_gate`` (Qwen2-MoE, sigmoid-gated).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        router: TopKRouter,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        seq_aux_loss_coeff: float = 0.0,
        bias_update_rate: float = 0.0,
        capacity_factor: float | None = None,
        drop_policy: Literal["position", "probs"] = "position",
        aux_loss_scope: AuxLossScope = "global",
    ) -> None:
        super().__init__()
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None for dropless routing).")
        if aux_loss_scope not in ("global", "local"):
            raise ValueError(f"aux_loss_scope={aux_loss_scope!r} is unknown; use 'global' or 'local'.")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.gate = router
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size)
        if shared_intermediate_size and shared_gate:
            self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        elif shared_intermediate_size:
            self.shared_experts = SwiGLUMLP(hidden_size, shared_intermediate_size)
        self.aux_loss_coeff, self.z_loss_coeff, self.bias_update_rate = aux_loss_coeff, z_loss_coeff, bias_update_rate
        self.seq_aux_loss_coeff = seq_aux_loss_coeff
        self.capacity_factor, self.drop_policy, self.aux_loss_scope = capacity_factor, drop_policy, aux_loss_scope
        # Knobs set by apply_* functions / the strategy (plain attributes: not part of the state dict).
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.aux_loss_scale = 1.0
        """Gradient scale of the aux losses: the factor the main loss is multiplied by (1/num_microbatches)."""
        self.token_group: dist.ProcessGroup | str | None = DEFAULT_GROUP
        """Ranks sharing the step's tokens (see module docstring); ``None``: this process only."""
        self.sequence_group: dist.ProcessGroup | None = None
        """Context-parallel ranks holding the other shards of this rank's sequences (``None``: whole sequences)."""
        self.sequence_parallel_group: dist.ProcessGroup | None = None
        """Under sequence parallelism the TP group (set by the TP plan, ``MoESequenceParallel``): the block takes and
        returns this rank's sequence chunk; it routes that chunk, or, with experts split over ETP ranks, runs on the
        whole sequence (see ``forward``)."""
        self.chunk_grads_at_step = False
        """Whether the gradient reduction of the optimizer step sums the weights that see only this rank's sequence
        chunk (``chunk_partial_params``) over the sequence-parallel group: the strategy sets it, with those weights
        tagged for it (``parallel.expert_parallel.tag_chunk_routed_params``), so they are summed once per step, not
        in every micro-batch's backward. False (a layer used on its own): the layer sums them where it uses them."""
        self.token_grad_scale: float | None = None
        """Factor on this rank's share of a global loss so the gradient reduction yields the global gradient;
        ``None``: the token group's size over the sequence-parallel ranks when the block routes its own chunk
        (gradients averaged over the group's data replicas, as DDP and ZeRO do, and summed over its TP ranks)."""
        self.recompute_level: RecomputeLevel | None = None
        self.recompute_token_threshold: int | None = None
        """Adaptive recompute: recompute only when the busiest EP rank holds more rows than this."""
        self.replicated_experts: tuple[int, ...] = ()
        """Hot experts with a replica on every EP rank (used by the EP dispatcher; see ``moe.balance``)."""
        self.hot_expert_config: HotExpertReplication | None = None
        """When set, ``moe.balance.update_moe_state`` picks the replicated experts (used under EP only)."""
        self.register_buffer("load_accum", torch.zeros(num_experts), persistent=False)
        # Host tensors even when the model is built on the meta device: telemetry is read (".max()") before the
        # first dispatch replaces it, e.g. by the adaptive "full" recompute decision.
        self.tokens_per_expert = torch.zeros(num_experts, device="cpu")
        self.tokens_per_ep_rank = torch.zeros(1, device="cpu")
        self.imbalance = torch.tensor(1.0, device="cpu")
        self.dropped_fraction = 0.0
        self.a2a_bytes = 0
        self.last_aux_losses: dict[str, Tensor] = {}

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the router bias and the load accumulator (after ``to_empty`` they hold garbage)."""
        self.load_accum.zero_()
        if self.gate.e_score_correction_bias is not None:
            self.gate.e_score_correction_bias.zero_()

    # ---- helpers the dispatcher calls ----
    def _recompute_parts(self, busiest_rank_rows: int) -> frozenset[str]:
        if self.recompute_level is None or not self.training:
            return frozenset()
        if self.recompute_token_threshold is not None and busiest_rank_rows <= self.recompute_token_threshold:
            return frozenset()
        return RECOMPUTE_LEVELS[self.recompute_level]

    def run_experts(
        self, x: Tensor, counts: list[int], tokens_on_busiest_rank: int, weights: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """Apply the local experts (or ``weights``) to rows sorted by expert; honours the recompute level."""
        parts = self._recompute_parts(tokens_on_busiest_rank) if "layer" not in self._static_parts() else frozenset()
        # capacity plans hold equal rows per expert, but not a sequence-parallel chunk's (``chunk_capacity_plan``)
        batched = self.capacity_factor is not None and weights is None and len(set(counts)) <= 1
        if weights is None and getattr(self.dispatcher, "replicated_experts", False):
            # Whole experts on every TP rank, each running its own chunk's rows: partial gradients, summed over TP.
            return self._call_summed(self.experts, x, counts, batched=batched, recompute=parts)
        return self.experts(x, counts, batched=batched, weights=weights, recompute=parts)

    def record_dispatch(self, counts_per_rank: Tensor, a2a_bytes: int) -> None:
        """Telemetry from the dispatcher: ``counts_per_rank`` [ep, E] rows each source rank sends to each expert."""
        if _in_backward():
            return
        per_expert = counts_per_rank.sum(0).float()
        self.tokens_per_expert = per_expert
        ep = counts_per_rank.shape[0]
        self.tokens_per_ep_rank = per_expert.view(ep, -1).sum(1) if per_expert.numel() % ep == 0 else per_expert.sum()
        self.imbalance = per_expert.max() / per_expert.mean().clamp_min(1e-9)
        self.a2a_bytes = a2a_bytes

    def _static_parts(self) -> frozenset[str]:
        if self.recompute_level is None or not self.training:
            return frozenset()
        return RECOMPUTE_LEVELS[self.recompute_level]

    # ---- forward ----
    def chunk_group(self) -> dist.ProcessGroup | None:
        """The sequence-parallel group when this block routes and dispatches only its own sequence chunk (every
        sequence-parallel layout but experts split over ETP ranks, which run on the whole sequence), else None."""
        if self.sequence_parallel_group is None or getattr(self.dispatcher, "etp_size", 1) != 1:
            return None
        return self.sequence_parallel_group

    def chunk_partial_params(self) -> list[nn.Parameter]:
        """The weights whose gradients are partial sums over the sequence-parallel group when the block routes its own
        chunk (each TP rank saw other tokens): the router's, the shared experts' (and gate's), and the experts' when
        they are whole on every rank (``LocalDispatcher``: no EP). Empty when the block does not route its chunk."""
        if self.chunk_group() is None:
            return []
        modules: list[nn.Module] = [self.gate]
        if getattr(self.dispatcher, "replicated_experts", False):
            modules.append(self.experts)
        modules += [
            getattr(self, n) for n in ("shared_expert", "shared_expert_gate", "shared_experts") if hasattr(self, n)
        ]
        params = [p for m in modules for p in m.parameters()]
        return [p for p in params if p.requires_grad]

    def _call_summed(self, module: nn.Module, *args, **kwargs) -> Tensor:
        """``module(*args, **kwargs)``; when the block routes its own chunk and the step does not sum them
        (``chunk_grads_at_step``), with the module's trainable weights' gradients summed over the sequence-parallel
        group (one all-reduce): each TP rank saw other tokens."""
        group = self.chunk_group()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if group is None or self.chunk_grads_at_step or not named or not torch.is_grad_enabled():
            return module(*args, **kwargs)
        summed = sum_grads([p for _, p in named], group)
        return functional_call(module, {n: p for (n, _), p in zip(named, summed)}, args, kwargs)

    def _partial_group(self) -> dist.ProcessGroup | None:
        """The group over which the dispatcher returns partial expert outputs (ETP inside TP under SP), else None."""
        group = getattr(self.dispatcher, "partial_group", None)
        if group is not None and self.sequence_parallel_group is None:
            raise RuntimeError(
                "The expert dispatcher returns partial sums over its ETP group, which the MoE block reduce-scatters"
                " over the sequence-parallel group, but this layer has none (apply_ep(etp_sequence_parallel=True)"
                " without the sequence-parallel TP plan)."
            )
        return group

    def forward(self, hidden: Tensor) -> Tensor:
        """``[B, S, H] -> [B, S, H]``; under sequence parallelism this rank's ``[B, S/tp, H]`` chunk in and out.

        Under SP with whole experts per EP rank (ETP = 1) each TP rank routes and dispatches only its own chunk, as
        Megatron does: each token reaches its experts once per TP group, not once per TP rank. The router's and the
        shared experts' weights (and whole experts without EP) then see other tokens on each TP rank: their gradients
        are summed over TP, by the optimizer step's gradient reduction under the strategy (``chunk_grads_at_step``)
        or else at their use (``_call_summed``), and the statistics of the aux losses and of the bias
        balancing are summed over a token group that holds the TP ranks (``set_moe_token_group``; per sequence
        over the sequence-parallel group too). Capacity-limited routing takes its drop decisions on the whole
        sequence, as one process does, from the gathered choices (``chunk_capacity_plan``).

        With experts split over ETP ranks the block runs on the whole sequence (all-gathered over TP), so the router,
        its statistics and the shared experts see what one process sees. Its output is this rank's chunk: a slice,
        or, when the ETP group lies inside the TP group, a reduce-scatter of the partial sums over the ETP group (of
        the chunks of its members; with ETP = TP the whole sequence), and the input's backward a reduce-scatter of
        partial gradients over TP: Megatron's sequence-parallel pair instead of an all-reduce of every routed row
        followed by a slice (issue 39)."""
        group = self.sequence_parallel_group
        partial = self._partial_group()
        if group is not None and self.chunk_group() is not None:
            return self._forward_maybe_recomputed(hidden)
        if group is not None:
            hidden = gather_sequence(hidden, group, partial_grad=partial is not None)
        out = self._forward_maybe_recomputed(hidden)
        return out if group is None else scatter_sequence(out, group, partial_over=partial)

    def _forward_maybe_recomputed(self, hidden: Tensor) -> Tensor:
        if "layer" in self._static_parts() and torch.is_grad_enabled():
            # Full recompute: the adaptive threshold uses the previous forward's per-rank load, which every EP rank
            # knows identically, so all ranks agree on re-running the all-to-alls in backward.
            busiest = int(self.tokens_per_ep_rank.max()) if self.tokens_per_ep_rank.numel() else 0
            if self.recompute_token_threshold is None or busiest > self.recompute_token_threshold:
                return maybe_checkpoint(True, self._forward, hidden)
        return self._forward(hidden)

    def _forward(self, hidden: Tensor) -> Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        static = self._static_parts()
        # ETP inside TP under SP: the expert outputs are partial sums over the k ETP ranks, reduce-scattered over them
        # after the combine (forward); the output gradient comes back all-gathered over the n TP ranks, the same on
        # each, and the input gradients are reduce-scattered over TP. Every TP rank computes the router and the
        # shared experts alike: their input gradients enter that sum scaled by 1/n, the shared output the ETP sum
        # scaled by 1/k (exact: identical halves, quarters, ...). The routed rows' input gradients are partial over
        # ETP and alike on the n/k ETP groups of a TP group: scaled by k/n. The routing weights' gradients, products
        # with partial outputs, are summed over ETP.
        partial = self._partial_group()
        k = dist.get_world_size(partial) if partial is not None else 1
        n = dist.get_world_size(self.sequence_parallel_group) if partial is not None else 1
        x_rep = x if partial is None else scale_grad(x, 1.0 / n)
        x_routed = x if k == n else scale_grad(x, k / n)
        router_weight = self.gate.weight
        summed_here = self.chunk_group() is not None and not self.chunk_grads_at_step
        if summed_here and router_weight.requires_grad and torch.is_grad_enabled():
            router_weight = sum_grads([router_weight], self.chunk_group())[0]  # each TP rank routes its own chunk
        route = self.gate.select(maybe_checkpoint("router" in static, self.gate.compute_logits, x_rep, router_weight))
        if self.capacity_factor is None:
            plan = dropless_plan(route.topk_idx, route.topk_weight, self.num_experts)
        elif self.chunk_group() is not None:  # the whole sequence's drop decisions, this rank's chunk of them
            sequences = shape[0] if hidden.dim() == 3 else 1
            plan = chunk_capacity_plan(
                route.topk_idx, route.topk_weight, self.num_experts, self.capacity_factor, self.drop_policy,
                sequences, self.chunk_group(),
            )  # fmt: skip
        else:
            capacity = math.ceil(x.shape[0] * self.top_k / self.num_experts * self.capacity_factor)
            plan = capacity_plan(route.topk_idx, route.topk_weight, self.num_experts, capacity, self.drop_policy)

        def permute(inp: Tensor) -> Tensor:
            rows = inp[plan.token_idx]
            return rows if plan.valid is None else rows * plan.valid.unsqueeze(-1).to(rows.dtype)

        x_perm = maybe_checkpoint("permute" in static, permute, x_routed)
        y_perm = self.dispatcher(self, x_perm, plan.counts)
        weight = plan.weight if partial is None else sum_grad(plan.weight, partial)
        out = torch.zeros_like(x).index_add_(0, plan.token_idx, y_perm * weight.unsqueeze(-1).to(y_perm.dtype))
        shared = maybe_checkpoint("shared" in static, self._shared, x_rep)
        out = out + (shared if partial is None else scale_forward(shared, 1.0 / k))
        if not _in_backward():
            load = torch.bincount(route.topk_idx.reshape(-1), minlength=self.num_experts).float()
            self.load_accum += load.to(self.load_accum.device)
            self.dropped_fraction = plan.dropped_fraction
        sequences = shape[0] if hidden.dim() == 3 else 1  # [B, S, H]: the sequence-wise loss's sequences
        return self._attach_aux_losses(out, route.logits, route.scores, route.topk_idx, sequences).view(shape)

    def _shared(self, x: Tensor) -> Tensor:
        if hasattr(self, "shared_expert"):
            return torch.sigmoid(self._call_summed(self.shared_expert_gate, x)) * self._call_summed(
                self.shared_expert, x
            )
        if hasattr(self, "shared_experts"):
            return self._call_summed(self.shared_experts, x)
        return torch.zeros_like(x)

    def resolved_token_group(self) -> dist.ProcessGroup | None:
        """The process group of :attr:`token_group` (``None``: no reduction)."""
        if isinstance(self.token_group, str):
            return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        return self.token_group

    def _attach_aux_losses(
        self, out: Tensor, logits: Tensor, scores: Tensor, topk_idx: Tensor, sequences: int
    ) -> Tensor:
        if self.aux_loss_coeff <= 0 and self.z_loss_coeff <= 0 and self.seq_aux_loss_coeff <= 0:
            return out
        normalize = self.gate.score_func == "sigmoid"
        group = self.resolved_token_group()
        chunk = self.chunk_group()
        sp = 1 if chunk is None else dist.get_world_size(chunk)
        values: dict[str, Tensor] = {}
        if self.aux_loss_scope == "global" and self.training and group is not None:
            # Only in training: inference (e.g. generation on one rank) must never wait for a collective.
            share = logits.new_zeros(())
            if self.aux_loss_coeff > 0 or self.z_loss_coeff > 0:
                values, share = global_balance_losses(
                    logits, scores, topk_idx, aux_coeff=self.aux_loss_coeff, z_coeff=self.z_loss_coeff,
                    normalize=normalize, group=group,
                )  # fmt: skip
            if self.seq_aux_loss_coeff > 0:
                values["seq_aux_loss"], seq_share = sequence_balance_loss(
                    scores, topk_idx, sequences, coeff=self.seq_aux_loss_coeff, normalize=normalize,
                    sequence_group=(self.sequence_group, chunk), token_group=group,
                )  # fmt: skip
                share = share + seq_share
            scale = self.token_grad_scale if self.token_grad_scale is not None else dist.get_world_size(group) // sp
            attached = share * scale
        else:
            if self.aux_loss_coeff > 0:
                aux = switch_aux_loss(scores, topk_idx, self.num_experts, normalize)
                values["aux_loss"] = self.aux_loss_coeff * aux
            if self.z_loss_coeff > 0:
                values["z_loss"] = self.z_loss_coeff * z_loss(logits)
            if self.seq_aux_loss_coeff > 0:  # this rank's sequences (shards of them under context parallelism)
                _, values["seq_aux_loss"] = sequence_balance_loss(  # without groups the share is the loss
                    scores, topk_idx, sequences, coeff=self.seq_aux_loss_coeff, normalize=normalize
                )
            # Routing its own chunk, each TP rank's value is a per-rank statistic of its chunk; their gradients add
            # up over TP, so each enters at 1/tp: the mean of the TP ranks' values, as the data replicas' are averaged.
            attached = sum(values.values()) / sp
        if not _in_backward():
            self.last_aux_losses = {k: v.detach() for k, v in values.items()}
        if torch.is_grad_enabled() and self.training:
            out = AttachAuxLoss.apply(out, attached, self.aux_loss_scale)
        return out


def build_moe(config: TransformerConfig, layer_idx: int) -> MoELayer:
    """The MoE block of decoder layer ``layer_idx`` (the decoder calls this when ``config.is_moe_layer(i)``)."""
    if not config.is_moe_layer(layer_idx):
        raise ValueError(f"Layer {layer_idx} is not an MoE layer for this config (see TransformerConfig.is_moe_layer).")
    inter = config.moe_intermediate_size or config.intermediate_size
    shared = 0
    if config.num_shared_experts:
        shared = config.shared_expert_intermediate_size or inter * config.num_shared_experts
    router = TopKRouter(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        score_func=config.router_type,
        norm_topk_prob=config.norm_topk_prob,
        scaling_factor=config.moe_router_scaling_factor,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        # DeepSeek-V3 checkpoints always carry the bias; keep it for sigmoid routers so HF import is lossless.
        use_bias=config.router_type == "sigmoid" or config.moe_router_bias_update_rate > 0,
    )
    layer = MoELayer(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        inter,
        router=router,
        shared_intermediate_size=shared,
        shared_gate=config.shared_expert_gate,
        aux_loss_coeff=config.moe_aux_loss_coeff,
        z_loss_coeff=config.moe_z_loss_coeff,
        seq_aux_loss_coeff=config.moe_seq_aux_loss_coeff,
        bias_update_rate=config.moe_router_bias_update_rate,
        capacity_factor=config.moe_capacity_factor,
        aux_loss_scope=config.moe_aux_loss_scope,
    )
    apply_moe_recompute(layer, config.moe_recompute, token_threshold=config.moe_recompute_token_threshold)
    if config.moe_hot_expert_replicas:
        layer.hot_expert_config = HotExpertReplication(
            num_replicas=config.moe_hot_expert_replicas,
            enable_imbalance=config.moe_hot_expert_enable_imbalance,
            disable_imbalance=config.moe_hot_expert_disable_imbalance,
        )
    return layer


def apply_moe_recompute(
    model: nn.Module, level: RecomputeLevel | None, *, token_threshold: int | None = None
) -> nn.Module:
    """Set multi-level MoE recompute on every MoE layer of ``model`` (in place; returns it).

    ``level``: "light" (activation, permute, router), "medium" (+ shared expert, expert FC1), "full" (whole layer,
    all-to-alls included) or None. ``token_threshold`` makes it adaptive: recompute only when the busiest EP rank
    holds more than this many rows (known from the count exchange; for "full", from the previous forward).
    """
    if level is not None and level not in RECOMPUTE_LEVELS:
        raise ValueError(f"MoE recompute level {level!r} is unknown; use one of {sorted(RECOMPUTE_LEVELS)} or None.")
    if token_threshold is not None and token_threshold < 0:
        raise ValueError(f"token_threshold={token_threshold} must be >= 0 (or None for always).")
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.recompute_level, module.recompute_token_threshold = level, token_threshold
    return model
