"""The flat reduce-scatter and all-gather that the data-parallel paths issue (buckets, flat ZeRO-3, calibration).

``reduce_scatter(out, inp, group)`` reduces the flat ``inp`` over ``group`` and leaves this rank's equal chunk in
``out``. Each backend gets its own native reduce-scatter:

- NCCL and every other backend: ``reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.10), the
  flat-buffer collective that NCCL runs without a copy.
- gloo (CPU tensors): the list form ``dist.reduce_scatter(out, list(inp.chunk(N)))``. ProcessGroupGloo (torch 2.13)
  runs the flat form as a clone of the whole input on the calling thread, an all-reduce of the clone and a copy
  of one chunk out: the bytes and time of an all-reduce. The list form runs gloo's own reduce-scatter algorithm.
  Timed alone on 4 ranks of this 2-core machine, 96 MB of fp32: flat 0.19-0.22 s, list 0.12-0.17 s, all-reduce
  0.11-0.13 s (``bench/results/compare_strategies.md`` has the script and the profile).

Both forms are one ``reduce_scatter`` in ``CommTracker``'s accounting (``c10d::_reduce_scatter_base_`` and
``c10d::reduce_scatter_``) with the same payload, so the bytes per step do not depend on the backend.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather", "reduce_scatter"]

# torch >= 2.10 names them *_single; the old names warn.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _cpu_backend_is_gloo(group: dist.ProcessGroup | None) -> bool:
    backend = str(dist.get_backend(group))  # "gloo", "nccl" or a device map like "cpu:gloo,cuda:nccl"
    return backend == "gloo" or "cpu:gloo" in backend


def reduce_scatter(
    out: Tensor, inp: Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    """Sum the flat ``inp`` (``N * out.numel()`` elements) over ``group``; this rank's chunk lands in ``out``."""
    if inp.device.type == "cpu" and _cpu_backend_is_gloo(group):
        world = dist.get_world_size(group)
        return dist.reduce_scatter(out, list(inp.chunk(world)), group=group, async_op=async_op)
    return _reduce_scatter_flat(out, inp, group=group, async_op=async_op)
