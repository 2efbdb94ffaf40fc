"""Memory model: bytes per rank at the backward peak for one layout."""

from __future__ import annotations

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.parallel.memory import expected_state_bytes

__all__ = ["estimate_memory", "stage_params"]


def stage_params(model: TransformerConfig, pp: int) -> float:
    """Parameters of the busiest pipeline stage (layers split evenly; embedding/head on the end stages)."""
    per_layer = (model.num_params(include_embedding=False) - model.hidden_size) / model.num_layers
    layers = -(-model.num_layers // pp)
    embed = model.vocab_size * model.hidden_size
    ends = embed if (pp > 1 or model.tie_word_embeddings) else 2 * embed
    return layers * per_layer + ends


def estimate_memory(model: TransformerConfig, c: ParallelConfig, seq_len: int, num_microbatches: int) -> float:
    """Bytes per rank at the backward peak: model states as this package holds them under ``bf16-mixed``
    (``expected_state_bytes``) + live activations (a 1F1B stage's in-flight micro-batches, or without PP the
    whole per-rank batch of one accumulation step)."""
    tp, pp, cp, dp = c.tensor_parallel_size, c.pipeline_parallel_size, c.context_parallel_size, c.dp
    psi = stage_params(model, pp) / tp
    # ZeRO shards over data x context ranks; during backward stages 1 and 2 both hold the full bf16 gradients.
    states = expected_state_bytes(psi, dp * cp, c.zero_stage, "bf16-mixed", when="backward_peak").total
    s, b, h, a = seq_len / cp, c.micro_batch_size, model.hidden_size, model.num_attention_heads
    if c.sequence_parallel:  # everything is split over TP
        per_layer = s * b * h * (34 + 5 * a * s / h) / tp
    else:  # TP splits attention/MLP insides only; norms and dropouts stay whole (the "10" term)
        per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    if pp > 1:
        live = min(pp, num_microbatches)  # 1F1B keeps at most p micro-batches alive on stage 0
    else:  # no schedule: one forward/backward over the whole per-rank batch of an accumulation step
        live = max(1, num_microbatches // c.gradient_accumulation_steps)
    activations = per_layer * -(-model.num_layers // pp) * live
    return states + activations
