"""Auto-tuning: the search space is valid, memory pruning holds, and the model's orderings follow theory."""

from __future__ import annotations

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.tune import Hardware, estimate_memory, search

MODEL = TransformerConfig.from_preset("llama3-8b")


def _layout(**kwargs) -> ParallelConfig:
    return ParallelConfig(**kwargs).resolve(64)


def test_zero_stages_and_sequence_parallel_lower_memory_as_theory_says():
    by_stage = [estimate_memory(MODEL, _layout(tensor_parallel_size=4, zero_stage=z), 4096, 8) for z in range(4)]
    assert by_stage == sorted(by_stage, reverse=True) and len(set(by_stage)) == 4
    psi = MODEL.num_params() / 4  # TP=4 splits every parameter (embeddings included, vocab-parallel)
    dp = 16
    saved_by_zero1 = by_stage[0] - by_stage[1]
    assert abs(saved_by_zero1 - 12 * psi * (1 - 1 / dp)) / (12 * psi) < 0.05  # optimizer states (12 bytes/param)
    no_sp = estimate_memory(MODEL, _layout(tensor_parallel_size=4), 4096, 8)
    with_sp = estimate_memory(MODEL, _layout(tensor_parallel_size=4, sequence_parallel=True), 4096, 8)
    assert with_sp < no_sp


def test_search_returns_valid_layouts_within_the_memory_budget():
    hw = Hardware(memory_bytes=40e9)
    best, considered = search(MODEL, 64, seq_len=4096, global_batch=256, hardware=hw, top_k=20)
    assert considered > 100 and 0 < len(best) <= 20
    for cand in best:
        assert cand.memory_bytes <= 40e9
        assert cand.config.world_size == 64
        cand.config.validate_model(MODEL)  # raises if the layout cannot split this model
    assert [c.step_seconds for c in best] == sorted(c.step_seconds for c in best)


def test_nothing_fits_in_a_tiny_budget():
    best, considered = search(MODEL, 8, seq_len=4096, global_batch=64, hardware=Hardware(memory_bytes=1e9))
    assert best == [] and considered > 0
