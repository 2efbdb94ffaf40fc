"""``ParallelConfig`` is four typed groups (issue 38 item 2): sizes, data-parallel settings (Megatron's
``DistributedDataParallelConfig``), pipeline settings and heterogeneous training. Each group validates its own
fields on its own; ``ParallelConfig`` adds the rules that tie groups together and hands each group out as a view."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_flagscale.config.parallel import (
    DataParallelConfig,
    HeteroConfig,
    ParallelConfig,
    ParallelSizes,
    PipelineConfig,
)

GROUPS = (ParallelSizes, DataParallelConfig, PipelineConfig, HeteroConfig)


def test_the_groups_partition_the_config_fields():
    names = [f.name for g in GROUPS for f in dataclasses.fields(g)]
    assert len(names) == len(set(names))
    assert set(names) == {f.name for f in dataclasses.fields(ParallelConfig)}


def test_each_group_is_a_view_of_the_resolved_config():
    c = ParallelConfig(tensor_parallel_size=2, zero_stage=1, grad_bucket_numel=1000, pipeline_parallel_size=2,
                       pipeline_schedule="zbv", recompute="full").resolve(8)  # fmt: skip
    assert c.sizes == ParallelSizes(tensor_parallel_size=2, pipeline_parallel_size=2, virtual_pipeline_parallel_size=2,
                                    data_parallel_size=2)  # fmt: skip
    assert c.data == DataParallelConfig(zero_stage=1, grad_bucket_numel=1000)
    assert c.pipeline == PipelineConfig(pipeline_schedule="zbv", recompute="full")
    assert c.hetero == HeteroConfig()


@pytest.mark.parametrize(
    ("group", "kwargs", "match"),
    [
        (ParallelSizes, dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (ParallelSizes, dict(context_parallel_size=4, context_parallel_mode="hybrid", ulysses_size=3), "must divide"),
        (ParallelSizes, dict(expert_tensor_parallel_size=0), "expert_tensor_parallel_size must be a positive integer"),
        (DataParallelConfig, dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
        (DataParallelConfig, dict(grad_bucket_numel=0), "grad_bucket_numel=0 must be a positive"),
        (DataParallelConfig, dict(overlap_param_gather=True), "zero_stage=0 has none to overlap"),
        (PipelineConfig, dict(micro_batch_size=0), "micro_batch_size must be a positive integer"),
        (PipelineConfig, dict(recompute="some"), "use 'none', 'selective'"),
        (HeteroConfig, dict(hetero_layers=[1, 1]), "hetero_layers needs hetero_meshes"),
        (HeteroConfig, dict(hetero_dp_batch_sizes="fast"), "give a list of per-rank batch sizes or 'auto'"),
    ],
)
def test_each_group_refuses_its_own_bad_values_alone_and_in_the_config(group, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group(**kwargs)
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_the_data_parallel_group_reaches_the_strategy():
    from lightning_flagscale import FlagScaleStrategy

    strategy = FlagScaleStrategy(zero_stage=2, grad_bucket_numel=1234, overlap_grad_reduce=False)
    assert strategy.parallel.data == DataParallelConfig(zero_stage=2, grad_bucket_numel=1234, overlap_grad_reduce=False)
