"""Cost model: predicted step time of one layout on a :class:`HardwareProfile` (issue 16 item 2).

Per micro-batch and pipeline rank, a block costs

- its **GEMMs** (q/k/v/o projections and the SwiGLU MLP, split by TP; or an MoE block's router, routed experts at the
  per-expert row count and shared experts as the block runs them, on its sequence chunk or the whole sequence,
  ``tune/moe_cost.py``; CP splits the tokens), each timed at the profile's efficiency for its size (the router, which
  runs in fp32, at ``fp32_peak_flops``: no tensor cores without TF32, 67 against 989 TFLOP/s on an H100); backward
  is two GEMMs of the same size (input gradient and weight gradient), at the profile's measured rate of each layout
  relative to the forward one (equal on GPUs; not on a CPU without native bf16);
- **core attention**: the causal half of ``4 b s^2 n_heads d_head`` FLOPs over TP x CP at the SDPA efficiency,
  backward 2.5x forward (FlashAttention-2's five matmuls against two); a calibrated profile times calls by size,
  forward and backward apart, and ring CP's blocks through the kernel they run (``_attention``);
- **memory-bound kernels** (norms, RoPE, SwiGLU activation, residuals): ~16 hidden-sized + 6 MLP-sized bf16 tensors
  read or written per token in forward, twice that in backward, at HBM bandwidth;
- **recompute**: ``full`` re-runs the block's forward in backward, ``selective`` its memory-bound kernels (plus,
  on a calibrated profile, the host time of torch's selective-checkpoint dispatch, ``selective_overhead``),
  ``selective_mm`` those and the k, o and up projections;
- exposed **TP/SP** collectives (2 all-reduces, or with SP 2 all-gathers + 2 reduce-scatters, per block and pass;
  nothing overlaps them without async TP; an MoE block has attention's and its own, ``tune/moe_cost.py``: none
  around a block that routes its own chunk, whose replicated weights' gradients the data-parallel reduction sums over
  TP once a step),
  **Ulysses** all-to-alls, **EP** dispatch/combine all-to-alls of the rows each rank routes (after an all-gather of
  the per-expert row counts in forward; plus, for a global balance loss, the all-reduces of the routing statistics
  over the token group), and the
  **ring CP** K/V exchange, which overlaps with the attention of the previous chunk (only the excess shows).

Multi-head latent attention prices its own projections (q_a, q_b, kv_a, kv_b, o; the down projections replicated
over TP, whose latents' gradients are all-reduced in backward) and ``Q K^T`` over the qk width, ``P V`` over
``v_head_dim``. The last stage runs each multi-token-prediction module: ``eh_proj``, one block (never recomputed)
and the LM head again with its collectives.

The pipeline adds its **bubble** per schedule. GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1): closed forms
in the per-chunk forward ``f``, full backward ``b`` and weight-gradient part ``w`` of each of the other ``p - 1`` ranks
the heaviest one waits on while the pipeline fills and drains (``v`` chunks; Qi et al., "Zero Bubble Pipeline
Parallelism", 2023): gpipe / 1F1B ``(p-1)(F+B)``, interleaved ``(p-1)(f+b)``, zero-bubble ``(p-1)(f+b-2w)``, each
equal to torch's order replayed with every stage's own times (checked for Llama-3-8B at p = 4 and 8). ZB-V and
DualPipeV: the order the runner runs (torch's, or the one generated for ``pipeline_chunk_costs`` /
``pipeline_max_activations``) replayed by ``orders.simulate`` with every stage's forward, input- and weight-gradient
seconds, less the heaviest rank's busy time (``_v_bubble``; the closed form ``(p-1)(f+2b-3w)`` from the DualPipe
README priced torch's DualPipeV order at twice its replay, issue 42); plus the P2P sends of each micro-batch.
DualPipeV with ``overlap_moe_expert_parallel_comm`` runs each fused forward-backward pair of its steady state
(torch's ``OVERLAP_F_B``) at once: each chunk's expert all-to-alls hide under the other's compute
(``_overlap_saving``), off the heaviest rank's busy time and off each pair of the replay, which sends both of a pair's
outputs when it ends, as torch lowers it (not on shared cores). Data parallelism reduces fp32 gradients over
data x context ranks (``parallel/data_parallel/grad_buckets.py``): for DDP / ZeRO-1 / ZeRO-2 the bucketed reduction runs during the
last micro-batch's backward, so only what exceeds that backward (and the last bucket) is exposed; ZeRO-1/2
all-gather the bf16 parameters after the step (exposed); ZeRO-3 gathers parameters per block in forward and backward
(prefetched: only the excess over compute and the first gather show). Under TP the weights that see only their TP
rank's share of the activations (norms on sequence shards under SP, QK-norm on head shards, the router, shared experts
and experts without EP of MoE blocks that route their own sequence chunk) are reduced (and ZeRO-1/2 sharded) over the
stage's dp x cp x tp ranks instead, summed over TP in the same collective; under ZeRO-3 their shards are all-reduced
over TP at the step. The Adam step is memory-bound.

Under TP the embedding, the head's input and the vocab-parallel loss add their collectives on the first and last
stage, and a calibrated profile adds the DTensor plan's host time per block and at the ends (``tp_overhead``).

When the ranks of a node share fewer compute units than there are ranks (``compute_units_per_node``: CPU processes
on a few cores), the step takes at least the node's summed busy time over its units (each rank's own optimizer
phase included): a rank waiting in a pipeline bubble or on a peer lends its core to the others. With a pipeline the
schedule torch runs is simulated on the shared units (``tune/shared_cores.py``): a rank on the critical path, in the
fill and drain or with the heavier embedding or head stage, still cannot use more than one unit. There a blocking
collective inside forward or backward (TP, SP, CP, EP) costs the calibrated wait for a descheduled peer (``blocking_collective``, wall time) instead of its latency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from lightning_flagscale.accounting.flops import flops_per_token
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.schedules import SCHEDULE_SPECS, min_microbatches
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL, cut_runs
from lightning_flagscale.parallel.pipeline_parallel.orders import action_cost, simulate
from lightning_flagscale.tune.hardware import COLLECTIVES, HardwareProfile, LinkPoint
from lightning_flagscale.tune.inflight import overlapped_pairs, runner_v_order, schedule_actions
from lightning_flagscale.tune.moe_cost import (
    TOKENS,
    moe_collectives,
    moe_gemms,
    moe_mlp_elements,
    router_gemm,
    tokens_group_size,
)
from lightning_flagscale.tune.shared_cores import pipeline_seconds, processor_sharing_seconds
from lightning_flagscale.tune.stage_params import attention_tensors, mtp_params, stage_reduced_params

__all__ = [
    "MeasuredStep",
    "StepCost",
    "calibrate_compute_scale",
    "estimate_step",
    "estimate_step_seconds",
    "fit_compute_scale",
    "stage_layer_counts",
]

BF16 = 2


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Predicted time of one optimizer step, split into what it is spent on (seconds, heaviest pipeline rank)."""

    step_seconds: float
    compute_seconds: float
    """Busy time of the heaviest rank: GEMMs, attention, memory-bound kernels, recompute, optimizer."""
    bubble_seconds: float
    exposed_comm_seconds: float
    comm: dict[str, float] = field(default_factory=dict)
    """Exposed seconds per kind: ``tp``, ``cp``, ``ep``, ``pp``, ``dp``."""
    optimizer_seconds: float = 0.0
    """The heaviest rank's own optimizer step (part of ``compute_seconds``)."""
    loop_seconds: float = 0.0
    """The training loop's own cost (``HardwareProfile.step_overhead``), part of ``step_seconds``."""
    optimizer_wall_seconds: float = 0.0
    """The optimizer phase on the wall clock: ``optimizer_seconds`` on devices of their own; on shared cores, every
    rank stepping at once (what a timer around the phase measures)."""
    tokens_per_second: float
    mfu: float
    """Model FLOPs (``accounting.flops.flops_per_token``) per second over the devices' peak."""

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_seconds / self.step_seconds if self.step_seconds else 0.0


@dataclass(frozen=True)
class _Pass:
    """Per micro-batch times of one block on one rank: forward, full backward, its weight-gradient part, and the
    exposed communication inside them (already included in f and b)."""

    f: float
    b: float
    w: float
    comm: dict[str, float]
    mean_fb: float = 0.0
    """Forward + backward averaged over the pipeline ranks (the heaviest rank's ``f + b`` without PP)."""
    others: tuple[tuple[float, float, float], ...] = ()
    """``(f, b, w)`` of every other pipeline rank: the pipeline fills and drains through them."""
    calls: dict[str, float] = field(default_factory=dict)
    """Blocking collectives per micro-batch by kind (``tp``, ``cp``, ``ep``, and ``ep_stats``: a global balance loss's
    all-reduce over the data x context-parallel ranks), forward and backward together."""
    stages: tuple[tuple[float, float, float], ...] = ()
    """``(f, b, w)`` of every pipeline stage (chunk), by stage index."""
    ep: tuple[float, float] = (0.0, 0.0)
    """Expert-parallel communication inside ``f`` and inside ``b`` (all-to-alls, their counts' all-gather, ETP's
    collectives): what DualPipeV's overlapped forward-backward pairs can hide (``_overlap_saving``)."""
    others_ep: tuple[tuple[float, float], ...] = ()
    """``ep`` of every other pipeline rank, in the order of ``others``."""
    rank: int = 0
    """The heaviest pipeline rank's index."""


# Every link costs 1 s a call and nothing a byte: communication seconds priced on it are numbers of calls.
_CALL_COUNTER = HardwareProfile(
    name="call-counter",
    links={kind: {s: [LinkPoint(group_size=2, latency=1.0, bus_bandwidth=math.inf)] for s in ("intra", "inter")}
           for kind in COLLECTIVES},
)  # fmt: skip


def _tokens(model: TransformerConfig, c: ParallelConfig, seq_len: int) -> float:
    """Tokens one rank's GEMMs see per micro-batch (CP splits the sequence)."""
    return c.micro_batch_size * seq_len / c.context_parallel_size


def _inter(group: int, stride: int, hw: HardwareProfile) -> bool:
    """Whether a group of ``group`` ranks, ``stride`` apart in rank order, spans nodes."""
    return group * stride > hw.devices_per_node


def _block_compute(model: TransformerConfig, c: ParallelConfig, seq_len: int, hw: HardwareProfile, moe: bool):
    """(GEMM forward seconds, attention forward seconds, memory-bound forward seconds) of one block."""
    tp, t = c.tensor_parallel_size, _tokens(model, c, seq_len)
    h = model.hidden_size
    gemm = sum(hw.gemm_seconds(*shape) for shape in _attention_gemms(model, t, tp))
    if moe:  # router, routed experts and shared experts as the block runs them under this layout (tune/moe_cost.py)
        gemm += hw.fp32_gemm_seconds(*router_gemm(model, c, t))  # the router runs in fp32 (moe/router.py)
        gemm += sum(hw.gemm_seconds(*shape) for shape in moe_gemms(model, c, t, router=False))
        mlp = moe_mlp_elements(model, c, t)
    else:
        inner = model.intermediate_size
        gemm += hw.gemm_seconds(t, inner / tp, h, count=2) + hw.gemm_seconds(t, h, inner / tp)
        mlp = t * inner / tp
    attn = _attention(model, c, seq_len, hw)
    hidden_split = tp if c.sequence_parallel else 1
    mem = hw.memory_seconds(BF16 * (16 * t * h / hidden_split + 6 * mlp))
    return gemm, attn, mem


def _attention_gemms(model: TransformerConfig, t: float, tp: int) -> list[tuple[float, float, float]]:
    """``(rows, columns, inner)`` of one block's attention GEMMs on one rank: the fused q/k/v GEMM and o; under MLA
    (``models/attention.py``) q_a and q_b (or q), kv_a, kv_b and o in the order they run, the down projections
    replicated over TP (they run on every token of the gathered sequence), heads split."""
    h, n, d = model.hidden_size, model.num_attention_heads, model.head_dim
    if not model.is_mla:
        return [(t, (n + 2 * model.num_key_value_heads) * d / tp, h), (t, h, n * d / tp)]
    r, rope, v = model.kv_lora_rank, model.qk_rope_head_dim, model.v_head_dim
    q = [(t, n * d / tp, h)] if model.q_lora_rank is None else [(t, model.q_lora_rank, h),
                                                                (t, n * d / tp, model.q_lora_rank)]  # fmt: skip
    return [*q, (t, r + rope, h), (t, n * (model.qk_nope_head_dim + v) / tp, r), (t, h, n * v / tp)]


def _every_other_gemm(model: TransformerConfig, c: ParallelConfig, seq_len: int, hw: HardwareProfile, moe: bool):
    """Forward seconds of the matmuls ``selective_mm`` recomputes: the 2nd, 4th, ... of the block's matmuls in the
    order they run (q, k, v, o, gate, up, down: k, o and up; under MLA its projections first), as
    ``parallel/pipeline_parallel/recompute.py`` counts them (dense blocks only)."""
    if moe:
        raise ValueError(
            "recompute='selective_mm' runs on dense blocks only (parallel/pipeline_parallel/recompute.py)."
        )
    tp, t = c.tensor_parallel_size, _tokens(model, c, seq_len)
    h, q, kv, d = model.hidden_size, model.num_attention_heads, model.num_key_value_heads, model.head_dim
    if model.is_mla:
        attn = _attention_gemms(model, t, tp)
    else:  # the q, k, v, o projections apart (the fused GEMM of _block_compute is three matmuls in the model)
        attn = [(t, q * d / tp, h), (t, kv * d / tp, h), (t, kv * d / tp, h), (t, h, q * d / tp)]
    inner = model.intermediate_size / tp
    shapes = [*attn, (t, inner, h), (t, inner, h), (t, h, inner)]
    return sum(hw.gemm_seconds(*shape) for shape in shapes[1::2])


def _attention(model: TransformerConfig, c: ParallelConfig, seq_len: int, hw: HardwareProfile) -> tuple[float, float]:
    """(forward, backward) seconds of one block's core attention on one rank.

    Without a ring: one fused call on the causal half of ``4 b s^2 h d`` (Ulysses gathers the sequence and splits
    the heads). Ring CP (``parallel/context_parallel/attention.py``, zigzag chunks): ``ring`` steps on the local ``s / ring`` tokens,
    the diagonal block causal and each other step half a block; through a fused kernel that is the same causal
    FLOPs as one call, through the ``torch`` block kernel each step is a separate call on its whole block."""
    tp, u, ring = c.tensor_parallel_size, c.resolved_ulysses_size, c.ring_size
    local = seq_len / ring
    width = (model.head_dim + (model.v_head_dim or model.head_dim)) / 2  # q k^T over the qk width, p v over v (MLA)
    full = 4 * c.micro_batch_size * local * local * model.num_attention_heads / (tp * u) * width
    backend = model.attn_backend
    if ring <= 1:
        return hw.attention_call_seconds(0.5 * full, backend=backend)
    diag_f, diag_b = hw.ring_block_seconds(full, 0.5 * full, backend=backend)
    rest_f, rest_b = hw.ring_block_seconds(0.5 * full, 0.5 * full, calls=ring - 1, backend=backend)
    return diag_f + rest_f, diag_b + rest_b


_STATS = TOKENS
"""Key of the MoE routing statistics' all-reduces (a global balance loss) in the per-kind dicts: they run over the
token group (data x context ranks, with the TP ranks when blocks route their own chunk), so their wait on shared
cores is that group's; reported as ``ep`` communication."""


def _fold_stats(by_kind: dict[str, float]) -> dict[str, float]:
    """``by_kind`` with the routing statistics' all-reduce counted as ``ep`` (the kinds :class:`StepCost` reports)."""
    out = {k: v for k, v in by_kind.items() if k != _STATS}
    if _STATS in by_kind:
        out["ep"] = out.get("ep", 0.0) + by_kind[_STATS]
    return out


def _block_comm(
    model: TransformerConfig, c: ParallelConfig, seq_len: int, hw: HardwareProfile, moe: bool, attn: tuple[float, float]
):
    """Exposed forward and backward communication seconds of one block, by kind."""
    tp, cp = c.tensor_parallel_size, c.context_parallel_size
    t, h, d = _tokens(model, c, seq_len), model.hidden_size, model.head_dim
    v, n, kv_heads = model.v_head_dim or d, model.num_attention_heads, model.num_key_value_heads
    act = t * h * BF16
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    if tp > 1:
        inter = _inter(tp, 1, hw)
        if c.sequence_parallel:
            one = hw.collective_seconds("all_gather", act, tp, inter_node=inter)
            one += hw.collective_seconds("reduce_scatter", act, tp, inter_node=inter)
        else:
            one = hw.collective_seconds("all_reduce", act, tp, inter_node=inter)
        # attention's and the MLP's; an MoE block's own TP collectives depend on how it routes (tune/moe_cost.py)
        fwd["tp"] = bwd["tp"] = (1 if moe else 2) * one
        if model.is_mla:  # the gradients of the replicated latents (q, kv) and of the shared rotary key reduced
            latents = [model.kv_lora_rank, model.qk_rope_head_dim, *([model.q_lora_rank] if model.q_lora_rank else [])]
            bwd["tp"] += sum(hw.collective_seconds("all_reduce", t * w * BF16, tp, inter_node=inter) for w in latents)
    if cp > 1:
        u, ring = c.resolved_ulysses_size, c.ring_size
        cp_inter = _inter(cp, tp, hw)
        if u > 1:  # q, k, v in and the output back, each an all-to-all; the same in backward
            qkvo = t * (n * (d + v) + kv_heads * (d + v)) * BF16 / tp
            fwd["cp"] = bwd["cp"] = hw.collective_seconds("all_to_all", qkvo, u, inter_node=_inter(u, tp, hw))
        if ring > 1:  # K and V of the local chunk go round the ring, overlapped with the attention of each step
            kv = t * kv_heads * (d + v) * BF16 / tp
            step = hw.collective_seconds("p2p", kv, 2, inter_node=cp_inter)
            fwd["cp"] = fwd.get("cp", 0.0) + max(0.0, (ring - 1) * step - attn[0] * (ring - 1) / ring)
            bwd["cp"] = bwd.get("cp", 0.0) + max(0.0, (ring - 1) * 2 * step - attn[1] * (ring - 1) / ring)
    if moe:  # the block's own collectives under this layout: EP, ETP, TP around it, balance statistics
        for priced, calls in zip((fwd, bwd), moe_collectives(model, c, t), strict=True):
            for x in calls:
                seconds = hw.collective_seconds(x.op, x.nbytes, x.size, inter_node=_inter(x.size, x.stride, hw))
                priced[x.kind] = priced.get(x.kind, 0.0) + seconds
    return fwd, bwd


def _block_pass(
    model: TransformerConfig, c: ParallelConfig, seq_len: int, hw: HardwareProfile, moe: bool, recompute: str
) -> _Pass:
    gemm, attn, mem = _block_compute(model, c, seq_len, hw, moe)
    fwd_comm, bwd_comm = _block_comm(model, c, seq_len, hw, moe, attn)
    host_f, host_b = hw.tp_overhead[:2] if c.tensor_parallel_size > 1 else (0.0, 0.0)
    if moe:
        host_f, host_b = host_f + hw.moe_overhead[0], host_b + hw.moe_overhead[1]
    if recompute in ("selective", "selective_mm"):
        host_f, host_b = host_f + hw.selective_overhead[0], host_b + hw.selective_overhead[1]
    f = gemm + attn[0] + mem + host_f + sum(fwd_comm.values())
    dgrad, w = hw.backward_gemm_seconds(gemm)  # one input- and one weight-gradient GEMM per forward GEMM
    b = dgrad + w + attn[1] + 2 * mem + host_b + sum(bwd_comm.values())
    if recompute == "full":
        b += f
    elif recompute == "selective":
        b += mem
    elif recompute == "selective_mm":
        b += mem + _every_other_gemm(model, c, seq_len, hw, moe)
    fwd_calls, bwd_calls = _block_comm(model, c, seq_len, _CALL_COUNTER, moe, (0.0, 0.0))
    comm = _fold_stats(_both(fwd_comm, bwd_comm, recompute))
    ep_f = fwd_comm.get("ep", 0.0)
    ep = (ep_f, bwd_comm.get("ep", 0.0) + (ep_f if recompute == "full" else 0.0))
    return _Pass(f, b, w, comm, calls=_both(fwd_calls, bwd_calls, recompute), ep=ep)


def _both(fwd: dict[str, float], bwd: dict[str, float], recompute: str) -> dict[str, float]:
    """Forward + backward by kind; full recompute runs the forward's collectives again in backward."""
    again = 2.0 if recompute == "full" else 1.0
    return {k: again * fwd.get(k, 0.0) + bwd.get(k, 0.0) for k in set(fwd) | set(bwd)}


def _ends_comm(
    model: TransformerConfig, c: ParallelConfig, seq_len: int, hw: HardwareProfile, first: bool, last: bool
) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's tensor-parallel collectives outside the blocks: the
    vocab-parallel embedding's all-reduce (first stage; under SP a reduce-scatter, all-gathered in backward), the
    head's input (last stage: replicated, all-reduced in backward; under SP all-gathered, reduce-scattered back)
    and the vocab-parallel cross-entropy's two all-reduces of fp32 per token (max; target logit and sum-exp)."""
    tp = c.tensor_parallel_size
    if tp <= 1:
        return 0.0, 0.0
    t, inter, sp = _tokens(model, c, seq_len), _inter(tp, 1, hw), c.sequence_parallel
    act = t * model.hidden_size * BF16

    def one(kind: str, nbytes: float) -> float:
        return hw.collective_seconds(kind, nbytes, tp, inter_node=inter)

    fwd = bwd = 0.0
    if first:
        fwd += one("reduce_scatter", act) if sp else one("all_reduce", act)
        bwd += one("all_gather", act) if sp else 0.0
    if last:
        fwd += (one("all_gather", act) if sp else 0.0) + one("all_reduce", 4 * t) + one("all_reduce", 8 * t)
        bwd += one("reduce_scatter", act) if sp else one("all_reduce", act)
    return fwd, bwd


def stage_layer_counts(model: TransformerConfig, c: ParallelConfig) -> list[int]:
    """Blocks per pipeline stage: ``pipeline_layers`` or an even split (earlier stages take the remainder)."""
    if c.pipeline_layers is not None:
        return list(c.pipeline_layers)
    n = c.num_stages
    q, r = divmod(model.num_layers, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _rank_stages(c: ParallelConfig) -> list[list[int]]:
    """Stage indices held by each pipeline rank (loop or V placement, ``config/schedules.py``)."""
    p, v = c.pipeline_parallel_size, c.virtual_pipeline_parallel_size
    if p > 1 and SCHEDULE_SPECS[c.pipeline_schedule].placement == "v":
        return [[r, 2 * p - 1 - r] for r in range(p)]
    return [[r + i * p for i in range(v)] for r in range(p)]


def _rank_pass(model: TransformerConfig, c: ParallelConfig, seq_len: int, hw: HardwareProfile) -> _Pass:
    """Forward/backward of one micro-batch on the heaviest pipeline rank (its blocks over all its chunks + head)."""
    counts, modes = stage_layer_counts(model, c), c.stage_recompute
    moe_flags = [model.is_moe_layer(i) for i in range(model.num_layers)]
    first = [sum(counts[:i]) for i in range(len(counts))]
    cache: dict[tuple[bool, str], _Pass] = {}
    split = SCHEDULE_SPECS[c.pipeline_schedule].split_backward
    ranks: list[_Pass] = []
    per_stage: dict[int, tuple[float, float, float]] = {}
    for stages in _rank_stages(c):
        f = b = w = ep_f = ep_b = 0.0
        comm: dict[str, float] = {}
        calls: dict[str, float] = {}
        for s in stages:
            before = (f, b, w)
            n_moe = sum(moe_flags[first[s] : first[s] + counts[s]])
            for moe, n in ((True, n_moe), (False, counts[s] - n_moe)):
                if n == 0:
                    continue
                key = (moe, modes[s])
                if key not in cache:
                    cache[key] = _block_pass(model, c, seq_len, hw, *key)
                one = cache[key]
                f, b, w = f + n * one.f, b + n * one.b, w + n * one.w
                ep_f, ep_b = ep_f + n * one.ep[0], ep_b + n * one.ep[1]
                _add(comm, one.comm, n)
                _add(calls, one.calls, n)
            ends = (s == 0, s == c.num_stages - 1)
            if any(ends) and c.tensor_parallel_size > 1:
                ends_f, ends_b = _ends_comm(model, c, seq_len, hw, *ends)
                f, b = f + ends_f, b + ends_b
                _add(comm, {"tp": ends_f + ends_b})
                _add(calls, {"tp": sum(_ends_comm(model, c, seq_len, _CALL_COUNTER, *ends))})
            if ends[1]:  # LM head (vocab-parallel over TP) and loss
                t, vocab = _tokens(model, c, seq_len), model.padded_vocab_size(c.tensor_parallel_size)
                head = hw.gemm_seconds(t, vocab / c.tensor_parallel_size, model.hidden_size)
                head_dgrad, head_w = hw.backward_gemm_seconds(head)
                host_f, host_b = hw.tp_overhead[2:] if c.tensor_parallel_size > 1 else (0.0, 0.0)
                f, b, w = f + head + host_f, b + head_dgrad + head_w + host_b, w + head_w
                for k in range(model.num_nextn_predict_layers):  # MTP: eh_proj, one block (never recomputed), head
                    key = (model.is_moe_layer(model.num_layers + k), "none")
                    if key not in cache:
                        cache[key] = _block_pass(model, c, seq_len, hw, *key)
                    one = cache[key]
                    rows = t / (c.tensor_parallel_size if c.sequence_parallel else 1)
                    eh = hw.gemm_seconds(rows, model.hidden_size, 2 * model.hidden_size)
                    gemm_f = eh + head
                    gemm_d, gemm_w = hw.backward_gemm_seconds(gemm_f)
                    f, b, w = f + one.f + gemm_f + host_f, b + one.b + gemm_d + gemm_w + host_b, w + one.w + gemm_w
                    ep_f, ep_b = ep_f + one.ep[0], ep_b + one.ep[1]
                    _add(comm, one.comm)
                    _add(calls, one.calls)
                    if c.tensor_parallel_size > 1:  # the head's collectives again (its input, the vocab-parallel loss)
                        ends_f, ends_b = _ends_comm(model, c, seq_len, hw, False, True)
                        f, b = f + ends_f, b + ends_b
                        _add(comm, {"tp": ends_f + ends_b})
                        _add(calls, {"tp": sum(_ends_comm(model, c, seq_len, _CALL_COUNTER, False, True))})
            if c.pipeline_parallel_size > 1 and hw.pipeline_action_overhead:
                # the schedule's host time per action: a forward, and a backward (an input- and a weight-gradient
                # action under the zero-bubble family)
                h = hw.pipeline_action_overhead
                f, b, w = f + h, b + (2 * h if split else h), w + (h if split else 0.0)
            per_stage[s] = (f - before[0], b - before[1], w - before[2])
        ranks.append(_Pass(f, b, w, comm, calls=calls, ep=(ep_f, ep_b)))
    heaviest = max(range(len(ranks)), key=lambda r: ranks[r].f + ranks[r].b)
    best = ranks[heaviest]
    others = tuple((r.f, r.b, r.w) for i, r in enumerate(ranks) if i != heaviest)
    others_ep = tuple(r.ep for i, r in enumerate(ranks) if i != heaviest)
    mean_fb = sum(r.f + r.b for r in ranks) / len(ranks)
    stage_times = tuple(per_stage[i] for i in range(len(per_stage)))
    return _Pass(
        best.f, best.b, best.w, best.comm, mean_fb, others, best.calls, stage_times, best.ep, others_ep, heaviest
    )


def _add(total: dict[str, float], part: dict[str, float], times: float = 1.0) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + times * v


def _bubble(c: ParallelConfig, one: _Pass, overlap: bool = False, m: int | None = None) -> float:
    """Idle time of one schedule run of ``m`` micro-batches on the heaviest rank (see the module docstring).

    ZB-V and DualPipeV: the order the runner runs, replayed (:func:`_v_bubble`). The others, closed forms: the fill
    and drain run through the *other* ranks' chunks, so each of the ``p - 1`` bubble slots costs that rank's time, not
    the heaviest's (equal for an even split; an uneven split's light stages fill faster)."""
    p, v = c.pipeline_parallel_size, c.virtual_pipeline_parallel_size
    if p == 1:
        return 0.0
    name = c.pipeline_schedule
    if SCHEDULE_SPECS[name].placement == "v":
        return _v_bubble(c, one, overlap, m)
    others = one.others or ((one.f, one.b, one.w),) * (p - 1)
    total = 0.0
    for f, b, w in others:
        f, b, w = f / v, b / v, w / v
        total += f + b if name in ("gpipe", "1f1b", "interleaved_1f1b") else max(0.0, f + b - 2 * w)
    return total


def _v_bubble(c: ParallelConfig, one: _Pass, overlap: bool, m: int | None) -> float:
    """ZB-V / DualPipeV: the makespan of the order the runner runs (``inflight.runner_v_order``: torch's, or the one
    generated for ``pipeline_chunk_costs`` / ``pipeline_max_activations``), replayed by ``orders.simulate`` with each
    stage's forward, input-gradient and weight-gradient seconds, less the heaviest rank's busy time.

    The closed form ``(p-1)(f+2b-3w)`` this replaces priced torch's DualPipeV order at about twice its replay (p = 4,
    F = I = W: 6 F against 3 F; I = 2F = 2W: 12 F against 8 F), ranking DualPipeV below ZB-V (issue 42). ``"auto"``
    costs: the order generated for this model's mean chunk costs (what the runner measures; its first two steps,
    on torch's order, are not priced). ``m`` None (the hetero planner's call): 2p, where torch's orders are past
    their warm-up (ZB-V idles more below about 2p micro-batches; from there the replay does not change with m). With ``overlap`` each fused pair (``OVERLAP_F_B``) runs as one
    action, the pair's hidden all-to-all seconds off (``_overlap_saving``, the rank's per-chunk average, as the busy
    time takes them) and both outputs sent when it ends (torch's lowering of a custom pair function); without it the
    runner runs the pair's halves apart, as the replay does."""
    p, name = c.pipeline_parallel_size, c.pipeline_schedule
    m = max(m or 2 * p, min_microbatches(name, p, 2))
    uniform = (one.f / 2, (one.b - one.w) / 2, one.w / 2)
    stages = tuple((f, b - w, w) for f, b, w in one.stages) if one.stages else (uniform,) * (2 * p)
    costs = c.pipeline_chunk_costs
    if costs == "auto":  # mean per chunk over every stage; the first stage's I and W are not its own (action_cost)
        f = sum(s[0] for s in stages) / len(stages)
        costs = (1.0, *(sum(s[k] for s in stages[1:]) / (len(stages) - 1) / f for k in (1, 2)))
    hidden = None
    if overlap:
        ranks = list(one.others or ((one.f, one.b, one.w),) * (p - 1))
        eps = list(one.others_ep or (one.ep,) * (p - 1))
        ranks.insert(one.rank, (one.f, one.b, one.w))
        eps.insert(one.rank, one.ep)
        hidden = tuple(_overlap_saving(f / 2, b / 2, ef / 2, eb / 2) for (f, b, _), (ef, eb) in zip(ranks, eps))
    return _replayed_bubble(name, p, m, costs, c.pipeline_max_activations, stages, hidden, one.rank)


def _replayed_bubble(
    name: str,
    p: int,
    m: int,
    costs: tuple[float, float, float] | None,
    cap: int | None,
    stages: tuple[tuple[float, float, float], ...],
    hidden: tuple[float, ...] | None,
    rank: int,
) -> float:
    """:func:`_v_bubble`'s replay. torch's orders repeat one pattern per micro-batch once warmed up, so their bubble
    settles within ~3p micro-batches (``tests/test_tune_cost.py`` checks DeepSeek-V3's stages at m up to 40p): beyond
    4p, when the replays at 3p and 4p agree, that is the bubble at m (a search prices m up to 60p, ~15x the replay's
    time); when they do not (a bubble still growing), m itself is replayed."""
    if costs is None and cap is None and m > 4 * p:
        steady = _steady_bubble(name, p, stages, hidden, rank)
        if steady is not None:
            return steady
    return _replay(name, p, m, costs, cap, stages, hidden, rank)


@lru_cache(maxsize=4096)
def _steady_bubble(
    name: str, p: int, stages: tuple[tuple[float, float, float], ...], hidden: tuple[float, ...] | None, rank: int
) -> float | None:
    """The bubble of torch's order once it no longer changes with m (replays at 3p and 4p agree), else None."""
    early, late = (_replay(name, p, k * p, None, None, stages, hidden, rank) for k in (3, 4))
    return late if math.isclose(early, late, rel_tol=1e-9, abs_tol=1e-12) else None


@lru_cache(maxsize=4096)
def _replay(
    name: str,
    p: int,
    m: int,
    costs: tuple[float, float, float] | None,
    cap: int | None,
    stages: tuple[tuple[float, float, float], ...],
    hidden: tuple[float, ...] | None,
    rank: int,
) -> float:
    """Makespan less ``rank``'s busy time of the runner's order (``runner_v_order``) replayed with each stage's
    (F, I, W) seconds, each overlapped pair fused (``hidden``: per rank, the seconds a pair hides) or, without
    ``hidden``, run apart. Cached: a search prices the same order with the same stage times for every ZeRO stage and
    DP degree that leaves the micro-batch count alone."""
    order = runner_v_order(name, p, m, costs, cap)
    fused: dict[tuple, float] = {}  # (kind, stage, micro-batch) -> seconds, for the halves of overlapped pairs
    if hidden is not None:
        for r, actions in order.items():
            for a in actions:
                if a.sub_actions:
                    fwd, bwd = a.sub_actions  # torch's pairs and orders.dualpipev_order's: the forward first
                    pair = action_cost(fwd, stages[fwd.stage_index]) + action_cost(bwd, stages[bwd.stage_index])
                    fused[_key(fwd)], fused[_key(bwd)] = pair - hidden[r], 0.0

    def seconds(a) -> float:
        return fused.get(_key(a), action_cost(a, stages[a.stage_index]))

    sim = simulate(order, 2 * p, seconds)
    return sim.makespan - sim.busy(rank)


def _key(a) -> tuple:
    return a.computation_type, a.stage_index, a.microbatch_index


def _overlap_saving(f: float, b: float, ep_f: float, ep_b: float) -> float:
    """Seconds one overlapped forward-backward pair of DualPipeV hides (``overlap_moe_expert_parallel_comm``): the
    forward chunk (``f`` seconds, ``ep_f`` of them expert-parallel communication) runs at the same time as the
    backward chunk of another micro-batch (``b``, ``ep_b``), so each one's all-to-alls wait while the other computes
    (DeepSeek-V3 section 3.2.1). Exposed: ``max(0, ep_f - (b - ep_b)) + max(0, ep_b - (f - ep_f))``; hidden: the
    rest of ``ep_f + ep_b``. Compute is not shared between the two (separate resources for comm and compute)."""
    exposed = max(0.0, ep_f - (b - ep_b)) + max(0.0, ep_b - (f - ep_f))
    return ep_f + ep_b - exposed


def _layer_params(model: TransformerConfig, layer: int, tp: int = 1) -> tuple[float, float]:
    """(dense, routed-expert) parameters of block ``layer``: dense ones on one of ``tp`` TP ranks."""
    tensors = _layer_tensors(model, layer, tp=tp, ep=1)
    return sum(n for g, n in tensors if g != "expert"), sum(n for g, n in tensors if g == "expert")


def _rank_params(model: TransformerConfig, c: ParallelConfig) -> list[tuple[float, float]]:
    """(dense, expert) parameters of each pipeline rank (all its chunks, embedding and head): the dense ones as each
    of its TP ranks holds them (split projections and vocabulary, whole norms, routers and shared experts), the
    routed experts before the division over their ``ep x etp`` shards."""
    tp, counts = c.tensor_parallel_size, stage_layer_counts(model, c)
    first = [sum(counts[:i]) for i in range(len(counts))]
    moe_flags = [model.is_moe_layer(i) for i in range(model.num_layers)]
    per = {moe: _layer_params(model, 0 if not moe else moe_flags.index(True), tp) for moe in set(moe_flags)}
    embed = model.vocab_size * model.hidden_size / tp
    out = []
    for stages in _rank_stages(c):
        dense = expert = 0.0
        for s in stages:
            n_moe = sum(moe_flags[first[s] : first[s] + counts[s]])
            for moe, n in ((True, n_moe), (False, counts[s] - n_moe)):
                if n:
                    dense, expert = dense + n * per[moe][0], expert + n * per[moe][1]
            ends = (s == 0) + (s == c.num_stages - 1)
            if c.num_stages == 1 and model.tie_word_embeddings:
                ends = 1
            dense += ends * embed + (model.hidden_size if s == c.num_stages - 1 else 0)  # the final norm
            if s == c.num_stages - 1 and model.num_nextn_predict_layers:  # MTP (+ its embedding copy away from 0)
                mtp_dense, mtp_expert = mtp_params(model, tp=tp)
                dense, expert = dense + mtp_dense + (embed if s else 0.0), expert + mtp_expert
        out.append((dense, expert))
    return out


def _rank_stage_params(model: TransformerConfig, c: ParallelConfig) -> list[float]:
    """Elements of each pipeline rank's weights reduced over its stage's dp x cp x tp ranks (part of its dense ones;
    ``tune.stage_params.stage_reduced_params``): 0 without TP."""
    counts = stage_layer_counts(model, c)
    first = [sum(counts[:i]) for i in range(len(counts))]
    return [
        stage_reduced_params(model, c, [i for s in stages for i in range(first[s], first[s] + counts[s])],
                             last_stage=c.num_stages - 1 in stages)
        for stages in _rank_stages(c)
    ]  # fmt: skip


def _layer_tensors(model: TransformerConfig, layer: int, tp: int, ep: int) -> list[tuple[str, float]]:
    """(group, elements on one rank) of each parameter tensor of block ``layer``, in registration order
    (``models/decoder.py``: norm, q, k, v, o, norm, then the MLP: gate, up, down, or the router and the experts'
    stacked gate_up and down, then shared experts); MLA's projections and latent norms as ``tune.stage_params`` lists
    them. Groups: ``dense``, ``expert`` (routed experts), ``moe`` (router, shared experts: whole on every TP rank),
    ``seq_norm`` (the block norms) and ``head_norm`` (QK-norm), each reduced as :func:`_reduction_group` says."""
    h, attn = model.hidden_size, attention_tensors(model, tp)
    qk = 2 if model.qk_norm and not model.is_mla else 0  # QK-norm's weights, registered last
    out = [("seq_norm", h), *(("dense", n) for n in attn[: len(attn) - qk])]
    out += [*(("head_norm", n) for n in attn[len(attn) - qk :]), ("seq_norm", h)]
    if not model.is_moe_layer(layer):
        return out + [("dense", h * model.intermediate_size / tp)] * 3
    inner, e = model.moe_intermediate_size, model.num_experts
    out += [("moe", h * e), ("expert", 2 * h * inner * e / ep), ("expert", h * inner * e / ep)]
    if model.num_shared_experts:  # whole on every TP rank (no TP plan splits them); Qwen2-MoE's sigmoid gate last
        shared = model.shared_expert_intermediate_size or inner * model.num_shared_experts
        out += [("moe", h * shared)] * 3 + ([("moe", h)] if model.shared_expert_gate else [])
    return out


def _reduction_group(c: ParallelConfig, group: str) -> str:
    """Where a :func:`_layer_tensors` group's gradients are reduced under ``c``: routed experts over the expert-data-
    parallel ranks (``expert``) when an expert mesh shards them, else with the block's other MoE weights; those over
    the stage's dp x cp x tp ranks (``stage``) when blocks route their own sequence chunk (``tag_chunk_routed_params``),
    as are, under TP, the norms on sequence shards (SP) and QK-norm (``tag_tp_partial_params``); the rest over the
    data x context ranks (``dense``)."""
    if group == "expert" and c.ep_enabled:
        return "expert"
    if group in ("expert", "moe"):
        return "stage" if c.moe_routes_sequence_chunks else "dense"
    if group == "seq_norm":  # on sequence shards under SP (tag_tp_partial_params)
        return "stage" if c.tp_enabled and c.sequence_parallel else "dense"
    if group == "head_norm":  # on the TP rank's heads
        return "stage" if c.tp_enabled else "dense"
    return group


def _bucket_sizes(model: TransformerConfig, c: ParallelConfig, stages: list[int], bucket_numel: float) -> dict:
    """Elements of each gradient bucket of a rank holding pipeline ``stages``, by reduction group (``dense`` over
    data x context ranks, ``expert`` over the expert-data-parallel ones, ``stage`` over the stage's dp x cp x tp
    ranks: :func:`_reduction_group`), as ``parallel/grad_buckets.bucket_runs``
    cuts them: the tensors in reverse registration order, runs of one group of at most ``bucket_numel`` elements, a
    larger tensor alone."""
    tp, ep, h = c.tensor_parallel_size, c.expert_shards, model.hidden_size
    embed = model.vocab_size * h / tp
    counts = stage_layer_counts(model, c)
    first = [sum(counts[:i]) for i in range(len(counts))]
    tensors: list[tuple[str, float]] = []
    for s in sorted(stages):
        if s == 0:
            tensors.append(("dense", embed))
        for layer in range(first[s], first[s] + counts[s]):
            tensors += _layer_tensors(model, layer, tp, ep)
        if s == c.num_stages - 1:
            tensors.append(("seq_norm", h))
            if not (c.num_stages == 1 and model.tie_word_embeddings):
                tensors.append(("dense", embed))
            for k in range(model.num_nextn_predict_layers):  # MTP: embedding copy (away from stage 0), block, norms
                if k == 0 and s:
                    tensors.append(("dense", embed))
                tensors += _layer_tensors(model, model.num_layers + k, tp, ep)
                tensors += [("seq_norm", h), ("seq_norm", h), ("seq_norm", 2 * h * h), ("seq_norm", h)]
    tensors = [(_reduction_group(c, g), n) for g, n in reversed(tensors)]
    out: dict[str, list[float]] = {"dense": [], "expert": [], "stage": []}
    for group, run in cut_runs(tensors, bucket_numel):
        out[group].append(sum(tensors[i][1] for i in run))
    return out


def _optimizer_seconds(
    c: ParallelConfig, hw: HardwareProfile, dense: float, expert: float, partial: float = 0.0
) -> float:
    """The optimizer phase of a rank holding ``dense`` (TP-local; ``partial`` of them reduced over the stage's
    dp x cp x tp ranks, :func:`_rank_stage_params`) and ``expert`` (before the EP division) parameters (ZeRO shards
    them over DP; ZeRO-1/2 the ``partial`` ones over the stage's ranks, which reduce them)."""
    cp, dp = c.context_parallel_size, c.dp
    if not c.ep_enabled:  # no expert mesh: the experts are reduced and sharded with the other parameters
        dense, expert = dense + expert, 0.0
    stage = dp * cp * (c.tensor_parallel_size if c.zero_stage < 3 else 1)
    groups = [(dense - partial, dp * cp), (partial, stage)]
    groups += [(expert / c.expert_shards, c.expert_data_parallel_size)] if expert else []
    return sum(hw.optimizer_seconds(psi / n if c.zero_stage >= 1 else psi) for psi, n in groups)


def _data_parallel(
    model,
    c: ParallelConfig,
    hw: HardwareProfile,
    dense: float,
    expert: float,
    last_backward: float,
    compute: float,
    buckets: dict[str, list[float]],
):
    """(exposed seconds, total seconds) of the gradient reduction and parameter gathers of a rank holding ``dense``
    (TP-local) and ``expert`` (before the EP division) parameters (exposed: what backward and compute do not hide;
    total: their whole duration).
    DDP / ZeRO-1 / ZeRO-2 issue one reduction and (ZeRO) one gather per gradient bucket (``buckets``, from
    :func:`_bucket_sizes`), each paying the link's latency; the last bucket's reduction starts when backward ends."""
    tp, cp, dp, shards = c.tensor_parallel_size, c.context_parallel_size, c.dp, c.expert_shards
    if not c.ep_enabled:  # no expert mesh: the experts are reduced and sharded with the other parameters
        dense, expert = dense + expert, 0.0
    # the TP-partial weights (norms on sequence / head shards, chunk-routed MoE weights): reduced (and ZeRO-1/2
    # sharded) over the stage's dp x cp x tp ranks, summed over TP in the same collective; ZeRO-3 reduces them with the
    # rest and all-reduces their fp32 shards over TP at the step
    partial = sum(buckets.get("stage", ()))
    zero3 = c.zero_stage == 3
    groups = [("dense", dense - (0.0 if zero3 else partial), dp * cp, _inter(dp * cp, tp, hw))]
    if partial and not zero3:
        groups.append(("stage", partial, dp * cp * tp, _inter(dp * cp * tp, 1, hw)))
    if expert:
        edp = c.expert_data_parallel_size  # over the ranks holding the same expert shard
        groups.append(("expert", expert / shards, edp, _inter(edp, shards, hw)))
    exposed = total = 0.0
    m = c.gradient_accumulation_steps
    for name, psi, n, inter in groups:
        if n <= 1:
            continue
        sizes = buckets.get(name) if c.zero_stage < 3 else None
        # each bucket's share of the bytes (the bucket sizes count tensors; the bytes stay ``psi``'s)
        shares = [b / sum(sizes) for b in sizes] if sizes else [1.0]

        def calls(kind: str, nbytes: float, shares=shares, n=n, inter=inter) -> list[float]:
            return [hw.collective_seconds(kind, f * nbytes, n, inter_node=inter) for f in shares]

        per_bucket = calls("all_reduce" if c.zero_stage == 0 else "reduce_scatter", 4 * psi)
        reduce = sum(per_bucket)
        gather = sum(calls("all_gather", 2 * psi)) if c.zero_stage else 0.0
        if c.zero_stage in (0, 1, 2):
            exposed += max(per_bucket[-1], reduce - last_backward)
            total += reduce
        if c.zero_stage in (1, 2):
            exposed += gather
            total += gather
        if c.zero_stage == 3:  # gathers per micro-batch in forward and backward, prefetched under compute
            per_block = gather / max(model.num_layers, 1)
            exposed += max(per_block, 2 * m * gather + reduce - compute) + per_block
            total += 2 * m * gather + reduce
    if (
        partial and zero3
    ):  # one flat fp32 all-reduce of their dp x cp shards at the step (parallel.step.sum_chunk_grads)
        tp_sum = hw.collective_seconds("all_reduce", 4 * partial / (dp * cp), tp, inter_node=_inter(tp, 1, hw))
        exposed, total = exposed + tp_sum, total + tp_sum
    return exposed, total


def _shared_ranks(c: ParallelConfig, hw: HardwareProfile) -> bool:
    """Whether the ranks of a node outnumber its ``compute_units_per_node`` (CPU processes on a few cores)."""
    return 0 < hw.compute_units_per_node < min(c.world_size, hw.devices_per_node)


def _shared_node_seconds(c: ParallelConfig, hw: HardwareProfile, mean_busy: float) -> float:
    """Time the ranks of one node need for their work when they share ``hw.compute_units_per_node`` compute units
    (0 when each device computes on its own): the node's summed busy time over its units."""
    if not _shared_ranks(c, hw):
        return 0.0
    return mean_busy * min(c.world_size, hw.devices_per_node) / hw.compute_units_per_node


def _pass_key(c: ParallelConfig) -> tuple:
    """Everything ``_rank_pass`` depends on besides the model, sequence and hardware (not ZeRO or DP)."""
    layers = tuple(c.pipeline_layers) if c.pipeline_layers is not None else None
    rc = c.recompute if isinstance(c.recompute, str) else tuple(c.recompute)
    return (
        c.tensor_parallel_size, c.pipeline_parallel_size, c.virtual_pipeline_parallel_size, c.pipeline_schedule,
        c.context_parallel_size, c.resolved_ulysses_size, c.expert_parallel_size, c.expert_tensor_parallel_size,
        c.sequence_parallel, c.micro_batch_size, rc, layers,
    )  # fmt: skip


def estimate_step(
    model: TransformerConfig,
    c: ParallelConfig,
    seq_len: int,
    global_batch: int,
    hw: HardwareProfile,
    *,
    cache: dict | None = None,
    grad_bucket_numel: float = DEFAULT_BUCKET_NUMEL,
) -> StepCost:
    """Predicted time of one optimizer step of ``global_batch`` sequences of ``seq_len`` tokens (module docstring).

    ``grad_bucket_numel``: the strategy's gradient bucket size (DDP / ZeRO-1 / ZeRO-2 launch one collective per
    bucket).

    ``cache``: a dict shared by calls with the same model, sequence length and profile (a search), so layouts that
    differ only in ZeRO stage or DP reuse the per-micro-batch pass."""
    dp, p = c.dp, c.pipeline_parallel_size
    per_replica = global_batch // dp
    m_total = max(1, per_replica // c.micro_batch_size)
    gas = c.gradient_accumulation_steps
    # Ranks sharing cores with a measured blocking-collective wait: the calls' latency is that wait, priced apart
    # (wall time, once); their bytes stay work on the shared cores.
    waits = _shared_ranks(c, hw) and bool(hw.blocking_collective)
    key = (*_pass_key(c), waits)
    one = cache.get(key) if cache is not None else None
    if one is None:
        one = _rank_pass(model, c, seq_len, hw.without_latency() if waits else hw)
        if cache is not None:
            cache[key] = one
    # DualPipeV's overlapped pairs (OVERLAP_F_B), each a forward chunk beside a backward chunk of another micro-batch:
    # what their expert all-to-alls hide leaves the heaviest rank's busy time, its exposed comm and the bubble's F&B
    # terms. Not on shared cores: there gloo copies and reduces on the cores the compute needs.
    overlap = c.overlap_moe_expert_parallel_comm and p > 1 and not _shared_ranks(c, hw)
    bubble = gas * _bubble(c, one, overlap, m_total // gas)
    busy = m_total * (one.f + one.b)
    comm = {k: m_total * val for k, val in one.comm.items()}
    if overlap:
        v = c.virtual_pipeline_parallel_size
        pairs = gas * overlapped_pairs(c.pipeline_schedule, p, m_total // gas)[one.rank]
        hidden = pairs * _overlap_saving(one.f / v, one.b / v, one.ep[0] / v, one.ep[1] / v)
        busy -= hidden
        comm["ep"] = comm.get("ep", 0.0) - hidden
    if p > 1:
        act = c.micro_batch_size * seq_len / c.context_parallel_size * model.hidden_size * BF16
        act /= c.tensor_parallel_size if c.sequence_parallel else 1
        hop = hw.collective_seconds("p2p", act, 2, inter_node=_inter(p, c.world_size // p, hw))
        comm["pp"] = 2 * (m_total * c.virtual_pipeline_parallel_size + gas * (p - 1)) * hop
    ranks = _rank_params(model, c)
    index = max(range(len(ranks)), key=lambda r: sum(ranks[r]))
    heaviest = ranks[index]
    buckets = _bucket_sizes(model, c, _rank_stages(c)[index], grad_bucket_numel)
    dp_exposed, dp_total = _data_parallel(model, c, hw, *heaviest, last_backward=one.b, compute=busy, buckets=buckets)
    partial = _rank_stage_params(model, c)
    optimizer = _optimizer_seconds(c, hw, *heaviest, partial[index])
    comm["dp"] = dp_exposed
    step = busy + bubble + comm.get("pp", 0.0) + dp_exposed + optimizer
    compute = busy - sum(v for k, v in comm.items() if k not in ("pp", "dp")) + optimizer
    # the node's busy time: each pipeline rank steps its own parameters (uneven stages and V placements differ)
    mean_optimizer = sum(_optimizer_seconds(c, hw, *r, k) for r, k in zip(ranks, partial, strict=True)) / len(ranks)
    shared = _shared_node_seconds(c, hw, m_total * one.mean_fb + mean_optimizer)
    # On shared cores the collectives (gloo) copy and reduce on the same cores: nothing hides them under compute.
    group = {
        "tp": c.tensor_parallel_size, "cp": c.context_parallel_size, "ep": c.expert_parallel_size,
        _STATS: tokens_group_size(c),
    }  # fmt: skip
    wait = {k: m_total * n * hw.blocking_seconds(group[k]) for k, n in one.calls.items()} if waits else {}
    wait = _fold_stats(wait)
    node = shared + comm.get("pp", 0.0)
    if shared and p > 1:
        # the schedule run on the shared units: a rank idle in a bubble lends its share to the busy ones, but a rank
        # on the critical path cannot use more than one unit (tune/shared_cores.py)
        units = hw.compute_units_per_node * p / min(c.world_size, hw.devices_per_node)
        actions = schedule_actions(c.pipeline_schedule, p, c.virtual_pipeline_parallel_size, m_total // gas)
        node = gas * pipeline_seconds(actions, dict(enumerate(one.stages)), hop, units)
        shared_optimizer = processor_sharing_seconds(
            [_optimizer_seconds(c, hw, *r, k) for r, k in zip(ranks, partial, strict=True)], units
        )
        node += shared_optimizer
    else:
        shared_optimizer = _shared_node_seconds(c, hw, mean_optimizer)
    optimizer_wall = optimizer
    if shared and node + dp_total + sum(wait.values()) > step:
        optimizer_wall = shared_optimizer
        comm["dp"] = dp_total
        _add(comm, wait)
        step = node + dp_total + sum(wait.values())
        bubble, compute = max(0.0, node - shared - comm.get("pp", 0.0)), shared
    step += hw.step_overhead  # the training loop's own cost per step (Lightning, the step guard), wall time
    tokens = global_batch * seq_len
    world = c.world_size
    mfu = tokens / step * flops_per_token(model, seq_len) / (world * hw.peak_flops)
    return StepCost(
        step_seconds=step, compute_seconds=compute, bubble_seconds=bubble,
        exposed_comm_seconds=sum(comm.values()), comm=comm, optimizer_seconds=optimizer,
        optimizer_wall_seconds=optimizer_wall, loop_seconds=hw.step_overhead, tokens_per_second=tokens / step, mfu=mfu,
    )  # fmt: skip


def estimate_step_seconds(
    model: TransformerConfig, c: ParallelConfig, seq_len: int, global_batch: int, hw: HardwareProfile
) -> float:
    return estimate_step(model, c, seq_len, global_batch, hw).step_seconds


def calibrate_compute_scale(
    model: TransformerConfig,
    c: ParallelConfig,
    seq_len: int,
    global_batch: int,
    hw: HardwareProfile,
    tokens_per_second: float,
    *,
    field: str = "compute_scale",
    grad_bucket_numel: float = DEFAULT_BUCKET_NUMEL,
) -> HardwareProfile:
    """``hw`` with ``field`` (``compute_scale``, or ``gemm_scale`` for a GEMM-only speed-up) chosen so the predicted
    throughput of this layout equals ``tokens_per_second`` (bisection in log space; links are left as profiled)."""
    if field not in ("compute_scale", "gemm_scale"):
        raise ValueError(f"field={field!r}: use 'compute_scale' or 'gemm_scale'.")
    lo, hi = 1e-3, 1e3

    def rate(scale: float) -> float:
        scaled = hw.replace(**{field: scale})
        return estimate_step(
            model, c, seq_len, global_batch, scaled, grad_bucket_numel=grad_bucket_numel
        ).tokens_per_second

    if not rate(lo) <= tokens_per_second <= rate(hi):
        raise ValueError(
            f"{tokens_per_second:.0f} tokens/s is out of reach of this profile's communication model for this layout;"
            " check the layout and the profile's link bandwidths."
        )
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if rate(mid) < tokens_per_second else (lo, mid)
    return hw.replace(**{field: math.sqrt(lo * hi)})


@dataclass(frozen=True)
class MeasuredStep:
    """One measured run for :func:`fit_compute_scale`: a layout and its measured optimizer-step time."""

    model: TransformerConfig
    config: ParallelConfig
    seq_len: int
    global_batch: int
    step_seconds: float


def fit_compute_scale(
    runs: Sequence[MeasuredStep], hw: HardwareProfile, *, grad_bucket_numel: float = DEFAULT_BUCKET_NUMEL
) -> HardwareProfile:
    """``hw`` with the ``compute_scale`` that minimises the squared log error of the predicted against the measured
    step over several runs (links, latencies and the optimizer phase are left as profiled).

    One run fits exactly (:func:`calibrate_compute_scale`), and so inherits that run's error in the unscaled terms,
    amplified by the share of its step they make up: a data-parallel step that is half all-reduce and optimizer
    passes twice its all-reduce error into every other layout's compute. Fitted over several layouts, those errors
    meet with opposite signs. The search is on a log grid over [1e-3, 1e3], refined by golden section around the
    best point (the error is not assumed convex in the scale: the step is a max of phases); a best point at either
    end of the grid is refused, as :func:`calibrate_compute_scale` refuses a step out of reach."""
    if not runs:
        raise ValueError("fit_compute_scale needs at least one measured run.")
    bad = [r for r in runs if not r.step_seconds > 0]
    if bad:
        raise ValueError(f"measured step_seconds must be > 0, got {[r.step_seconds for r in bad]}.")

    def loss(log_scale: float) -> float:
        scaled = hw.replace(compute_scale=math.exp(log_scale))
        return sum(
            math.log(
                estimate_step(
                    r.model, r.config, r.seq_len, r.global_batch, scaled, grad_bucket_numel=grad_bucket_numel
                ).step_seconds
                / r.step_seconds
            )
            ** 2
            for r in runs
        )

    grid = [math.log(1e-3) + i * math.log(1e6) / 120 for i in range(121)]
    values = [loss(x) for x in grid]
    i = min(range(len(grid)), key=values.__getitem__)
    if i in (0, len(grid) - 1):
        raise ValueError(
            f"no compute_scale in [1e-3, 1e3] fits these {len(runs)} measured steps (the best is at the "
            f"{'slow' if i == 0 else 'fast'} end): they are "
            + ("longer" if i == 0 else "shorter")
            + " than this profile's model can reach by compute alone; check the layouts, the measured times and the "
            "profile's link and optimizer terms."
        )
    lo, hi = grid[i - 1], grid[i + 1]  # an interior point: the ends were refused above
    golden = (math.sqrt(5) - 1) / 2
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(60):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - golden * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + golden * (hi - lo)
            fb = loss(b)
    return hw.replace(compute_scale=math.exp((lo + hi) / 2))
