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
