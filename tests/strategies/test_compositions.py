"""Compositions beyond the basic layouts: accumulation, recompute, PP x ZeRO-3, CP x PP, CP with ragged labels."""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_gradient_accumulation_with_zero_and_recompute(launcher, zero_stage):
    # Two accumulated batches of 4 per optimizer step = one batch of 8 in the single-process run.
    reference = reference_run(tiny_config(), STEPS, clip=1.0, global_batch=8)
    kwargs = dict(zero_stage=zero_stage, gradient_accumulation_steps=2, recompute="selective")
    results = launcher(2, trainer_run, kwargs, tiny_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, f"zero{zero_stage}+accumulation", losses_per_step=2)


def test_every_other_matmul_recompute_under_tensor_and_sequence_parallel(launcher):
    # selective_mm counts the block's matmuls as the recompute sees them: under TP + SP they are DTensor ops with
    # all-gathers and reduce-scatters between them; the cached and recomputed outputs must still line up. With QK-norm
    # (Qwen3): its weights on the TP rank's heads, like the norms on sequence shards, plain tensors summed over TP by
    # the step's gradient reduction (tensor_parallel/partial_grads.py), recomputed too.
    kwargs = dict(tensor_parallel_size=2, sequence_parallel=True, recompute="selective_mm")
    config = tiny_config(qk_norm=True)
    results = launcher(2, trainer_run, kwargs, config, STEPS, clip=1.0, ragged=True)
    reference = reference_run(config, STEPS, clip=1.0, ragged=True)
    assert_matches_reference(results, reference, "tp2-sp-selective_mm", every_rank_holds_all=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pipeline_parallel_size=2, zero_stage=3, micro_batch_size=1, recompute="full"),
        dict(pipeline_parallel_size=2, context_parallel_size=2, micro_batch_size=1),
    ],
    ids=["pp2xzero3-recompute", "pp2xcp2"],
)
def test_pipeline_compositions(launcher, kwargs):
    results = launcher(4, trainer_run, kwargs, tiny_config(num_layers=4), STEPS, clip=1.0)
    assert_matches_reference(results, reference_run(tiny_config(num_layers=4), STEPS, clip=1.0), str(kwargs))


def test_context_parallel_weights_ragged_labels_by_tokens(launcher):
    """Ignored labels fall unevenly across CP slices: the loss must still be the token mean of whole sequences."""
    reference = reference_run(tiny_config(), STEPS, clip=1.0, ragged=True)
    results = launcher.shared(2, trainer_run, dict(context_parallel_size=2), tiny_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, "cp2-ragged", every_rank_holds_all=True)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_data_parallel_weights_ragged_labels_by_tokens(launcher, zero_stage):
    """Samples with different numbers of target tokens: the loss is the global token mean, as in one process."""
    reference = reference_run(tiny_config(), STEPS, clip=1.0, ragged=True)
    results = launcher.shared(2, trainer_run, dict(zero_stage=zero_stage), tiny_config(), STEPS, clip=1.0, ragged=True)
    assert_matches_reference(results, reference, f"dp2-ragged-zero{zero_stage}", every_rank_holds_all=True)
