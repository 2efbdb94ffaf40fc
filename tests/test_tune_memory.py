"""The tuner's memory model against what the code really holds: model states of Trainer runs (exact, per pipeline
rank, TP/PP/EP), activations of our layers per recompute policy (one process), and the micro-batches each pipeline
schedule keeps alive (counted on a real run)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.schedules import SCHEDULE_NAMES
from lightning_flagscale.models.decoder import CausalLM
from lightning_flagscale.tune.activations import (
    head_bytes,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    model_edge_bytes,
)
from lightning_flagscale.tune.inflight import (
    live_activation_peak,
    max_live_microbatches,
    schedule_actions,
    schedule_live_peak,
)
from lightning_flagscale.tune.measure import AllocationPeak, SavedActivations, allocation_levels
from lightning_flagscale.tune.memory_model import estimate_memory, memory_breakdown
from tests.strategies._lm import tiny_config, trainer_run

SHAPE = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)


def _forward_bytes(config: TransformerConfig, dtype: torch.dtype, recompute: str, b: int = 2, s: int = 64):
    """(saved-tensor bytes, bytes still allocated after the forward) of a forward + loss on one process."""
    from lightning_flagscale.parallel.pipeline_parallel.recompute import apply_recompute

    model = CausalLM(config, vocab_multiple=64).to(dtype)
    apply_recompute(model, recompute)
    x, y = torch.randint(0, config.vocab_size, (2, b, s))
    with AllocationPeak() as alloc, SavedActivations.of_module(model) as saved:
        loss = model.loss_fn(model(x), y)
    del loss
    return saved.total_bytes, alloc.net_bytes


def _predicted(config: TransformerConfig, e: int, recompute: str, tokens: int) -> tuple[float, float]:
    """(one layer's kept bytes, everything kept) for a single-process model."""
    layers = [layer_activation_bytes(config, tokens, layer=i, act_bytes=e, recompute=recompute)[0]
              for i in range(config.num_layers)]  # fmt: skip
    head = head_bytes(config, tokens, padded_vocab=config.padded_vocab_size(64), act_bytes=e)
    return layers[-1], sum(layers) + model_edge_bytes(config, tokens, act_bytes=e) + head.saved


def _layers_and_rest(one: float, many: float, n: int) -> tuple[float, float]:
    """(one layer, everything that is not a layer: embedding, RoPE tables, final norm, head, loss) of the bytes
    measured on a 1-layer and an ``n``-layer model."""
    layer = (many - one) / (n - 1)
    return layer, one - layer


@pytest.mark.parametrize(("dtype", "moe"), [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_layer_activations_are_the_bytes_autograd_saves(dtype, moe):
    """Derived op by op from models/: a dense layer to the byte, an MoE layer within 1% (its routing bookkeeping is a
    measured constant), the rest of the model (embedding, RoPE tables, norm, head, loss) within 0.5%."""
    e = 2 if dtype == torch.bfloat16 else 4
    configs = [TransformerConfig(**SHAPE, **(MOE if moe else {}), num_layers=n) for n in (1, 2)]
    one, two = (_forward_bytes(c, dtype, "none")[0] for c in configs)
    layer, total = _predicted(configs[1], e, "none", 128)
    got_layer, got_rest = _layers_and_rest(one, two, 2)
    if moe:
        assert abs(got_layer - layer) <= 1e-2 * layer, (got_layer, layer)
    else:
        assert got_layer == layer, (got_layer, layer)
    rest = total - 2 * layer
    assert abs(got_rest - rest) <= 5e-3 * rest, (got_rest, rest)


@pytest.mark.parametrize("recompute", ["selective", "selective_mm", "full"])
def test_recompute_keeps_what_the_model_says(recompute):
    """Selective keeps matmul/attention outputs (in the checkpoint's cache, so counted by the allocator), selective_mm
    every other matmul's, full only the block input: bytes alive after the forward, a layer to the byte, the rest of
    the model within 0.5%."""
    configs = [TransformerConfig(**SHAPE, num_layers=n) for n in (1, 3)]
    one, three = (_forward_bytes(c, torch.bfloat16, recompute)[1] for c in configs)
    layer, total = _predicted(configs[1], 2, recompute, 128)
    got_layer, got_rest = _layers_and_rest(one, three, 3)
    assert got_layer == layer, (got_layer, layer)
    rest = total - 3 * layer
    assert abs(got_rest - rest) <= 5e-3 * rest, (got_rest, rest)
    none_layer = _predicted(configs[1], 2, "none", 128)[0]
    assert layer < {"selective": 0.6, "selective_mm": 0.4, "full": 0.1}[recompute] * none_layer  # what it is for


def test_korthikanti_formula_is_available_for_published_shapes():
    # GPT-3 175B row of Korthikanti et al. Table 2 (s=2048, b=1, h=12288, a=96, t=8): 34sbh/t with SP + selective.
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, tp=8, sequence_parallel=True, recompute="selective") == (
        2048 * 12288 * 34 / 8
    )
    no_tp = korthikanti_layer_bytes(2048, 1, 12288, 96)
    assert no_tp == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)


# ---- pipeline schedules: micro-batches alive at once, counted on a real run ----


def _count_live(schedule: str) -> int:
    """Max (stage, micro-batch) activation sets alive at once on this rank: every stage's first block output carries
    a marker whose saved tensor dies with that micro-batch's graph."""
    import weakref

    import lightning as L

    state = {"live": 0, "peak": 0}

    def _dead() -> None:
        state["live"] -= 1

    class Marker(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            token = torch.empty(1)
            ctx.save_for_backward(token)
            state["live"] += 1
            state["peak"] = max(state["peak"], state["live"])
            weakref.finalize(token, _dead)
            return x.clone()  # not a view: zero-bubble's input-gradient pass detaches outputs in place

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Hook(L.Callback):
        def on_train_start(self, trainer, pl_module):
            for stage in pl_module.model.stage_modules:
                block = next(iter(stage.layers.values()))
                block.register_forward_hook(lambda mod, args, out: Marker.apply(out))

    vpp = 1 if schedule in ("gpipe", "1f1b") else 2
    trainer_run(dict(pipeline_parallel_size=2, pipeline_schedule=schedule, virtual_pipeline_parallel_size=vpp),
                tiny_config(num_layers=4), 1, callbacks=[Hook()])  # fmt: skip
    return state["peak"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"])
def test_live_microbatches_match_what_the_schedule_keeps(launcher, schedule):
    counted = launcher(2, _count_live, schedule)
    vpp = 1 if schedule in ("gpipe", "1f1b") else 2
    assert counted == max_live_microbatches(schedule, 2, vpp, 4), (schedule, counted)  # 4 micro-batches of 1


def _walk(actions, weight):
    """The plain walk: live (stage, micro-batch) pairs added at F, freed at B or W; the first strict maximum."""
    live, total, peak, count = set(), 0.0, 0.0, 0
    for kind, stage, mb in actions:
        if kind == "F":
            live.add((stage, mb))
            total += weight.get(stage, 0.0)
            if total > peak:
                peak, count = total, len(live)
        elif kind in ("B", "W") and (stage, mb) in live:
            live.discard((stage, mb))
            total -= weight.get(stage, 0.0)
    return peak, count


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_activation_peak_and_schedule_order_match_the_direct_computation(schedule):
    # The search remembers each schedule's distinct live states and builds torch's order once, without its
    # lowering to communication actions: same orders as torch's full schedule of every rank, same peaks as the
    # plain walk, whatever the stage weights (zero for an empty stage included).
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as torch_schedules

    from lightning_flagscale.config.schedules import SCHEDULE_SPECS
    from lightning_flagscale.parallel.pipeline_parallel.plan import stage_ids_for_rank

    spec = SCHEDULE_SPECS[schedule]
    v = 3 if spec.stages_per_rank is None else spec.stages_per_rank  # interleaved: any virtual size; V: 2
    rng = random.Random(0)
    for p, m in ((2, 4), (4, 8), (4, 12)):
        actions = schedule_actions(schedule, p, v, m)
        if v > 1:
            for rank in range(p):
                ids = stage_ids_for_rank(rank, p, p * v, spec.placement)
                stages = [SimpleNamespace(group_size=p, group_rank=rank, num_stages=p * v, stage_index=i,
                                          is_first=i == 0, is_last=i == p * v - 1, submod=None) for i in ids]  # fmt: skip
                full = getattr(torch_schedules, spec.torch_class)(stages, m, loss_fn=lambda out, target: out)
                order = [(str(a.computation_type).rsplit(".", 1)[-1], a.stage_index, a.microbatch_index)
                         for act in full.pipeline_order[rank] if act is not None for a in (act.sub_actions or (act,))]  # fmt: skip
                kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
                assert list(actions[rank]) == [(kinds.get(k, k), s, mb) for k, s, mb in order]
        for rank, rank_actions in enumerate(actions):
            stages = sorted({s for _, s, _ in rank_actions})
            for _ in range(4):
                weight = {s: rng.choice([0.0, 1.0, rng.uniform(1e3, 1e9)]) for s in stages}
                got, want = live_activation_peak(rank_actions, weight), _walk(rank_actions, weight)
                assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=1e-12)
                assert schedule_live_peak(schedule, p, v, m, rank, weight) == got  # the walk cached by its integers


# ---- model states, measured on Trainer runs ----


def _states(strategy_kwargs: dict, moe: bool) -> dict:
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale.accounting.state_bytes import state_bytes

    got: dict = {}

    class Measure(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:  # Adam states exist from the second step on
                got.update(vars(state_bytes(pl_module, [optimizer])))

    config = tiny_config(num_layers=3, **(MOE if moe else {}))
    trainer_run(strategy_kwargs, config, 2, precision="bf16-mixed", callbacks=[Measure()], optimizer="adamw")
    return {"rank": dist.get_rank(), **got}


LAYOUTS = [
    dict(tensor_parallel_size=2, zero_stage=1),
    dict(pipeline_parallel_size=2, pipeline_layers=[2, 1], zero_stage=1),
    dict(expert_parallel_size=2, zero_stage=1),
    dict(expert_tensor_parallel_size=2, zero_stage=1),  # each expert's FFN over 2 ranks, states over edp 2
]


@pytest.mark.parametrize("kwargs", LAYOUTS, ids=["tp2-zero1", "pp2-uneven", "ep2-moe", "etp2-moe"])
def test_model_states_per_rank_match_the_trainer_run(launcher, kwargs):
    moe = "expert_parallel_size" in kwargs or "expert_tensor_parallel_size" in kwargs
    world = 4 if moe else 2
    c = ParallelConfig(**kwargs).resolve(world)
    config = tiny_config(num_layers=3, **(MOE if moe else {}))
    per_pp_rank = memory_breakdown(config, c, 16, 2).ranks
    for m in launcher(world, _states, kwargs, moe):
        want = per_pp_rank[m["rank"] // (world // c.pipeline_parallel_size)]
        for key in ("params", "grads", "master_params", "optimizer_states"):
            value = getattr(want, key)
            # Beyond the formula: Adam's 4-byte step per tensor and shard padding (a few rows).
            assert abs(m[key] - value) <= 512 + 2e-3 * value, (kwargs, m["rank"], key, m[key], value)


def test_generated_v_orders_hold_their_activation_cap():
    # With pipeline_max_activations the runner runs the generated order (orders.zbv_order), which may hold up to the
    # cap: the memory model walks that order, not torch's (2p for ZB-V).
    from lightning_flagscale.tune.inflight import schedule_live_peak

    model = TransformerConfig(**SHAPE, num_layers=8)
    torch_order = ParallelConfig(pipeline_parallel_size=2, pipeline_schedule="zbv").resolve(2)
    generated = ParallelConfig(
        pipeline_parallel_size=2, pipeline_schedule="zbv", pipeline_chunk_costs=[1, 2, 1], pipeline_max_activations=8
    ).resolve(2)  # fmt: skip
    weights = {s: 1.0 for s in range(4)}
    assert (
        schedule_live_peak("zbv", 2, 2, 16, 0, weights, (1, 2, 1), 8)[1]
        > schedule_live_peak("zbv", 2, 2, 16, 0, weights)[1]
    )
    gen, tor = (
        memory_breakdown(model, generated, 64, 16).ranks[0],
        memory_breakdown(model, torch_order, 64, 16).ranks[0],
    )
    assert (gen.live_microbatches, tor.live_microbatches) == (8, 4) and gen.activations == 2 * tor.activations


def test_uneven_pipeline_split_heaviest_stage_decides():
    model = TransformerConfig(**SHAPE, num_layers=8)
    even = ParallelConfig(pipeline_parallel_size=2).resolve(2)
    heavy = ParallelConfig(pipeline_parallel_size=2, pipeline_layers=[6, 2]).resolve(2)
    b_even, b_heavy = memory_breakdown(model, even, 64, 4), memory_breakdown(model, heavy, 64, 4)
    assert b_heavy.heaviest.pp_rank == 0 and b_heavy.peak > b_even.peak
    assert estimate_memory(model, heavy, 64, 4) == b_heavy.peak


def test_allocation_levels_take_off_a_block_whose_address_comes_back():
    mib = 2**20
    events = [
        (0, "a", 4 * mib),  # freed unseen (another thread), its address allocated again at t=2
        (1, "b", 2 * mib),
        (2, "a", 3 * mib),  # peak before this: 6 MiB; the 4 MiB block is gone at this instant
        (3, "b", -2 * mib),
        (4, "old", -1 * mib),  # allocated before the block started: lowers the level
        (5, "c", 8 * mib),  # freed unseen, never reused: stays counted
    ]
    assert allocation_levels(events) == (10 * mib, 10 * mib)
    assert allocation_levels(reversed(events)) == (10 * mib, 10 * mib)  # order comes from the times
    # a free and a new block at its address at one instant: the free came first, the new block stays alive
    assert allocation_levels([(0, "a", mib), (1, "a", mib), (1, "a", -mib)]) == (mib, mib)


def test_allocation_peak_recovers_a_free_made_on_another_thread():
    """A 40 MiB block (mmap'd, so its address comes back on the next allocation of that size) dropped on a helper
    thread, the way gloo's worker threads drop collective buffers: the profiler sees no free; the reuse of the address
    shows it."""
    import threading

    n = 40 * 2**20
    with AllocationPeak() as m:
        box = [torch.empty(n, dtype=torch.uint8)]
        first = box[0].data_ptr()
        thread = threading.Thread(target=box.clear)
        thread.start()
        thread.join()
        again = torch.empty(n, dtype=torch.uint8)
    assert again.data_ptr() == first, "the allocator did not reuse the address: the premise of this test"
    assert (m.peak_bytes, m.net_bytes) == (n, n)


# ---- DeepSeek-V3 (MLA, first_k_dense, shared experts, MTP): parameters per pipeline rank against the real model ----


def _local_numel(model: torch.nn.Module, name: str, numel: int, tp: int, ep: int) -> float:
    """Elements of parameter ``name`` on one rank, read off the model's own TP plan (column/row-parallel layers and
    the vocab-parallel embedding split, every other style replicated) and the EP split of the routed experts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    owner, _, leaf = name.rpartition(".")
    if ".experts" in f".{owner}":
        return numel / ep
    style = model.tp_plan(False).get(owner) if tp > 1 else None
    if isinstance(style, RowwiseParallel) and leaf == "bias":
        return numel  # a row-parallel layer's bias is replicated
    return numel / tp if isinstance(style, (ColwiseParallel, RowwiseParallel)) else numel


@pytest.mark.parametrize(("pp", "tp", "ep", "q_lora"), [(1, 1, 1, True), (2, 1, 1, True), (2, 2, 2, True),
                                                        (2, 2, 1, False), (4, 1, 2, True)])  # fmt: skip
def test_deepseek_v3_parameters_per_pipeline_rank_match_the_model(pp, tp, ep, q_lora):
    """MLA projections and latent norms, the dense first block against MoE blocks with a shared expert, and the MTP
    module (norms, 2h -> h projection, block, and the embedding copy on a last stage that is not the first):
    ``rank_params`` equals the elements of the real stage modules cut from a meta model, split as the model's TP plan
    and EP split them."""
    from lightning_flagscale.parallel.pipeline_parallel.plan import build_stage_module, plan_stages
    from lightning_flagscale.tune.stage_params import rank_params

    overrides = dict(num_nextn_predict_layers=1, num_layers=4, attention_bias=not q_lora)
    if not q_lora:
        overrides["q_lora_rank"] = None
    config = TransformerConfig.from_preset("deepseek-v3-tiny", **overrides)
    with torch.device("meta"):
        model = CausalLM(config, vocab_multiple=64)
    plan = plan_stages(model.pipeline_units(), pp)
    predicted = rank_params(config, ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                                   expert_parallel_size=ep).resolve(pp * tp * ep), vocab_multiple=64)  # fmt: skip
    for rank, units in enumerate(plan.units):
        stage = build_stage_module(model, units)
        dense = expert = 0.0
        for name, p in stage.named_parameters():  # a tied Parameter once
            n = _local_numel(model, name, p.numel(), tp, ep)
            dense, expert = (dense, expert + n) if ".experts." in name else (dense + n, expert)
        assert (predicted[rank].dense, predicted[rank].expert) == (dense, expert), (rank, units)
    assert "mtp" in plan.units[-1] and config.num_params() == sum(p.numel() for p in model.parameters())


def test_deepseek_v3_671b_has_the_published_parameter_count():
    """DeepSeek-V3 report: 671B parameters in the main model, 37B of them active per token, and "14B" in its MTP module,
    whose checkpoint stores its own copies of the embedding and the head that ours shares (13.46B counted that way:
    one MoE block of 11.6B + eh_proj + norms, the report rounding up)."""
    main = TransformerConfig.from_preset("deepseek-v3", num_nextn_predict_layers=0)
    full = TransformerConfig.from_preset("deepseek-v3")  # the preset holds the published MTP module
    assert full.num_nextn_predict_layers == 1
    shared_copies = 2 * full.vocab_size * full.hidden_size
    assert round(main.num_params() / 1e9) == 671
    assert 13e9 < full.num_params() - main.num_params() + shared_copies < 14e9
    assert 37 <= main.num_params(active=True) / 1e9 < 38


MLA = dict(SHAPE, num_key_value_heads=None, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, rope_interleave=True)  # fmt: skip


def _mla_layer(dtype, recompute: str, **overrides) -> tuple[TransformerConfig, float, float]:
    """(2-layer config, one layer's measured bytes, the rest of the model's) for a dense MLA model, as the GQA tests
    measure them: saved tensors without recompute, bytes alive after the forward with it."""
    configs = [TransformerConfig(**{**MLA, **overrides}, num_layers=n) for n in (1, 2)]
    one, two = (_forward_bytes(c, dtype, recompute)[0 if recompute == "none" else 1] for c in configs)
    return configs[1], *_layers_and_rest(one, two, 2)


@pytest.mark.parametrize(
    ("dtype", "recompute", "q_lora"),
    [(torch.bfloat16, rc, q) for rc in ("none", "selective", "selective_mm", "full") for q in (48, None)]
    + [(torch.float32, "none", 48), (torch.float32, "selective", 48)],
)
def test_mla_layer_activations_are_the_bytes_autograd_saves(dtype, recompute, q_lora):
    """MLA to the byte per layer under every recompute mode: latent norms and projection inputs, and the core
    attention as torch runs it here (v_head_dim != qk head dim: the math SDPA path, fp32 scores kept); the rest of
    the model (embedding, rotary tables of qk_rope_head_dim, norm, head, loss) within 0.5%."""
    from lightning_flagscale.tune.activations import math_attention_keys

    e = 2 if dtype == torch.bfloat16 else 4
    config, got_layer, got_rest = _mla_layer(dtype, recompute, q_lora_rank=q_lora)
    keys = math_attention_keys(config, 64, cpu=True)
    assert keys == 64  # the premise: the math path runs on CPU for these widths
    layer = layer_activation_bytes(config, 128, act_bytes=e, recompute=recompute, attention_keys=keys)[0]
    assert got_layer == layer, (got_layer, layer)
    head = head_bytes(config, 128, padded_vocab=config.padded_vocab_size(64), act_bytes=e)
    rest = model_edge_bytes(config, 128, act_bytes=e) + head.saved
    assert abs(got_rest - rest) <= 5e-3 * rest, (got_rest, rest)


def test_mla_moe_layer_and_mtp_module_activations():
    """An MLA block with routed and shared experts within 1% (routing bookkeeping is a measured constant, as for the
    GQA MoE block); the MTP module on top of the model (shifted-token embedding, enorm, hnorm, 2h -> h projection,
    a block, its head and loss) to the byte, bf16 and fp32."""
    from lightning_flagscale.tune.activations import math_attention_keys, mtp_activation_bytes

    moe = dict(MOE, num_shared_experts=1)
    config, got_layer, _ = _mla_layer(torch.bfloat16, "none", **moe)
    layer = layer_activation_bytes(config, 128, layer=1, recompute="none", attention_keys=64)[0]
    assert config.is_moe_layer(1) and abs(got_layer - layer) <= 1e-2 * layer, (got_layer, layer)
    for dtype, e in ((torch.bfloat16, 2), (torch.float32, 4)):
        base, with_mtp = (TransformerConfig(**MLA, num_layers=1, num_nextn_predict_layers=d) for d in (0, 1))
        got = _forward_bytes(with_mtp, dtype, "none")[0] - _forward_bytes(base, dtype, "none")[0]
        keys = math_attention_keys(with_mtp, 64, cpu=True)
        want = mtp_activation_bytes(with_mtp, 128, padded_vocab=1024, act_bytes=e, attention_keys=keys)
        assert got == want, (dtype, got, want)


def _tp_layer_bytes(shape: dict, loras: tuple = (), moe: dict | None = None) -> dict:
    """Per sequence-parallel setting, the bytes one more layer adds to what autograd saves on this rank for a forward
    + loss under TP 2 (bf16): the 2-layer model's minus the 1-layer model's; then the same with each LoRA config of
    ``loras`` (keyed ``(sp, index)``) and with ``moe`` added to the shape (keyed ``("moe", sp)``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.models.lora import apply_lora
    from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x, y = torch.randint(0, shape["vocab_size"], (2, 2, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    cases = [(sp, k) for k in (None, *range(len(loras)), *(("moe",) if moe else ())) for sp in (False, True)]
    for sp, k in cases:
        saved_bytes = []
        for n in (1, 2):
            with torch.device("meta"):
                model = CausalLM(
                    TransformerConfig(**shape, **(moe if k == "moe" else {}), num_layers=n), vocab_multiple=64
                )
            if isinstance(k, int):
                apply_lora(model, loras[k])
            apply_tp(model, mesh, sequence_parallel=sp)
            model.to_empty(device="cpu")
            model.init_weights(seed=0)
            model.to(torch.bfloat16)
            with SavedActivations.of_module(model) as saved:
                loss = model.loss_fn(model(x), y)
            del loss
            saved_bytes.append(saved.total_bytes)
        out[sp if k is None else ("moe", sp) if k == "moe" else (sp, k)] = saved_bytes[1] - saved_bytes[0]
    return out


@pytest.mark.parametrize("shape", ["mla", "gqa"])
def test_layer_activations_under_tensor_parallel(launcher, shape):
    """Under TP 2, with and without SP, a layer keeps on each rank what the model says (sharded DTensors counted by
    their local shard): heads and MLP width split; MLA's down projections and latent norms whole on the gathered
    sequence; the block norms on sequence shards under SP, the projections' gathered inputs whole. With LoRA (GQA,
    same launch; issue 40): A's ``r``-wide outputs whole on every rank (column-parallel A replicated, row-parallel
    A's output a partial sum), dropout's copies of the local inputs, DoRA's products split like the output rows."""
    from lightning_flagscale.config.lora import LoRAConfig
    from lightning_flagscale.tune.activations import lora_layer_activation_bytes, math_attention_keys

    kwargs = MLA if shape == "mla" else SHAPE
    config = TransformerConfig(**kwargs, num_layers=2)
    keys = math_attention_keys(config, 64, cpu=True)
    loras = () if shape == "mla" else (LoRAConfig(rank=4, **LORA_CASES["dora"]), LoRAConfig(rank=4, **LORA_CASES["q,v"],
                                                                                             dropout=0.1))  # fmt: skip
    moe = MOE if shape == "gqa" else None
    for rank, got in enumerate(launcher(2, _tp_layer_bytes, kwargs, loras, moe)):
        assert len(got) == 2 + 2 * len(loras) + (2 if moe else 0)
        for key, layer in got.items():
            if isinstance(key, tuple) and key[0] == "moe":
                # an MoE layer: under SP each TP rank routes its own sequence chunk; within 1% (routing bookkeeping)
                moe_config = TransformerConfig(**kwargs, **MOE, num_layers=2)
                want = layer_activation_bytes(moe_config, 128, layer=1, tp=2, sequence_parallel=key[1],
                                              attention_keys=keys)[0]  # fmt: skip
                assert abs(layer - want) <= 1e-2 * want, (rank, key, layer, want)
                continue
            if isinstance(key, tuple):
                sp, lora = key[0], loras[key[1]]
                want = lora_layer_activation_bytes(config, 128, lora, layer=1, tp=2, sequence_parallel=sp, cpu=True)
            else:
                sp = key
                want = layer_activation_bytes(config, 128, tp=2, sequence_parallel=sp, attention_keys=keys)[0]
            assert layer == want, (rank, key, layer, want)


def test_mtp_activations_are_priced_on_the_last_pipeline_stage_only():
    """Under PP 2 (1F1B, one micro-batch alive on the last rank at its peak) the MTP module adds its bytes to the
    last rank's activations and nothing to the first's."""
    from lightning_flagscale.tune.activations import mtp_activation_bytes

    base, with_mtp = (TransformerConfig(**MLA, num_layers=4, num_nextn_predict_layers=d) for d in (0, 1))
    c = ParallelConfig(pipeline_parallel_size=2).resolve(2)
    before, after = (memory_breakdown(m, c, 64, 4).ranks for m in (base, with_mtp))
    assert after[0].activations == before[0].activations and after[1].live_microbatches == 1
    mtp = mtp_activation_bytes(with_mtp, 64, padded_vocab=with_mtp.padded_vocab_size(64))
    assert after[1].activations - before[1].activations == mtp


def _lora_forward_bytes(n: int, dtype: torch.dtype, lora) -> int:
    """Saved-tensor bytes of a forward + loss of an ``n``-layer model with LoRA ``lora`` (training mode: dropout on)."""
    from lightning_flagscale.models.lora import apply_lora

    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(**SHAPE, num_layers=n), vocab_multiple=64)
    apply_lora(model, lora)
    model = model.to(dtype).train()
    x, y = torch.randint(0, SHAPE["vocab_size"], (2, 2, 64), generator=torch.Generator().manual_seed(0))
    with SavedActivations.of_module(model) as saved:
        loss = model.loss_fn(model(x), y)
    del loss
    return saved.total_bytes


_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_CASES = {
    "all": dict(target_modules=_ALL),
    "dora": dict(target_modules=_ALL, use_dora=True),
    "dropout": dict(target_modules=_ALL, dropout=0.1),
    "q,v": dict(target_modules=["q_proj", "v_proj"]),
    "o,down dora+dropout": dict(target_modules=["o_proj", "down_proj"], use_dora=True, dropout=0.1),
    "v,up dora": dict(target_modules=["v_proj", "up_proj"], use_dora=True),
    "gate dropout": dict(target_modules=["gate_proj"], dropout=0.2),
}


@pytest.mark.parametrize(
    ("case", "dtype"), [(c, torch.float32) for c in LORA_CASES] + [("all", torch.bfloat16), ("dropout", torch.bfloat16)]
)
def test_lora_activations_are_the_bytes_autograd_saves(case, dtype):
    """Issue 40: under LoRA the memory model prices what autograd keeps with the base frozen (``tune.activations``):
    the adapters' inputs and ``r``-wide outputs, dropout's copies and CPU masks, DoRA's products and vectors, and
    nothing for a frozen linear's input or a norm's ``x_hat``; the first block (input without gradient) and RoPE's
    tables only where a q or k needs a gradient. One more block to the byte, the whole model (embedding, first block,
    head, loss) within 0.5% (the loss's int64 targets and scalars), both read off ``memory_breakdown``."""
    from lightning_flagscale.config.lora import LoRAConfig

    lora = LoRAConfig(rank=4, alpha=8.0, **LORA_CASES[case])
    e, precision = (4, "32-true") if dtype == torch.float32 else (2, "bf16-mixed")
    one, two = (_lora_forward_bytes(n, dtype, lora) for n in (1, 2))
    c = ParallelConfig(micro_batch_size=2).resolve(1)
    planned = [memory_breakdown(TransformerConfig(**SHAPE, num_layers=n), c, 64, 1, precision=precision,
                                backend="gloo", lora=lora).ranks[0].activations for n in (1, 2)]  # fmt: skip
    assert two - one == planned[1] - planned[0], (case, two - one, planned[1] - planned[0])
    assert abs(one - planned[0]) <= 5e-3 * one, (case, one, planned[0])
    full = layer_activation_bytes(TransformerConfig(**SHAPE, num_layers=2), 128, act_bytes=e)[0]
    if case in ("all", "q,v"):  # what LoRA saves over full fine-tuning: frozen inputs and x_hat dropped
        assert two - one < full


@pytest.mark.parametrize("case", ["all", "q,v"])
def test_lora_full_recompute_keeps_the_block_input(case):
    """Under full recompute a LoRA block keeps its input, the RNG state and, per adapted linear, the 8-byte scalar of
    ``update * scaling`` the checkpoint holds: bytes alive after the forward, a layer to the byte, the rest within
    0.5%; the block's LoRA activations are the re-materialised transient."""
    from lightning_flagscale.config.lora import LoRAConfig
    from lightning_flagscale.models.lora import apply_lora
    from lightning_flagscale.parallel.pipeline_parallel.recompute import apply_recompute

    lora = LoRAConfig(rank=4, alpha=8.0, **LORA_CASES[case])

    def alive_after_forward(n: int) -> int:
        torch.manual_seed(0)
        model = CausalLM(TransformerConfig(**SHAPE, num_layers=n), vocab_multiple=64)
        apply_lora(model, lora)
        model = model.to(torch.bfloat16)
        apply_recompute(model, "full")
        x, y = torch.randint(0, SHAPE["vocab_size"], (2, 2, 64), generator=torch.Generator().manual_seed(0))
        gc.collect()  # nothing of an earlier model may be freed inside the measurement
        with AllocationPeak() as alloc:
            loss = model.loss_fn(model(x), y)
        del loss
        return alloc.net_bytes

    alive = [alive_after_forward(n) for n in (1, 3)]
    c = ParallelConfig(micro_batch_size=2, recompute="full").resolve(1)
    planned = [memory_breakdown(TransformerConfig(**SHAPE, num_layers=n), c, 64, 1, backend="gloo", lora=lora).ranks[0]
               for n in (1, 3)]  # fmt: skip
    assert alive[1] - alive[0] == planned[1].activations - planned[0].activations, (case, alive, planned)
    assert abs(alive[0] - planned[0].activations) <= 5e-3 * alive[0], (case, alive, planned)
