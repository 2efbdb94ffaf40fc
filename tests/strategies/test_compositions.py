"""Compositions beyond the basic layouts: accumulation, recompute, PP x ZeRO-3, CP x PP, CP with ragged labels."""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_rel_close, reference_run, tiny_config, trainer_run

STEPS = 3


def _check(results, ref_losses, ref_params, what, losses_per_step=1):
    for rank, (losses, params) in enumerate(results):
        assert len(losses) == STEPS * losses_per_step
        for step, want in enumerate(ref_losses):
            # Lightning reports each accumulated batch's loss already divided by the accumulation count.
            got = sum(losses[step * losses_per_step : (step + 1) * losses_per_step])
            assert abs(got - want) <= 1e-5 * abs(want), f"{what} rank {rank} step {step}: loss {got} != {want}"
        for name, value in params.items():
            assert_rel_close(value, ref_params[name], 1e-5, f"{what} rank {rank} {name}")


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_gradient_accumulation_with_zero_and_recompute(launcher, zero_stage):
    # Two accumulated batches of 4 per optimizer step = one batch of 8 in the single-process run.
    ref_losses, ref_params = reference_run(tiny_config(), STEPS, clip=1.0, global_batch=8)
    kwargs = dict(zero_stage=zero_stage, gradient_accumulation_steps=2, recompute="selective")
    results = launcher(2, trainer_run, kwargs, tiny_config(), STEPS, clip=1.0)
    _check(results, ref_losses, ref_params, f"zero{zero_stage}+accumulation", losses_per_step=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pipeline_parallel_size=2, zero_stage=3, micro_batch_size=1, recompute="full"),
        dict(pipeline_parallel_size=2, context_parallel_size=2, micro_batch_size=1),
    ],
    ids=["pp2xzero3-recompute", "pp2xcp2"],
)
def test_pipeline_compositions(launcher, kwargs):
    ref_losses, ref_params = reference_run(tiny_config(num_layers=4), STEPS, clip=1.0)
    results = launcher(4, trainer_run, kwargs, tiny_config(num_layers=4), STEPS, clip=1.0)
    _check(results, ref_losses, ref_params, str(kwargs))


def test_context_parallel_weights_ragged_labels_by_tokens(launcher):
    """Ignored labels fall unevenly across CP slices: the loss must still be the token mean of whole sequences."""
    ref_losses, ref_params = reference_run(tiny_config(), STEPS, clip=1.0, ragged=True)
    results = launcher(2, trainer_run, dict(context_parallel_size=2), tiny_config(), STEPS, clip=1.0, ragged=True)
    _check(results, ref_losses, ref_params, "cp2-ragged")
