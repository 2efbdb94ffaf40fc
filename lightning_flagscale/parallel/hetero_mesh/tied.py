"""A weight tied across two heterogeneous meshes (embedding on the first stage, LM head on the last).

The two copies live on stage groups with their own TP / DP / CP / ZeRO layouts, e.g. a vocab-parallel embedding
sharded TP=2 on mesh 0 and an unsharded LM head replicated over DP=2 on mesh 1, so no shard of one side lines up with
a shard of the other. The reduction therefore goes through the full (gathered) tensor, over one process group that
holds every rank of both groups:

* each rank gathers its copy's full gradient over its own group (``DTensor.full_tensor``): under ZeRO-0/1/2 that is
  this data x context rank's partial sum (TP copies of it are identical), under ZeRO-3 the already averaged gradient;
  either way the group's ``n`` ranks together hold ``n`` times the group's contribution (its average is the
  single-process gradient of that copy, see ``hetero_runner.py``);
* one all-reduce of ``full / n`` over both groups gives the sum of the two contributions on every rank;
* each rank writes back the slice it holds. Its group's DP average (ZeRO-0/1/2, still to come) then leaves it
  unchanged, and both copies hold the same gradient, as the single tied Parameter would.

Parameters start equal the same way: the first group's full embedding is broadcast and every last-group rank keeps
its slice. Cost: one all-reduce of the full weight per optimizer step, over both groups (FlagScale instead requires
equal TP on the first and last mesh).

Under a V-shaped schedule (``zbv``, ``dualpipev``) the first and the last stage are on the same stage group: every
rank of it holds both copies, laid out alike, and the sync is local (copy the values once; add the two gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_flagscale.config.hetero import StageGroup
from lightning_flagscale.distributed.dtensor import copy_global_into

__all__ = ["TiedAcrossMeshes"]


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class TiedAcrossMeshes:
    """Keeps the first and the last stage group's copies of one tied weight equal (module docstring)."""

    def __init__(self, first: StageGroup, last: StageGroup) -> None:
        """``first`` / ``last``: the stage groups of the first and the last pipeline stage (the same one in a V)."""
        self._local = first is last
        self._ranks = sorted(set(first.ranks) | set(last.ranks))
        # Created by every rank in the same order (group creation is collective over the default group).
        self._group = None if self._local else dist.new_group(self._ranks)
        self._src = first.ranks[0]
        me = dist.get_rank()
        self._in_first = me in first.ranks
        self._size = first.size if self._in_first else last.size if me in last.ranks else 0

    @property
    def member(self) -> bool:
        return self._size > 0

    @torch.no_grad()
    def sync_params(self, params: list[nn.Parameter]) -> None:
        """Every copy takes the first stage's values (call once after initialisation, on members only, with the
        copies this rank holds: the first stage's and / or the last stage's)."""
        if self._local:
            first, last = params
            copy_global_into(last.data if not isinstance(last, DTensor) else last, _full(first.detach()))
            return
        (param,) = params
        if self._in_first:  # `full_tensor` is collective over the first group's meshes: all its ranks gather
            full = _full(param.detach()).contiguous()
        else:
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        dist.broadcast(full, src=self._src, group=self._group)
        if not self._in_first:
            copy_global_into(param.data if not isinstance(param, DTensor) else param, full)

    @torch.no_grad()
    def sync_grads(self, params: list[nn.Parameter]) -> None:
        """Sum the two copies' gradient contributions into every copy (call once per optimizer step, members only)."""
        grads = [_aligned_grad(p) for p in params]
        if self._local:  # both copies here, summed through the full tensor (their layouts may differ, e.g. a
            total = sum(_full(g).float() for g in grads)  # Replicate embedding gradient and a sharded head's)
            for g in grads:
                copy_global_into(g, total.to(g.dtype))
            return
        (grad,) = grads
        total = _full(grad).float() / self._size
        dist.all_reduce(total, group=self._group)
        copy_global_into(grad, total.to(grad.dtype))


def _aligned_grad(param: nn.Parameter) -> Tensor:
    """``param``'s gradient (zeros if it has none) laid out like ``param``."""
    grad = param.grad
    if grad is None:
        grad = param.grad = torch.zeros_like(param)
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        # Torch's embedding backward may give a Replicate gradient for a vocab-sharded weight: align it first.
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
    return grad
