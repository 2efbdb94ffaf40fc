"""``torch_compile=True`` (``parallel/compile.py``) trains like the eager single-process run, keeps parameter names,
and is refused where it is not applied; AdamW runs fused on CUDA parameters (``models/lightning.py::adamw_impl``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.models import CausalLM
from lightning_flagscale.models.lightning import adamw_impl
from lightning_flagscale.parallel.compile import apply_compile
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3


LAYOUTS = {
    # ZeRO-1 (fp32 masters in flat buckets, gradient hooks on the compiled blocks' parameters) and selective recompute
    # (its op policy traced by the compiler)
    "zero1-selective": dict(zero_stage=1, recompute="selective"),
    # ring attention inside the compiled blocks, FSDP2 units around them (compiled before sharding), full recompute
    "cp2-fsdp2-full": dict(context_parallel_size=2, zero_stage=3, zero3_impl="fsdp2", recompute="full"),
    # each stage's blocks compiled, the loss on the last stage, the 1F1B schedule around them
    "pp2-1f1b-selective": dict(pipeline_parallel_size=2, micro_batch_size=1, recompute="selective"),
    # DTensor styles inside the compiled blocks; the vocab-parallel embedding's all-reduce (reduce-scatter under SP)
    # waited before the first block (WaitedRowwiseParallel: as an AsyncCollectiveTensor it lost its gradient path)
    # under full recompute the TP block's checkpoint stays eager around its compiled body (compile.py::_compile_block)
    "tp2-full": dict(tensor_parallel_size=2, recompute="full"),
    "tp2-sp": dict(tensor_parallel_size=2, sequence_parallel=True),
}


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(), STEPS, clip=1.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_blocks_and_loss_train_like_the_eager_single_process_run(launcher, reference, layout):
    # on ragged labels with plain SGD and clipping: weights and losses after 3 steps = the eager one-process run
    kwargs = dict(LAYOUTS[layout], torch_compile=True)
    results = launcher.shared(2, trainer_run, kwargs, tiny_config(), STEPS, clip=1.0)
    whole = "pipeline_parallel_size" not in LAYOUTS[layout]  # a pipeline rank holds its stage's parameters
    assert_matches_reference(results, reference, f"{layout}-compile", every_rank_holds_all=whole)


def test_compile_keeps_parameter_names_and_compiles_once():
    model = CausalLM(tiny_config())
    names = list(model.state_dict())
    apply_compile(model)
    assert list(model.state_dict()) == names
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
    assert hasattr(model.loss_fn, "_torchdynamo_orig_callable")
    with pytest.raises(ValueError, match="already compiled"):
        apply_compile(model)


@pytest.mark.parametrize(
    "layout",
    [
        dict(pipeline_parallel_size=2, pipeline_schedule="zbv"),
        dict(hetero_meshes=[{"tensor_parallel_size": 1}, {"tensor_parallel_size": 1}]),
    ],
)
def test_compile_is_refused_where_it_is_not_supported(layout):
    with pytest.raises(ValueError, match="torch_compile=True"):
        ParallelConfig(torch_compile=True, **layout).resolve(2)


def test_compile_refuses_moe_models_before_start():
    config = tiny_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="not supported for MoE models"):  # the launcher's check (validate_layout)
        ParallelConfig(torch_compile=True).resolve(1).validate_model(config)
    ParallelConfig().resolve(1).validate_model(config)
    with pytest.raises(ValueError, match="not supported for MoE models"):  # and the plan's, for models built otherwise
        apply_compile(CausalLM(config))


def test_adamw_is_fused_on_cuda_parameters_only():
    def groups(*devices):
        return [{"params": [SimpleNamespace(device=torch.device(d)) for d in devices]}]

    assert adamw_impl(groups("cuda", "cuda")) == {"fused": True}
    assert adamw_impl(groups("cpu")) == {}
    assert adamw_impl(groups("cuda", "cpu")) == {}
