"""Expert parallelism inside Trainer.fit: dropless MoE training matches the single-process run."""

from __future__ import annotations

import pytest

from lightning_flagscale.config import TransformerConfig
from tests.strategies._lm import assert_matches_reference, reference_run, trainer_run

STEPS = 3


def moe_config() -> TransformerConfig:
    return TransformerConfig.from_preset(
        "mixtral-tiny", num_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_aux_loss_coeff=0.0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return reference_run(moe_config(), STEPS, clip=1.0)


@pytest.mark.parametrize(
    "world,kwargs",
    [
        (2, dict(expert_parallel_size=2)),
        (2, dict(expert_parallel_size=2, zero_stage=1)),
        (4, dict(expert_parallel_size=2, tensor_parallel_size=2)),
        (4, dict(expert_parallel_size=4, zero_stage=1)),
    ],
    ids=["ep2", "ep2-zero1", "ep2xtp2", "ep4-zero1"],
)
def test_expert_parallel_training_matches_single_process(launcher, reference, world, kwargs):
    results = launcher(world, trainer_run, kwargs, moe_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, str(kwargs), every_rank_holds_all=True)


def test_expert_parallel_inside_pipeline_stages(launcher):
    kwargs = dict(pipeline_parallel_size=2, expert_parallel_size=2, micro_batch_size=1, zero_stage=1)
    results = launcher(4, trainer_run, kwargs, moe_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference_run(moe_config(), STEPS, clip=1.0), "pp2 x ep2")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tensor_parallel_size=2, sequence_parallel=True),
        dict(tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2),
    ],
    ids=["tp2-sp", "tp2-sp-ep2"],
)
def test_moe_under_sequence_parallel(launcher, reference, kwargs):
    world = 2 if "expert_parallel_size" not in kwargs else 4
    results = launcher(world, trainer_run, kwargs, moe_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, str(kwargs), every_rank_holds_all=True)


def test_expert_parallel_with_zero3(launcher, reference):
    # Experts: FSDP2 over edp on the expert mesh; the rest: FSDP2 over dp x cp.
    results = launcher(4, trainer_run, dict(expert_parallel_size=2, zero_stage=3), moe_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, "ep2 x zero3", every_rank_holds_all=True)
