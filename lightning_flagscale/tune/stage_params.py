"""Parameters each pipeline rank holds for one layout, as ``parallel/`` builds them (before data-parallel sharding).

Stages come from ``parallel.pipeline_parallel.plan.plan_stages`` on the decoder's unit names (even split with padding,
``pipeline_layers`` or cost balance), placed on ranks as the schedule places them (looped or V). Per rank: TP splits
attention, dense MLP and the vocabulary (padded to ``vocab_multiple``, as ``CausalLMModule`` pads it); norms are
replicated; routed experts are split over EP (and not over TP: MoE blocks run whole on every TP rank); a tied
embedding split across stages is held on both end stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.schedules import SCHEDULE_SPECS
from lightning_flagscale.parallel.pipeline_parallel.plan import is_layer_unit, plan_stages, stage_ids_for_rank

__all__ = ["RankParams", "decoder_units", "layer_params", "rank_params", "stage_layers"]


def decoder_units(m: TransformerConfig) -> list[str]:
    """The pipeline units of ``models.decoder.CausalLM`` (``pipeline_units()``), without building the model."""
    return ["embed_tokens", *(f"layers.{i}" for i in range(m.num_layers)), "norm", "lm_head"]


def layer_params(m: TransformerConfig, layer: int, *, tp: int = 1, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of decoder layer ``layer`` on one rank; expert ones reduce over the EP-DP group."""
    h, d, q, kv = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_key_value_heads
    attn = (2 * h * q * d + 2 * h * kv * d) / tp + 2 * h  # q, k, v, o split; the two norms replicated
    if m.attention_bias:
        attn += (q * d + 2 * kv * d) / tp
    if m.qk_norm:
        attn += 2 * d
    if not m.is_moe_layer(layer):
        return attn + 3 * h * m.intermediate_size / tp, 0.0
    dense = attn + h * m.num_experts  # router
    if m.num_shared_experts:
        width = m.shared_expert_intermediate_size or m.moe_intermediate_size * m.num_shared_experts
        dense += 3 * h * width + (h if m.shared_expert_gate else 0)
    return dense, m.num_experts / ep * 3 * h * m.moe_intermediate_size


def _unit_costs(m: TransformerConfig, padded_vocab: int) -> dict[str, float]:
    costs = {f"layers.{i}": sum(layer_params(m, i)) for i in range(m.num_layers)}
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


_CACHE: dict[tuple, tuple[RankParams, ...]] = {}
_CACHE_SIZE = 4096


def rank_params(m: TransformerConfig, c: ParallelConfig, *, vocab_multiple: int = 64) -> list[RankParams]:
    """Per pipeline rank, the parameters it holds (see module docstring). Remembered per model and the layout
    fields it depends on: a search asks for the same split thousands of times (ZeRO, micro-batch, recompute, CP)."""
    p = c.pipeline_parallel_size
    placement = SCHEDULE_SPECS[c.pipeline_schedule].placement if p > 1 else "loop"
    layers = tuple(c.pipeline_layers) if c.pipeline_layers is not None else None
    key = (repr(m), c.tensor_parallel_size, c.expert_parallel_size, p, c.virtual_pipeline_parallel_size, layers,
           c.pipeline_balance, placement, vocab_multiple)  # fmt: skip
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = tuple(_rank_params(m, c, placement, vocab_multiple))
    return list(_CACHE[key])


def _rank_params(m: TransformerConfig, c: ParallelConfig, placement: str, vocab_multiple: int) -> list[RankParams]:
    tp, ep, p = c.tensor_parallel_size, c.expert_parallel_size, c.pipeline_parallel_size
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
        if has_first or has_last:
            largest = max(largest, vocab)
        out.append(RankParams(pp_rank=r, stages=tuple(stages), layers=tuple(tuple(layers[s]) for s in stages),
                              dense=dense, expert=expert, largest=largest))  # fmt: skip
    return out
