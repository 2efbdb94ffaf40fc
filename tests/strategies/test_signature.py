"""``FlagScaleStrategy.__init__`` spells out ``ParallelConfig``'s fields (LightningCLI reads the explicit signature):
both lists must name the same fields with the same defaults and types, and every one must reach the config."""

from __future__ import annotations

import dataclasses
import inspect
import typing

from lightning_flagscale import FlagScaleStrategy, ParallelConfig

# Keyword arguments of the strategy that are not part of the parallel layout.
NON_LAYOUT_KWARGS = {
    "parallel",
    "resume",
    "nan_policy",
    "skip_spiky_loss",
    "watchdog_timeout",
    "process_group_backend",
    "timeout",
    "async_checkpoint",
}

# A valid non-default value for every ParallelConfig field: a new field must be added here (and to the strategy).
NON_DEFAULTS = dict(
    tensor_parallel_size=2, pipeline_parallel_size=2, virtual_pipeline_parallel_size=2, context_parallel_size=4,
    context_parallel_mode="hybrid", ulysses_size=2, expert_parallel_size=2, expert_tensor_parallel_size=2,
    data_parallel_size=3, zero_stage=1, sequence_parallel=True, micro_batch_size=2, gradient_accumulation_steps=2,
    pipeline_schedule="interleaved_1f1b", pipeline_layers=[1, 2, 1, 2], hetero_dp_batch_sizes=[1, 2, 3],
    pipeline_balance="cost", recompute="full", zero3_impl="flat", grad_bucket_numel=1000, overlap_grad_reduce=False,
    overlap_param_gather=True,
)  # fmt: skip


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(ParallelConfig) if f.init}


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def test_strategy_kwargs_are_the_config_fields_plus_the_listed_extras():
    params = dict(inspect.signature(FlagScaleStrategy.__init__).parameters)
    params.pop("self")
    assert set(params) - NON_LAYOUT_KWARGS == set(_fields()), "FlagScaleStrategy.__init__ and ParallelConfig drifted"
    assert set(params) >= NON_LAYOUT_KWARGS, "update NON_LAYOUT_KWARGS"
    strategy_hints = typing.get_type_hints(FlagScaleStrategy.__init__)
    config_hints = typing.get_type_hints(ParallelConfig)
    for name, field in _fields().items():
        param = params[name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert param.default == _default(field), (name, param.default, _default(field))
        assert strategy_hints[name] == config_hints[name], (name, strategy_hints[name], config_hints[name])


# Fields tested apart: heterogeneous meshes exclude the global sizes.
HETERO_NON_DEFAULTS = dict(
    hetero_meshes=[dict(tensor_parallel_size=2), dict(data_parallel_size=2)], hetero_layers=[1, 1]
)
HETERO_SPEED = dict(
    hetero_meshes=[dict(tensor_parallel_size=2, device_type="a"), dict(data_parallel_size=2, device_type="b")],
    hetero_device_speed={"a": 2.0, "b": 1.0},
    hetero_mesh_order="speed",
    hetero_warmup="speed",
)

# DualPipeV's overlap needs EP without TP or CP (ParallelConfig._check_moe_comm_overlap).
OVERLAP = dict(
    pipeline_parallel_size=2, expert_parallel_size=2, pipeline_schedule="dualpipev",
    overlap_moe_expert_parallel_comm=True,
)  # fmt: skip

# torch_compile is refused under pipeline parallelism and hetero meshes (ParallelConfig.__post_init__).
COMPILE = dict(torch_compile=True, context_parallel_size=2, recompute="selective")

# The V order knobs need pipeline_schedule="zbv" or "dualpipev" (ParallelConfig._check_v_order).
ZBV_ORDER = dict(
    pipeline_parallel_size=2, pipeline_schedule="zbv", pipeline_chunk_costs=(1.0, 2.0, 1.0), pipeline_max_activations=8
)


def test_every_kwarg_reaches_the_config():
    covered = (
        set(NON_DEFAULTS) | set(HETERO_NON_DEFAULTS) | set(HETERO_SPEED) | set(OVERLAP) | set(ZBV_ORDER) | set(COMPILE)
    )
    assert covered == set(_fields()), "give every ParallelConfig field a non-default value here"
    for name, value in {**NON_DEFAULTS, **HETERO_NON_DEFAULTS, **ZBV_ORDER, **COMPILE}.items():
        assert value != _default(_fields()[name]), name
    assert FlagScaleStrategy(**NON_DEFAULTS).parallel == ParallelConfig(**NON_DEFAULTS)
    assert FlagScaleStrategy(**HETERO_NON_DEFAULTS).parallel == ParallelConfig(**HETERO_NON_DEFAULTS)
    assert FlagScaleStrategy(**HETERO_SPEED).parallel == ParallelConfig(**HETERO_SPEED)
    assert FlagScaleStrategy(**OVERLAP).parallel == ParallelConfig(**OVERLAP)
    assert FlagScaleStrategy(**ZBV_ORDER).parallel == ParallelConfig(**ZBV_ORDER)
    assert FlagScaleStrategy(**COMPILE).parallel == ParallelConfig(**COMPILE)
    assert FlagScaleStrategy().parallel == ParallelConfig()
