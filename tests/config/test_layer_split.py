"""The heterogeneous stage planner counts the embedding and the LM head on the stages that hold them (issue 42 item 5)."""

from __future__ import annotations

import pytest

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.config.hetero import parse_hetero_meshes
from lightning_flagscale.config.layer_split import (
    edge_block_costs,
    edge_extra_blocks,
    plan_stage_groups,
    speed_aware_layers,
)

# bench/hetero.py's 6-block case: fast mesh (DP 2) then slow mesh (DP 2), the slow type 2x slower, sequence 128
SHAPE = dict(num_layers=6, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
SPEED = {"fast": 2.0, "slow": 1.0}
FAST_SLOW = [dict(data_parallel_size=2, device_type="fast"), dict(data_parallel_size=2, device_type="slow")]
SEQ = 128


def _times(layers: list[int], extra: list[float], weights: list[float]) -> list[float]:
    """Modelled stage time: (blocks + extra) / (speed x ranks)."""
    return [(n + e) / w for n, e, w in zip(layers, extra, weights, strict=True)]


def _imbalance(times: list[float]) -> float:
    return max(times) * len(times) / sum(times)


def test_head_in_blocks_from_the_config():
    # llama-tiny's vocab of 256 at hidden 128: the head GEMM (2 V h = 65.5k FLOPs a token) is 0.18 of a block
    # (2 x 147.7k parameters + attention 2 x 4 heads x 64 x 128 = 361k); the embedding is a lookup.
    embed, head = edge_block_costs(TransformerConfig.from_preset("llama-tiny", **SHAPE), SEQ)
    assert embed == 0.0 and head == pytest.approx(65536 / 360960)
    # at vocab 32k the same shape's head is about 23 blocks, and it grows with the vocabulary
    big = edge_block_costs(TransformerConfig.from_preset("llama-tiny", **SHAPE, vocab_size=32000), SEQ)[1]
    assert big == pytest.approx(head * 32000 / 256)


def test_split_counts_the_head_on_the_slow_last_stage():
    """The 6-block case's shape and slowdown with a head of 1.45 blocks (vocab 2048) on the slow last stage: the
    old split (blocks by speed alone) is 4 + 2; counting the head moves a block to the fast stage, 5 + 1, and the
    modelled slowest stage and max / mean stage time both improve."""
    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, vocab_size=2048)
    meshes = parse_hetero_meshes(FAST_SLOW)
    extra = edge_extra_blocks(model, SEQ, 2)
    assert extra == [0.0, pytest.approx(1.4525, abs=1e-4)]  # the head on the last stage: the slow mesh
    old = speed_aware_layers(meshes, 6, SPEED)
    new = speed_aware_layers(meshes, 6, SPEED, extra_blocks=extra)
    assert old == [4, 2] and new == [5, 1]  # fewer blocks on the stage that holds the head
    weights = [2 * SPEED["fast"], 2 * SPEED["slow"]]
    before, after = _times(old, extra, weights), _times(new, extra, weights)
    assert before == pytest.approx([1.0, 1.7262], abs=1e-4) and after == pytest.approx([1.25, 1.2262], abs=1e-4)
    assert max(after) < max(before) and _imbalance(after) < _imbalance(before)
    groups = plan_stage_groups(meshes, None, 6, SPEED, extra_blocks=extra)  # the planner passes it through
    assert [g.num_layers for g in groups] == [5, 1]


def test_bench_model_head_is_too_small_to_move_a_block():
    """At the bench's vocab of 256 the head is 0.18 block: 4 + 2 stays the split with the fastest slowest stage
    (5 + 1 would give the fast stage 5 / 4 = 1.25 against (2 + 0.18) / 2 = 1.09 now); with the meshes slow then fast
    the head is on the fast mesh and the split 2 + 4."""
    model = TransformerConfig.from_preset("llama-tiny", **SHAPE)
    for order, want in ((FAST_SLOW, [4, 2]), (FAST_SLOW[::-1], [2, 4])):
        meshes = parse_hetero_meshes(order)
        assert speed_aware_layers(meshes, 6, SPEED, extra_blocks=edge_extra_blocks(model, SEQ, 2)) == want


def test_v_schedule_holds_the_head_on_the_first_group():
    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, vocab_size=2048)
    extra = edge_extra_blocks(model, SEQ, 2, virtual=2, schedule="zbv")
    assert extra[0] > 1.0 and extra[1] == 0.0  # the V turns in the last group and ends in the first


def test_no_extra_keeps_the_speed_split_and_bad_extra_is_refused():
    meshes = parse_hetero_meshes(FAST_SLOW)
    assert speed_aware_layers(meshes, 8, {"fast": 3.0, "slow": 1.0}, extra_blocks=[0.0, 0.0]) == [6, 2]
    with pytest.raises(ValueError, match="one value >= 0 per pipeline stage"):
        speed_aware_layers(meshes, 6, SPEED, extra_blocks=[1.0])


def test_device_speed_split_counts_the_head():
    """``hetero_device_speed`` splits count the embedding and LM head too (the profiled split already did): the
    config plans the groups the runtime builds (``build_hetero_layout`` calls ``ParallelConfig.stage_groups`` with the
    module's config), so the 6-block case with a 1.45-block head on the slow mesh is 5 + 1 and validates as such;
    without a decoder config, or with ``hetero_layers``, nothing moves."""
    from lightning_flagscale.config import ParallelConfig

    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, vocab_size=2048, max_seq_len=SEQ)
    parallel = ParallelConfig(hetero_meshes=FAST_SLOW, hetero_device_speed=SPEED, micro_batch_size=1)
    assert parallel.hetero_extra_blocks(model) == edge_extra_blocks(model, SEQ, 2)
    assert [g.num_layers for g in parallel.stage_groups(6, model)] == [5, 1]
    assert [g.num_layers for g in parallel.stage_groups(6)] == [4, 2]  # no config: blocks by speed alone
    zbv = ParallelConfig(hetero_meshes=FAST_SLOW, hetero_device_speed=SPEED, micro_batch_size=1,
                         pipeline_schedule="zbv")  # fmt: skip
    assert zbv.hetero_extra_blocks(model)[0] > 1.0  # the V ends on the first (fast) group
    fixed = ParallelConfig(hetero_meshes=FAST_SLOW, hetero_layers=[3, 3], micro_batch_size=1)
    assert fixed.hetero_extra_blocks(model) is None and [g.num_layers for g in fixed.stage_groups(6, model)] == [3, 3]
    parallel.validate_model(model)


# ---- hetero_mesh_order="speed": the planner picks which mesh holds the LM head (issue 42 item 5) ----
SLOW_FAST = FAST_SLOW[::-1]


def _slowest(groups, extra: list[float], speed: dict[str, float]) -> float:
    """Modelled slowest stage of planned groups: (blocks + extra) / (speed x ranks)."""
    return max(_times([g.num_layers for g in groups], extra, [speed[g.device_type] * g.size for g in groups]))


def _parallel(meshes, order: str, **kw):
    from lightning_flagscale.config import ParallelConfig

    return ParallelConfig(hetero_meshes=meshes, hetero_device_speed=SPEED, micro_batch_size=1, hetero_mesh_order=order,
                          **kw)  # fmt: skip


def test_speed_order_puts_the_head_on_the_fast_mesh():
    """The bench's 6-block case (fast 2x slow, 2 ranks each, head 0.18 block): listed fast then slow, the head sits on
    the slow last stage and [4, 2] is the best split (slowest 2.18 / 2 = 1.09); "speed" makes the fast mesh the last
    stage group, [2, 4] (slowest 4.18 / 4 = 1.045). Under ZB-V the V ends on the first group: listed slow then fast,
    "speed" puts the fast mesh first."""
    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, max_seq_len=SEQ)
    extra = edge_extra_blocks(model, SEQ, 2)
    given = _parallel(FAST_SLOW, "given").stage_groups(6, model)
    ordered = _parallel(FAST_SLOW, "speed").stage_groups(6, model)
    assert [(g.mesh, g.device_type, g.num_layers) for g in given] == [(0, "fast", 4), (1, "slow", 2)]
    assert [(g.mesh, g.device_type, g.num_layers) for g in ordered] == [(1, "slow", 2), (0, "fast", 4)]
    assert [g.index for g in ordered] == [0, 1] and [g.first_rank for g in ordered] == [0, 2]
    assert _slowest(given, extra, SPEED) == pytest.approx(1.0908, abs=1e-4)
    assert _slowest(ordered, extra, SPEED) == pytest.approx(1.0454, abs=1e-4)
    # already head-on-fast: kept as listed
    assert [g.mesh for g in _parallel(SLOW_FAST, "speed").stage_groups(6, model)] == [0, 1]
    for schedule in ("zbv", "dualpipev"):
        v_extra = edge_extra_blocks(model, SEQ, 2, virtual=2, schedule=schedule)
        v_given = _parallel(SLOW_FAST, "given", pipeline_schedule=schedule).stage_groups(6, model)
        v_ordered = _parallel(SLOW_FAST, "speed", pipeline_schedule=schedule).stage_groups(6, model)
        assert [g.device_type for g in v_ordered] == ["fast", "slow"], schedule
        assert [g.mesh for g in v_ordered] == [1, 0]
        assert _slowest(v_ordered, v_extra, SPEED) < _slowest(v_given, v_extra, SPEED)
        assert [g.mesh for g in _parallel(FAST_SLOW, "speed", pipeline_schedule=schedule).stage_groups(6, model)] == [
            0, 1,
        ]  # fmt: skip


def test_speed_order_keeps_ties_as_listed():
    """Equal speeds, or no decoder config (no head counted: every order has the same slowest stage here): as listed."""
    from lightning_flagscale.config.layer_split import speed_mesh_order

    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, max_seq_len=SEQ)
    assert [g.mesh for g in _parallel(FAST_SLOW, "speed").stage_groups(6)] == [0, 1]
    meshes = parse_hetero_meshes(FAST_SLOW)
    extra = edge_extra_blocks(model, SEQ, 2)
    assert speed_mesh_order(meshes, 6, {"fast": 1.0, "slow": 1.0}, extra_blocks=extra) == (0, 1)
    assert speed_mesh_order(meshes, 6, SPEED, extra_blocks=extra) == (1, 0)
    # three meshes, the fastest listed first: it moves to the end, the other two keep their listed order
    three = parse_hetero_meshes([dict(device_type="a"), dict(device_type="b"), dict(device_type="c")])
    head = [0.0, 0.0, 2.0]  # as listed the head makes the last stage 1 + 2 = 3; with "a" last, 7 / 3
    assert speed_mesh_order(three, 9, {"a": 3.0, "b": 1.0, "c": 1.0}, extra_blocks=head) == (1, 2, 0)


def test_reordered_meshes_keep_their_own_ranks():
    """Ranks are laid out in the listed mesh order (or by device type over the listed meshes); a mesh moved to
    another pipeline position keeps those ranks."""
    from lightning_flagscale.config.layer_split import pipeline_rank_order
    from lightning_flagscale.parallel.hetero_mesh.ranks import rank_order_by_type

    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, max_seq_len=SEQ)
    parallel = _parallel(FAST_SLOW, "speed")
    assert [g.ranks for g in parallel.stage_groups(6, model)] == [[2, 3], [0, 1]]  # no device types: rank order
    types = ["slow", "fast", "slow", "fast"]
    order = rank_order_by_type(parse_hetero_meshes(FAST_SLOW), types)
    assert order == [1, 3, 0, 2]
    groups = parallel.stage_groups(6, model, order)
    assert [(g.device_type, g.ranks) for g in groups] == [("slow", [0, 2]), ("fast", [1, 3])]
    assert all(types[r] == g.device_type for g in groups for r in g.ranks)
    # meshes of different sizes, pipeline stages inside a mesh: every block of positions moves whole
    meshes = parse_hetero_meshes(
        [dict(data_parallel_size=2, pipeline_parallel_size=2), dict(), dict(data_parallel_size=3)]
    )
    assert pipeline_rank_order(meshes, (2, 0, 1)) == [5, 6, 7, 0, 1, 2, 3, 4]
    assert pipeline_rank_order(meshes, (0, 1, 2)) is None
    assert pipeline_rank_order(meshes, (1, 0, 2), [7, 6, 5, 4, 3, 2, 1, 0]) == [3, 7, 6, 5, 4, 2, 1, 0]
    speed = {"a": 1.0}
    typed = [dict(m, device_type="a") for m in ([dict(data_parallel_size=2, pipeline_parallel_size=2), {},
                                                 dict(data_parallel_size=3)])]  # fmt: skip
    groups = plan_stage_groups(parse_hetero_meshes(typed), None, 8, speed, extra_blocks=[0, 0, 0, 3.0],
                               mesh_order="speed")  # fmt: skip
    assert [(g.mesh, g.ranks) for g in groups] == [(0, [0, 1]), (0, [2, 3]), (1, [4]), (2, [5, 6, 7])]


def test_micro_batch_stays_per_rank_of_the_first_listed_mesh():
    """``micro_batch_size`` counts samples per data-parallel rank of ``hetero_meshes[0]`` as listed: moving a DP=1
    mesh in front of a DP=2 one must not halve the micro-batch (which DP=2 could then not split)."""
    from lightning_flagscale.config import ParallelConfig

    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, max_seq_len=SEQ)
    meshes = [dict(data_parallel_size=2, device_type="fast"), dict(tensor_parallel_size=2, device_type="slow")]
    parallel = ParallelConfig(hetero_meshes=meshes, hetero_device_speed=SPEED, micro_batch_size=1,
                              hetero_mesh_order="speed")  # fmt: skip
    assert [g.mesh for g in parallel.stage_groups(6, model)] == [1, 0]
    assert [(c.tensor_parallel_size, c.micro_batch_size) for c in parallel.stage_group_configs(6, model)] == [
        (2, 2), (1, 1),
    ]  # fmt: skip
    parallel.validate_model(model)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hetero_meshes=FAST_SLOW), "needs hetero_device_speed"),
        (dict(hetero_meshes=FAST_SLOW, hetero_layers=[4, 2]), "leave hetero_layers at None"),
        (dict(hetero_device_speed=SPEED, hetero_dp_batch_sizes="auto"), "give hetero_meshes"),
        (dict(hetero_meshes=[dict(device_type="fast")] * 7, hetero_device_speed=SPEED), "at most 6"),
        (dict(hetero_meshes=FAST_SLOW, hetero_device_speed=SPEED, recompute=["full", "none"]), "one mode for all"),
        (dict(hetero_meshes=FAST_SLOW, hetero_device_speed=SPEED, hetero_mesh_order="fast"), "use 'given'"),
    ],
    ids=["no-speed", "layers", "no-meshes", "too-many", "recompute-list", "bad-name"],
)
def test_bad_mesh_order_combinations_are_refused(kwargs, message):
    from lightning_flagscale.config import ParallelConfig

    kwargs = {"hetero_mesh_order": "speed", **kwargs}
    with pytest.raises(ValueError, match=message):
        ParallelConfig(micro_batch_size=1, **kwargs)


# ---- hetero_warmup="speed": the first group's 1F1B warm-up covers the first micro-batch's round trip (issue 42 item 5)


def test_speed_warmup_covers_the_round_trip_of_the_later_groups():
    """Group 0 waits for micro-batch 0's gradient unless its ``w`` warm-up forwards (a third of its time each) last
    as long as every later group's forward + backward; never fewer than 1F1B's ``G - 1``."""
    from lightning_flagscale.config.layer_split import speed_warmup

    assert speed_warmup([1.0, 1.0]) == 3  # 3 forwards of 1/3 cover the other group's 1
    assert speed_warmup([1.0, 1.045]) == 4
    assert speed_warmup([2.0, 1.0]) == 2  # a slow first group: 1F1B's 1 leaves a wait of 1 - 2/3
    assert speed_warmup([3.0, 1.0]) == 1  # a forward of 1 covers it: the standard
    assert speed_warmup([1.0, 1.0, 1.0]) == 6
    assert speed_warmup([10.0, 1.0, 1.0]) == 2  # never fewer than G - 1
    assert speed_warmup([1.0, 1.0], backward_share=0.6) == 3  # ceil(1 / 0.4)
    assert speed_warmup([1.0]) == 0
    with pytest.raises(ValueError, match="positive stage times"):
        speed_warmup([1.0, 0.0])


def test_speed_warmup_is_set_on_the_first_group_of_the_plan():
    """The bench's case: slow mesh first (2 blocks over 2 ranks: 1.0), fast mesh last with the head (4.18 blocks at
    2 x 2: 1.045): the slow group runs 4 warm-up forwards instead of 1; the others keep 1F1B's; '1f1b' sets none."""
    model = TransformerConfig.from_preset("llama-tiny", **SHAPE, max_seq_len=SEQ)
    groups = _parallel(FAST_SLOW, "speed", hetero_warmup="speed").stage_groups(6, model)
    assert [(g.device_type, g.num_layers, g.warmup) for g in groups] == [("slow", 2, 4), ("fast", 4, None)]
    assert [g.warmup for g in _parallel(FAST_SLOW, "speed").stage_groups(6, model)] == [None, None]
    three = [dict(device_type="slow"), dict(device_type="fast"), dict(device_type="fast")]
    groups = plan_stage_groups(parse_hetero_meshes(three), None, 8, SPEED, warmup="speed")
    # [2, 3, 3] blocks at speeds 1, 2, 2: times 2, 1.5, 1.5; forward 2/3 -> ceil(3 / (2/3)) = 5
    assert [(g.num_layers, g.warmup) for g in groups] == [(2, 5), (3, None), (3, None)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hetero_meshes=FAST_SLOW, hetero_layers=[4, 2]), "give hetero_meshes and hetero_device_speed"),
        (dict(hetero_device_speed=SPEED, hetero_dp_batch_sizes="auto"), "give hetero_meshes and hetero_device_speed"),
        (dict(hetero_meshes=FAST_SLOW, hetero_device_speed=SPEED, pipeline_schedule="gpipe"), "sets 1F1B's warm-up"),
        (dict(hetero_meshes=FAST_SLOW, hetero_device_speed=SPEED, virtual_pipeline_parallel_size=2), "sets 1F1B's"),
        (dict(hetero_meshes=FAST_SLOW, hetero_device_speed=SPEED, hetero_warmup="eager"), "use '1f1b'"),
    ],
    ids=["no-speed", "no-meshes", "gpipe", "interleaved", "bad-name"],
)
def test_bad_warmup_combinations_are_refused(kwargs, message):
    from lightning_flagscale.config import ParallelConfig

    kwargs = {"hetero_warmup": "speed", **kwargs}
    with pytest.raises(ValueError, match=message):
        ParallelConfig(micro_batch_size=1, **kwargs)
