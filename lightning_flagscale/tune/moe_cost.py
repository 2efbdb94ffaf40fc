"""One MoE block on one rank and micro-batch as ``moe/layer.py`` and ``parallel/expert_parallel/apply.py`` run it:
its GEMMs and its own collectives, by layout (``tune/cost.py`` times them; ``tests/test_tune_cost.py`` counts them
against ``FlopCounterMode`` and ``CommTracker`` under TP 2).

A tensor-parallel group runs the block in one of two ways (``ParallelConfig.moe_routes_sequence_chunks``):

- **own chunk** (TP + SP with ETP = 1, Megatron's layout): each TP rank routes and dispatches only its ``t / tp``
  tokens. The router, the shared experts (whole on every TP rank: no TP plan splits them) and the ``t k / tp``
  routed rows run on the chunk, and nothing is gathered around the block. The weights each TP rank applied to other
  tokens (the router, the shared experts, the experts without EP) have their gradients summed over TP once a step,
  by the data-parallel reduction (:func:`chunk_summed_params`). Capacity routing first all-gathers every chunk's
  expert choices and weights (``chunk_capacity_plan``).
- **whole sequence** (TP without SP, or ETP > 1): every TP rank routes all ``t`` tokens and dispatches their ``t k``
  rows, so each token reaches the experts once per TP rank (``ParallelConfig.expert_grad_divisor``): the router and
  shared-expert GEMMs, the expert rows and the all-to-all bytes are ``tp`` times the own-chunk ones. Under SP the
  block all-gathers the sequence and returns its chunk: a slice, or with ETP inside TP a reduce-scatter of the
  partial expert outputs over the ETP group; backward all-gathers the output's gradient and (ETP inside TP)
  reduce-scatters the input's partial gradients.

``t``: the rank's tokens of one micro-batch (CP splits the sequence). Routing is assumed balanced: every rank of an
EP group receives as many rows as it sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_flagscale.config import ParallelConfig, TransformerConfig

__all__ = [
    "Collective",
    "chunk_summed_params",
    "moe_collectives",
    "moe_gemms",
    "moe_mlp_elements",
    "routed_tokens",
    "router_gemm",
    "tokens_group_size",
]

BF16 = 2
FP32 = 4
TOKENS = "ep_stats"
"""``Collective.kind`` of the routing statistics' all-reduces over the token group (``tune.cost`` reports them as
``ep``)."""


@dataclass(frozen=True)
class Collective:
    """One collective call of the block on one rank."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all`` (``tune.hardware.COLLECTIVES``)."""
    nbytes: float
    """The whole buffer, as ``HardwareProfile.collective_seconds`` takes it: an all-gather's output, otherwise the
    rank's input."""
    kind: str
    """What it is reported as: ``tp``, ``cp``, ``ep`` or :data:`TOKENS`."""
    size: int
    """Ranks in its group."""
    stride: int = 1
    """Distance of the group's ranks in rank order (whether it spans nodes)."""


def routed_tokens(c: ParallelConfig, t: float) -> float:
    """Tokens the block routes on one rank: its sequence chunk when it routes its own chunk, else all ``t``."""
    return t / c.tensor_parallel_size if c.moe_routes_sequence_chunks else t


def _shared_width(m: TransformerConfig) -> float:
    if not m.num_shared_experts:
        return 0.0
    return m.shared_expert_intermediate_size or m.moe_intermediate_size * m.num_shared_experts


def _expert_rows(m: TransformerConfig, c: ParallelConfig, t: float) -> tuple[float, float]:
    """(rows through this rank's expert GEMMs, the FFN width they go through): the rows it dispatched (what it
    receives back from its EP group), all-gathered over the ETP group unless its ranks already hold the same rows
    (ETP inside TP), each through ``1 / etp`` of the FFN."""
    etp = c.expert_tensor_parallel_size
    rows = routed_tokens(c, t) * m.num_experts_per_tok
    return rows * (1 if c.etp_tokens_replicated else etp), m.moe_intermediate_size / etp


def router_gemm(m: TransformerConfig, c: ParallelConfig, t: float) -> tuple[float, float, float, float]:
    """``(rows, columns, inner, count)`` of the router's forward GEMM on one rank (``E x h`` on the routed tokens).
    It runs in fp32 whatever the precision (``TopKRouter.compute_logits``: ``x.float() @ w.float()``), so
    ``tune.cost`` times it, forward and backward, at the profile's ``fp32_peak_flops``."""
    return routed_tokens(c, t), m.num_experts, m.hidden_size, 1


def moe_gemms(
    m: TransformerConfig, c: ParallelConfig, t: float, *, router: bool = True
) -> list[tuple[float, float, float, float]]:
    """``(rows, columns, inner, count)`` of each forward GEMM of the block on one rank: the router (``E x h``,
    :func:`router_gemm`; left out with ``router=False``), the local experts' gate/up and down at the per-expert row
    count, and the shared experts' gate/up, down (and their sigmoid gate, Qwen2-MoE), whole on every TP rank."""
    h, e = m.hidden_size, m.num_experts
    r = routed_tokens(c, t)
    rows, inner = _expert_rows(m, c, t)
    local = e / c.expert_parallel_size
    out = [router_gemm(m, c, t)] if router else []
    out += [(rows / local, inner, h, 2 * local), (rows / local, h, inner, local)]
    s = _shared_width(m)
    if s:
        out += [(r, s, h, 2), (r, h, s, 1)] + ([(r, 1, h, 1)] if m.shared_expert_gate else [])
    return out


def moe_mlp_elements(m: TransformerConfig, c: ParallelConfig, t: float) -> float:
    """FFN-wide elements per MLP-sized tensor of the block on one rank (routed rows times their width, plus the
    shared experts'), what the memory-bound SwiGLU kernels read and write."""
    rows, inner = _expert_rows(m, c, t)
    return rows * inner + routed_tokens(c, t) * _shared_width(m)


def chunk_summed_params(m: TransformerConfig, c: ParallelConfig) -> float:
    """Elements of one MoE block's weights that see only their TP rank's sequence chunk when the block routes its own
    chunk (0 otherwise, and for dense models): the router, the shared expert (and its gate), the experts without EP. The strategy tags them
    ``"dp_cp_tp"`` (``tag_chunk_routed_params``): DDP / ZeRO-1/2 reduce (and ZeRO-1/2 shard) them over the stage's
    dp x cp x tp ranks, summing over TP inside the data-parallel reduction; ZeRO-3 all-reduces their reduced shards
    over TP once a step (``parallel.step.sum_chunk_grads``). No TP collective of theirs runs per micro-batch."""
    if not (c.moe_routes_sequence_chunks and m.num_experts):
        return 0.0
    h, s = m.hidden_size, _shared_width(m)
    experts = 0.0 if c.ep_enabled else 3 * h * m.moe_intermediate_size * m.num_experts
    return h * m.num_experts + experts + 3 * h * s + (h if s and m.shared_expert_gate else 0)


def tokens_group_size(c: ParallelConfig) -> int:
    """Ranks over which the routing statistics are summed: the stage's data x context ranks, and its TP ranks when
    each routes its own chunk (``set_moe_token_group``)."""
    n = c.dp * c.context_parallel_size
    return n * c.tensor_parallel_size if c.moe_routes_sequence_chunks else n


def moe_collectives(
    m: TransformerConfig, c: ParallelConfig, t: float, *, act_bytes: int = BF16
) -> tuple[list[Collective], list[Collective]]:
    """(forward, backward) collectives of the block's own on one rank and micro-batch under the strategy (the
    attention's TP collectives are not its own; the TP sum of the chunk-routed weights' gradients is the optimizer
    step's, :func:`chunk_summed_params`). ``act_bytes``: bytes per activation element."""
    tp, ep, etp = c.tensor_parallel_size, c.expert_parallel_size, c.expert_tensor_parallel_size
    h, k, e = m.hidden_size, m.num_experts_per_tok, m.num_experts
    r = routed_tokens(c, t)
    rows = _expert_rows(m, c, t)[0]
    fwd: list[Collective] = []
    bwd: list[Collective] = []
    if c.moe_routes_sequence_chunks:
        if m.moe_capacity_factor is not None:  # every chunk's choices and weights, fp32, [r, 2k] each
            fwd.append(Collective("all_gather", t * 2 * k * FP32, "tp", tp))
    elif c.sequence_parallel and tp > 1:
        act = t * h * act_bytes
        fwd.append(Collective("all_gather", act, "tp", tp))  # the sequence, in
        bwd.append(Collective("all_gather", act, "tp", tp))  # the output chunk's gradient
        if c.etp_sequence_parallel:  # partial outputs out (the ETP members' chunks), partial input gradients back
            fwd.append(Collective("reduce_scatter", act * etp / tp, "tp", etp))
            bwd.append(Collective("reduce_scatter", act, "tp", tp))
    if ep > 1:  # the per-expert counts (int64) first, then dispatch and combine; both again in backward
        a2a = Collective("all_to_all", r * k * h * act_bytes, "ep", ep, etp)
        fwd += [Collective("all_gather", 8 * e * ep, "ep", ep, etp), a2a, a2a]
        bwd += [a2a, a2a]
    if etp > 1:
        if c.etp_sequence_parallel:  # the routing weights' gradients (fp32), partial products over ETP
            bwd.append(Collective("all_reduce", r * k * FP32, "ep", etp))
        elif c.etp_tokens_replicated:  # partial outputs all-reduced; the rows' input gradients in backward
            fwd.append(Collective("all_reduce", rows * h * act_bytes, "ep", etp))
            bwd.append(Collective("all_reduce", rows * h * act_bytes, "ep", etp))
        else:  # counts all-gathered, rows sent to every ETP rank and the partial outputs back; mirrored in backward
            pair = [Collective("all_to_all", rows * h * act_bytes, "ep", etp)] * 2
            fwd += [Collective("all_gather", 8 * e / ep * etp, "ep", etp), *pair]
            bwd += pair
    return fwd + _balance_collectives(m, c), bwd


def _balance_collectives(m: TransformerConfig, c: ParallelConfig) -> list[Collective]:
    """The balance losses' statistics (fp32, forward), global scope only: one all-reduce over the token group of a
    global aux / z loss's; the sequence-wise loss's per-sequence statistics over the context ranks (and the TP ranks
    when each routes its own chunk), then its total over the token group (``moe/router.py``)."""
    group = tokens_group_size(c)
    if m.moe_aux_loss_scope != "global" or group <= 1:
        return []
    stride = 1 if c.moe_routes_sequence_chunks else c.tensor_parallel_size
    fwd = []
    if m.moe_aux_loss_coeff > 0 or m.moe_z_loss_coeff > 0:
        fwd.append(Collective("all_reduce", (2 * m.num_experts + 2) * FP32, TOKENS, group, stride))
    if m.moe_seq_aux_loss_coeff > 0:
        # per sequence of the micro-batch: expert counts and probability sums (E each) and its token count
        stats = c.micro_batch_size * (2 * m.num_experts + 1) * FP32
        cp, tp = c.context_parallel_size, c.tensor_parallel_size
        if cp > 1:
            fwd.append(Collective("all_reduce", stats, "cp", cp, tp))
        if c.moe_routes_sequence_chunks:
            fwd.append(Collective("all_reduce", stats, "tp", tp))
        fwd.append(Collective("all_reduce", 2 * FP32, TOKENS, group, stride))
    return fwd
