"""Heterogeneous meshes, issue 12 items 3, 5 and 9: context parallelism on every mesh and sequence parallelism across a
boundary against the single-process fp32 run (SGD, ragged labels, weights and gradient norms after 3 steps); the
pure reslicing plan (batch x CP x sequence cells), the schedule orders and every refused layout. Tied weights and
interleaved 1F1B across meshes: ``test_hetero_tied_interleaved.py``."""

from __future__ import annotations

import itertools

import pytest

from lightning_flagscale import FlagScaleStrategy, ParallelConfig
from lightning_flagscale.config.hetero import StageGroup, parse_hetero_meshes
from lightning_flagscale.config.layer_split import plan_stage_groups
from lightning_flagscale.config.schedules import min_microbatches, stage_placement
from lightning_flagscale.parallel.hetero_mesh.boundary import boundary_transfers, coords, gradient_transfers
from lightning_flagscale.parallel.hetero_mesh.runner import schedule_order, simulate
from lightning_flagscale.parallel.pipeline_parallel.orders import zbv_order
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3
TP2, DP2, CP2 = dict(tensor_parallel_size=2), dict(data_parallel_size=2), dict(context_parallel_size=2)


def _run(launcher, strategy, config, global_batch, what):
    reference = reference_run(config, STEPS, clip=1.0, global_batch=global_batch)
    first_dp = strategy["hetero_meshes"][0].get("data_parallel_size", 1)
    results = launcher(4, trainer_run, strategy, config, STEPS, clip=1.0, batch_size=global_batch // first_dp)
    assert_matches_reference(results, reference, what)


def test_context_parallel_on_both_meshes(launcher):
    """CP 2 on both meshes (ring attention, zigzag order); an uneven split and 4 micro-batches through 1F1B."""
    strategy = dict(hetero_meshes=[CP2, CP2], hetero_layers=[3, 1], micro_batch_size=1, zero_stage=1)
    _run(launcher, strategy, tiny_config(num_layers=4), 4, "hetero cp2 | cp2")


@pytest.mark.parametrize(
    ("meshes", "schedule"), [([TP2, DP2], "1f1b"), ([DP2, TP2], "gpipe")], ids=["sp-tp2-to-dp2", "dp2-to-sp-tp2"]
)
def test_sequence_parallel_across_a_boundary(launcher, meshes, schedule):
    """Activations sharded along the sequence over TP=2 on one mesh, whole sequences on the other."""
    mbs = 2 // meshes[0].get("data_parallel_size", 1)
    strategy = dict(hetero_meshes=meshes, hetero_layers=[2, 2], micro_batch_size=mbs, sequence_parallel=True,
                    pipeline_schedule=schedule)  # fmt: skip
    _run(launcher, strategy, tiny_config(num_layers=4), 4, f"hetero sp {meshes}")


# ---- pure: the reslicing plan and the schedule orders ----


def _group(index, first_rank, tp=1, dp=1, cp=1, sp=False):
    return StageGroup(index, index, first_rank, tensor_parallel_size=tp, data_parallel_size=dp,
                      context_parallel_size=cp, expert_parallel_size=1, num_layers=1, sequence_parallel=sp and tp > 1)  # fmt: skip


FINE = 12  # sequence units fine enough for every TP size used below (1, 2, 3, 4)


def _holdings(group, rank, rows):
    """(row, cp rank, sequence unit of FINE) cells a rank holds; a replicated TP rank holds every unit."""
    i, c, t = coords(group, rank)
    r = rows // group.data_parallel_size
    shards = group.tensor_parallel_size if group.sequence_parallel else 1
    t = t if shards > 1 else 0
    units = range(t * FINE // shards, (t + 1) * FINE // shards)
    return {(row, c, u) for row in range(i * r, (i + 1) * r) for u in units}


def _cells(tr, src, dst, rows):
    """What a transfer moves, in global cells, and where it lands in the destination's local rows."""
    i, c, _ = coords(src, tr.src)
    j, c_dst, _ = coords(dst, tr.dst)
    assert c == c_dst  # context-parallel rank c only talks to rank c: the zigzag order is the same on both sides
    src_row0, dst_row0 = i * rows // src.data_parallel_size, j * rows // dst.data_parallel_size
    assert src_row0 + tr.src_lo == dst_row0 + tr.dst_lo
    units = range(tr.seq_lo * FINE // tr.seq_den, tr.seq_hi * FINE // tr.seq_den)
    return [(src_row0 + r, c, u) for r in range(tr.src_lo, tr.src_hi) for u in units]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (dict(tp=2), dict(dp=2)), (dict(dp=2), dict(tp=2)), (dict(tp=2, sp=True), dict(dp=2)),
        (dict(dp=2), dict(tp=2, sp=True)), (dict(tp=2, sp=True), dict(tp=3, sp=True)),
        (dict(cp=2, tp=2), dict(cp=2, dp=2)), (dict(cp=2, dp=2, tp=2, sp=True), dict(cp=2, tp=4, sp=True)),
        (dict(dp=3), dict(dp=2, tp=2)),
    ],
)  # fmt: skip
def test_every_receiver_gets_each_cell_exactly_once(a, b):
    """Forward and backward plans deliver every (row, cp rank, sequence unit) a destination holds exactly once, from
    a source that holds it."""
    send = _group(0, 0, **a)
    recv = _group(1, send.size, **b)
    rows = 6 if 3 in (send.data_parallel_size, recv.data_parallel_size) else 4
    for src, dst, transfers in (
        (send, recv, boundary_transfers(send, recv, rows)),
        (recv, send, gradient_transfers(send, recv, rows)),
    ):
        got: dict[int, list] = {r: [] for r in dst.ranks}
        for tr in transfers:
            cells = _cells(tr, src, dst, rows)
            assert set(cells) <= _holdings(src, tr.src, rows), tr  # the source holds what it sends
            got[tr.dst] += cells
        for rank, cells in got.items():
            assert sorted(cells) == sorted(_holdings(dst, rank, rows)), rank  # every cell, exactly once


@pytest.mark.parametrize(
    ("schedule", "v"),
    [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zero_bubble", 1),
     ("zero_bubble", 2)],
)  # fmt: skip
@pytest.mark.parametrize("num_groups", [2, 3, 4])
def test_schedule_orders_run_every_action_once_without_deadlock(schedule, v, num_groups):
    for n, train in itertools.product([num_groups, 2 * num_groups], [True, False]):
        orders = [schedule_order(schedule, num_groups, g, v, n, train=train) for g in range(num_groups)]
        simulate(orders, num_groups * v)
        for g, order in enumerate(orders):
            stages = range(g, num_groups * v, num_groups)
            kinds = ("FIW" if schedule == "zero_bubble" else "FB") if train else "F"
            assert sorted(order) == sorted((k, s, m) for k in kinds for s in stages for m in range(n))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("num_groups", [2, 3, 4])
def test_v_shaped_orders_place_two_chunks_per_group_and_run_without_deadlock(schedule, num_groups):
    """ZB-V and DualPipeV across stage groups: group g runs stages g and 2G-1-g (the first group holds the first and
    the last stage); every stage and micro-batch gets one forward and one backward (whole, or its I and W halves)."""
    G = num_groups
    assert [stage_placement(s, G, schedule) for s in (0, G - 1, G, 2 * G - 1)] == [(0, 0), (G - 1, 0), (G - 1, 1),
                                                                                    (0, 1)]  # fmt: skip
    low = min_microbatches(schedule, G, 2)
    for n, train in itertools.product([low, low + 1, 2 * low], [True, False]):
        orders = [schedule_order(schedule, G, g, 2, n, train=train) for g in range(G)]
        simulate(orders, 2 * G)
        for g, order in enumerate(orders):
            assert len(set(order)) == len(order), order
            for s, m in itertools.product((g, 2 * G - 1 - g), range(n)):
                kinds = "".join(sorted(k for k, s2, m2 in order if (s2, m2) == (s, m)))
                assert kinds in (("BF", "FIW") if train else ("F",)), (g, s, m, kinds)
            assert {s for _, s, _ in order} == {g, 2 * G - 1 - g}
    with pytest.raises(ValueError, match=f"at least {low} micro-batches"):
        schedule_order(schedule, G, 0, 2, low - 1, train=True)
    simulate([schedule_order(schedule, G, g, 2, 1, train=False) for g in range(G)], 2 * G)  # evaluation: any count


@pytest.mark.parametrize("num_groups", [2, 3])
def test_zbv_across_groups_runs_the_order_generated_for_the_config_knobs(num_groups):
    """``pipeline_chunk_costs`` / ``pipeline_max_activations`` give every stage group its rank's order of
    ``orders.zbv_order`` (as without hetero meshes), here not torch's; each group's config carries them."""
    G, n, costs = num_groups, 2 * num_groups, (1.0, 2.0, 1.0)
    orders = [schedule_order("zbv", G, g, 2, n, train=True, costs=costs, cap=4 * G) for g in range(G)]
    want = zbv_order(G, n, costs, 4 * G)
    assert orders == [
        [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in want[g]] for g in range(G)
    ]
    assert orders != [schedule_order("zbv", G, g, 2, n, train=True) for g in range(G)]
    simulate(orders, 2 * G)
    forward_only = [schedule_order("zbv", G, g, 2, n, train=False, costs=costs, cap=4 * G) for g in range(G)]
    assert forward_only == [schedule_order("zbv", G, g, 2, n, train=False) for g in range(G)]
    cfg = ParallelConfig(hetero_meshes=[TP2, DP2], pipeline_schedule="zbv", micro_batch_size=2,
                         pipeline_chunk_costs=[1, 2, 1], pipeline_max_activations=8)  # fmt: skip
    knobs = [(c.pipeline_chunk_costs, c.pipeline_max_activations) for c in cfg.stage_group_configs(4)]
    assert knobs == [(costs, 8)] * 2


def test_zero_bubble_defers_weight_passes_by_the_warmup_depth():
    # Group g of G runs each W (G - g - 1) backward passes after its I (the last group at once); after its last I a
    # group still has G - g weight passes to run, which fill the cool-down bubble.
    orders = [schedule_order("zero_bubble", 3, g, 1, 4, train=True) for g in range(3)]
    assert orders[2] == [("F", 2, 0), ("I", 2, 0), ("W", 2, 0), ("F", 2, 1), ("I", 2, 1), ("W", 2, 1),
                         ("F", 2, 2), ("I", 2, 2), ("W", 2, 2), ("F", 2, 3), ("I", 2, 3), ("W", 2, 3)]  # fmt: skip
    first_w = [next(i for i, a in enumerate(o) if a[0] == "W") for o in orders]
    last_i = [max(i for i, a in enumerate(o) if a[0] == "I") for o in orders]
    assert first_w[0] > first_w[1] > first_w[2]
    assert [sum(a[0] == "W" for a in o[last_i[g] + 1 :]) for g, o in enumerate(orders)] == [3, 2, 1]


def test_a_deadlocking_order_is_detected_and_interleaved_needs_whole_rounds():
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate([[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]], 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        schedule_order("interleaved_1f1b", 2, 0, 2, 3, train=True)


def test_chunk_layers_split_per_group_or_per_virtual_stage():
    meshes = parse_hetero_meshes([TP2, DP2])
    even = plan_stage_groups(meshes, [3, 2], 5, virtual=2)
    assert [g.chunk_layers for g in even] == [(2, 1), (1, 1)]
    explicit = plan_stage_groups(meshes, [1, 2, 2, 1], 6, virtual=2)  # global stages 0, 1, 2, 3 = g0k0, g1k0, ...
    assert [g.chunk_layers for g in explicit] == [(1, 2), (2, 1)] and [g.num_layers for g in explicit] == [3, 3]
    with pytest.raises(ValueError, match="fewer than virtual_pipeline_parallel_size=2"):
        plan_stage_groups(meshes, [3, 1], 4, virtual=2)
    # V placement: global stages 0, 1, 2, 3 = g0k0, g1k0, g1k1, g0k1; V schedules take 2 chunks per group by default
    v_shaped = plan_stage_groups(meshes, [1, 2, 3, 4], 10, virtual=2, schedule="zbv")
    assert [g.chunk_layers for g in v_shaped] == [(1, 4), (2, 3)]
    assert ParallelConfig(hetero_meshes=[TP2, DP2], pipeline_schedule="dualpipev").virtual_pipeline_parallel_size == 2
    per_group = ParallelConfig(hetero_meshes=[TP2, DP2], recompute=["none", "full"], micro_batch_size=2)
    assert [c.recompute for c in per_group.stage_group_configs(4)] == ["none", "full"]  # one mode per stage group
    sp = plan_stage_groups(meshes, [2, 2], 4, sequence_parallel=True)
    assert [g.sequence_parallel for g in sp] == [True, False]  # a TP=1 mesh has nothing to shard over
    assert [c.sequence_parallel for c in ParallelConfig(hetero_meshes=[TP2, DP2], sequence_parallel=True,
                                                        micro_batch_size=2).stage_group_configs(4)] == [True, False]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hetero_meshes=[CP2, TP2]), "differs between hetero_meshes"),
        (dict(hetero_meshes=[DP2, DP2], sequence_parallel=True), "at least one of the hetero_meshes"),
        (dict(hetero_meshes=[TP2, DP2], pipeline_schedule="dualpipev", virtual_pipeline_parallel_size=1),
         "V-shaped: every hetero stage group holds exactly 2 model chunks"),
        (dict(hetero_meshes=[TP2, DP2], hetero_layers=[1, 1, 2], pipeline_schedule="zbv"), "or 4, one per virtual"),
        (dict(hetero_meshes=[TP2, DP2], virtual_pipeline_parallel_size=2), "needs pipeline_schedule='interleaved_1f1b'"),
        (dict(hetero_meshes=[TP2, DP2], hetero_layers=[1, 1, 2], virtual_pipeline_parallel_size=2,
              pipeline_schedule="interleaved_1f1b"), "or 4, one per virtual stage"),
    ],
)  # fmt: skip
def test_refused_boundary_layouts_are_named_before_spawn(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlagScaleStrategy(**kwargs)


def test_first_group_warmup_runs_more_forwards_before_its_backwards():
    """``hetero_warmup="speed"`` (``StageGroup.warmup``): group 0 runs ``w`` forwards, then 1F1B pairs, then its
    last ``w`` backwards; the order still runs without deadlock against the other groups' standard 1F1B orders, and
    the runner asks for it in training only (issue 42 item 5)."""
    from types import SimpleNamespace

    from lightning_flagscale.parallel.hetero_mesh.runner import HeteroPipelineRunner

    n = 6
    eager = schedule_order("1f1b", 2, 0, 1, n, train=True, warmup=3)
    assert eager == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3), ("B", 0, 0), ("F", 0, 4), ("B", 0, 1),
                     ("F", 0, 5), ("B", 0, 2), ("B", 0, 3), ("B", 0, 4), ("B", 0, 5)]  # fmt: skip
    assert schedule_order("1f1b", 2, 0, 1, n, train=True, warmup=None) == schedule_order("1f1b", 2, 0, 1, n, train=True)
    assert schedule_order("1f1b", 2, 0, 1, n, train=True, warmup=9)[:n] == [("F", 0, m) for m in range(n)]  # capped
    for G, w in ((2, 3), (3, 5), (4, 3)):
        simulate([schedule_order("1f1b", G, g, 1, n, train=True, warmup=w if g == 0 else None) for g in range(G)], G)
    for bad in (dict(schedule="gpipe", warmup=3), dict(schedule="1f1b", warmup=0)):
        with pytest.raises(ValueError, match="warm-up of"):
            schedule_order(bad["schedule"], 2, 0, 1, n, train=True, warmup=bad["warmup"])
    # the runner's order comes from its group's warm-up when training, plain 1F1B forwards when evaluating
    group = StageGroup(0, 0, 0, tensor_parallel_size=1, data_parallel_size=1, context_parallel_size=1,
                       expert_parallel_size=1, num_layers=1, warmup=3)  # fmt: skip
    runner = SimpleNamespace(schedule_name="1f1b", groups=[group, group], group=group, virtual=1,
                             order_costs=None, order_max_activations=None, _orders={})  # fmt: skip
    assert HeteroPipelineRunner._order(runner, n, True) == eager
    assert HeteroPipelineRunner._order(runner, n, False) == [("F", 0, m) for m in range(n)]
