"""DTensor helpers shared by the models and the runtime: a rank's local part of a tensor, a local copy of global
values into a shard, and how many ranks hold distinct parts of a parameter (its share of the gradient norm)."""

from __future__ import annotations

import math

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def local_tensor(t: Tensor) -> Tensor:
    """The part of ``t`` this rank holds (the local shard of a DTensor, or ``t`` itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def copy_global_into(dst: Tensor, full: Tensor) -> None:
    """Copy the part of ``full`` (global values) that ``dst`` holds: all of it, or its DTensor shard. Slices locally
    instead of ``distribute_tensor``: no communication, for callers where every rank holds the same ``full``."""
    if isinstance(dst, DTensor) and any(isinstance(p, _StridedShard) for p in dst.placements):
        # Not one box of `full` (expert tensor parallelism's gate/up chunks): each rank keeps its own part, no
        # communication (src_data_rank=None).
        dst.to_local().copy_(distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local())
    elif isinstance(dst, DTensor):
        # Private torch helper: the shard's local shape and global offset under any placements.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, dst.device_mesh, dst.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        dst.to_local().copy_(full[index])
    else:
        dst.copy_(full)


def num_shards(p: Tensor) -> int:
    """How many ranks of a pipeline stage hold distinct parts of ``p``."""
    explicit = getattr(p, "_fs_num_shards", None)
    if explicit is not None:
        return explicit
    if isinstance(p, DTensor):
        return math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if _is_shard(pl))
    return 1


def _is_shard(placement) -> bool:
    # FSDP2 on top of TP shards the same dim twice with `_StridedShard`, which is not a `Shard` subclass.
    return placement.is_shard() or isinstance(placement, _StridedShard)
