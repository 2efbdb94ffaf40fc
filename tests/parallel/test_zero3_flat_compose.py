"""Flat ZeRO-3 composed with pipeline parallelism, expert parallelism and activation recompute: parity with one
process (Trainer-level oracle of ``tests/strategies/_lm.py``: SGD lr 0.5, 3 steps, ragged labels, weights and
per-step gradient norms within 1e-5), as FSDP2's ZeRO-3 is tested in ``tests/strategies/test_compositions.py`` and
``test_expert_loop.py``. Each test composes two features to keep the file cheap (world 4, ~40 s each).
"""

from __future__ import annotations

from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run
from tests.strategies.test_expert_loop import moe_config

STEPS = 3
FLAT = dict(zero_stage=3, zero3_impl="flat")


def test_flat_zero3_inside_pipeline_stages_with_full_recompute(launcher):
    # PP=2 x DP=2 (1F1B, 2 micro-batches per rank): per-stage units, one reduce-scatter per unit after the stage's
    # last backward; tied embeddings: the embedding and LM-head copies are units of their own on the end stages.
    # Full recompute: the blocks' forward re-runs inside backward and must read the re-gathered parameters.
    config = tiny_config(num_layers=4, tie_word_embeddings=True)
    kwargs = dict(FLAT, pipeline_parallel_size=2, micro_batch_size=1, recompute="full")
    results = launcher(4, trainer_run, kwargs, config, STEPS, clip=1.0, ragged=True)
    reference = reference_run(config, STEPS, clip=1.0, ragged=True)
    assert_matches_reference(results, reference, "pp2 x flat", rename={"lm_head.weight": "embed_tokens.weight"})


def test_flat_zero3_with_expert_parallel_and_selective_recompute(launcher):
    # DP=4 x EP=2: expert units sharded over the expert-data-parallel pairs, the rest over all four ranks.
    # Selective recompute of the blocks re-runs the nested expert units' forward hooks inside backward.
    reference = reference_run(moe_config(), STEPS, clip=1.0, ragged=True)
    kwargs = dict(FLAT, expert_parallel_size=2, recompute="selective")
    results = launcher(4, trainer_run, kwargs, moe_config(), STEPS, clip=1.0, ragged=True)
    assert_matches_reference(results, reference, "ep2 x flat x selective", every_rank_holds_all=True)


def test_flat_zero3_expert_checkpoint_reshards_to_fsdp2(launcher, tmp_path):
    # Expert units write FSDP2's layout for experts: Shard(0) over edp on top of the ep shards.
    from tests.parallel._zero3_flat_hops import STEPS_PER_HOP, run_hops

    ep = dict(expert_parallel_size=2, zero_stage=3)
    out = run_hops(launcher, tmp_path, [dict(ep, zero3_impl="flat"), dict(ep, zero3_impl="fsdp2")], 4, moe_config())
    assert out.steps_per_hop == [{STEPS_PER_HOP}] * len(out.steps_per_hop), out.steps_per_hop  # resumed, not restarted
    assert out.rel_error <= 1e-5, f"{out.worst}: relative error {out.rel_error:.3e} against one process"
