"""Named device meshes built from a ``ParallelConfig``.

Rank order (row-major over the dims below, the last dim fastest):

    world mesh   ("pp", "dp", "cp", "tp")    tp neighbours are adjacent ranks (same node: fastest links),
                                             then cp, then dp; pipeline stages are the outermost blocks.
    expert mesh  ("pp", "edp", "ep", "etp")  the same ranks, with a stage's dp x cp x tp ranks refolded as
                                             edp x ep x etp (Megatron's "MoE parallel folding").

Example, 8 ranks, pp=2, dp=2, tp=2: stage 0 holds ranks 0-3, with TP pairs (0,1) and (2,3) and DP pairs (0,2), (1,3).

A ``ParallelMeshes`` object is a plain value: nothing is global, and several of them can coexist (heterogeneous
training builds one per homogeneous sub-mesh).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from lightning_flagscale.config import ParallelConfig

__all__ = ["MeshDim", "ParallelMeshes", "build_meshes"]


class MeshDim(str, Enum):
    """Every mesh axis name used in the package."""

    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"
    DP_CP = "dp_cp"  # flattened: gradients and ZeRO shards are reduced over data x context ranks
    STAGE = "dp_cp_tp"  # flattened: every rank of one pipeline stage (MoE load statistics, per-stage reductions)
    EDP = "edp"
    EP = "ep"
    ETP = "etp"


_WORLD_DIMS = (MeshDim.PP, MeshDim.DP, MeshDim.CP, MeshDim.TP)
_EXPERT_DIMS = (MeshDim.PP, MeshDim.EDP, MeshDim.EP, MeshDim.ETP)


@dataclass(frozen=True)
class ParallelMeshes:
    """The world mesh and, for MoE, the expert mesh over the same ranks."""

    config: ParallelConfig
    world: DeviceMesh
    dp_cp: DeviceMesh
    stage: DeviceMesh
    expert: DeviceMesh | None = None

    def __getitem__(self, dims: str | MeshDim | tuple[str | MeshDim, ...]) -> DeviceMesh:
        return self.get(dims)

    def get(self, dims: str | MeshDim | tuple[str | MeshDim, ...]) -> DeviceMesh:
        """Sub-mesh by axis name(s); raises naming the valid axes."""
        names = (dims,) if isinstance(dims, (str, MeshDim)) else tuple(dims)
        names = tuple(MeshDim(n).value for n in names)
        world_names = set(self.world.mesh_dim_names or ())
        if names == (MeshDim.DP_CP.value,):
            return self.dp_cp
        if names == (MeshDim.STAGE.value,):
            return self.stage
        if MeshDim.DP_CP.value in names and len(names) > 1 and all(n in world_names for n in names if n != "dp_cp"):
            # The flattened axis beside world axes (e.g. ("dp_cp", "tp") for flat ZeRO-3's 2-D sharding): joined from
            # the kept meshes and their existing groups. Slicing the flattened axis from the root mesh is deprecated
            # by torch ("users need to bookkeep the flattened mesh"); it warned on every TP x ZeRO-3 run.
            return DeviceMesh._concatenate([self.dp_cp if n == MeshDim.DP_CP.value else self.world[n] for n in names])
        if all(n in world_names for n in names):
            return self.world[names if len(names) > 1 else names[0]]
        if self.expert is not None and all(n in (self.expert.mesh_dim_names or ()) for n in names):
            return self.expert[names if len(names) > 1 else names[0]]
        valid = sorted(
            world_names | {MeshDim.DP_CP.value} | set(self.expert.mesh_dim_names if self.expert is not None else ())
        )
        raise KeyError(f"Unknown mesh axes {names}; valid axes are {valid}.")

    def size(self, dim: str | MeshDim) -> int:
        return self.get(dim).size()

    def local_rank(self, dim: str | MeshDim) -> int:
        return self.get(dim).get_local_rank()

    def group(self, dim: str | MeshDim) -> dist.ProcessGroup:
        return self.get(dim).get_group()

    @property
    def device_type(self) -> str:
        return self.world.device_type


def build_meshes(config: ParallelConfig, device_type: str) -> ParallelMeshes:
    """Create the world (and expert) meshes for an initialised default process group.

    ``config`` must be resolved against the world size (``ParallelConfig.resolve``). Every size-1 axis is kept, so
    code can always ask for ``meshes["tp"]`` without special cases.
    """
    world_size = dist.get_world_size()
    if config.world_size != world_size:
        raise ValueError(f"ParallelConfig describes {config.world_size} ranks but the process group has {world_size}.")
    shape = (config.pipeline_parallel_size, config.dp, config.context_parallel_size, config.tensor_parallel_size)
    world = init_device_mesh(device_type, shape, mesh_dim_names=tuple(d.value for d in _WORLD_DIMS))
    dp_cp = world[(MeshDim.DP.value, MeshDim.CP.value)]._flatten(MeshDim.DP_CP.value)
    stage = world[(MeshDim.DP.value, MeshDim.CP.value, MeshDim.TP.value)]._flatten(MeshDim.STAGE.value)
    expert = None
    if config.expert_parallel_size > 1 or config.expert_tensor_parallel_size > 1:
        folded = config.dp * config.context_parallel_size * config.tensor_parallel_size
        etp = config.expert_tensor_parallel_size
        ep = config.expert_parallel_size
        eshape = (config.pipeline_parallel_size, folded // (ep * etp), ep, etp)
        expert = init_device_mesh(device_type, eshape, mesh_dim_names=tuple(d.value for d in _EXPERT_DIMS))
    return ParallelMeshes(config=config, world=world, dp_cp=dp_cp, stage=stage, expert=expert)


def device_type_of(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else device.type
