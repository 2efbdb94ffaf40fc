"""Pipeline parallelism inside Trainer.fit: the unchanged training_step matches the single-process run."""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_rel_close, reference_run, tiny_config, trainer_run

STEPS = 3


def _check(results, reference, what):
    ref_losses, ref_params = reference
    for rank, (losses, params) in enumerate(results):
        assert len(losses) == STEPS
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{what} rank {rank} step {step}: loss {got} != {want}"
        for name, value in params.items():  # each rank holds (and returns) only its own stages' parameters
            assert_rel_close(value, ref_params[name], 1e-5, f"{what} rank {rank} {name}")
    held = set().union(*(params.keys() for _, params in results))
    assert held == set(ref_params), "every parameter lives on some pipeline rank"


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(num_layers=4), STEPS, clip=1.0)


@pytest.fixture(scope="module")
def tied_reference():
    return reference_run(tiny_config(num_layers=4, tie_word_embeddings=True), STEPS, clip=1.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"])
def test_schedules_in_the_lightning_loop(launcher, reference, schedule):
    vpp = 1 if schedule in ("gpipe", "1f1b") else 2
    kwargs = dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=vpp, pipeline_schedule=schedule,
                  micro_batch_size=1)  # fmt: skip
    _check(launcher(2, trainer_run, kwargs, tiny_config(num_layers=4), STEPS, clip=1.0), reference, schedule)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pipeline_parallel_size=2, tensor_parallel_size=2, micro_batch_size=2),
        dict(pipeline_parallel_size=2, zero_stage=1, micro_batch_size=1),
    ],
    ids=["pp2xtp2", "pp2xdp2-zero1"],
)
def test_pipeline_composes_with_tp_and_zero(launcher, reference, kwargs):
    _check(launcher(4, trainer_run, kwargs, tiny_config(num_layers=4), STEPS, clip=1.0), reference, str(kwargs))


def test_tied_embeddings_across_first_and_last_stage(launcher, tied_reference):
    kwargs = dict(pipeline_parallel_size=2, micro_batch_size=1, pipeline_layers=[3, 1])
    results = launcher(2, trainer_run, kwargs, tiny_config(num_layers=4, tie_word_embeddings=True), STEPS, clip=1.0)
    ref_losses, ref_params = tied_reference
    # The last stage's LM head is the tied embedding: compare it against the reference embedding.
    for losses, params in results:
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
        for name, value in params.items():
            ref_name = "embed_tokens.weight" if name == "lm_head.weight" else name
            assert_rel_close(value, ref_params[ref_name], 1e-5, name)
