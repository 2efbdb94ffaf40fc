"""Context parallelism inside Trainer.fit: CP=2 (ring, Ulysses) and CP=2 x TP=2 match the single-process run."""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_matches_reference, assert_rel_close, reference_run, tiny_config, trainer_run

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
        (4, dict(context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True)),
        (4, dict(context_parallel_size=2, zero_stage=1)),
    ],
    ids=["cp2-ring", "cp2-ulysses", "cp2xtp2", "cp2xtp2-sp", "cp2xdp2-zero1"],
)
def test_context_parallel_training_matches_single_process(launcher, reference, world, kwargs):
    results = launcher.shared(world, trainer_run, kwargs, tiny_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, str(kwargs), every_rank_holds_all=True)


def test_checkpoints_do_not_depend_on_the_context_parallel_size(launcher, tmp_path):
    """Save under CP=2, resume under CP=1 x DP=2: no context-parallel state lives in the checkpoint."""
    path = str(tmp_path / "cp2.ckpt")
    launcher(2, trainer_run, dict(context_parallel_size=2), tiny_config(), 3, max_epochs=1, num_samples=12,
             save_path=path)  # fmt: skip
    reference = reference_run(tiny_config(), 6, num_samples=12)
    results = launcher(2, trainer_run, {}, tiny_config(), 6, max_epochs=2, num_samples=12, ckpt_path=path)
    for losses, params in results:
        assert len(losses) == 3
        for got, want in zip(losses, reference[0][3:]):
            assert abs(got - want) <= 1e-5 * abs(want)
        for name, want in reference[1].items():
            assert_rel_close(params[name], want, 1e-5, name)
