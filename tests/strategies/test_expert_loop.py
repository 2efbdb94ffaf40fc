"""Expert parallelism inside Trainer.fit: dropless MoE training matches the single-process run."""

from __future__ import annotations

import pytest

from lightning_flagscale.config import TransformerConfig
from tests.moe._trainer import assert_sgd_parity, sgd_reference, sgd_trainer_run, shrink
from tests.strategies._lm import assert_matches_reference, reference_run, trainer_run

STEPS = 3


def moe_config(num_layers: int = 2) -> TransformerConfig:
    return TransformerConfig.from_preset(
        "mixtral-tiny", num_layers=num_layers, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_aux_loss_coeff=0.0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return reference_run(moe_config(), STEPS, clip=1.0)


@pytest.mark.parametrize(
    "world,kwargs",
    [
        (2, dict(expert_parallel_size=2)),
        (2, dict(expert_parallel_size=2, zero_stage=1)),
        (4, dict(expert_parallel_size=2, tensor_parallel_size=2)),
        (4, dict(expert_parallel_size=4, zero_stage=1)),
    ],
    ids=["ep2", "ep2-zero1", "ep2xtp2", "ep4-zero1"],
)
def test_expert_parallel_training_matches_single_process(launcher, reference, world, kwargs):
    results = launcher(world, trainer_run, kwargs, moe_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, str(kwargs), every_rank_holds_all=True)


def test_expert_parallel_inside_pipeline_stages(launcher):
    kwargs = dict(pipeline_parallel_size=2, expert_parallel_size=2, micro_batch_size=1, zero_stage=1)
    results = launcher(4, trainer_run, kwargs, moe_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference_run(moe_config(), STEPS, clip=1.0), "pp2 x ep2")


@pytest.mark.parametrize(
    "dp,kwargs",
    [
        # Each TP rank routes its own chunk; the router, shared-expert (and, without EP, expert) gradients are summed
        # over TP once per step, inside the data-parallel reduction (DDP / ZeRO-1/2 buckets over dp x cp x tp,
        # ZeRO-2 after each backward) or after it (ZeRO-3): every case accumulates 2 micro-batches per step.
        (1, dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=1)),
        (2, dict(tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2, zero_stage=2)),
        # the experts' ZeRO-3 scale is edp / expert_grad_divisor (tp / ep)
        (2, dict(tensor_parallel_size=2, sequence_parallel=True, expert_parallel_size=2, zero_stage=3)),
        # flat ZeRO-3 without EP: the experts are whole on every rank and tagged with the router
        (1, dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=3)),
        (1, dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=3, zero3_impl="fsdp2")),
        # FSDP2 over dp 2: the shards are averaged over dp, then summed over TP
        (2, dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=3, zero3_impl="fsdp2")),
        # CP 2: the stage group is cp x tp, divisor dp x cp (the SP norms and the chunk-routed weights)
        (1, dict(tensor_parallel_size=2, sequence_parallel=True, context_parallel_size=2, zero_stage=1)),
        # ZB-H1 / ZBV / DualPipeV split backward: their weight-gradient passes bypass the hooks, the buckets are
        # filled at the step (the V schedules hold 2 chunks per rank: 4 layers)
        *[
            (
                1,
                dict(
                    tensor_parallel_size=2,
                    sequence_parallel=True,
                    pipeline_parallel_size=2,
                    pipeline_schedule=schedule,
                    micro_batch_size=1,
                    zero_stage=1,
                ),
            )
            for schedule in ("zero_bubble", "zbv", "dualpipev")
        ],
    ],
    ids=[
        "tp2-sp-zero1",
        "tp2-sp-ep2-zero2",
        "tp2-sp-ep2-zero3",
        "tp2-sp-zero3",
        "tp2-sp-fsdp2",
        "dp2xtp2-sp-fsdp2",
        "cp2xtp2-sp-zero1",
        "tp2-sp-pp2-zb",
        "tp2-sp-pp2-zbv",
        "tp2-sp-pp2-dualpipev",
    ],
)
def test_moe_under_sequence_parallel(launcher, reference, dp, kwargs):
    from tests.strategies._lm import GLOBAL_BATCH

    pp, cp = kwargs.get("pipeline_parallel_size", 1), kwargs.get("context_parallel_size", 1)
    world, accumulate = 2 * pp * cp * dp, 2
    # DualPipeV needs 4 pipeline micro-batches per step (8 samples per step, 4 per accumulated batch)
    schedule = kwargs.get("pipeline_schedule")
    config, batch = (
        moe_config(4 if schedule in ("zbv", "dualpipev") else 2),
        GLOBAL_BATCH * (2 if schedule == "dualpipev" else 1),
    )
    if config.num_layers != moe_config().num_layers or batch != GLOBAL_BATCH:
        reference = reference_run(config, STEPS, clip=1.0, global_batch=batch)
    results = launcher(
        world, trainer_run, kwargs, config, STEPS, clip=1.0, accumulate=accumulate, batch_size=batch // dp // accumulate,
    )  # fmt: skip
    assert_matches_reference(results, reference, str(kwargs), every_rank_holds_all=pp == 1, losses_per_step=accumulate)


def test_expert_parallel_with_zero3(launcher, reference):
    # Experts: FSDP2 over edp on the expert mesh; the rest: FSDP2 over dp x cp.
    results = launcher(4, trainer_run, dict(expert_parallel_size=2, zero_stage=3), moe_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, "ep2 x zero3", every_rank_holds_all=True)


# ---- presets with their default MoE coefficients (issue 10 item 5): plain SGD, ragged labels, clipped at 1.0 (below
# every step's norm: clipping active) with each step's pre-clip global norm compared ----
CLIP = 1.0
PRESETS = ["mixtral-tiny", "qwen2-moe-tiny", "deepseek-v3-routing-tiny"]
LAYOUTS = {
    "dp2-zero1": (2, dict(zero_stage=1)),
    "ep2": (2, dict(expert_parallel_size=2)),
    "ep2xtp2-sp": (4, dict(expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def sgd_references():
    cache: dict[str, dict] = {}

    def get(preset: str, **overrides) -> dict:
        key = f"{preset}{sorted(overrides.items())}"
        if key not in cache:
            cache[key] = sgd_reference(shrink(preset, **overrides), STEPS, clip=CLIP)
        return cache[key]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_defaults_match_single_process(launcher, sgd_references, preset, layout):
    # Aux loss and z-loss from global token statistics, bias balancing by the module after each step.
    world, kwargs = LAYOUTS[layout]
    config = shrink(preset)
    assert config.moe_aux_loss_coeff > 0 or config.moe_router_bias_update_rate > 0
    ref = sgd_references(preset)
    assert min(ref["norms"]) > CLIP  # clipping active at every step
    results = launcher(world, sgd_trainer_run, kwargs, config, STEPS, clip=CLIP)
    assert_sgd_parity(results, ref, f"{preset} {layout}")
    if kwargs.get("sequence_parallel"):
        # Each TP rank routes its own sequence chunk: the EP group (the TP pair here) hands its experts every token
        # of the data shard once, top_k rows each -- not once per TP rank (the whole sequence on each).
        for res in results:
            assert res["dispatched"] and all(rows == tokens_k for rows, tokens_k in res["dispatched"]), res[
                "dispatched"
            ]
    if config.moe_router_bias_update_rate > 0:
        assert any(b.abs().max() > 0 for b in ref["buffers"].values())  # the biases really moved


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_defaults_under_expert_x_pipeline_parallel(launcher, sgd_references, preset):
    # EP=2 inside PP=2 stages with one micro-batch per step (GPipe): the aux statistics of a micro-batch are then those
    # of the whole global batch, as in the single-process oracle. With several micro-batches the global aux loss is,
    # as in Megatron-Core, a per-micro-batch statistic and the run equals a one-process run with the same micro-batches.
    kwargs = dict(expert_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="gpipe", micro_batch_size=2)
    results = launcher(4, sgd_trainer_run, kwargs, shrink(preset), STEPS, clip=CLIP)
    assert_sgd_parity(results, sgd_references(preset), f"{preset} ep2 x pp2", pipeline=True)


def test_deepseek_bias_balancing_under_hetero_meshes(launcher, sgd_references):
    # Issue 12 item 4: EP=2 on the first mesh (2 layers), EP=1 x TP=2 + SP on the second (1 layer); each mesh's routers
    # count the load of the whole global batch (one micro-batch per step) and take the same aux-free bias steps. On
    # the second mesh each TP rank routes its own sequence chunk: the router, shared-expert and expert gradients are
    # summed over TP by the pipeline's step (ZeRO-1 buckets over dp x cp x tp, filled at the step).
    config = shrink("deepseek-v3-routing-tiny")
    assert config.moe_router_bias_update_rate > 0
    meshes = [dict(data_parallel_size=2, expert_parallel_size=2), dict(tensor_parallel_size=2)]
    kwargs = dict(hetero_meshes=meshes, hetero_layers=[2, 1], micro_batch_size=2, zero_stage=1, sequence_parallel=True)
    results = launcher(4, sgd_trainer_run, kwargs, config, STEPS, batch_size=2, clip=CLIP)
    ref = sgd_references("deepseek-v3-routing-tiny")
    assert_sgd_parity(results, ref, "deepseek hetero ep2 | ep1 x tp2 + sp", pipeline=True)
    assert any(b.abs().max() > 0 for b in ref["buffers"].values())  # the biases really moved
    held = {name for res in results for name in res["buffers"]}
    assert held == set(ref["buffers"]), "every router bias is held (and compared) on some mesh"


def test_local_aux_loss_depends_on_the_layout(launcher, sgd_references):
    # The per-rank ("local") variant is selectable, and the parity test above is sensitive to the difference.
    results = launcher(
        2, sgd_trainer_run, dict(zero_stage=1), shrink("mixtral-tiny", moe_aux_loss_scope="local"), STEPS, clip=CLIP
    )
    ref = sgd_references("mixtral-tiny")
    err = (results[0]["params"]["layers.0.mlp.gate.weight"] - ref["params"]["layers.0.mlp.gate.weight"]).norm()
    update = (ref["params"]["layers.0.mlp.gate.weight"] - ref["init"]["layers.0.mlp.gate.weight"]).norm()
    assert err / update > 1e-3


# ---- hot-expert replication and MoE recompute from the config (issue 11 item 5) ----
DEEPSEEK_BALANCED = dict(
    moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-3,  # aux loss on top of the preset's bias balancing
    moe_hot_expert_replicas=2, moe_hot_expert_enable_imbalance=1.0, moe_hot_expert_disable_imbalance=1.0,
)  # fmt: skip


@pytest.mark.parametrize(
    "world,kwargs,recompute",
    [
        (2, dict(expert_parallel_size=2, zero_stage=1), dict(moe_recompute="full")),
        (
            4,
            dict(expert_parallel_size=2, tensor_parallel_size=2),
            dict(moe_recompute="medium", moe_recompute_token_threshold=0),
        ),
    ],
    ids=["ep2-zero1-full", "ep2xtp2-medium"],
)
def test_deepseek_hot_experts_and_recompute_match_single_process(launcher, sgd_references, world, kwargs, recompute):
    # Sigmoid, group-limited routing, shared expert, aux + z loss, bias balancing; replicas of the two busiest
    # experts on every EP rank from the second step on (imbalance threshold 1.0), and MoE recompute.
    overrides = {**DEEPSEEK_BALANCED, **recompute}
    results = launcher(
        world, sgd_trainer_run, kwargs, shrink("deepseek-v3-routing-tiny", **overrides), STEPS, clip=CLIP
    )
    assert_sgd_parity(
        results, sgd_references("deepseek-v3-routing-tiny", **overrides), f"deepseek {kwargs} {recompute}"
    )
    for res in results:
        assert all(len(r) == 2 for r in res["replicated"]), res["replicated"]  # chosen after every step
        assert sum(res["replica_bytes"]) > 0  # and used by the dispatcher's forwards
