"""Parameters each pipeline rank holds for one layout, as ``parallel/`` builds them (before data-parallel sharding).

Stages come from ``parallel.pipeline_parallel.plan.plan_stages`` on the decoder's unit names (even split with padding,
``pipeline_layers`` or cost balance), placed on ranks as the schedule places them (looped or V). Per rank: TP splits
attention, dense MLP and the vocabulary (padded to ``vocab_multiple``, as ``CausalLMModule`` pads it); norms are
replicated; routed experts are split over EP (and not over TP: MoE blocks run whole on every TP rank); a tied
embedding split across stages is held on both end stages.

Multi-head latent attention (``models/attention.py`` ``LatentAttention``, TP plan ``latent_attention_tp_plan``): the
down projections ``q_a_proj`` and ``kv_a_proj_with_mqa`` and their RMSNorms are replicated over TP, ``q_proj`` /
``q_b_proj`` / ``kv_b_proj`` column-parallel and ``o_proj`` row-parallel (heads split). Blocks before
``first_k_dense_layers`` keep a dense MLP. Multi-token prediction (``models/decoder.py`` ``MTPLayer``): each of the
``num_nextn_predict_layers`` modules is one block (its index after the main layers decides dense or MoE), ``enorm``,
``hnorm``, its own final norm and ``eh_proj`` (2h -> h, replicated over TP); they form the ``mtp`` pipeline unit,
which travels with the LM head to the last stage, where a copy of the embedding they share is held when the first
stage is elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.schedules import SCHEDULE_SPECS
from lightning_flagscale.parallel.pipeline_parallel.plan import is_layer_unit, plan_stages, stage_ids_for_rank
from lightning_flagscale.tune.moe_cost import chunk_summed_params

__all__ = [
    "RankParams",
    "attention_tensors",
    "decoder_units",
    "layer_params",
    "mtp_params",
    "rank_params",
    "stage_layers",
    "stage_reduced_params",
]


def decoder_units(m: TransformerConfig) -> list[str]:
    """The pipeline units of ``models.decoder.CausalLM`` (``pipeline_units()``), without building the model."""
    units = ["embed_tokens", *(f"layers.{i}" for i in range(m.num_layers)), "norm", "lm_head"]
    return [*units, "mtp"] if m.num_nextn_predict_layers else units


def attention_tensors(m: TransformerConfig, tp: int = 1) -> list[float]:
    """Elements on one TP rank of each parameter of one attention module, in registration order."""
    h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
    bias = m.attention_bias
    if not m.is_mla:
        kv = m.num_key_value_heads
        out: list[float] = []
        for width in (n * d, kv * d, kv * d):  # q, k, v: column-parallel (weight and bias split)
            out += [h * width / tp] + ([width / tp] if bias else [])
        out.append(n * d * h / tp)  # o: row-parallel
        return out + ([d, d] if m.qk_norm else [])  # QK-norm weights: replicated
    r, rope, v = m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank is None:
        out = [h * n * d / tp]  # q_proj: column-parallel
    else:  # q_a_proj (+ bias) and q_a_layernorm replicated, q_b_proj column-parallel
        q = m.q_lora_rank
        out = [h * q, *([q] if bias else []), q, q * n * d / tp]
    out += [h * (r + rope), *([r + rope] if bias else []), r]  # kv_a_proj_with_mqa (+ bias), kv_a_layernorm
    out += [r * n * (m.qk_nope_head_dim + v) / tp, n * v * h / tp]  # kv_b_proj column-, o_proj row-parallel
    return out + ([h] if bias else [])  # o_proj's bias is replicated (row-parallel)


def layer_params(m: TransformerConfig, layer: int, *, tp: int = 1, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of decoder layer ``layer`` on one rank; expert ones reduce over the EP-DP group.
    ``ep``: the ranks splitting the routed experts (ep x etp under expert tensor parallelism).
    ``layer >= num_layers`` is an MTP module's block (dense or MoE by the same rule)."""
    h = m.hidden_size
    attn = sum(attention_tensors(m, tp)) + 2 * h  # the two block norms replicated
    if not m.is_moe_layer(layer):
        return attn + 3 * h * m.intermediate_size / tp, 0.0
    dense = attn + h * m.num_experts  # router
    if m.num_shared_experts:
        width = m.shared_expert_intermediate_size or m.moe_intermediate_size * m.num_shared_experts
        dense += 3 * h * width + (h if m.shared_expert_gate else 0)
    return dense, m.num_experts / ep * 3 * h * m.moe_intermediate_size


def mtp_params(m: TransformerConfig, *, tp: int = 1, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of all MTP modules on one rank (without the shared embedding): per module its
    block, ``enorm``, ``hnorm``, its final norm and ``eh_proj`` (2h -> h), the last four replicated over TP."""
    dense = expert = 0.0
    for k in range(m.num_nextn_predict_layers):
        d, e = layer_params(m, m.num_layers + k, tp=tp, ep=ep)
        dense, expert = dense + d + 3 * m.hidden_size + 2 * m.hidden_size**2, expert + e
    return dense, expert


def stage_reduced_params(m: TransformerConfig, c: ParallelConfig, layers: list[int], *, last_stage: bool) -> float:
    """Elements of the weights one rank holding decoder ``layers`` (and, ``last_stage``, the final norm and the MTP
    modules) reduces over its stage's dp x cp x tp ranks, their TP sum inside the data-parallel reduction
    (``"dp_cp_tp"``: ``tag_tp_partial_params``, ``tag_chunk_routed_params``): under TP the norms on sequence shards
    (SP: the block norms, the final norm, MTP's ``enorm`` / ``hnorm`` / ``eh_proj`` / norm) and QK-norm on head
    shards, and the chunk-routed MoE weights (``tune.moe_cost.chunk_summed_params``)."""
    if not c.tp_enabled:
        return 0.0
    h, sp = m.hidden_size, c.sequence_parallel
    per_block = (2 * h if sp else 0) + (2 * m.head_dim if m.qk_norm and not m.is_mla else 0)
    moe = chunk_summed_params(m, c)

    def block(i: int) -> float:
        return per_block + (moe if m.is_moe_layer(i) else 0.0)

    total = sum(block(i) for i in layers)
    if last_stage:
        mtp = range(m.num_layers, m.num_layers + m.num_nextn_predict_layers)
        total += (h if sp else 0) + sum(block(i) + (3 * h + 2 * h * h if sp else 0) for i in mtp)
    return total


def _unit_costs(m: TransformerConfig, padded_vocab: int) -> dict[str, float]:
    costs = {f"layers.{i}": sum(layer_params(m, i)) for i in range(m.num_layers)}
    if m.num_nextn_predict_layers:
        costs["mtp"] = sum(mtp_params(m))
    return {**costs, "embed_tokens": padded_vocab * m.hidden_size, "norm": m.hidden_size,
            "lm_head": padded_vocab * m.hidden_size}  # fmt: skip


def stage_layers(m: TransformerConfig, c: ParallelConfig, *, vocab_multiple: int = 64) -> list[list[int]]:
    """Decoder-layer indices of every global stage (``pp x vpp`` of them; one stage without PP)."""
    units = decoder_units(m)
    plan = plan_stages(
        units, c.pipeline_parallel_size, c.virtual_pipeline_parallel_size, pipeline_layers=c.pipeline_layers,
        balance=c.pipeline_balance, unit_costs=_unit_costs(m, m.padded_vocab_size(vocab_multiple)),
    )  # fmt: skip
    return [[int(u.rpartition(".")[2]) for u in stage if is_layer_unit(u)] for stage in plan.units]


@dataclass(frozen=True, kw_only=True)
class RankParams:
    """What one pipeline rank holds (every TP/CP/DP rank of that pipeline rank holds the same amount)."""

    pp_rank: int
    stages: tuple[int, ...]
    """Global stage indices on this rank."""
    layers: tuple[tuple[int, ...], ...]
    """Decoder layers of each of those stages."""
    dense: float
    """Parameters reduced/sharded over the data x context ranks."""
    expert: float
    """Routed-expert parameters reduced/sharded over the expert-data-parallel ranks."""
    largest: float
    """The largest single parameter (local shard): the biggest gradient autograd materialises at once."""
    frozen: float = 0.0
    """Parameters held without gradient or optimizer state (LoRA's base; ``dense`` then counts the adapters)."""


_CACHE: dict[tuple, tuple[RankParams, ...]] = {}
_CACHE_SIZE = 4096


def rank_params(m: TransformerConfig, c: ParallelConfig, *, vocab_multiple: int = 64) -> list[RankParams]:
    """Per pipeline rank, the parameters it holds (see module docstring). Remembered per model and the layout
    fields it depends on: a search asks for the same split thousands of times (ZeRO, micro-batch, recompute, CP)."""
    p = c.pipeline_parallel_size
    placement = SCHEDULE_SPECS[c.pipeline_schedule].placement if p > 1 else "loop"
    layers = tuple(c.pipeline_layers) if c.pipeline_layers is not None else None
    key = (repr(m), c.tensor_parallel_size, c.expert_shards, p, c.virtual_pipeline_parallel_size, layers,
           c.pipeline_balance, placement, vocab_multiple)  # fmt: skip
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = tuple(_rank_params(m, c, placement, vocab_multiple))
    return list(_CACHE[key])


def _rank_params(m: TransformerConfig, c: ParallelConfig, placement: str, vocab_multiple: int) -> list[RankParams]:
    tp, ep, p = c.tensor_parallel_size, c.expert_shards, c.pipeline_parallel_size  # experts: ep x etp shards
    layers = stage_layers(m, c, vocab_multiple=vocab_multiple)
    n = len(layers)
    vocab = m.padded_vocab_size(vocab_multiple) * m.hidden_size / tp
    out = []
    for r in range(p):
        stages = stage_ids_for_rank(r, p, n, placement)
        dense = expert = 0.0
        largest = 0.0
        for s in stages:
            for i in layers[s]:
                d, e = layer_params(m, i, tp=tp, ep=ep)
                dense, expert = dense + d, expert + e
                largest = max(largest, m.hidden_size * m.intermediate_size / tp)  # gate/up/down
        has_first, has_last = 0 in stages, n - 1 in stages
        if has_first:
            dense += vocab
        if has_last:
            dense += m.hidden_size + (0 if (m.tie_word_embeddings and has_first) else vocab)
            if m.num_nextn_predict_layers:  # the MTP modules, and their copy of the embedding away from stage 0
                d, e = mtp_params(m, tp=tp, ep=ep)
                dense, expert = dense + d + (0 if has_first else vocab), expert + e
                largest = max(largest, 2 * m.hidden_size**2)
        if has_first or has_last:
            largest = max(largest, vocab)
        out.append(RankParams(pp_rank=r, stages=tuple(stages), layers=tuple(tuple(layers[s]) for s in stages),
                              dense=dense, expert=expert, largest=largest))  # fmt: skip
    return out
