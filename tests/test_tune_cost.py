"""The cost model's structure (issue 16 item 2): schedule bubbles, recompute overhead, DP reduction hidden under
backward, exposed TP traffic, MoE active FLOPs and MFU, on profiles whose every rate is known."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from lightning_flagscale.accounting.flops import flops_per_token
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.models.decoder import CausalLM
from lightning_flagscale.parallel.data_parallel.grad_buckets import bucket_runs
from lightning_flagscale.parallel.pipeline_parallel.orders import action_cost, simulate, torch_v_order
from lightning_flagscale.tune import HardwareProfile, LinkPoint, estimate_step
from lightning_flagscale.tune.calibrate import REFERENCE, selective_block_overhead
from lightning_flagscale.tune.cost import (
    _bubble,
    _bucket_sizes,
    _data_parallel,
    _optimizer_seconds,
    _overlap_saving,
    _Pass,
    _rank_params,
    _rank_pass,
    _rank_stage_params,
    _replay,
    _steady_bubble,
)
from lightning_flagscale.tune.hardware import BUILTIN_PROFILES, COLLECTIVES
from lightning_flagscale.tune.inflight import overlapped_pairs, schedule_live_peak
from lightning_flagscale.tune.memory_model import memory_breakdown

MODEL = TransformerConfig.from_preset("llama3-8b")
_TINY = TransformerConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_layers=4,
                          num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _profile(bandwidth: float = float("inf"), latency: float = 0.0, hbm: float = 1e12) -> HardwareProfile:
    link = [LinkPoint(group_size=2, latency=latency, bus_bandwidth=bandwidth)]
    return HardwareProfile(
        peak_flops=1e15, hbm_bandwidth=hbm, gemm=[(1.0, 1.0)], attention_efficiency=1.0,
        links={kind: {"intra": link, "inter": link} for kind in COLLECTIVES},
    )  # fmt: skip


def _layout(**kw) -> ParallelConfig:
    return ParallelConfig(**kw).resolve(8)


def test_bubbles_follow_each_schedule():
    hw, p, gb = _profile(), 4, 16  # 2 data-parallel replicas x 8 micro-batches
    bubbles = {}
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)):
        c = _layout(pipeline_parallel_size=p, pipeline_schedule=schedule, virtual_pipeline_parallel_size=v)
        one = _rank_pass(MODEL, c, 4096, hw)
        assert len(one.others) == p - 1  # the pipeline fills and drains through the other ranks
        bubbles[schedule] = estimate_step(MODEL, c, 4096, gb, hw).bubble_seconds
        if v == 2 and schedule in ("zbv", "dualpipev"):
            # V schedules: torch's order replayed with every stage's own F, I and W (the first stage's backward all
            # in W, torch's stage), less the heaviest rank's busy time; rank 0 holds the embedding and the head
            stages = [(f, b - w, w) for f, b, w in one.stages]
            sim = simulate(torch_v_order(schedule, p, 8), 2 * p, lambda a, st=stages: action_cost(a, st[a.stage_index]))
            assert one.rank == 0 and bubbles[schedule] == pytest.approx(sim.makespan - sim.busy(0), rel=1e-12)
            continue
        want = 0.0
        for f, b, w in one.others:
            f, b, w = f / v, b / v, w / v
            want += {"1f1b": f + b, "interleaved_1f1b": f + b, "zero_bubble": f + b - 2 * w}[schedule]
        assert bubbles[schedule] == pytest.approx(want)
    # interleaving halves the 1F1B bubble; splitting weight gradients (zero-bubble family) shrinks it further
    assert bubbles["1f1b"] == pytest.approx(2 * bubbles["interleaved_1f1b"], rel=0.02)
    assert bubbles["zero_bubble"] < bubbles["interleaved_1f1b"] and bubbles["zbv"] < bubbles["interleaved_1f1b"]
    assert bubbles["zbv"] < bubbles["dualpipev"] < bubbles["zero_bubble"]
    no_pp = estimate_step(MODEL, _layout(), 4096, gb, hw)
    assert no_pp.bubble_seconds == 0.0


@pytest.mark.parametrize("chunk", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0)])
def test_v_bubbles_are_the_replayed_order_the_runner_runs(chunk):
    # p = 4, m = 8, every chunk costing F : I : W = chunk (units): the closed form (p-1)(f+2b-3w) priced torch's
    # DualPipeV order at 6 and 12 units (issue 42), its replay idles 3 and 8, what the bench measures
    # (bench/results/pipeline_gen*.md); ZB-V's order 3 and 6. With pipeline_chunk_costs / pipeline_max_activations
    # the runner runs the generated order (orders.zbv_order / dualpipev_order), priced from its own replay.
    f, i, w = chunk
    one = _Pass(f=2 * f, b=2 * (i + w), w=2 * w, comm={})  # a rank's two chunks; no per-stage split: even stages

    def bubble(schedule: str, **knobs) -> float:
        return _bubble(_layout(pipeline_parallel_size=4, pipeline_schedule=schedule, **knobs), one, m=8)

    heavy = i > w
    assert bubble("dualpipev") == (8.0 if heavy else 3.0)
    assert bubble("zbv") == (6.0 if heavy else 3.0)
    # generated for the chunk's costs: DualPipeV's weight gradients placed in its waits (5 at torch's 2p + 1
    # activations and at 3p); ZB-V only gains from more memory (4p: the (p-1)F no V order beats)
    assert bubble("dualpipev", pipeline_chunk_costs=chunk) == (5.0 if heavy else 3.0)
    assert bubble("dualpipev", pipeline_chunk_costs=chunk, pipeline_max_activations=12) == (5.0 if heavy else 3.0)
    assert bubble("zbv", pipeline_chunk_costs=chunk) == (6.0 if heavy else 3.0)
    assert bubble("zbv", pipeline_chunk_costs=chunk, pipeline_max_activations=16) == 3.0
    # "auto": the order generated for the measured costs, here the model's own
    assert bubble("dualpipev", pipeline_chunk_costs="auto") == bubble("dualpipev", pipeline_chunk_costs=chunk)
    # DualPipeV's overlapped pairs run fused (both outputs sent when the pair ends): nothing to hide, the fill and
    # drain cost twice the apart order at F = I = W (p = 4, m = 8: 11.1% of the step instead of 5.9%)
    fused = _bubble(_layout(pipeline_parallel_size=4, pipeline_schedule="dualpipev"), one, overlap=True, m=8)
    assert fused == (11.0 if heavy else 6.0)


def test_v_bubble_settles_after_the_warm_up_as_the_search_prices_it():
    # The search prices m up to 60p micro-batches from the replays at 3p and 4p when they agree (_replayed_bubble):
    # DeepSeek-V3's stages (MoE, MLA, the MTP module on the last stage, embedding and head on rank 0) on PP 8, with
    # and without DualPipeV's fused pairs, give the replay of m itself at 10p and 40p
    model, hw = TransformerConfig.from_preset("deepseek-v3"), _profile(bandwidth=5e10, latency=1e-5)
    for schedule, overlap in (("zbv", False), ("dualpipev", False), ("dualpipev", True)):
        c = ParallelConfig(pipeline_parallel_size=8, pipeline_schedule=schedule, expert_parallel_size=8,
                           recompute="full", overlap_moe_expert_parallel_comm=overlap).resolve(64)  # fmt: skip
        one = _rank_pass(model, c, 4096, hw)
        for m in (80, 320):
            exact = _replay.__wrapped__(schedule, 8, m, None, None, *_replay_args(one, overlap))
            assert _bubble(c, one, overlap, m) == pytest.approx(exact, rel=1e-9)
        assert _steady_bubble(schedule, 8, *_replay_args(one, overlap)) is not None  # the shortcut was taken


def _replay_args(one: _Pass, overlap: bool) -> tuple:
    stages = tuple((f, b - w, w) for f, b, w in one.stages)
    hidden = None
    if overlap:
        ranks = [*one.others[: one.rank], (one.f, one.b, one.w), *one.others[one.rank :]]
        eps = [*one.others_ep[: one.rank], one.ep, *one.others_ep[one.rank :]]
        hidden = tuple(_overlap_saving(f / 2, b / 2, ef / 2, eb / 2) for (f, b, _), (ef, eb) in zip(ranks, eps))
    return stages, hidden, one.rank


def test_generated_v_orders_hold_the_activations_of_the_order_the_runner_runs():
    # p = 4, m = 8, one activation a stage: torch's ZB-V order holds 2p, its DualPipeV order 2p + 1 on every rank;
    # the order generated for I = 2F = 2W under a larger cap uses it (tune.memory_model walks what runs)
    unit = dict.fromkeys(range(8), 1.0)

    def live(schedule: str, weight: dict = unit, **knobs) -> list[tuple[float, int]]:
        return [schedule_live_peak(schedule, 4, 2, 8, r, weight, **knobs) for r in range(4)]

    assert [n for _, n in live("zbv")] == [8] * 4 and [n for _, n in live("dualpipev")] == [9] * 4
    assert [n for _, n in live("dualpipev", costs=(1.0, 2.0, 1.0), cap=12)] == [12, 11, 12, 12]
    assert [n for _, n in live("zbv", costs=(1.0, 2.0, 1.0), cap=16)] == [13, 13, 14, 16]
    assert live("zbv", costs=(1.0, 2.0, 1.0)) == live("zbv")  # the cap left at 2p: torch's memory
    # "auto": the costs are measured in training; the order never holds more than its cap, each at the rank's
    # heaviest stage (the last stage, on rank 0, carries the head)
    heavy = {**unit, 7: 3.0}
    assert live("dualpipev", heavy, costs="auto") == [(27.0, 9), (9.0, 9), (9.0, 9), (9.0, 9)]
    assert live("zbv", heavy, costs="auto", cap=12)[0] == (36.0, 12)
    with pytest.raises(ValueError, match="only 'zbv' and 'dualpipev' run an order built here"):
        schedule_live_peak("zero_bubble", 4, 2, 8, 0, unit, costs=(1.0, 2.0, 1.0))


def test_uneven_split_fills_through_the_light_stages():
    # 29 + 1 + 1 + 1 layers: the heavy first stage waits (p-1) slots of one-layer stages, not of itself
    hw = _profile()
    c = _layout(pipeline_parallel_size=4, pipeline_layers=[29, 1, 1, 1])
    one = _rank_pass(MODEL, c, 4096, hw)
    light = sum(f + b for f, b, _ in one.others)
    assert estimate_step(MODEL, c, 4096, 16, hw).bubble_seconds == pytest.approx(light)
    assert light < 0.25 * (one.f + one.b)  # the heaviest-stage formula would charge 3 (F+B) of the 29-layer stage


def test_full_recompute_costs_about_one_extra_forward():
    hw = _profile(hbm=float("inf"))  # GEMMs and attention only (no optimizer or memory-bound time)
    none = estimate_step(MODEL, _layout(), 4096, 8, hw).compute_seconds
    full = estimate_step(MODEL, _layout(recompute="full"), 4096, 8, hw).compute_seconds
    selective = estimate_step(MODEL, _layout(recompute="selective"), 4096, 8, hw).compute_seconds
    assert 1.25 < full / none < 1.36  # forward is a third of the GEMM work, a bit less with attention's 2.5x backward
    assert selective == none < full  # selective re-runs memory-bound kernels only: free at infinite bandwidth
    hw = _profile()
    selective = estimate_step(MODEL, _layout(recompute="selective"), 4096, 8, hw).compute_seconds
    assert estimate_step(MODEL, _layout(), 4096, 8, hw).compute_seconds < selective


def test_selective_mm_recomputes_the_k_o_and_up_projections():
    # On the flat profile (1 PFLOP/s) a GEMM costs its FLOPs / 1e15: llama3-8b's k (4096 x 1024), o (4096 x 4096)
    # and up (4096 x 14336) forward GEMMs on 4096 tokens a micro-batch, re-run in each block's backward.
    hw, tokens = _profile(hbm=float("inf")), 4096
    per_block = 2 * tokens * MODEL.hidden_size * (1024 + 4096 + MODEL.intermediate_size) / 1e15
    c = {mode: _layout(recompute=mode) for mode in ("selective", "selective_mm")}
    base, got = (_rank_pass(MODEL, c[mode], tokens, hw) for mode in ("selective", "selective_mm"))
    assert got.f == base.f and got.b - base.b == pytest.approx(MODEL.num_layers * per_block)
    over = hw.replace(selective_overhead=(1e-3, 3e-3))  # the same selective-checkpoint dispatch
    assert _rank_pass(MODEL, c["selective_mm"], tokens, over).b - got.b == pytest.approx(MODEL.num_layers * 3e-3)
    # ~37% of a block's projection FLOPs, between selective (none) and full (all of the forward)
    compute = {m: estimate_step(MODEL, _layout(recompute=m), tokens, 8, hw).compute_seconds
               for m in ("selective", "selective_mm", "full")}  # fmt: skip
    assert compute["selective"] < compute["selective_mm"] < compute["full"]
    moe = TransformerConfig.from_preset("mixtral-tiny")
    with pytest.raises(ValueError, match="dense blocks only"):
        estimate_step(moe, ParallelConfig(recompute="selective_mm").resolve(1), 64, 1, hw)


def test_data_parallel_reduction_hides_under_backward():
    c = _layout(zero_stage=0)
    fast = estimate_step(MODEL, c, 4096, 8, _profile(bandwidth=1e12))
    psi = MODEL.num_params()
    reduce = 2 * 7 / 8 * 4 * psi / 1e12  # fp32 all-reduce over 8 ranks
    # only the last bucket shows: the embedding's (reduced last, a tensor larger than a bucket, alone)
    embedding = MODEL.vocab_size * MODEL.hidden_size
    assert fast.comm["dp"] == pytest.approx(reduce * embedding / psi, rel=1e-6)
    slow = estimate_step(MODEL, c, 4096, 8, _profile(bandwidth=1e9))
    backward = _rank_pass(MODEL, c, 4096, _profile()).b
    assert slow.comm["dp"] == pytest.approx(2 * 7 / 8 * 4 * psi / 1e9 - backward, rel=1e-3)


def test_every_gradient_bucket_pays_the_link_latency():
    """DDP / ZeRO launch one collective per bucket: the latency is paid per bucket, the bytes once."""
    tiny = _TINY
    c = _layout(zero_stage=1)
    for numel in (1 << 18, 1 << 20):
        # the buckets the tuner counts are the ones the strategy cuts (one process: the same tensors)
        params = list(CausalLM(tiny).parameters())
        real = [sum(p.numel() for p in run) for _, run in bucket_runs(params[::-1], numel)]
        assert _bucket_sizes(tiny, c, [0], numel)["dense"] == pytest.approx(real)
        zero = estimate_step(tiny, c, 128, 8, _profile(bandwidth=float("inf"), latency=0.0), grad_bucket_numel=numel)
        slow = estimate_step(tiny, c, 128, 8, _profile(bandwidth=float("inf"), latency=1e-3), grad_bucket_numel=numel)
        # no compute hides anything at infinite bandwidth: each bucket's reduce-scatter and all-gather add 1 ms
        assert slow.step_seconds - zero.step_seconds == pytest.approx(2 * len(real) * 1e-3, rel=0.05)


def _tp_bucket_sizes(numel: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

    model = CausalLM(_TINY)
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=False)
    params = list(model.parameters())
    return [sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in run)
            for _, run in bucket_runs(params[::-1], numel)]  # fmt: skip


# An MoE block with a gated shared expert (Qwen2-MoE), both balance losses and QK-norm, under each TP layout of 2
# ranks: its own chunk with and without EP, the whole sequence without SP (EP 2) and with experts split over ETP 2
# (with and without SP).
_MOE_TP = TransformerConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, num_shared_experts=1,
    shared_expert_intermediate_size=80, shared_expert_gate=True, moe_aux_loss_coeff=0.01, moe_seq_aux_loss_coeff=0.01,
    qk_norm=True,
)  # fmt: skip
_MOE_TP_LAYOUTS = {
    "own chunk, EP 2": dict(sequence_parallel=True, expert_parallel_size=2),
    "own chunk, no EP": dict(sequence_parallel=True),
    "whole sequence, EP 2": dict(expert_parallel_size=2),
    "whole sequence, ETP 2 + SP": dict(sequence_parallel=True, expert_tensor_parallel_size=2),
    "whole sequence, ETP 2": dict(expert_tensor_parallel_size=2),
    "own chunk, EP 2, capacity": dict(sequence_parallel=True, expert_parallel_size=2, moe_capacity_factor=8.0),
}
"""Layout keywords (``moe_capacity_factor``: the model's; 8.0 drops nothing, so every routed row runs)."""


def _moe_tp_case(kw: dict) -> tuple[TransformerConfig, ParallelConfig]:
    """The model and TP 2 layout of a ``_MOE_TP_LAYOUTS`` entry."""
    kw = dict(kw)
    model = dataclasses.replace(_MOE_TP, moe_capacity_factor=kw.pop("moe_capacity_factor", None))
    return model, ParallelConfig(tensor_parallel_size=2, **kw).resolve(2)


_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _strategy_model(config: TransformerConfig, c: ParallelConfig) -> tuple[CausalLM, Any]:
    """``CausalLM(config)`` built on this rank as the strategy builds it under ``c`` (meta, parallelised,
    materialised, seed 0) and its weights tagged as the strategy tags them (experts, chunk-routed and TP-partial
    weights); with its meshes."""
    from lightning_flagscale.parallel.mesh import build_meshes
    from lightning_flagscale.parallel.plan import Parallelized, RankLayout, _apply_model_parallelisms

    meshes = build_meshes(c, "cpu")
    with torch.device("meta"):
        model = CausalLM(config)
    _apply_model_parallelisms(model, RankLayout(c, meshes, torch.device("cpu")))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    Parallelized(parts=[model]).tag_parameters(model, c)
    return model, meshes


def _moe_block_counts(kw: dict, batch: int, seq: int) -> tuple[int, dict[str, list[int]], list[tuple[str, int]]]:
    """FLOPs of the MoE block's forward + backward on this rank, per collective op its calls and payload bytes on
    groups of more than one rank, and the model's gradient buckets of 2^14 elements (reduction group, elements),
    with the block built as the strategy builds it (TP 2 plan, EP / ETP, token groups; fp32)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_flagscale.accounting.comm import CommTracker
    from lightning_flagscale.distributed.dtensor import local_tensor

    config, c = _moe_tp_case(kw)
    model, meshes = _strategy_model(config, c)
    block = model.layers["0"].mlp
    block.experts.use_grouped_mm = False  # per-expert matmuls, which FlopCounterMode counts (torch._grouped_mm not)
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(batch, seq, _MOE_TP.hidden_size, generator=g) for _ in range(2))  # the TP group's sequences
    if c.sequence_parallel:  # the block takes and returns this rank's sequence chunk
        x, dy = (t.chunk(2, dim=1)[meshes.local_rank("tp")] for t in (x, dy))
    x.requires_grad_()
    with FlopCounterMode(display=False) as flops, CommTracker() as comm:
        block(x).backward(dy)
    ops = {op: [0, 0] for op in _OPS}
    for group in comm.summary().values():
        for op, stats in group["ops"].items():
            if group["size"] > 1:  # a collective of one rank moves nothing (the token group without data ranks)
                ops[op][0] += stats["calls"]
                ops[op][1] += stats["payload_bytes"]
    params = list(model.parameters())[::-1]
    buckets = [(key[0], sum(local_tensor(p).numel() for p in run)) for key, run in bucket_runs(params, 1 << 14)]
    return flops.get_total_flops(), ops, buckets


def _chunk_routed_zero1_states() -> dict:
    """Model-state bytes on this rank of the MoE model under TP 2 + SP with ZeRO-1 (AdamW, fp32), its weights tagged
    as the strategy tags them, after one step (Adam's states exist)."""
    from lightning_flagscale.accounting.state_bytes import state_bytes
    from lightning_flagscale.parallel.data_parallel.optimizer import distributed_optimizers

    c = ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, zero_stage=1).resolve(2)
    model, meshes = _strategy_model(_MOE_TP, c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (dopt,) = distributed_optimizers([opt], model, meshes, c, master_weights=False, hooks=False).values()
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    dopt.reduce_grads()
    opt.step()
    dopt.sync_params()
    return vars(state_bytes(model, [opt]))


_QK_NORM = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                qk_norm=True, max_seq_len=32)  # fmt: skip


def _tp_plans() -> tuple[dict[str, str], dict[str, str]]:
    """(the calibration's, the strategy's) TP 2 plan of a QK-norm decoder: each parameter's kind and placements."""
    from lightning_flagscale.parallel.mesh import build_meshes
    from lightning_flagscale.parallel.plan import RankLayout, _apply_model_parallelisms
    from lightning_flagscale.tune.calibrate import planned_decoder

    c = ParallelConfig(tensor_parallel_size=2).resolve(2)
    meshes = build_meshes(c, "cpu")
    strategy = CausalLM(TransformerConfig(**_QK_NORM, num_layers=1))
    _apply_model_parallelisms(strategy, RankLayout(c, meshes, torch.device("cpu")))
    calibration = planned_decoder(_QK_NORM, 1, torch.float32, meshes["tp"])
    return tuple(
        {name: f"{type(p.data).__name__}{getattr(p, 'placements', '')}" for name, p in m.named_parameters()}
        for m in (calibration, strategy)
    )


def _tp2_runs(numels: tuple[int, ...], batch: int, seq: int) -> tuple[list, dict, dict, tuple]:
    """One TP 2 launch: the strategy's gradient buckets for each bucket size, the MoE block's counts per layout,
    the chunk-routed MoE model's ZeRO-1 states and the calibration's and the strategy's TP plans."""
    counts = {k: _moe_block_counts(kw, batch, seq) for k, kw in _MOE_TP_LAYOUTS.items()}
    return [_tp_bucket_sizes(n) for n in numels], counts, _chunk_routed_zero1_states(), _tp_plans()


@pytest.fixture(scope="module")
def tp2_runs(launcher):
    return launcher(2, _tp2_runs, (1 << 16, 1 << 18), 2, 32)


def test_calibration_times_the_tensor_parallel_plan_the_strategy_runs(tp2_runs):
    """``tune --calibrate`` measures the TP host time (``tp_overhead``) on the plan the strategy applies: QK-norm's
    weights plain local tensors whose TP-partial gradients the step sums (c8712d7), not replicated DTensors summed
    in every backward; every other parameter sharded or replicated alike."""
    for rank in tp2_runs:
        calibration, strategy = rank[3]
        assert calibration == strategy
        assert strategy["layers.0.self_attn.q_norm.weight"] == "Tensor"  # what the default plan would make a DTensor
        assert strategy["layers.0.self_attn.q_proj.weight"].startswith("DTensor")


def test_tensor_parallel_buckets_hold_sharded_and_replicated_parameters_as_the_tuner_counts(tp2_runs):
    """Under TP 2 the strategy's buckets (local shards of the sharded weights with the replicated norms) are the
    ones ``_bucket_sizes`` prices: the norms no longer cut a bucket each."""
    c = ParallelConfig(tensor_parallel_size=2).resolve(2)
    (real_0, *_), (real_1, *_) = tp2_runs
    # tensors larger than a bucket (alone), then several tensors a bucket
    for numel, real in zip((1 << 16, 1 << 18), zip(real_0, real_1, strict=True), strict=True):
        assert real[0] == real[1]
        assert _bucket_sizes(_TINY, c, [0], numel)["dense"] == pytest.approx(real[0])
    # a bucket cut at every replicated norm would mean at least 2 x layers + 1 buckets
    assert len(real[0]) < 2 * _TINY.num_layers + 1


def test_moe_block_under_tensor_parallel_is_priced_as_it_runs(tp2_runs):
    """The MoE block's GEMMs and collectives the cost model prices (``tune.moe_cost``) are the ones it runs under each
    TP 2 layout, summed over both ranks (routing decides how the rows split between EP ranks, not their sum): the
    FLOPs of its forward + backward (every GEMM's input and weight need gradients: backward = 2 x forward) and the
    calls and payload bytes of each collective op, with the weights tagged as the strategy tags them. Routing its own
    chunk, router, shared expert and rows run on t / tp tokens and no TP collective runs in the block (the replicated
    weights' gradients are summed over TP by the step's reduction, below; capacity routing first all-gathers every
    chunk's choices and weights); on the whole sequence every TP rank routes all t tokens and dispatches their t k
    rows."""
    from lightning_flagscale.tune.moe_cost import moe_collectives, moe_gemms

    batch, seq = 2, 32
    counts = [dict(rank[1]) for rank in tp2_runs]
    for name, kw in _MOE_TP_LAYOUTS.items():
        model, c = _moe_tp_case(kw)
        c = dataclasses.replace(c, micro_batch_size=batch)
        t = batch * seq  # the micro-batch's tokens on each TP rank
        flops = 2 * 3 * sum(rows * cols * inner * n for rows, cols, inner, n in moe_gemms(model, c, t))
        assert sum(rank[name][0] for rank in counts) == pytest.approx(2 * flops, rel=1e-12), name
        want = {op: [0, 0] for op in _OPS}
        for x in (x for calls in moe_collectives(model, c, t, act_bytes=4) for x in calls):
            want[x.op][0] += 1
            want[x.op][1] += x.nbytes / x.size if x.op == "all_gather" else x.nbytes  # the rank's input
        got = {op: [sum(rank[name][1][op][i] for rank in counts) for i in (0, 1)] for op in _OPS}
        assert got == {op: [2 * n, pytest.approx(2 * b, rel=1e-12)] for op, (n, b) in want.items()}, name
    # The gradient buckets hold the router and the shared expert (and its gate) whole on each TP rank, as the data-
    # parallel reduction and the optimizer are priced; routing its own chunk, they and the experts without EP are
    # reduced over the stage (dp_cp_tp), with the norms on sequence shards under SP, the rest over the data x context
    # ranks, the experts under EP over edp.
    groups = {"dp_cp": "dense", "dp_cp_tp": "stage", "edp": "expert"}
    for name in ("own chunk, no EP", "own chunk, EP 2", "whole sequence, EP 2"):
        c = ParallelConfig(tensor_parallel_size=2, **_MOE_TP_LAYOUTS[name]).resolve(2)
        real = {"dense": [], "expert": [], "stage": []}
        for group, numel in counts[0][name][2]:
            real[groups[group]].append(numel)
        assert _bucket_sizes(_MOE_TP, c, [0], 1 << 14) == real, name
        dense, expert = _rank_params(_MOE_TP, c)[0]
        assert dense + expert / c.expert_shards == sum(sum(sizes) for sizes in real.values()), name
        assert _rank_stage_params(_MOE_TP, c) == [sum(real["stage"])], name
    # ZeRO-1 shards the TP-partial weights' fp32 main copy and Adam states over the stage (2 ranks here), the rest
    # over the data ranks (1): the memory model's states equal the run's (as test_tune_memory's Trainer runs)
    c = ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, zero_stage=1).resolve(2)
    want = memory_breakdown(_MOE_TP, c, seq, batch, precision="32-true").ranks[0]
    for rank in tp2_runs:
        for key in ("params", "grads", "master_params", "optimizer_states"):
            value = getattr(want, key)
            assert abs(rank[2][key] - value) <= 512 + 2e-3 * value, (key, rank[2][key], value)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_tp_partial_weights_are_reduced_over_the_stage_once_a_step(zero):
    """Under TP 2 + SP (DP 4), routing its own chunk, the router, shared expert and experts (no EP), and the norms on
    sequence shards, are reduced over the stage's 8 ranks, summed over TP in the same collective (DDP: all-reduce;
    ZeRO-1: reduce-scatter + all-gather, states sharded 8 ways), the rest over the 4 data ranks; under ZeRO-3
    everything over the data ranks, then one fp32 all-reduce of the TP-partial shards over TP at the step
    (``reduction_groups``, ``sum_chunk_grads``). No TP all-reduce of theirs per micro-batch (the block's collectives
    above)."""
    hw = _profile(bandwidth=1e10).replace(optimizer_seconds_per_param=1e-9)
    c = ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, zero_stage=zero).resolve(8)
    dense, expert = _rank_params(_MOE_TP, c)[0]
    buckets = _bucket_sizes(_MOE_TP, c, [0], 1 << 30)
    partial = sum(buckets["stage"])  # the norms cut the runs: one bucket of them per run
    h, e, inner, shared, d = 64, 4, 48, 80, 16  # _MOE_TP: router, experts, shared expert and its gate; QK-norm
    moe, norms = h * e + 3 * h * inner * e + 3 * h * shared + h, 2 * d + 2 * h + h  # 2 block norms, the final one
    assert [partial] == _rank_stage_params(_MOE_TP, c) == [moe + norms]
    whole, rest = dense + expert, dense + expert - partial

    def seconds(op: str, nbytes: float, n: int) -> float:
        return hw.collective_seconds(op, nbytes, n, inter_node=False)

    _, total = _data_parallel(_MOE_TP, c, hw, dense, expert, last_backward=0.0, compute=0.0, buckets=buckets)
    if zero == 0:
        want = seconds("all_reduce", 4 * rest, 4) + seconds("all_reduce", 4 * partial, 8)
    elif zero == 1:
        want = sum(seconds("reduce_scatter", 4 * p, n) + seconds("all_gather", 2 * p, n) for p, n in ((rest, 4),
                                                                                                   (partial, 8)))  # fmt: skip
    else:  # FSDP gathers per micro-batch in forward and backward, one reduce-scatter, then the TP sum of the shards
        want = 2 * c.gradient_accumulation_steps * seconds("all_gather", 2 * whole, 4)
        want += seconds("reduce_scatter", 4 * whole, 4) + seconds("all_reduce", 4 * partial / 4, 2)
    assert total == pytest.approx(want, rel=1e-12)
    shards = {0: whole, 1: rest / 4 + partial / 8, 3: whole / 4}[zero]
    assert _optimizer_seconds(c, hw, dense, expert, partial) == pytest.approx(1e-9 * shards, rel=1e-12)


def test_tensor_parallel_traffic_is_exposed_per_layer_and_at_the_ends():
    c = _layout(tensor_parallel_size=8, sequence_parallel=True)
    bw = 1e11
    cost = estimate_step(MODEL, c, 4096, 1, _profile(bandwidth=bw))
    act = 4096 * MODEL.hidden_size * 2  # one bf16 activation of a micro-batch
    # forward and backward: 2 all-gathers + 2 reduce-scatters each, per layer; the embedding's reduce-scatter and
    # the head's all-gather, both mirrored in backward; the loss's two fp32 all-reduces (1 and 2 floats a token)
    want = (MODEL.num_layers * 2 * 2 * 2 + 4) * (7 / 8 * act / bw) + 2 * 7 / 8 * 4096 * (4 + 8) / bw
    assert cost.comm["tp"] == pytest.approx(want, rel=1e-6)
    assert cost.step_seconds > estimate_step(MODEL, c, 4096, 1, _profile()).step_seconds + 0.9 * want


def test_mfu_uses_model_flops_and_the_profile_peak():
    mixtral = TransformerConfig.from_preset("mixtral-8x7b")
    hw = _profile()
    c = ParallelConfig(expert_parallel_size=8).resolve(8)
    cost = estimate_step(mixtral, c, 4096, 8, hw)
    assert cost.mfu == pytest.approx(cost.tokens_per_second * flops_per_token(mixtral, 4096) / (8 * hw.peak_flops))
    assert 0 < cost.mfu < 1


@pytest.mark.parametrize("balance", [0.0, 0.01])
def test_expert_parallel_counts_every_collective_of_the_moe_layer(balance):
    # Latency only: per MoE layer and micro-batch the code runs an all-gather of the per-expert counts and the
    # dispatch + combine all-to-alls in forward, the two all-to-alls again in backward, and with a global balance
    # loss one all-reduce of the routing statistics over the data-parallel ranks (parallel/expert_parallel/apply.py, moe/router.py).
    moe = TransformerConfig.from_preset("mixtral-8x7b", moe_aux_loss_coeff=balance)
    c = ParallelConfig(expert_parallel_size=8).resolve(8)  # EP 8 inside DP 8
    latency = 1e-3
    cost = estimate_step(moe, c, 4096, 8, _profile(latency=latency))
    calls = 5 + (1 if balance else 0)
    assert cost.comm["ep"] == pytest.approx(moe.num_layers * calls * latency)


def test_attention_is_timed_per_call_and_ring_blocks_through_their_kernel():
    # A calibrated CPU profile: SDPA calls at 10% of peak forward and 2% backward (on 2.5x the FLOPs), the torch ring
    # kernel at 5% / 4% on whole blocks. Without the tables every call runs at attention_efficiency, backward 2.5x.
    from lightning_flagscale.tune.cost import _attention

    hw = _profile().replace(attention_efficiency=0.5)
    table = hw.replace(attention_calls=[(1.0, 0.1, 0.02)], ring_blocks=[(1.0, 0.05, 0.04)])
    s, heads, d, peak = 4096, MODEL.num_attention_heads, MODEL.head_dim, hw.peak_flops
    causal = 0.5 * 4 * s * s * heads / 2 * d  # TP 2 splits the heads
    tp = _layout(tensor_parallel_size=2)
    assert _attention(MODEL, tp, s, hw) == pytest.approx((causal / (0.5 * peak), 2.5 * causal / (0.5 * peak)))
    assert _attention(MODEL, tp, s, table) == pytest.approx((causal / (0.1 * peak), 2.5 * causal / (0.02 * peak)))
    # ring CP 4: 4 steps on s/4 tokens; the diagonal block causal, the 3 others half a block
    ring = _layout(context_parallel_size=4)
    block = 4 * (s / 4) ** 2 * heads * d
    fused = (0.5 + 3 * 0.5) * block  # = the causal FLOPs of one call over the whole sequence, split over 4 ranks
    assert fused == pytest.approx(0.5 * 4 * s * s * heads * d / 4)
    assert _attention(MODEL, ring, s, hw) == pytest.approx((fused / (0.5 * peak), 2.5 * fused / (0.5 * peak)))
    torch_blocks = (1 + 3 * 0.5) * block  # the torch kernel computes the whole diagonal block (masked)
    want = (torch_blocks / (0.05 * peak), 2.5 * torch_blocks / (0.04 * peak))
    assert _attention(MODEL, ring, s, table) == pytest.approx(want)
    # Ulysses: one call on the whole sequence with the heads split
    uly = _layout(context_parallel_size=4, context_parallel_mode="ulysses")
    assert _attention(MODEL, uly, s, table) == pytest.approx(
        (causal / 2 / (0.1 * peak), 2.5 * causal / 2 / (0.02 * peak))
    )


def test_each_attention_backend_is_priced_by_its_own_kernel_curve():
    # attention_kernels: flash_attn at 20% forward / 10% backward, transformer_engine at 40% / 30%; torch has no
    # curve here and falls back to this machine's measured calls (10% / 2%). A ring through a fused kernel is its
    # causal FLOPs at that kernel's rate, whatever the torch block kernel's measured table says.
    import dataclasses

    from lightning_flagscale.tune.cost import _attention

    kernels = {"flash_attn": [(1.0, 0.2, 0.1)], "transformer_engine": [(1.0, 0.4, 0.3)]}
    hw = _profile().replace(attention_calls=[(1.0, 0.1, 0.02)], ring_blocks=[(1.0, 0.05, 0.04)],
                            attention_kernels=kernels)  # fmt: skip
    s, heads, d, peak = 4096, MODEL.num_attention_heads, MODEL.head_dim, hw.peak_flops
    causal = 0.5 * 4 * s * s * heads * d
    for backend, (fwd, bwd) in (("flash_attn", (0.2, 0.1)), ("transformer_engine", (0.4, 0.3)), ("torch", (0.1, 0.02))):
        model = dataclasses.replace(MODEL, attn_backend=backend)
        want = (causal / (fwd * peak), 2.5 * causal / (bwd * peak))
        assert _attention(model, _layout(), s, hw) == pytest.approx(want)
        if backend != "torch":  # ring CP 4 through the fused kernel: the causal FLOPs split over 4 ranks
            ring = _layout(context_parallel_size=4)
            assert _attention(model, ring, s, hw) == pytest.approx((want[0] / 4, want[1] / 4))


def test_builtin_hopper_profiles_price_flash_attention_2_and_cudnn_from_their_benchmarks():
    # FlashAttention-3 paper, H100 SXM5, head dim 128, at 16k tokens a call (16 heads of 128): FA2 335 TFLOP/s
    # forward (causal) and 322 backward, cuDNN 539 / 516. torch's SDPA runs cuDNN on sm90 (torch 2.13).
    import dataclasses

    from lightning_flagscale.tune.hardware import builtin_profile

    for name in ("h100", "h200"):
        hw = builtin_profile(name)
        flops = 2.0 * 16384 * 16384 * 2048
        rate = hw.peak_flops * hw.compute_scale / 989e12
        assert hw.attention_call_seconds(flops, backend="flash_attn") == pytest.approx(
            (flops / (335e12 * rate), 2.5 * flops / (322e12 * rate))
        )
        assert hw.attention_call_seconds(flops, backend="transformer_engine") == pytest.approx(
            (flops / (539e12 * rate), 2.5 * flops / (516e12 * rate))
        )
        assert hw.attention_call_seconds(flops) == hw.attention_call_seconds(flops, backend="transformer_engine")
        # a whole step: only attention differs, and FlashAttention-2 makes it slower
        c = _layout(context_parallel_size=2)
        fa2, te = (estimate_step(dataclasses.replace(MODEL, attn_backend=b), c, 32768, 8, hw)
                   for b in ("flash_attn", "transformer_engine"))  # fmt: skip
        assert fa2.step_seconds > te.step_seconds
    assert not builtin_profile("a100").attention_kernels  # no published A100 curves: attention_efficiency


def test_attention_kernel_curves_are_validated_and_round_trip_through_json():
    import json

    hw = _profile().replace(attention_kernels={"flash_attn": [(1e9, 0.3, 0.25), (1e12, 0.34, 0.33)]})
    assert HardwareProfile.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    with pytest.raises(ValueError, match="attention_kernels maps attn_backend names"):
        _profile().replace(attention_kernels={"flash": [(1.0, 0.3, 0.3)]})
    with pytest.raises(ValueError, match="attention_kernels maps attn_backend names"):
        _profile().replace(attention_kernels={"flash_attn": []})
    with pytest.raises(ValueError, match=r"attention_kernels\['flash_attn'\] points are"):
        _profile().replace(attention_kernels={"flash_attn": [(1.0, 0.0, 0.3)]})


def test_few_rows_run_below_the_gemm_curve():
    # gemm_rows: a 16-row GEMM reaches half the efficiency its FLOPs give, 64 rows 0.8, from 256 rows up the curve
    hw = _profile()
    rows = hw.replace(gemm_rows=[(16.0, 0.5), (64.0, 0.8), (256.0, 1.0)])
    for m, factor in ((16, 0.5), (8, 0.5), (64, 0.8), (256, 1.0), (4096, 1.0)):
        assert rows.gemm_seconds(m, 4096, 4096) == pytest.approx(hw.gemm_seconds(m, 4096, 4096) / factor)
    assert rows.gemm_seconds(4096, 32, 4096) == pytest.approx(
        hw.gemm_seconds(4096, 32, 4096) / rows.gemm_shape_factor(32)
    )
    assert 0.5 < rows.gemm_shape_factor(32) < 0.8  # log-linear between 16 and 64
    with pytest.raises(ValueError, match="gemm_rows"):
        hw.replace(gemm_rows=[(16.0, 0.0)])


def test_the_moe_router_gemm_is_priced_at_the_fp32_rate():
    """The router runs ``x.float() @ w.float()`` whatever the precision (``moe/router.py``; torch's default fp32
    matmul precision, no TF32, which neither the package nor Lightning changes): its forward GEMM and both backward
    GEMMs are priced at the profile's ``fp32_peak_flops`` (on its measured ``fp32_gemm`` curve if it has one), the
    block's other GEMMs at the bf16 peak, and a Float8 speed-up (``gemm_scale``) is not the router's. 0:
    ``peak_flops``. The built-in profiles carry the datasheet FP32 peaks."""
    from lightning_flagscale.tune.cost import _block_pass

    model = TransformerConfig.from_preset("mixtral-8x7b")
    c, seq = ParallelConfig(expert_parallel_size=8).resolve(8), 4096
    router = 2 * seq * model.num_experts * model.hidden_size  # one micro-batch of one sequence
    hw = _profile(hbm=float("inf"))
    for scale in (1.0, 2.0):
        same = hw.replace(gemm_scale=scale)  # fp32_peak_flops 0: the router at peak_flops, without gemm_scale
        slow = same.replace(fp32_peak_flops=hw.peak_flops / 16)
        base, fp32 = (_block_pass(model, c, seq, p, True, "none") for p in (same, slow))
        extra = router / slow.fp32_peak_flops - router / hw.peak_flops
        assert fp32.f - base.f == pytest.approx(extra, rel=1e-9)
        assert fp32.w - base.w == pytest.approx(extra, rel=1e-9)  # the weight gradient
        assert fp32.b - base.b == pytest.approx(2 * extra, rel=1e-9)  # and the input gradient
    assert _block_pass(model, c, seq, hw, True, "none") == _block_pass(
        model, c, seq, hw.replace(fp32_peak_flops=hw.peak_flops), True, "none"
    )
    # a measured fp32 curve (tune --calibrate in bf16) times it instead of the bf16 one and its row factors
    curve = hw.replace(fp32_peak_flops=1e14, fp32_gemm=[(1e6, 0.5), (1e10, 1.0)], gemm_rows=[(8.0, 0.1), (512.0, 1.0)])
    assert curve.fp32_gemm_seconds(16, 4, 1024) == pytest.approx(2 * 16 * 4 * 1024 / (1e14 * 0.5), rel=1e-12)
    assert curve.fp32_gemm_seconds(8192, 256, 7168) == pytest.approx(2 * 8192 * 256 * 7168 / 1e14, rel=1e-12)
    assert HardwareProfile.from_dict(curve.to_dict()) == curve
    assert [BUILTIN_PROFILES[n].fp32_peak_flops for n in ("h100", "h200", "a100")] == [67e12, 67e12, 19.5e12]
    with pytest.raises(ValueError, match="fp32_peak_flops"):
        hw.replace(fp32_peak_flops=-1.0)
    with pytest.raises(ValueError, match="fp32_gemm"):
        hw.replace(fp32_gemm=[(1e6, 0.0)])


def test_backward_gemm_factors_slow_only_the_backward():
    # A CPU without native bf16 runs dY @ W ~10x slower than X @ W^T: the profile's factor moves backward time only.
    hw = _profile(hbm=float("inf"))
    slow = hw.replace(input_grad_gemm_factor=0.1)
    base, dgrad = _rank_pass(MODEL, _layout(), 4096, hw), _rank_pass(MODEL, _layout(), 4096, slow)
    assert dgrad.f == pytest.approx(base.f) and dgrad.w == pytest.approx(base.w)
    gemm = base.w  # forward GEMM time (= weight-gradient time at factor 1)
    assert dgrad.b - base.b == pytest.approx(9 * gemm)
    fast_w = _rank_pass(MODEL, _layout(), 4096, hw.replace(weight_grad_gemm_factor=2.0))
    assert fast_w.w == pytest.approx(gemm / 2) and fast_w.b == pytest.approx(base.b - gemm / 2)


def test_ranks_sharing_cores_absorb_the_pipeline_bubble_as_far_as_cores_allow():
    # 8 ranks on 4 cores: a rank waiting in the bubble lends its core, but a rank on the critical path (the fill and
    # the drain) cannot use more than one; the schedule is simulated on the shared cores (tune/shared_cores.py).
    hw = _profile(hbm=float("inf")).replace(devices_per_node=8)  # no optimizer time: DDP's would be 4x PP's
    ddp, pp = _layout(), _layout(pipeline_parallel_size=4)
    dedicated = estimate_step(MODEL, pp, 4096, 16, hw)
    assert dedicated.bubble_seconds > 0
    on_cores = estimate_step(MODEL, pp, 4096, 16, hw.replace(compute_units_per_node=4.0))
    assert 0.2 * dedicated.bubble_seconds < on_cores.bubble_seconds < 0.8 * dedicated.bubble_seconds
    assert on_cores.step_seconds == pytest.approx(on_cores.compute_seconds + on_cores.bubble_seconds, rel=1e-9)
    # compute = the node's work over its cores, the same as DDP's (the embedding/head sit on one stage: per-rank
    # work differs, the sum does not much)
    ddp_cores = estimate_step(MODEL, ddp, 4096, 16, hw.replace(compute_units_per_node=4.0))
    assert ddp_cores.step_seconds == pytest.approx(2 * estimate_step(MODEL, ddp, 4096, 16, hw).step_seconds, rel=1e-6)
    assert on_cores.compute_seconds == pytest.approx(ddp_cores.step_seconds, rel=0.05)
    # 4 ranks a core: each pipeline's 4 ranks share one core, always busy, the bubble is gone
    crowded = estimate_step(MODEL, pp, 4096, 16, hw.replace(compute_units_per_node=2.0))
    assert crowded.bubble_seconds == pytest.approx(0.0, abs=1e-9)
    assert crowded.step_seconds == pytest.approx(2 * on_cores.compute_seconds, rel=1e-9)
    # enough cores: nothing changes
    assert estimate_step(MODEL, pp, 4096, 16, hw.replace(compute_units_per_node=8.0)) == dedicated


def test_pipeline_actions_pay_the_schedule_host_time():
    # every forward and backward action of a schedule costs the calibrated host time: GPipe's critical path has
    # m + p - 1 of each, on the heaviest rank and through the bubble alike; nothing without a pipeline
    h, m, p = 2e-3, 4, 4
    hw = _profile(hbm=float("inf"))
    pp = _layout(pipeline_parallel_size=p, pipeline_schedule="gpipe")
    plain, with_host = (estimate_step(MODEL, pp, 4096, 2 * m, x) for x in (hw, hw.replace(pipeline_action_overhead=h)))
    assert with_host.step_seconds - plain.step_seconds == pytest.approx((m + p - 1) * 2 * h, rel=1e-6)
    ddp = _layout()
    assert estimate_step(MODEL, ddp, 4096, 8, hw.replace(pipeline_action_overhead=h)) == estimate_step(
        MODEL, ddp, 4096, 8, hw
    )
    # zero-bubble splits each backward into an input- and a weight-gradient action: three actions a micro-batch
    zb = _layout(pipeline_parallel_size=p, pipeline_schedule="zero_bubble", virtual_pipeline_parallel_size=2)
    one = _rank_pass(MODEL, zb, 4096, hw)
    host = _rank_pass(MODEL, zb, 4096, hw.replace(pipeline_action_overhead=h))
    assert (host.f - one.f, host.b - one.b, host.w - one.w) == pytest.approx((2 * h, 4 * h, 2 * h))  # 2 chunks
    with pytest.raises(ValueError, match="pipeline_action_overhead"):
        hw.replace(pipeline_action_overhead=-1.0)


def test_optimizer_time_is_the_measured_one_or_adam_traffic():
    # Without a measurement, Adam moves 34 bytes a parameter at HBM speed; a calibrated profile's per-parameter time
    # is used as measured, whatever compute_scale the end-to-end fit chose.
    c = _layout(zero_stage=1)  # the optimizer steps a 1/8 shard on each rank
    shard = MODEL.num_params() / 8
    derived = estimate_step(MODEL, c, 4096, 8, _profile(hbm=1e12))
    assert derived.optimizer_seconds == pytest.approx(shard * 34 / 1e12, rel=1e-3)
    measured = _profile(hbm=1e12).replace(optimizer_seconds_per_param=5e-9, compute_scale=0.25)
    got = estimate_step(MODEL, c, 4096, 8, measured)
    assert got.optimizer_seconds == pytest.approx(shard * 5e-9, rel=1e-3)
    with pytest.raises(ValueError, match="optimizer_seconds_per_param"):
        _profile().replace(optimizer_seconds_per_param=-1.0)


def test_collectives_on_shared_cores_are_not_hidden_under_backward():
    # gloo reduces on the CPU cores the ranks compute on: with 8 ranks on 4 cores the whole all-reduce adds to the
    # node's work, where dedicated devices hide all but its tail under backward.
    c = _layout(zero_stage=0)
    hw = _profile(bandwidth=1e12, hbm=float("inf")).replace(devices_per_node=8)
    reduce = 2 * 7 / 8 * 4 * MODEL.num_params() / 1e12
    dedicated = estimate_step(MODEL, c, 4096, 8, hw)
    assert dedicated.comm["dp"] < 0.5 * reduce
    shared = estimate_step(MODEL, c, 4096, 8, hw.replace(compute_units_per_node=4.0))
    assert shared.comm["dp"] == pytest.approx(reduce, rel=1e-6)
    assert shared.step_seconds == pytest.approx(2 * dedicated.compute_seconds + reduce, rel=1e-6)
    # the optimizer phase on the wall clock: every rank steps at once, 8 ranks on 4 cores take twice one rank's
    hw = hw.replace(optimizer_seconds_per_param=1e-9)
    dedicated = estimate_step(MODEL, c, 4096, 8, hw)
    assert dedicated.optimizer_wall_seconds == dedicated.optimizer_seconds > 0
    shared = estimate_step(MODEL, c, 4096, 8, hw.replace(compute_units_per_node=4.0))
    assert shared.optimizer_wall_seconds == pytest.approx(2 * shared.optimizer_seconds, rel=1e-6)


def test_ranks_sharing_cores_step_their_own_parameters():
    # The node's busy time sums what each rank holds: under a V placement one pipeline rank steps the embedding and
    # the head and the other neither, so the node steps the whole model once per replica, not twice the heaviest
    # rank's share (which charged pp2-zbv +24% and an uneven gpipe split +15% in the validation).
    units, per_param = 4.0, 1e-9
    hw = _profile(bandwidth=float("inf"), hbm=float("inf")).replace(
        peak_flops=1e30, devices_per_node=8, compute_units_per_node=units, optimizer_seconds_per_param=per_param
    )
    zbv = _layout(pipeline_parallel_size=2, pipeline_schedule="zbv")  # rank 0: stages 0 and 3, rank 1: 1 and 2
    got = estimate_step(MODEL, zbv, 4096, 8, hw)
    node = 8 * MODEL.num_params() / 2 * per_param  # 8 ranks, each half the model on average
    assert got.step_seconds == pytest.approx(node / units, rel=1e-3)
    heaviest = MODEL.num_params() / 2 + MODEL.vocab_size * MODEL.hidden_size
    assert got.optimizer_seconds == pytest.approx(heaviest * per_param, rel=1e-3)  # the heaviest rank's own phase
    # on the wall clock: the ranks' phases shared over the units (8 ranks, 4 units: each at half speed until the
    # lighter ones finish)
    light = MODEL.num_params() / 2 - MODEL.vocab_size * MODEL.hidden_size
    both = 2 * light * per_param + (heaviest - light) * per_param
    assert got.optimizer_wall_seconds == pytest.approx(both, rel=1e-3)


@pytest.mark.parametrize("ep", [1, 2])
def test_balance_statistics_wait_for_the_tokens_group_on_shared_cores(ep):
    # 8 ranks on 4 cores, a global balance loss: each MoE layer all-reduces its routing statistics over the 8 data-
    # parallel ranks (moe/router.py), so on shared cores that call waits the 8-rank wait, whatever the EP size; the
    # EP collectives (an all-gather and two all-to-alls forward, two all-to-alls backward) wait the EP group's.
    moe = TransformerConfig.from_preset("mixtral-8x7b", moe_aux_loss_coeff=0.01)
    hw = _profile(latency=1e-3).replace(devices_per_node=8, compute_units_per_node=4.0)
    c = _layout(expert_parallel_size=ep)
    base = estimate_step(moe, c, 4096, 8, hw)
    two, eight = 5e-3, 7e-2
    waited = estimate_step(moe, c, 4096, 8, hw.replace(blocking_collective=[(2.0, two), (8.0, eight)]))
    ep_calls = 5 if ep > 1 else 0
    per_layer = ep_calls * two + eight
    assert waited.comm["ep"] == pytest.approx(moe.num_layers * per_layer, rel=1e-9)
    assert waited.comm["ep"] - base.comm["ep"] == pytest.approx(moe.num_layers * (per_layer - (ep_calls + 1) * 1e-3))


def test_blocking_collectives_on_shared_cores_cost_the_measured_wait():
    # 8 ranks on 4 cores, TP 2: a blocking collective inside forward / backward costs the measured wait (wall time,
    # once) in place of the link latency (work on the shared cores, twice over with 2 ranks a core)
    latency, wait = 1e-3, 5e-3
    hw = _profile(bandwidth=float("inf"), latency=latency).replace(devices_per_node=8, compute_units_per_node=4.0)
    c = _layout(tensor_parallel_size=2)
    base = estimate_step(MODEL, c, 4096, 8, hw)
    waited = estimate_step(MODEL, c, 4096, 8, hw.replace(blocking_collective=[(2.0, wait), (8.0, 1.0)]))
    micro_batches = 8 // c.dp
    # per block 2 all-reduces in forward and 2 in backward; the embedding's, the head input's and the loss's two
    calls = micro_batches * (4 * MODEL.num_layers + 4)
    assert waited.comm["tp"] == pytest.approx(calls * wait, rel=1e-9)
    assert waited.step_seconds - base.step_seconds == pytest.approx(calls * (wait - 2 * latency), rel=1e-6)
    # devices of their own: the latency as before, the waits are a shared-core effect
    dedicated = hw.replace(compute_units_per_node=0.0)
    assert estimate_step(MODEL, c, 4096, 8, dedicated.replace(blocking_collective=[(2.0, wait)])) == estimate_step(
        MODEL, c, 4096, 8, dedicated
    )


def test_tensor_parallel_host_overhead_per_block_and_at_the_ends():
    hw = _profile()
    over = hw.replace(tp_overhead=(1e-3, 2e-3, 3e-3, 4e-3))
    c = _layout(tensor_parallel_size=2)
    base, got = _rank_pass(MODEL, c, 4096, hw), _rank_pass(MODEL, c, 4096, over)
    assert got.f - base.f == pytest.approx(MODEL.num_layers * 1e-3 + 3e-3)
    assert got.b - base.b == pytest.approx(MODEL.num_layers * 2e-3 + 4e-3)
    assert _rank_pass(MODEL, _layout(), 4096, over) == _rank_pass(MODEL, _layout(), 4096, hw)  # no TP, no DTensor
    with pytest.raises(ValueError, match="tp_overhead"):
        hw.replace(tp_overhead=(1.0, -1.0, 0.0, 0.0))


def test_selective_overhead_is_added_per_selectively_recomputed_block():
    hw = _profile()
    over = hw.replace(selective_overhead=(1e-3, 3e-3))
    c = _layout(recompute="selective")
    base, got = _rank_pass(MODEL, c, 4096, hw), _rank_pass(MODEL, c, 4096, over)
    assert (got.f - base.f, got.b - base.b) == pytest.approx((MODEL.num_layers * 1e-3, MODEL.num_layers * 3e-3))
    for mode in ("none", "full"):  # no selective-checkpoint dispatch there
        c = _layout(recompute=mode)
        assert _rank_pass(MODEL, c, 4096, over) == _rank_pass(MODEL, c, 4096, hw)
    with pytest.raises(ValueError, match="selective_overhead is 2 non-negative seconds"):
        hw.replace(selective_overhead=(1e-3, -1e-3))


def test_calibrated_block_overheads_are_the_residual_beyond_the_model():
    """``tune --calibrate`` keeps what a block measured beyond the model's own prediction of it (the difference of
    3 blocks and 1, so the embedding, head and loss cancel)."""
    hw = _profile()
    one_rank = ParallelConfig(recompute="selective").resolve(1)
    pred = [_rank_pass(TransformerConfig(**dict(REFERENCE, num_layers=n)), one_rank, REFERENCE["max_seq_len"], hw)
            for n in (1, 3)]  # fmt: skip
    ends, extra = (0.01, 0.02), (2e-3, 5e-4)  # seconds the ends and each block's dispatch took beyond the model
    busy = [
        p
        for pass_, n in zip(pred, (1, 3))
        for p in (pass_.f + ends[0] + n * extra[0], pass_.b + ends[1] + n * extra[1])
    ]
    assert selective_block_overhead(hw, busy) == pytest.approx(extra)
    below = [pred[0].f, pred[0].b, pred[1].f - 1e-3, pred[1].b - 1e-3]  # measured faster than predicted: no credit
    assert selective_block_overhead(hw, below) == (0.0, 0.0)


def test_moe_overhead_is_added_per_moe_block():
    mixtral = TransformerConfig.from_preset("mixtral-8x7b")
    hw = _profile()
    over = hw.replace(moe_overhead=(1e-3, 3e-3))
    base, got = _rank_pass(mixtral, _layout(), 4096, hw), _rank_pass(mixtral, _layout(), 4096, over)
    moe_blocks = sum(mixtral.is_moe_layer(i) for i in range(mixtral.num_layers))
    assert moe_blocks == mixtral.num_layers
    assert (got.f - base.f, got.b - base.b) == pytest.approx((moe_blocks * 1e-3, moe_blocks * 3e-3))
    assert _rank_pass(MODEL, _layout(), 4096, over) == _rank_pass(MODEL, _layout(), 4096, hw)  # dense: nothing


def _cpu_like() -> HardwareProfile:
    """A profile whose step has unscaled terms (links, optimizer phase) beside the scaled compute, like a CPU one."""
    return _profile(bandwidth=2e8, latency=1e-3).replace(
        peak_flops=2e11, optimizer_seconds_per_param=5e-9, compute_units_per_node=2
    )


def test_fit_over_several_runs_recovers_the_scale_they_were_made_with():
    from lightning_flagscale.tune import MeasuredStep, fit_compute_scale

    hw = _cpu_like()
    truth = hw.replace(compute_scale=0.37)
    layouts = [_layout(), _layout(tensor_parallel_size=2), _layout(pipeline_parallel_size=2), _layout(zero_stage=3)]
    runs = [MeasuredStep(_TINY, c, 64, 8, estimate_step(_TINY, c, 64, 8, truth).step_seconds) for c in layouts]
    assert fit_compute_scale(runs, hw).compute_scale == pytest.approx(0.37, rel=1e-6)


def test_fit_on_one_run_is_the_exact_fit_and_several_runs_share_their_errors():
    import math

    from lightning_flagscale.tune import MeasuredStep, calibrate_compute_scale, fit_compute_scale

    hw = _cpu_like()
    truth = hw.replace(compute_scale=0.5)
    a, b = _layout(), _layout(tensor_parallel_size=2)
    # a measured 15% slower and b 15% faster than the model at the true scale
    ta = estimate_step(_TINY, a, 64, 8, truth).step_seconds * 1.15
    tb = estimate_step(_TINY, b, 64, 8, truth).step_seconds / 1.15
    runs = [MeasuredStep(_TINY, a, 64, 8, ta), MeasuredStep(_TINY, b, 64, 8, tb)]
    only_a = fit_compute_scale(runs[:1], hw)
    exact_a = calibrate_compute_scale(_TINY, a, 64, 8, hw, 64 * 8 / ta)
    assert only_a.compute_scale == pytest.approx(exact_a.compute_scale, rel=1e-6)
    only_b = fit_compute_scale(runs[1:], hw).compute_scale
    both = fit_compute_scale(runs, hw).compute_scale
    assert min(only_a.compute_scale, only_b) < both < max(only_a.compute_scale, only_b)

    def loss(scale: float) -> float:
        s = hw.replace(compute_scale=scale)
        return sum(math.log(estimate_step(_TINY, r.config, 64, 8, s).step_seconds / r.step_seconds) ** 2 for r in runs)

    assert loss(both) < min(loss(only_a.compute_scale), loss(only_b))
    assert loss(both) <= min(loss(both * 1.01), loss(both / 1.01))


def test_fit_refuses_no_runs_and_non_positive_times():
    from lightning_flagscale.tune import MeasuredStep, fit_compute_scale

    with pytest.raises(ValueError, match="at least one"):
        fit_compute_scale([], _cpu_like())
    with pytest.raises(ValueError, match="> 0"):
        fit_compute_scale([MeasuredStep(_TINY, _layout(), 64, 8, 0.0)], _cpu_like())
    # a step shorter than the profile's unscaled terms (links, optimizer phase) alone: no compute speed reaches it
    floor = estimate_step(_TINY, _layout(), 64, 8, _cpu_like().replace(compute_scale=1e6)).step_seconds
    with pytest.raises(ValueError, match="shorter than this profile's model can reach"):
        fit_compute_scale([MeasuredStep(_TINY, _layout(), 64, 8, floor / 2)], _cpu_like())


def test_the_training_loop_costs_its_measured_time_once_a_step():
    # Lightning's loop and the step guard cost the same wall time whatever the layout: added once to the step (not
    # scaled by compute_scale), on dedicated devices and on shared cores alike; the breakdown names it.
    loop = 0.02
    for hw in (_cpu_like(), _profile(bandwidth=1e11)):
        for c in (_layout(), _layout(pipeline_parallel_size=2), _layout(tensor_parallel_size=2, zero_stage=3)):
            plain = estimate_step(_TINY, c, 64, 8, hw)
            got = estimate_step(_TINY, c, 64, 8, hw.replace(step_overhead=loop))
            assert got.step_seconds == pytest.approx(plain.step_seconds + loop, rel=1e-9)
            assert got.loop_seconds == loop and plain.loop_seconds == 0.0
            faster = estimate_step(_TINY, c, 64, 8, hw.replace(step_overhead=loop, compute_scale=2.0))
            assert faster.step_seconds - estimate_step(_TINY, c, 64, 8, hw.replace(compute_scale=2.0)).step_seconds == (
                pytest.approx(loop, rel=1e-9)
            )
    with pytest.raises(ValueError, match="step_overhead"):
        _cpu_like().replace(step_overhead=-0.001)


def test_the_loop_overhead_is_the_measured_step_beyond_what_the_model_prices():
    from lightning_flagscale.config import TransformerConfig as Config
    from lightning_flagscale.tune.calibrate import LOOP_MODEL, training_loop_overhead

    hw = _cpu_like()
    priced = estimate_step(Config(**LOOP_MODEL), ParallelConfig(zero_stage=0).resolve(4), 64, 4, hw).step_seconds
    assert training_loop_overhead(hw, priced + 0.015, 4) == pytest.approx(0.015, rel=1e-9)
    # a profile that already carries an overhead is priced without it; a measurement below the price gives 0
    assert training_loop_overhead(hw.replace(step_overhead=0.5), priced + 0.015, 4) == pytest.approx(0.015, rel=1e-9)
    assert training_loop_overhead(hw, priced / 2, 4) == 0.0


# ---- DeepSeek-V3: MLA and MTP in the FLOP count and the cost model ----


@pytest.mark.parametrize("q_lora", [48, None])
def test_mla_and_mtp_flops_are_what_torch_counts(q_lora):
    """A forward + backward of deepseek-v3-tiny with one MTP module under torch's FLOP counter: the matmuls (MLA's
    low-rank projections, dense and MoE blocks, the MTP projection and block, the LM head twice) are 6 x the matmul
    weights per token, and the attention's ``bmm`` (q k^T over the qk width, p v over v_head_dim, in the main blocks
    and the MTP block) its closed form. The routed experts run their per-expert GEMMs (FlopCounterMode has no formula
    for ``torch._grouped_mm``)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_flagscale.models.layers import RMSNorm

    config = TransformerConfig.from_preset("deepseek-v3-tiny", num_nextn_predict_layers=1, q_lora_rank=q_lora)
    model = CausalLM(config)
    for module in model.modules():
        if hasattr(module, "use_grouped_mm"):
            module.use_grouped_mm = False
    x, y = torch.randint(0, config.vocab_size, (2, 4, 32), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model.loss_fn(model(x), y).backward()
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    blocks = config.num_layers + config.num_nextn_predict_layers
    attention = 6 * blocks * config.num_attention_heads * (config.head_dim + config.v_head_dim) * 32
    norms = sum(p.numel() for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters())
    assert counted == {"aten.mm": x.numel() * (flops_per_token(config, 32) - attention - 6 * norms),
                       "aten.bmm": x.numel() * attention}  # fmt: skip


def test_deepseek_v3_step_on_ideal_hardware_is_its_model_flops():
    """On a profile where every GEMM and attention kernel runs at peak and nothing else costs, the cost model's step
    of DeepSeek-V3 671B with its MTP module (EP 64 over DP 2048) is its model FLOPs: attention at the causal half
    with a 2.5x backward, every matmul weight but the norms' (in ``flops_per_token``'s N, in no GEMM)."""
    hw = _profile(hbm=float("inf"))
    model = TransformerConfig.from_preset("deepseek-v3")
    c = ParallelConfig(expert_parallel_size=64, zero_stage=1).resolve(2048)
    seq, batch = 4096, 2048
    cost = estimate_step(model, c, seq, batch, hw)
    blocks = model.num_layers + model.num_nextn_predict_layers
    attention = 6 * blocks * model.num_attention_heads * (model.head_dim + model.v_head_dim) * seq
    h = model.hidden_size
    norms = blocks * (2 * h + model.kv_lora_rank + model.q_lora_rank) + h + 3 * h  # + final norm, MTP's three
    gemms = flops_per_token(model, seq) - attention - 6 * norms
    want = (gemms + attention / 2 * 3.5 / 3) * batch * seq / (c.world_size * hw.peak_flops)
    assert cost.step_seconds == pytest.approx(want, rel=1e-12)


def test_an_overlapped_pair_hides_each_all_to_all_under_the_other_chunks_compute():
    # By hand: a forward chunk of 3 s (1 s of it all-to-all) beside a backward chunk of 5 s (2 s): each all-to-all
    # fits under the other chunk's compute (1 <= 5 - 2, 2 <= 3 - 1): all 3 s hidden.
    assert _overlap_saving(3.0, 5.0, 1.0, 2.0) == 3.0
    # Communication-bound chunks: f = 2 (1.5 all-to-all, 0.5 compute), b = 3 (2.5, 0.5): exposed
    # (1.5 - 0.5) + (2.5 - 0.5) = 3 of the 4 s; 1 s hidden, one compute's worth per direction.
    assert _overlap_saving(2.0, 3.0, 1.5, 2.5) == 1.0
    assert _overlap_saving(2.0, 3.0, 0.0, 0.0) == 0.0  # nothing to hide
    # DualPipeV's steady state fuses 2m - 3p + 1 + min(r, p - 2) pairs on rank r (torch's OVERLAP_F_B actions)
    assert overlapped_pairs("dualpipev", 2, 4) == (3, 3) and overlapped_pairs("dualpipev", 4, 8) == (5, 6, 7, 7)
    assert overlapped_pairs("zbv", 2, 4) == (0, 0)


def test_dualpipev_overlap_hides_the_expert_all_to_alls_of_its_pairs():
    # Mixtral 8x7B (4 layers) on PP 2 x EP 4, DualPipeV, 4 micro-batches a replica: with the overlap on, the heaviest
    # rank's busy time and exposed EP time drop by (its pairs) x (one pair's hidden seconds); the bubble is torch's
    # order replayed with each pair as one action (the pair's hidden seconds off, both outputs sent when it ends:
    # torch's lowering of the pair function), everything else is unchanged.
    model = TransformerConfig.from_preset("mixtral-8x7b", num_layers=4)
    hw = _profile(bandwidth=2e10, latency=1e-5)
    kw = dict(pipeline_parallel_size=2, pipeline_schedule="dualpipev", expert_parallel_size=4, zero_stage=1)
    plain, overlap = (ParallelConfig(**kw, overlap_moe_expert_parallel_comm=o).resolve(8) for o in (False, True))
    seq, batch = 4096, 16  # dp 4: 4 micro-batches of one sequence per replica
    one = _rank_pass(model, plain, seq, hw)
    assert one.ep[0] > 0 and one.ep[1] > 0 and one.comm["ep"] == pytest.approx(sum(one.ep))
    (f, b), (ep_f, ep_b) = (one.f / 2, one.b / 2), (one.ep[0] / 2, one.ep[1] / 2)  # per chunk
    per_pair = _overlap_saving(f, b, ep_f, ep_b)
    assert 0 < per_pair <= ep_f + ep_b
    pairs = overlapped_pairs("dualpipev", 2, 4)[one.rank]
    # the fused replay by hand: rank r's pair costs its forward + backward less its hidden seconds, in one action
    rank_pass = {one.rank: (one.f, one.b, one.ep), 1 - one.rank: (*one.others[0][:2], one.others_ep[0])}
    hidden = {r: _overlap_saving(rf / 2, rb / 2, ep[0] / 2, ep[1] / 2) for r, (rf, rb, ep) in rank_pass.items()}
    stages = [(sf, sb - sw, sw) for sf, sb, sw in one.stages]
    fused = {}
    for r, actions in torch_v_order("dualpipev", 2, 4).items():
        seq_r = []
        for act in filter(None, actions):
            if act.sub_actions:
                fwd, bwd = act.sub_actions
                cost = sum(action_cost(x, stages[x.stage_index]) for x in (fwd, bwd)) - hidden[r]
                act = _Action(fwd.stage_index, _ComputationType.FORWARD, fwd.microbatch_index)
                seq_r += [(act, cost), (bwd, 0.0)]  # the forward's output leaves with the pair's end
            else:
                seq_r.append((act, action_cost(act, stages[act.stage_index])))
        fused[r] = seq_r
    costs = {(a.computation_type, a.stage_index, a.microbatch_index): t for seq_r in fused.values() for a, t in seq_r}
    sim = simulate({r: [a for a, _ in seq_r] for r, seq_r in fused.items()}, 4,
                   lambda a: costs[a.computation_type, a.stage_index, a.microbatch_index])  # fmt: skip
    a, o = estimate_step(model, plain, seq, batch, hw), estimate_step(model, overlap, seq, batch, hw)
    assert a.comm["ep"] - o.comm["ep"] == pytest.approx(pairs * per_pair, rel=1e-12)
    assert o.bubble_seconds == pytest.approx(sim.makespan - sim.busy(one.rank), rel=1e-12)
    assert a.step_seconds - o.step_seconds == pytest.approx(
        pairs * per_pair + a.bubble_seconds - o.bubble_seconds, rel=1e-9
    )
    assert {k: v for k, v in a.comm.items() if k != "ep"} == {k: v for k, v in o.comm.items() if k != "ep"}
    # ranks sharing a few cores (CPU processes): gloo's copies compete with the compute, nothing is hidden
    shared = hw.replace(compute_units_per_node=2, devices_per_node=8)
    assert estimate_step(model, plain, seq, batch, shared) == estimate_step(model, overlap, seq, batch, shared)


def test_expert_tensor_parallel_splits_expert_gemms_and_states_and_adds_its_collectives():
    # Issue 39 item 4: Mixtral 8x7B, TP 2 x EP 4 on 8 ranks, with and without ETP 2 (inside TP: the same rows split,
    # partial outputs all-reduced). ETP halves the expert GEMMs and the expert weights per rank and adds ETP traffic.
    model = TransformerConfig.from_preset("mixtral-8x7b", num_layers=4)
    hw = _profile(bandwidth=1e11, latency=1e-5)  # finite links: the ETP all-reduces cost time
    plain = ParallelConfig(tensor_parallel_size=2, expert_parallel_size=4, zero_stage=1).resolve(8)
    etp = ParallelConfig(tensor_parallel_size=2, expert_parallel_size=4, expert_tensor_parallel_size=2, zero_stage=1)
    etp = etp.resolve(8)
    assert (plain.expert_shards, plain.expert_data_parallel_size) == (4, 2)
    assert (etp.expert_shards, etp.expert_data_parallel_size) == (8, 1)  # each expert shard on one rank of the stage
    a, b = estimate_step(model, plain, 4096, 16, hw), estimate_step(model, etp, 4096, 16, hw)
    assert b.compute_seconds < a.compute_seconds
    assert b.comm["ep"] > a.comm["ep"]
    (dense_a, expert_a), (dense_b, expert_b) = _rank_params(model, plain)[0], _rank_params(model, etp)[0]
    assert dense_a == dense_b and expert_a == expert_b  # before the division by the expert shards
    # Under SP with ETP = 1 each TP rank routes its own sequence chunk: nothing is gathered around the block (the
    # router's gradient is summed over TP by the step's data-parallel reduction). With ETP = TP the block runs on the
    # whole sequence: it all-gathers it and reduce-scatters the partial expert outputs (each rank its chunk), the
    # mirror pair in backward (MoELayer.forward), every TP rank dispatches all t k rows (twice the all-to-all bytes) and the routing weights'
    # gradients (fp32, one per routed row) are all-reduced over ETP in backward (tune/moe_cost.py).
    sp = dict(tensor_parallel_size=2, expert_parallel_size=4, sequence_parallel=True, zero_stage=1)
    sp_plain, sp_etp = (ParallelConfig(**sp, expert_tensor_parallel_size=e).resolve(8) for e in (1, 2))
    assert sp_plain.moe_routes_sequence_chunks and sp_etp.etp_sequence_parallel and not etp.etp_sequence_parallel
    c, d = estimate_step(model, sp_plain, 4096, 16, hw), estimate_step(model, sp_etp, 4096, 16, hw)

    def seconds(op: str, nbytes: float, n: int) -> float:
        return hw.collective_seconds(op, nbytes, n, inter_node=False)

    act, rows = 4096 * model.hidden_size * 2, 4096 * model.num_experts_per_tok * model.hidden_size * 2
    sp_pair = seconds("all_gather", act, 2) + seconds("reduce_scatter", act, 2)
    per_layer = model.num_layers * 16 // (etp.dp * etp.micro_batch_size)  # layers x micro-batches
    assert d.comm["tp"] - c.comm["tp"] == pytest.approx(per_layer * 2 * sp_pair, rel=1e-9)
    a2a = 4 * (seconds("all_to_all", rows, 4) - seconds("all_to_all", rows / 2, 4))  # dispatch + combine, both ways
    weights = seconds("all_reduce", 4096 * model.num_experts_per_tok * 4, 2)
    assert d.comm["ep"] - c.comm["ep"] == pytest.approx(per_layer * (a2a + weights), rel=1e-9)
