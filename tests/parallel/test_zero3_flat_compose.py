"""Flat ZeRO-3 composed with pipeline parallelism, expert parallelism and activation recompute: parity with one
process (Trainer-level oracle of ``tests/strategies/_lm.py``: SGD lr 0.5, 3 steps, weights and per-step gradient
norms within 1e-5), as FSDP2's ZeRO-3 is tested in ``tests/strategies/test_compositions.py`` / ``test_expert_loop.py``.
"""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run
from tests.strategies.test_expert_loop import moe_config

STEPS = 3
FLAT = dict(zero_stage=3, zero3_impl="flat")


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_flat_zero3_with_recompute(launcher, recompute):
    # The recomputed forward runs inside backward: it must read the unit's re-gathered parameters.
    reference = reference_run(tiny_config(), STEPS, clip=1.0, ragged=True)
    results = launcher(2, trainer_run, dict(FLAT, recompute=recompute), tiny_config(), STEPS, clip=1.0, ragged=True)
    assert_matches_reference(results, reference, f"flat x recompute={recompute}", every_rank_holds_all=True)


def test_flat_zero3_inside_pipeline_stages(launcher):
    # PP=2 x DP=2 (1F1B, 2 micro-batches per rank): per-stage units, one reduce-scatter per unit after the stage's
    # last backward; tied embeddings: the embedding and LM-head copies are units of their own on the end stages.
    config = tiny_config(num_layers=4, tie_word_embeddings=True)
    kwargs = dict(FLAT, pipeline_parallel_size=2, micro_batch_size=1, recompute="full")
    results = launcher(4, trainer_run, kwargs, config, STEPS, clip=1.0, ragged=True)
    reference = reference_run(config, STEPS, clip=1.0, ragged=True)
    assert_matches_reference(results, reference, "pp2 x flat", rename={"lm_head.weight": "embed_tokens.weight"})


def test_flat_zero3_with_expert_parallel(launcher):
    # DP=4 x EP=2: expert units sharded over the expert-data-parallel pairs, the rest over all four ranks.
    reference = reference_run(moe_config(), STEPS, clip=1.0, ragged=True)
    results = launcher(4, trainer_run, dict(FLAT, expert_parallel_size=2), moe_config(), STEPS, clip=1.0, ragged=True)
    assert_matches_reference(results, reference, "ep2 x flat", every_rank_holds_all=True)
