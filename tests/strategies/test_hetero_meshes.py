"""Heterogeneous process meshes (issue 12): pipeline stages on meshes with different TP / DP sizes and layer counts,
activations and gradients resliced at the boundary, against the single-process fp32 run (SGD, ragged labels, weights
and gradient norms after 3 steps)."""

from __future__ import annotations

import pytest

from lightning_flagscale import FlagScaleStrategy, ParallelConfig
from lightning_flagscale.config.hetero import StageGroup, parse_hetero_meshes
from lightning_flagscale.config.layer_split import plan_stage_groups
from lightning_flagscale.parallel.hetero_dp.batching import MicroBatchSliceSampler
from lightning_flagscale.parallel.hetero_mesh.build import boundary_transfers, gradient_transfers
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3
TP2 = dict(tensor_parallel_size=2)
DP2 = dict(data_parallel_size=2)


def _config():
    return tiny_config(num_layers=4)


@pytest.mark.parametrize(
    ("meshes", "layers", "kwargs", "global_batch"),
    [
        ([TP2, DP2], [3, 1], dict(micro_batch_size=2, pipeline_schedule="1f1b"), 4),  # TP 2 -> 1, DP 1 -> 2, uneven
        ([DP2, TP2], [1, 3], dict(micro_batch_size=1, pipeline_schedule="gpipe", zero_stage=1), 4),  # TP 1 -> 2
        # 4 micro-batches through 1F1B, ZeRO-3; listed TP 2 then DP 2, run DP 2 -> TP 2 (ranks 2, 3 then 0, 1): the
        # planner puts the faster mesh last, where the LM head is (hetero_mesh_order="speed", issue 42 item 5); the
        # slow first mesh runs all 4 forwards before its backwards (hetero_warmup="speed": 4 > 1F1B's 1)
        ([dict(TP2, device_type="fast"), dict(DP2, device_type="slow")], None,
         dict(micro_batch_size=2, zero_stage=3, hetero_device_speed={"fast": 3.0, "slow": 1.0},
              hetero_mesh_order="speed", hetero_warmup="speed"), 8),
    ],
    ids=["tp2-to-dp2-1f1b", "dp2-to-tp2-gpipe-zero1", "tp2-dp2-speed-ordered-warmup-zero3"],
)  # fmt: skip
def test_hetero_meshes_match_single_process(launcher, meshes, layers, kwargs, global_batch):
    strategy = dict(hetero_meshes=meshes, hetero_layers=layers, **kwargs)
    if kwargs.get("hetero_mesh_order") == "speed":  # the plan the strategy runs (it passes the module's config)
        groups = ParallelConfig(**strategy).stage_groups(_config().num_layers, _config())
        assert [(g.mesh, g.ranks, g.num_layers, g.warmup) for g in groups] == [(1, [2, 3], 1, 4), (0, [0, 1], 3, None)]
    first_dp = meshes[0].get("data_parallel_size", 1)
    reference = reference_run(_config(), STEPS, clip=1.0, global_batch=global_batch)
    results = launcher(4, trainer_run, strategy, _config(), STEPS, clip=1.0, batch_size=global_batch // first_dp)
    assert_matches_reference(results, reference, str(strategy))


def test_boundary_transfers_cover_every_row_once():
    send = StageGroup(0, 0, 0, tensor_parallel_size=2, data_parallel_size=1, context_parallel_size=1,
                      expert_parallel_size=1, num_layers=1)  # fmt: skip
    recv = StageGroup(1, 1, 2, tensor_parallel_size=1, data_parallel_size=2, context_parallel_size=1,
                      expert_parallel_size=1, num_layers=1)  # fmt: skip
    fwd = boundary_transfers(send, recv, rows=4)
    assert {(t.dst, t.src_lo, t.src_hi, t.dst_lo) for t in fwd} == {(2, 0, 2, 0), (3, 2, 4, 0)}
    back = gradient_transfers(send, recv, rows=4)
    # both TP ranks of the sender get both halves of the gradient
    assert sorted((t.src, t.dst, t.dst_lo) for t in back) == [(2, 0, 0), (2, 1, 0), (3, 0, 2), (3, 1, 2)]


def test_every_mesh_reads_slices_of_the_same_micro_batches():
    first = [list(MicroBatchSliceSampler(16, 4, 2, 1, 0, shuffle=True))]
    second = [list(MicroBatchSliceSampler(16, 4, 2, 2, r, shuffle=True)) for r in (0, 1)]
    for k in range(4):
        a = first[0][k]
        assert second[0][k] + second[1][k] != a  # rank 0 of the second mesh holds the first half of EACH micro-batch
        assert [a[0], a[2]] == second[0][k] and [a[1], a[3]] == second[1][k]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hetero_meshes=[TP2, DP2], tensor_parallel_size=2), "belong inside each mesh's dict"),
        (dict(hetero_meshes=[TP2, dict(context_parallel_size=2)]), "differs between hetero_meshes"),
        (dict(hetero_meshes=[TP2, DP2], hetero_layers=[1, 1, 2]), "one layer count per stage"),
        (
            dict(hetero_meshes=[TP2, DP2], pipeline_schedule="zbv", virtual_pipeline_parallel_size=3),
            "needs virtual_pipeline_parallel_size=2",
        ),
        (dict(hetero_meshes=[TP2, dict(tensor_parallel_size=0)]), "must be a positive integer"),
        (dict(hetero_meshes=[TP2, dict(tp=2)]), "unknown keys"),
        (dict(hetero_meshes=[TP2, DP2], hetero_dp_batch_sizes=[1, 1]), "cannot be combined"),
    ],
)
def test_invalid_hetero_layouts_are_rejected_before_spawn(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlagScaleStrategy(**kwargs)


def test_world_size_layers_and_micro_batches_are_checked():
    config = ParallelConfig(hetero_meshes=[TP2, DP2])
    with pytest.raises(ValueError, match=r"2 \+ 2 = 4 ranks but the world size is 8"):
        config.resolve(8)
    with pytest.raises(ValueError, match="sums to 3 but the model has num_layers=4"):
        ParallelConfig(hetero_meshes=[TP2, DP2], hetero_layers=[2, 1]).validate_model(_config())
    with pytest.raises(ValueError, match="cannot be split over mesh 1's data_parallel_size=2"):
        ParallelConfig(hetero_meshes=[TP2, DP2], micro_batch_size=1).stage_group_configs(4)
    groups = plan_stage_groups(parse_hetero_meshes([TP2, dict(data_parallel_size=2, pipeline_parallel_size=2)]),
                               [2, 1, 1], 4)  # fmt: skip
    assert [(g.index, g.mesh, g.first_rank, g.size) for g in groups] == [(0, 0, 0, 2), (1, 1, 2, 2), (2, 1, 4, 2)]


def _meshes_then_world_group() -> float:
    import torch
    import torch.distributed as dist

    from lightning_flagscale.parallel.hetero_mesh.build import build_group_meshes

    config = ParallelConfig(hetero_meshes=[TP2, DP2], micro_batch_size=2)
    groups = plan_stage_groups(parse_hetero_meshes(config.hetero_meshes), None, 4)
    meshes = build_group_meshes(groups, config.stage_group_configs(4), "cpu")
    # A world-wide group created afterwards (as Lightning's data barrier does) must not hang: every rank created the
    # same groups in the same order.
    world = dist.new_group(backend="gloo")
    total = torch.ones(())
    dist.all_reduce(total, group=world)
    assert meshes.size("dp_cp") == (1 if dist.get_rank() < 2 else 2) and meshes.size("tp") == (
        2 if dist.get_rank() < 2 else 1
    )
    return float(total)


def test_group_meshes_keep_world_group_creation_in_step(launcher):
    assert launcher(4, _meshes_then_world_group, timeout=60) == [4.0] * 4


HETERO = dict(hetero_meshes=[TP2, DP2], hetero_layers=[3, 1], micro_batch_size=2, zero_stage=1)


def test_checkpoints_reshard_between_hetero_and_homogeneous_layouts(launcher, tmp_path):
    """Save under hetero meshes, resume under TP2 x DP2 (and a homogeneous save resumed under hetero meshes):
    the losses and weights equal an uninterrupted single-process run (DCP reshards by parameter name)."""
    samples = 12  # global batch 4: one epoch is 3 steps, so the checkpoints sit on an epoch boundary
    reference = reference_run(_config(), 6, num_samples=samples)
    homogeneous = dict(tensor_parallel_size=2, zero_stage=1)
    for save, resume, tag in ((HETERO, homogeneous, "hetero-to-tp2xdp2"), (homogeneous, HETERO, "tp2xdp2-to-hetero")):
        path = str(tmp_path / f"{tag}.ckpt")
        batch = {id(HETERO): 4, id(homogeneous): 2}
        launcher(4, trainer_run, save, _config(), 3, max_epochs=1, num_samples=samples, save_path=path,
                 batch_size=batch[id(save)])  # fmt: skip
        results = launcher(4, trainer_run, resume, _config(), 6, max_epochs=2, num_samples=samples, ckpt_path=path,
                           batch_size=batch[id(resume)])  # fmt: skip
        ref_losses, ref_params = reference
        for losses, params in results:
            for got, want in zip(losses, ref_losses[3:]):
                assert abs(got - want) <= 1e-5 * abs(want), (tag, losses, ref_losses[3:])
            for name, value in params.items():
                torch_assert = ref_params[name]
                assert ((value - torch_assert).norm() / torch_assert.norm()) <= 1e-5, (tag, name)


def test_speed_aware_split_equalises_stage_times():
    from lightning_flagscale.config.layer_split import speed_aware_layers

    fast, slow = dict(tensor_parallel_size=2, device_type="fast"), dict(data_parallel_size=2, device_type="slow")
    meshes = parse_hetero_meshes([fast, slow])
    assert speed_aware_layers(meshes, 8) == [4, 4]  # equal ranks, equal speed
    assert speed_aware_layers(meshes, 8, {"fast": 3.0, "slow": 1.0}) == [6, 2]  # time per stage: 6/6 = 2/2
    assert speed_aware_layers(meshes, 4, {"fast": 100.0, "slow": 1.0}) == [3, 1]  # every stage keeps a block
    uneven = parse_hetero_meshes([dict(tensor_parallel_size=2, data_parallel_size=2), dict(device_type="x")])
    assert speed_aware_layers(uneven, 10) == [8, 2]  # 4 ranks vs 1 rank
    with pytest.raises(ValueError, match="no entry for hetero_meshes"):
        speed_aware_layers(meshes, 8, {"fast": 2.0})
    config = ParallelConfig(
        hetero_meshes=[fast, slow], hetero_device_speed={"fast": 3.0, "slow": 1.0}, micro_batch_size=2
    )
    assert [c.tensor_parallel_size for c in config.stage_group_configs(8)] == [2, 1]
    with pytest.raises(ValueError, match="not both"):
        ParallelConfig(hetero_meshes=[fast, slow], hetero_layers=[6, 2], hetero_device_speed={"fast": 1.0})


def test_a_tuner_hetero_plan_trains_as_the_single_process_run(launcher):
    """``tune --hetero``'s plans are what the strategy runs: the planner's best mesh plan for two device groups (one
    4x faster), and its best plan feeding another mesh layout from data-parallel ranks (micro-batches split over
    them, activations resliced at the boundary), passed as they come
    out (``HeteroPlan.parallel``) to ``FlagScaleStrategy``, train the single-process fp32 run's losses and weights
    (SGD, ragged labels, clipping)."""
    from lightning_flagscale.tune import HardwareProfile
    from lightning_flagscale.tune.hardware import COLLECTIVES, LinkPoint
    from lightning_flagscale.tune.hetero import DeviceGroup, plan_hetero

    link = [LinkPoint(group_size=2, latency=1e-5, bus_bandwidth=1e10)]
    fast = HardwareProfile(name="fast", device_type="fast", peak_flops=4e10, hbm_bandwidth=5e10, memory_bytes=1e9,
                           links={k: {"intra": link, "inter": link} for k in COLLECTIVES})  # fmt: skip
    slow = fast.replace(name="slow", device_type="slow", peak_flops=1e10, hbm_bandwidth=1.25e10)
    groups = [DeviceGroup(device_type=p.device_type, count=2, profile=p) for p in (fast, slow)]
    global_batch = 8
    plans = plan_hetero(_config(), groups, seq_len=16, global_batch=global_batch)

    def shapes(plan):
        return [{k: v for k, v in m.items() if k != "device_type"} for m in plan.parallel["hetero_meshes"]]

    # the best plan feeding a TP mesh from a DP mesh (its micro-batch split over the first mesh's DP ranks)
    mixed = next(p for p in plans if shapes(p)[0]["data_parallel_size"] > 1 and shapes(p)[0] != shapes(p)[1])
    reference = reference_run(_config(), STEPS, clip=1.0, global_batch=global_batch)
    for plan in (plans[0], mixed):
        layers = plan.parallel["hetero_layers"]
        assert sum(layers) == 4 and layers[0] > layers[-1]  # the fast group takes more blocks
        first_dp = plan.parallel["hetero_meshes"][0]["data_parallel_size"]
        results = launcher(4, trainer_run, plan.parallel, _config(), STEPS, clip=1.0,
                           batch_size=global_batch // first_dp)  # fmt: skip
        assert_matches_reference(results, reference, str(plan.parallel))
