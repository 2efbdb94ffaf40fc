"""Context parallelism inside Trainer.fit: CP=2 (ring, Ulysses) and CP=2 x TP=2 match the single-process run."""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(), STEPS, clip=1.0)


@pytest.mark.parametrize(
    "world,kwargs",
    [
        (2, dict(context_parallel_size=2, context_parallel_mode="ring")),
        (2, dict(context_parallel_size=2, context_parallel_mode="ulysses")),
        (4, dict(context_parallel_size=2, tensor_parallel_size=2)),
        (4, dict(context_parallel_size=2, zero_stage=1)),
    ],
    ids=["cp2-ring", "cp2-ulysses", "cp2xtp2", "cp2xdp2-zero1"],
)
def test_context_parallel_training_matches_single_process(launcher, reference, world, kwargs):
    results = launcher(world, trainer_run, kwargs, tiny_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, str(kwargs), every_rank_holds_all=True)
