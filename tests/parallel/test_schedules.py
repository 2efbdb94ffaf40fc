"""Pipeline schedules by name (``config/schedules.py``): one list of names, every layout rule checked when the
``ParallelConfig`` (or the strategy) is created, before any process exists; V-shaped schedules pick 2 chunks."""

from __future__ import annotations

import typing

import pytest

from lightning_flagscale import FlagScaleStrategy, ParallelConfig
from lightning_flagscale.config.schedules import (
    SCHEDULE_NAMES,
    SCHEDULE_SPECS,
    ScheduleName,
    default_virtual_size,
    min_microbatches,
    validate_schedule,
)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: validate_schedule("1f1b", 4, 1, 3), "at least 4 micro-batches"),
        (lambda: validate_schedule("dualpipev", 2, 2, 3), "at least 4 micro-batches"),
        (lambda: validate_schedule("interleaved_1f1b", 2, 2, 5), "multiple of 2"),
        (lambda: validate_schedule("zbv", 2, 1), "needs virtual_pipeline_parallel_size=2"),
        (lambda: validate_schedule("dualpipev", 2, 3), "exactly 2 stages"),
        (lambda: validate_schedule("1f1b", 2, 2), "one stage per rank"),
        (lambda: validate_schedule("pipedream", 2, 1), "unknown"),
    ],
)
def test_validate_schedule_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_min_microbatches():
    assert min_microbatches("gpipe", 4) == 1
    assert min_microbatches("1f1b", 4) == 4
    assert min_microbatches("dualpipev", 4, 2) == 8


def test_one_list_of_names_for_config_strategy_and_torch():
    from lightning_flagscale.config.parallel import ParallelConfig as _Config
    from lightning_flagscale.parallel.pipeline_parallel.runner import SCHEDULES

    assert tuple(SCHEDULE_SPECS) == SCHEDULE_NAMES == typing.get_args(ScheduleName)
    assert tuple(SCHEDULES) == SCHEDULE_NAMES  # every name maps to a torch schedule class
    hints = typing.get_type_hints(_Config)
    assert hints["pipeline_schedule"] == ScheduleName
    assert typing.get_type_hints(FlagScaleStrategy.__init__)["pipeline_schedule"] == ScheduleName


@pytest.mark.parametrize(
    ("schedule", "pp", "want"),
    [("zbv", 2, 2), ("dualpipev", 4, 2), ("1f1b", 2, 1), ("gpipe", 2, 1), ("interleaved_1f1b", 2, 1),
     ("zero_bubble", 2, 1), ("zbv", 1, 1)],
)  # fmt: skip
def test_virtual_size_is_auto_when_unset(schedule, pp, want):
    assert default_virtual_size(schedule, pp) == want
    assert ParallelConfig(pipeline_parallel_size=pp, pipeline_schedule=schedule).virtual_pipeline_parallel_size == want
    strategy = FlagScaleStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule)
    assert strategy.parallel.virtual_pipeline_parallel_size == want
    assert strategy.parallel.num_stages == pp * want


def test_explicit_virtual_size_is_kept():
    cfg = ParallelConfig(pipeline_parallel_size=2, virtual_pipeline_parallel_size=3, pipeline_schedule="zero_bubble")
    assert cfg.num_stages == 6
    # Auto resolves before the per-stage lists are checked against the stage count.
    ParallelConfig(pipeline_parallel_size=2, pipeline_schedule="zbv", recompute=["none", "full", "full", "none"])
    with pytest.raises(ValueError, match="2 pipeline stages"):
        ParallelConfig(pipeline_parallel_size=2, recompute=["none", "full", "full", "none"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(pipeline_parallel_size=2, pipeline_schedule="pipedream"), "pipeline_schedule='pipedream' is unknown"),
        (dict(pipeline_schedule="pipedream"), "is unknown"),  # a typo is reported even without PP
        (dict(pipeline_parallel_size=2, pipeline_schedule="zbv", virtual_pipeline_parallel_size=1), "needs virtual"),
        (dict(pipeline_parallel_size=2, pipeline_schedule="dualpipev", virtual_pipeline_parallel_size=3), "exactly 2"),
        (dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", virtual_pipeline_parallel_size=2), "one stage per"),
        (dict(pipeline_schedule="zbv", virtual_pipeline_parallel_size=2), "needs pipeline_parallel_size > 1"),
        (dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=0), "must be a positive integer"),
    ],
)
def test_schedule_errors_at_creation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=match):  # the strategy fails in its constructor, not in setup
        FlagScaleStrategy(**kwargs)


ZBV = dict(pipeline_parallel_size=2, pipeline_schedule="zbv")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(ZBV, pipeline_chunk_costs=[1, 2]), r"pipeline_chunk_costs=\[1, 2\]: give three positive finite"),
        (dict(ZBV, pipeline_chunk_costs=[1, 0, 1]), "give three positive finite numbers"),
        (dict(ZBV, pipeline_chunk_costs=[1, float("inf"), 1]), "give three positive finite numbers"),
        (dict(ZBV, pipeline_chunk_costs=[1, float("nan"), 1]), "give three positive finite numbers"),
        (dict(ZBV, pipeline_chunk_costs=[1, "2", 1]), "give three positive finite numbers"),
        (dict(ZBV, pipeline_max_activations=1), "pipeline_max_activations=1: give an integer >= 2"),
        (dict(ZBV, pipeline_max_activations=8.0), "pipeline_max_activations=8.0: give an integer >= 2"),
        (dict(pipeline_parallel_size=2, pipeline_max_activations=8),
         "pipeline_max_activations: only pipeline_schedule='zbv' or 'dualpipev' generates .* got"
         " pipeline_schedule='1f1b'"),
        (dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", pipeline_chunk_costs=[1, 2, 1],
              pipeline_max_activations=8),
         "pipeline_chunk_costs and pipeline_max_activations: only pipeline_schedule='zbv' or 'dualpipev'.* leave"
         " pipeline_chunk_costs and pipeline_max_activations at None"),
    ],
)  # fmt: skip
def test_v_order_knobs_are_checked_at_creation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=match):  # the strategy fails in its constructor, before any process starts
        FlagScaleStrategy(**kwargs)


def test_order_knobs_without_a_pipeline_are_refused_not_ignored():
    # Checked on the user's layout (the strategy's), not in ParallelConfig itself: each hetero stage group's own config
    # is pp = 1 and carries the knobs by design (stage_group_configs), and must stay valid.
    with pytest.raises(
        ValueError, match="pipeline_chunk_costs shape a pipeline schedule's order, but pipeline_parallel"
    ):
        FlagScaleStrategy(pipeline_schedule="zbv", pipeline_chunk_costs=[1, 2, 1])
    with pytest.raises(ValueError, match=r"pipeline_max_activations shape .* leave pipeline_max_activations at None"):
        FlagScaleStrategy(parallel=ParallelConfig(pipeline_schedule="dualpipev", pipeline_max_activations=9))
    hetero = ParallelConfig(
        hetero_meshes=[{"data_parallel_size": 1}, {"data_parallel_size": 1}], pipeline_schedule="zbv",
        pipeline_chunk_costs=[1, 2, 1],
    )  # fmt: skip
    FlagScaleStrategy(parallel=hetero)
    for group in hetero.stage_group_configs(num_layers=4):
        assert group.pipeline_chunk_costs == (1, 2, 1) or group.pipeline_chunk_costs == [1, 2, 1]


def test_dualpipev_cap_below_its_first_backward_is_refused_at_creation():
    # orders.dualpipev_order needs 2p + 1 activations at every p and m (tests/parallel/test_pipeline_orders.py): the
    # strategy says so before any process starts, not when the first schedule is built
    with pytest.raises(ValueError, match=r"pipeline_max_activations=8: .* over 4 pipeline ranks holds 9 .* at least 9"):
        FlagScaleStrategy(pipeline_parallel_size=4, pipeline_schedule="dualpipev", pipeline_max_activations=8)
    assert ParallelConfig(pipeline_parallel_size=4, pipeline_schedule="dualpipev", pipeline_max_activations=9)
    with pytest.raises(ValueError, match="over 2 pipeline ranks holds 5"):
        ParallelConfig(hetero_meshes=[{"data_parallel_size": 1}, {"data_parallel_size": 1}],
                       pipeline_schedule="dualpipev", pipeline_max_activations=4)  # fmt: skip


def test_chunk_costs_auto_is_kept_and_refused_where_it_is_not_measured():
    # "auto": the runner measures F, I, W on the second training step (tests/parallel/test_pipeline.py's DualPipeV case)
    assert ParallelConfig(**ZBV, pipeline_chunk_costs="auto").pipeline_chunk_costs == "auto"
    with pytest.raises(ValueError, match="only pipeline_schedule='zbv' or 'dualpipev' generates"):
        FlagScaleStrategy(pipeline_parallel_size=2, pipeline_chunk_costs="auto")
    with pytest.raises(ValueError, match="pipeline_chunk_costs='auto' is not measured across hetero_meshes"):
        FlagScaleStrategy(hetero_meshes=[{"data_parallel_size": 1}, {"data_parallel_size": 1}],
                          pipeline_schedule="dualpipev", pipeline_chunk_costs="auto")  # fmt: skip
    with pytest.raises(
        ValueError, match=r"pipeline_chunk_costs='fast': give three positive finite numbers.* or 'auto'"
    ):
        ParallelConfig(**ZBV, pipeline_chunk_costs="fast")


def test_zbv_order_knobs_are_kept_as_three_floats():
    # a YAML / CLI list and ints compare equal to the tuple of floats the order is generated for
    cfg = ParallelConfig(**ZBV, pipeline_chunk_costs=[1, 2, 1], pipeline_max_activations=8)
    assert (cfg.pipeline_chunk_costs, cfg.pipeline_max_activations) == ((1.0, 2.0, 1.0), 8)
    assert cfg == ParallelConfig(**ZBV, pipeline_chunk_costs=(1.0, 2.0, 1.0), pipeline_max_activations=8)
    strategy = FlagScaleStrategy(**ZBV, pipeline_chunk_costs=(1, 2, 1))
    assert strategy.parallel.pipeline_chunk_costs == (1.0, 2.0, 1.0)
    assert strategy.parallel.pipeline_max_activations is None
