"""Pipeline parallelism across heterogeneous process meshes: the stage groups' meshes and the pipelined model.

Each pipeline stage is a *stage group* (``config/hetero.py``): the ranks of one stage of one mesh, with their own
data / context / tensor / expert parallel sizes. Inside a group everything is the homogeneous code path (TP, SP, CP,
EP, ZeRO on the group's own meshes, built by :func:`build_group_meshes`). Between groups, activations and their
gradients are resliced (``hetero_boundary.py``) by a schedule of our own (``hetero_runner.py``); a weight tied
between the first and the last stage is kept in sync across the two meshes (``hetero_tied.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_flagscale.config.hetero import StageGroup
from lightning_flagscale.config.schedules import SCHEDULE_SPECS, stage_placement
from lightning_flagscale.parallel.hetero_mesh.boundary import Transfer, boundary_transfers, gradient_transfers
from lightning_flagscale.parallel.hetero_mesh.runner import HeteroPipelineRunner
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes
from lightning_flagscale.parallel.pipeline_parallel.model import PipelinedModel
from lightning_flagscale.parallel.pipeline_parallel.plan import stage_ids_for_rank
from lightning_flagscale.parallel.pipeline_parallel.runner import (
    build_stage_module,
    check_units_cover_parameters,
    plan_stages,
    tied_across_stages,
)

__all__ = [
    "HeteroPipelineRunner",
    "Transfer",
    "boundary_transfers",
    "build_group_meshes",
    "build_hetero_layout",
    "build_hetero_pipelined_model",
    "gradient_transfers",
    "group_of_rank",
]


def group_of_rank(groups: list[StageGroup], rank: int) -> StageGroup:
    for group in groups:
        if rank in group.ranks:
            return group
    raise ValueError(f"Rank {rank} is in no heterogeneous mesh ({sum(g.size for g in groups)} ranks are described).")


def build_group_meshes(groups: list[StageGroup], configs: list[Any], device_type: str) -> ParallelMeshes:
    """Every group's meshes, created collectively by all ranks; returns this rank's (a plain ``ParallelMeshes``).

    Each group's world mesh is ``("pp", "dp", "cp", "tp")`` with pp = 1 over the group's own ranks, so everything
    inside a stage (TP, EP, ZeRO) runs the homogeneous code unchanged. Group creation is collective over the default
    group, hence every rank builds every mesh; a rank keeps only its own.
    """
    mine: ParallelMeshes | None = None
    for group, config in zip(groups, configs):
        dp, cp, tp = group.data_parallel_size, group.context_parallel_size, group.tensor_parallel_size
        ranks = torch.tensor(group.ranks).reshape(1, dp, cp, tp)
        world = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "dp", "cp", "tp"))
        # The flattened meshes are built as meshes of their own, on every rank: `_flatten` would create their
        # groups on the members only, and the default group's group counter must stay in step on all ranks (a
        # later world-wide `new_group`, e.g. Lightning's barrier, would otherwise hang).
        by_tp = DeviceMesh(
            device_type, ranks.reshape(dp * cp, tp).T, mesh_dim_names=("tp_of_dp_cp", MeshDim.DP_CP.value)
        )
        stage = DeviceMesh(device_type, ranks.reshape(-1), mesh_dim_names=(MeshDim.STAGE.value,))
        expert = None
        if group.expert_parallel_size > 1 or group.expert_tensor_parallel_size > 1:
            ep, etp = group.expert_parallel_size, group.expert_tensor_parallel_size
            eshape = (1, group.size // (ep * etp), ep, etp)
            expert = DeviceMesh(device_type, ranks.reshape(eshape), mesh_dim_names=("pp", "edp", "ep", "etp"))
        if dist.get_rank() in group.ranks:
            dp_cp = by_tp[MeshDim.DP_CP.value]
            mine = ParallelMeshes(config=config, world=world, dp_cp=dp_cp, stage=stage, expert=expert)
    assert mine is not None, f"rank {dist.get_rank()} belongs to no heterogeneous stage group"
    return mine


def build_hetero_pipelined_model(
    model: nn.Module, groups: list[StageGroup], meshes: ParallelMeshes, config: Any, device: torch.device
) -> PipelinedModel:
    """Cut ``model`` into the stage groups' chunks and wrap this rank's stages (cf. ``build_pipelined_model``).

    ``config`` is this rank's group layout (its ``micro_batch_size`` is this rank's share of a micro-batch);
    recompute, TP, CP, EP and ZeRO are applied to each stage afterwards by the parallelize plan, as without PP.
    Global stage ``s`` is chunk ``k`` of group ``g`` for ``(g, k) = stage_placement(s, G, schedule)``: ``k G + g``
    looped over the ``G`` groups, or ``g`` and ``2G - 1 - g`` in a V (``zbv``, ``dualpipev``).
    """
    units = list(model.pipeline_units())
    check_units_cover_parameters(model, units)
    G, v, schedule = len(groups), len(groups[0].chunk_layers), config.pipeline_schedule
    layers = [groups[g].chunk_layers[k] for g, k in (stage_placement(s, G, schedule) for s in range(G * v))]
    plan = plan_stages(units, len(layers), 1, pipeline_layers=layers)
    me = group_of_rank(groups, dist.get_rank())
    stage_ids = stage_ids_for_rank(me.index, G, plan.num_stages, SCHEDULE_SPECS[schedule].placement)
    holder: list[PipelinedModel] = []
    runner = HeteroPipelineRunner(
        groups=groups, group=me, plan=plan, schedule_name=schedule, stage_ids=stage_ids,
        stage_modules=[build_stage_module(model, plan.units[s]) for s in stage_ids],
        micro_batch_size=config.micro_batch_size, device=device, tied=tied_across_stages(model, plan),
        loss_fn=lambda out, target, n: holder[0].scaled_stage_loss(out, target, n),
        token_group=meshes.group(MeshDim.DP_CP) if meshes.size(MeshDim.DP_CP) > 1 else None,
        order_costs=config.pipeline_chunk_costs, order_max_activations=config.pipeline_max_activations,
    )  # fmt: skip
    pipelined = PipelinedModel(runner, model, mtp_group=meshes.group(MeshDim.DP_CP))
    holder.append(pipelined)
    return pipelined


def build_hetero_layout(
    parallel: Any, num_layers: int, device_type: str, rank_order: list[int] | None = None, model: Any = None
) -> tuple[list[StageGroup], ParallelMeshes, Any]:
    """Plan the stage groups of a heterogeneous ``ParallelConfig``, build every group's meshes (collectively) and
    return (groups, this rank's meshes, this rank's group layout); the chosen split is logged. ``model``: the
    module's config, whose embedding and LM head a ``hetero_device_speed`` split counts."""
    groups = parallel.stage_groups(num_layers, model, rank_order)
    if dist.get_rank() == 0:
        order = list(dict.fromkeys(g.mesh for g in groups))  # hetero_mesh_order="speed" may have moved the meshes
        logging.getLogger(__name__).info(
            f"Heterogeneous mesh order ({parallel.hetero_mesh_order}): hetero_meshes {order} as pipeline stages; stages: "
            + "; ".join(f"stage {g.index} on mesh {g.mesh} ({g.device_type or 'untyped'}, ranks "
                        f"{g.ranks}): {'+'.join(map(str, g.chunk_layers))} blocks" for g in groups)
        )  # fmt: skip
    configs = parallel.stage_group_configs(num_layers, model)
    mine = build_group_meshes(groups, configs, device_type)
    return groups, mine, configs[group_of_rank(groups, dist.get_rank()).index]
