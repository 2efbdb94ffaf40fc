"""Pipeline action orders replayed with unit costs (``pipeline_parallel/orders.py``) and the work each action runs
(issue 42 item 2).

Single process, no timing: each order is replayed with exact per-chunk costs and free communication, and its bubble
(all ranks starting together, the step ending with the last one) is compared with the closed forms the benchmark
(``bench/pipeline.py``) states as theory, and with the least any V order can idle."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from lightning_flagscale.parallel.pipeline_parallel.orders import (
    _peak_activations,
    dualpipev_order,
    simulate,
    torch_v_order,
    v_lower_bound,
    zbv_order,
)
from lightning_flagscale.parallel.pipeline_parallel.runner import param_groups_overlap

FWD, INP, WGT = _ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
OVERLAP = _ComputationType.OVERLAP_F_B


def _as_dict(ops: list[list[_Action | None]]) -> dict[int, list[_Action | None]]:
    return dict(enumerate(ops))


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (3, 7)])
def test_torch_v_order_is_the_one_torch_builds(name, p, m):
    want = _as_dict(get_schedule_ops(name, p, m, num_stages_per_rank=2))
    assert torch_v_order("zbv" if name == "ZBVZeroBubble" else "dualpipev", p, m) == want


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 16), (2, 5)])
def test_textbook_orders_replay_at_their_formula(p, m):
    # GPipe over p ranks: (p-1)/(m+p-1); interleaved 1F1B with 2 chunks of half the cost: (p-1)/(2m+p-1)
    gpipe = simulate(_as_dict(get_schedule_ops("GPipe", p, m)), p, (2.0, 2.0, 2.0))
    assert gpipe.bubble == pytest.approx((p - 1) / (m + p - 1))
    if m % p == 0:
        interleaved = simulate(_as_dict(get_schedule_ops("Interleaved1F1B", p, m, 2)), 2 * p, (1.0, 1.0, 1.0))
        assert interleaved.bubble == pytest.approx((p - 1) / (2 * m + p - 1))


@pytest.mark.parametrize("m", [8, 16])
def test_torch_v_orders_reach_the_v_bound_when_costs_are_equal(m):
    # F = I = W: torch's ZB-V and DualPipeV orders idle (p-1)F per rank, the least a V order with a common start can
    for name in ("zbv", "dualpipev"):
        sim = simulate(torch_v_order(name, 4, m), 8, (1.0, 1.0, 1.0))
        assert sim.bubble == pytest.approx(v_lower_bound(4, m, (1.0, 1.0, 1.0)))
        assert len({sim.busy(r) for r in range(4)}) == 1  # every rank carries the same work


@pytest.mark.parametrize("m", [8, 16])
def test_v_orders_per_rank_span_bubble_as_the_papers_count_it(m):
    # Counted from each rank's own first action to its own last (the ZB paper's and DeepSeek's count): torch's ZB-V
    # order idles nothing at F = I = W (the ZB paper's 0); DualPipeV's rank r idles (p-1-r)F (none at the V's turn);
    # at I = 2W torch's ZB-V order idles over 3%, the order generated for those costs with 4p activations under 1%
    f = 1.0
    zbv = simulate(torch_v_order("zbv", 4, m), 8, (f, f, f))
    assert [zbv.own_span_bubble(r) for r in range(4)] == [0.0] * 4
    dual = simulate(torch_v_order("dualpipev", 4, m), 8, (f, f, f))
    busy = 2 * m * 3 * f
    assert [dual.own_span_bubble(r) for r in range(4)] == pytest.approx(
        [(3 - r) * f / (busy + (3 - r) * f) for r in range(4)]
    )
    costs = (1.0, 2.0, 1.0)
    assert simulate(torch_v_order("zbv", 4, m), 8, costs).own_bubble > 0.03
    assert simulate(zbv_order(4, m, costs, cap=16), 8, costs).own_bubble < 0.01


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 16), (2, 8), (3, 9)])
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0)])
def test_greedy_zbv_order_is_complete_and_never_worse_than_torchs(p, m, costs):
    order = zbv_order(p, m, costs)
    for r, actions in order.items():
        stages = {r, 2 * p - 1 - r}
        got = sorted((a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions)
        assert got == sorted((s, k, mb) for s in stages for k in "FIW" for mb in range(m))
    assert _peak_activations(order) <= 2 * p  # 1F1B's activation memory (p stages of twice a V chunk)
    ours = simulate(order, 2 * p, costs)  # raises if a rank would wait forever
    torch = simulate(torch_v_order("zbv", p, m), 2 * p, costs)
    assert ours.makespan <= torch.makespan


@pytest.mark.parametrize("m", [8, 16])
def test_greedy_zbv_order_with_more_memory_reaches_the_v_bound_when_i_exceeds_w(m):
    # I = 2F = 2W: torch's order idles (p-1)(F+I-W) = 2(p-1)F per rank; given 4p activations per rank (2x 1F1B's)
    # the greedy order idles the (p-1)F that no V order can beat
    costs = (1.0, 2.0, 1.0)
    torch = simulate(torch_v_order("zbv", 4, m), 8, costs)
    assert torch.bubble > v_lower_bound(4, m, costs) + 0.02
    order = zbv_order(4, m, costs, cap=16)
    assert simulate(order, 8, costs).bubble == pytest.approx(v_lower_bound(4, m, costs))
    assert _peak_activations(order) <= 16


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 3.0)])
def test_two_activations_per_rank_is_the_least_a_zbv_order_needs(costs):
    # ParallelConfig.pipeline_max_activations refuses values below 2 at creation: rank 0 runs the first micro-batch's
    # forwards through both its chunks (stages 0 and 2p-1) before any backward, and 2 always admits an order
    for p in range(1, 5):
        for m in (1, 2, p, 2 * p + 1):
            order = zbv_order(p, m, costs, cap=2)
            assert _peak_activations(order) <= 2
            simulate(order, 2 * p, costs)
            with pytest.raises(ValueError, match=r"raise cap \(ParallelConfig.pipeline_max_activations\)"):
                zbv_order(p, m, costs, cap=1)


def test_simulate_refuses_an_order_that_would_hang():
    # rank 1 runs the backward of micro-batch 0 before its forward has been received
    order = {
        0: [_Action(0, FWD, 0), _Action(0, INP, 0), _Action(0, WGT, 0)],
        1: [_Action(1, INP, 0), _Action(1, FWD, 0), _Action(1, WGT, 0)],
    }
    with pytest.raises(ValueError, match="cannot run"):
        simulate(order, 2, (1.0, 1.0, 1.0))


def test_bench_sleep_model_gives_the_first_stage_its_input_gradient():
    # bench/pipeline.py's layers sleep F, I and W; the first layer's input must require grad (a free embedding
    # before it), or the first stage skips one I per micro-batch and the theory's equal stages do not hold
    path = Path(__file__).resolve().parents[2] / "bench" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("_bench_pipeline", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        model = bench._SleepLM(0.01, (1.0, 2.0, 3.0))
        x = torch.randn(2, bench.HIDDEN)
        bench._SLEPT[0] = 0.0
        model(x).sum().backward()
        assert bench._SLEPT[0] == pytest.approx(bench.LAYERS * 6 * 0.01 / 1000)
    finally:
        sys.modules.pop(spec.name, None)


def _mock_v_schedule(p: int, m: int, cls_name: str = "ScheduleZBVZeroBubble"):
    from unittest import mock

    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)  # as torch's _schedule_visualizer builds orders
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, 2 * p
    return getattr(schedules, cls_name)([stage, stage], m)


def test_runner_runs_the_generated_zbv_order_and_keeps_torchs_by_default():
    from lightning_flagscale.parallel.pipeline_parallel.runner import _use_generated_order

    sched = _mock_v_schedule(2, 4)
    torchs = {r: list(a) for r, a in sched.pipeline_order.items()}
    _use_generated_order(sched, "zbv", 2, 4, (1.0, 1.0, 1.0), None)  # equal costs: torch's order, untouched
    assert sched.pipeline_order == torchs
    _use_generated_order(sched, "zbv", 2, 4, (1.0, 2.0, 1.0), 8)
    want = zbv_order(2, 4, (1.0, 2.0, 1.0), 8)
    assert sched.pipeline_order == want != torchs
    for rank, actions in sched.pipeline_order_with_comms.items():  # lowered with send/recv in the new order
        compute = [a for a in actions if a.computation_type in (FWD, INP, WGT)]
        assert compute == want[rank]


def test_runner_runs_the_generated_dualpipev_order_with_its_pairs():
    from lightning_flagscale.parallel.pipeline_parallel.runner import _run_pairs_apart, _use_generated_order

    sched = _mock_v_schedule(4, 8, "ScheduleDualPipeV")
    _use_generated_order(sched, "dualpipev", 4, 8, (1.0, 2.0, 1.0), None)
    want = dualpipev_order(4, 8, (1.0, 2.0, 1.0))
    assert sched.pipeline_order == want
    for rank, actions in sched.pipeline_order_with_comms.items():  # lowered with the pairs kept whole
        assert [a for a in actions if a.computation_type in (FWD, INP, WGT, OVERLAP)] == want[rank]
    _run_pairs_apart(sched)  # without the overlap: each pair's forward, then its input gradient
    for rank, actions in sched.pipeline_order_with_comms.items():
        flat = [sub for a in want[rank] for sub in (a.sub_actions or (a,))]
        assert [a for a in actions if a.computation_type in (FWD, INP, WGT)] == flat


def _dualpipev_skeleton(order: dict[int, list]) -> dict[int, list]:
    """Per rank the forwards, pairs and backwards in their sequence, every backward as its input gradient, no W."""
    full = _ComputationType.FULL_BACKWARD

    def as_input(a: _Action) -> _Action:
        return _Action(a.stage_index, INP, a.microbatch_index) if a.computation_type == full else a

    return {
        r: [
            tuple(as_input(s) for s in (a.sub_actions or (a,)))
            for a in acts
            if a is not None and a.computation_type != WGT
        ]
        for r, acts in order.items()
    }


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 8), (4, 16)])
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5)])
def test_dualpipev_order_keeps_torchs_pairs_and_is_never_worse(p, m, costs):
    # the generated order is torch's DualPipeV with each backward split into its input gradient (in place, paired as
    # torch pairs it) and a weight gradient placed in a wait; at torch's own memory it never idles more
    from lightning_flagscale.parallel.pipeline_parallel.overlap import check_pairs_cross_chunks

    torchs = torch_v_order("dualpipev", p, m)
    order = dualpipev_order(p, m, costs)
    if order != {r: [a for a in acts if a is not None] for r, acts in torchs.items()}:
        assert _dualpipev_skeleton(order) == _dualpipev_skeleton(torchs)
    for r, actions in order.items():
        flat = [sub for a in actions for sub in (a.sub_actions or (a,))]
        got = sorted((a.stage_index, a.microbatch_index) for a in flat if a.computation_type in (INP, WGT))
        full = [
            (a.stage_index, a.microbatch_index) for a in flat if a.computation_type == _ComputationType.FULL_BACKWARD
        ]
        assert sorted(got + 2 * full) == sorted((s, mb) for s in (r, 2 * p - 1 - r) for mb in range(m) for _ in "IW")
    check_pairs_cross_chunks(order, {s: min(s, 2 * p - 1 - s) for s in range(2 * p)})
    assert _peak_activations(order) <= _peak_activations(torchs) == 2 * p + 1
    ours, theirs = simulate(order, 2 * p, costs), simulate(torchs, 2 * p, costs)  # raises if a rank would hang
    assert ours.makespan <= theirs.makespan + 1e-9


@pytest.mark.parametrize("m", [8, 16])
def test_dualpipev_order_idles_less_when_i_exceeds_w(m):
    # I = 2F = 2W, p = 4: torch's DualPipeV idles 7.1% (m = 8) of each rank's own span, 11.1% of the common step;
    # the weight gradients placed in the waits take it under the 5% at torch's memory for m = 16 and with
    # 3p activations (12, torch's 9) for m = 8, and cut the common-step bubble too
    costs = (1.0, 2.0, 1.0)
    torchs = simulate(torch_v_order("dualpipev", 4, m), 8, costs)
    same_memory = simulate(dualpipev_order(4, m, costs), 8, costs)
    more_memory = dualpipev_order(4, m, costs, cap=12)
    assert _peak_activations(more_memory) <= 12
    more = simulate(more_memory, 8, costs)
    assert torchs.own_bubble > 0.035
    assert same_memory.own_bubble < torchs.own_bubble - 0.01 and same_memory.bubble < torchs.bubble - 0.02
    assert more.own_bubble < 0.03 and more.bubble <= same_memory.bubble
    if m == 16:
        assert same_memory.own_bubble < 0.03


@pytest.mark.parametrize("p", range(1, 7))
def test_dualpipev_order_needs_2p_plus_1_activations_at_every_micro_batch_count(p):
    # what ParallelConfig checks at creation (it does not know m yet)
    for m in (2 * p, 2 * p + 1, 4 * p):
        assert _peak_activations(dualpipev_order(p, m, (1.0, 2.0, 1.0), cap=2 * p + 1)) <= 2 * p + 1
        with pytest.raises(ValueError, match=f"need {2 * p + 1}"):
            dualpipev_order(p, m, (1.0, 2.0, 1.0), cap=2 * p)


def test_dualpipev_order_refuses_a_cap_below_torchs_first_backward():
    # in torch's sequence the last rank runs 2p + 1 forwards (p + 1 of its first chunk, p of the V's way back) before
    # its first backward
    assert _peak_activations(dualpipev_order(4, 8, (1.0, 2.0, 1.0), cap=9)) == 9
    with pytest.raises(ValueError, match=r"cap=8 .* need 9\); raise ParallelConfig.pipeline_max_activations"):
        dualpipev_order(4, 8, (1.0, 2.0, 1.0), cap=8)


class _Tagged(torch.autograd.Function):
    """Identity whose backward records its tag: which gradient nodes a backward pass ran."""

    calls: list[str] = []

    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Tagged.calls.append(ctx.tag)
        return grad, None


def _tagged_chain() -> tuple[list[torch.nn.Parameter], torch.Tensor, torch.Tensor]:
    """Three layers y = x * w with their input (I0-I2) and weight (W0-W2) paths tagged: (weights, x, output)."""
    weights = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    x = torch.randn(2, 4, requires_grad=True)
    h = x
    for k, w in enumerate(weights):
        h = _Tagged.apply(h, f"I{k}") * _Tagged.apply(w, f"W{k}")
    return weights, x, h


def test_weight_pass_of_a_layer_chain_runs_each_weight_gradient_once():
    # three layers y = x * w, their input and weight paths tagged: torch's per-group weight passes are disjoint and
    # run W0..W2 only; merged into one pass they would run I1 and I2 again (a second input gradient per layer)
    weights, x, h = _tagged_chain()
    _, groups = stage_backward_input([h.sum()], None, [x], iter(weights))
    assert not param_groups_overlap(groups)
    _Tagged.calls.clear()
    stage_backward_weight(iter(weights), groups)
    assert sorted(_Tagged.calls) == ["W0", "W1", "W2"]


def test_chained_mtp_modules_are_found_to_overlap():
    # the case merge_param_groups exists for (issue 39): torch's per-group passes would walk common nodes
    from lightning_flagscale.models.decoder import CausalLM
    from tests.strategies.test_mtp_loop import mtp_config

    torch.manual_seed(0)
    stage = CausalLM(mtp_config(num_nextn_predict_layers=3, num_layers=1))
    stage.init_weights(0)
    stage.embed_tokens = None
    ids, labels = torch.randint(0, stage.vocab_size, (2, 2, 16)).unbind(0)
    x = torch.randn(2, 16, stage.config.hidden_size, requires_grad=True)
    loss = stage.loss_fn(stage(x, mtp_input_ids=ids), labels)
    _, groups = stage_backward_input([loss], None, [x], stage.parameters())
    assert param_groups_overlap(groups)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 4)])
def test_dualpipev_pairs_send_their_forward_output_when_the_forward_ends(p, m):
    # torch lowers a forward-backward pair with both sends after the pair: the next rank's forward also waits for
    # this rank's backward (p = 4, m = 8, F = I = W: 11.1% bubble instead of 5.9%); the runner runs them apart
    from lightning_flagscale.parallel.pipeline_parallel.runner import _run_pairs_apart

    sched = _mock_v_schedule(p, m, "ScheduleDualPipeV")
    pairs = {r: [sub for a in acts for sub in (a.sub_actions or (a,))] for r, acts in sched.pipeline_order.items()}
    _run_pairs_apart(sched)
    compute = (FWD, INP, WGT, _ComputationType.FULL_BACKWARD)
    for rank, actions in sched.pipeline_order_with_comms.items():
        assert [a for a in actions if a.computation_type in compute] == pairs[rank]  # same work, same order
        for k, a in enumerate(actions):
            if a.computation_type == FWD and a.stage_index not in (p - 1, 2 * p - 1):  # its output leaves the rank
                sends = [b for b in actions[k + 1 :] if b.computation_type == _ComputationType.SEND_F]
                assert sends and sends[0] == _Action(a.stage_index, _ComputationType.SEND_F, a.microbatch_index)
                assert not any(b.computation_type in compute for b in actions[k + 1 : actions.index(sends[0])])
    assert simulate(sched.pipeline_order, 2 * p, (1.0, 1.0, 1.0)).bubble == pytest.approx(
        v_lower_bound(p, m, (1.0, 1.0, 1.0))
    )


def test_stage_keeps_torchs_weight_groups_for_a_layer_chain(monkeypatch):
    # the runner's stage merges the weight groups into one pass only where they overlap (chained MTP modules)
    from torch.distributed.pipelining import PipelineStage

    from lightning_flagscale.parallel.pipeline_parallel.runner import StatelessInferenceStage

    weights, x, h = _tagged_chain()
    _, groups = stage_backward_input([h.sum()], None, [x], iter(weights))
    monkeypatch.setattr(PipelineStage, "backward_maybe_with_nosync", lambda self, *a, **k: ((None,), groups))
    stage = object.__new__(StatelessInferenceStage)  # only the override under test runs
    _, got = stage.backward_maybe_with_nosync("input", {}, False)
    assert got is groups and len(got) == 3
    _Tagged.calls.clear()
    stage_backward_weight(iter(weights), got)
    assert sorted(_Tagged.calls) == ["W0", "W1", "W2"]  # merged, the pass also ran I1 and I2 again


def test_hetero_runner_keeps_torchs_weight_groups_for_a_layer_chain():
    # the hetero runner's I step, like the pipeline stage: a chain of blocks keeps torch's per-group weight passes
    # (merged, the W pass ran the input gradients I1 and I2 again); only overlapping groups are merged
    from types import SimpleNamespace

    from lightning_flagscale.parallel.hetero_mesh.runner import HeteroPipelineRunner

    weights, x, h = _tagged_chain()
    runner = object.__new__(HeteroPipelineRunner)  # only _backward's split path runs: the last stage, V turn local
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(weights)
    runner.plan = SimpleNamespace(num_stages=2)
    runner._saved, runner._weight_work, runner._local, runner._one_weight_pass = {(1, 0): (x, h.sum())}, {}, {}, {}
    runner._module = lambda s: module
    runner._local_turn = lambda s: True
    runner._backward(1, 0, split=True, hold=True)
    assert runner._one_weight_pass == {1: False} and len(runner._weight_work[(1, 0)]) == 3
    _Tagged.calls.clear()
    stage_backward_weight(iter(weights), runner._weight_work.pop((1, 0)))
    assert sorted(_Tagged.calls) == ["W0", "W1", "W2"]
