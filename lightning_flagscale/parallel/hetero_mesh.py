"""Pipeline parallelism across heterogeneous process meshes, resliced at every stage boundary.

Each pipeline stage is a *stage group* (``config/hetero.py``): the ranks of one stage of one mesh, with their own
data / tensor / expert parallel sizes. Inside a group everything is the homogeneous code path (TP, EP, ZeRO on the
group's own meshes, built by :func:`build_group_meshes`). Between groups, ``torch.distributed.pipelining`` cannot be
used: it assumes one peer rank per neighbouring stage, while here a stage with data-parallel size 1 may feed a stage
with data-parallel size 2. :class:`HeteroPipelineRunner` therefore runs its own GPipe / 1F1B schedule with P2P
transfers that reslice activations (and, backwards, their gradients) between the two layouts:

* **Batch axis.** Every micro-batch is one set of samples; data-parallel rank ``i`` of a group with ``dp`` ranks
  holds the ``i``-th of ``dp`` equal slices of it (the strategy's sampler lays the data out that way). Each receiving
  rank gets exactly the rows it needs from the overlapping senders (1-D segment intersection).
* **Tensor axis.** Activations between blocks are replicated over TP (no sequence parallelism across boundaries):
  receiving TP rank ``u`` is served by sending TP rank ``u mod tp_send``; gradients go back to every sending TP rank
  ``t`` from receiving TP rank ``t mod tp_recv``.
* **Gradient scale.** Every group averages its gradients over its own data x context ranks ``R`` while the loss is a
  global token mean multiplied by the last group's ``R``; a gradient crossing from group ``r`` back to group ``s`` is
  multiplied by ``R_s / R_r`` so that every group's average is exactly the single-process gradient.

::

    mesh 0: TP=2, DP=1  (ranks 0,1)          mesh 1: TP=1, DP=2  (ranks 2,3)
      micro-batch rows [0, 4) on both  --->  rank 2 gets rows [0, 2) from rank 0
                                             rank 3 gets rows [2, 4) from rank 1 (u=0 -> t=0 ... spread by dp)
      grads: ranks 0 and 1 each receive rows [0, 2) from rank 2 and [2, 4) from rank 3, times R_0 / R_1 = 1/2
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_flagscale.config.hetero import StageGroup
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes
from lightning_flagscale.parallel.pipeline import (
    StagePlan,
    build_stage_module,
    check_units_cover_parameters,
    plan_stages,
    tied_parameters,
)
from lightning_flagscale.parallel.pipeline_model import PipelinedModel

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

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def group_of_rank(groups: list[StageGroup], rank: int) -> StageGroup:
    for group in groups:
        if rank in group.ranks:
            return group
    raise ValueError(f"Rank {rank} is in no heterogeneous mesh ({sum(g.size for g in groups)} ranks are described).")


def _coords(group: StageGroup, rank: int) -> tuple[int, int]:
    """(dp index, tp index) of a global rank inside its group (layout dp, cp, tp with tp fastest; cp = 1)."""
    local = group.local_index(rank)
    return local // group.tensor_parallel_size, local % group.tensor_parallel_size


def _rank(group: StageGroup, dp: int, tp: int) -> int:
    return group.ranks[dp * group.tensor_parallel_size + tp]


@dataclass(frozen=True)
class Transfer:
    """Rows ``[src_lo, src_hi)`` of the sender's micro-batch slice go to rows ``[dst_lo, ...)`` of the receiver's."""

    src: int
    dst: int
    src_lo: int
    src_hi: int
    dst_lo: int


def boundary_transfers(send: StageGroup, recv: StageGroup, rows: int) -> list[Transfer]:
    """Forward transfers of one micro-batch of ``rows`` samples from group ``send`` to group ``recv``."""
    if rows % send.data_parallel_size or rows % recv.data_parallel_size:
        raise ValueError(
            f"A micro-batch of {rows} samples cannot be split over data-parallel sizes {send.data_parallel_size} and"
            f" {recv.data_parallel_size}; make the samples per micro-batch a multiple of both."
        )
    cs, cr = rows // send.data_parallel_size, rows // recv.data_parallel_size
    out = []
    for j in range(recv.data_parallel_size):
        for i in range(send.data_parallel_size):
            lo, hi = max(i * cs, j * cr), min((i + 1) * cs, (j + 1) * cr)
            if lo >= hi:
                continue
            for u in range(recv.tensor_parallel_size):
                t = u % send.tensor_parallel_size
                out.append(Transfer(_rank(send, i, t), _rank(recv, j, u), lo - i * cs, hi - i * cs, lo - j * cr))
    return out


def gradient_transfers(send: StageGroup, recv: StageGroup, rows: int) -> list[Transfer]:
    """Backward transfers: from the receiving group's ranks to every sending TP rank (``src``/``dst`` swapped)."""
    cs, cr = rows // send.data_parallel_size, rows // recv.data_parallel_size
    out = []
    for i in range(send.data_parallel_size):
        for j in range(recv.data_parallel_size):
            lo, hi = max(i * cs, j * cr), min((i + 1) * cs, (j + 1) * cr)
            if lo >= hi:
                continue
            for t in range(send.tensor_parallel_size):
                u = t % recv.tensor_parallel_size
                out.append(Transfer(_rank(recv, j, u), _rank(send, i, t), lo - j * cr, hi - j * cr, lo - i * cs))
    return out


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
        if group.expert_parallel_size > 1:
            ep = group.expert_parallel_size
            eshape = (1, group.size // ep, ep, 1)
            expert = DeviceMesh(device_type, ranks.reshape(eshape), mesh_dim_names=("pp", "edp", "ep", "etp"))
        if dist.get_rank() in group.ranks:
            dp_cp = by_tp[MeshDim.DP_CP.value]
            mine = ParallelMeshes(config=config, world=world, dp_cp=dp_cp, stage=stage, expert=expert)
    assert mine is not None, f"rank {dist.get_rank()} belongs to no heterogeneous stage group"
    return mine


def _split(value: Any, n: int) -> list[Any]:
    if isinstance(value, Tensor):
        return list(value.tensor_split(n, dim=0))
    return [value] * n


class HeteroPipelineRunner:
    """This rank's stage of a heterogeneous pipeline; the interface of ``parallel.pipeline.PipelineRunner``."""

    def __init__(
        self,
        *,
        groups: list[StageGroup],
        plan: StagePlan,
        stage_module: nn.Module,
        schedule_name: str,
        micro_batch_size: int,
        loss_fn: Callable[..., Tensor],
        device: torch.device,
        token_group: dist.ProcessGroup | None,
    ) -> None:
        self.groups = groups
        self.group = group_of_rank(groups, dist.get_rank())
        self.plan = plan
        self.stage_ids = [self.group.index]
        self.stage_modules = [stage_module]
        self.schedule_name = schedule_name
        self.micro_batch_size = micro_batch_size
        self.num_microbatches: int | None = None
        self.device = device
        self.tied = None
        self._loss_fn = loss_fn
        self._token_group = token_group  # this group's data x context ranks (sums the last group's losses)
        self.has_first_stage = self.group.index == 0
        self.has_last_stage = self.group.index == len(groups) - 1
        self._prev = None if self.has_first_stage else groups[self.group.index - 1]
        self._next = None if self.has_last_stage else groups[self.group.index + 1]

    # ---- the PipelineRunner interface ----
    def count_microbatches(self, batch_size: int) -> int:
        return max(batch_size // self.micro_batch_size, 1)

    def sync_tied_params(self) -> None:
        """No weight is tied across heterogeneous stages (rejected at validation)."""

    def sync_tied_grads(self) -> None:
        """No weight is tied across heterogeneous stages (rejected at validation)."""

    def step(self, args: tuple, kwargs: Mapping[str, Any], target: Tensor, num_items: Tensor | int | None = None):
        return self._run(args, kwargs, target, num_items, train=True)

    @torch.no_grad()
    def eval_step(self, args: tuple, kwargs: Mapping[str, Any], target: Tensor, num_items=None):
        return self._run(args, kwargs, target, num_items, train=False)

    # ---- schedule ----
    def _run(self, args: tuple, kwargs: Mapping[str, Any], target: Tensor, num_items: Any, *, train: bool) -> Tensor:
        rows = target.shape[0]
        if rows % self.micro_batch_size:
            raise ValueError(
                f"Batch of {rows} samples on rank {dist.get_rank()} is not a multiple of its micro-batch size"
                f" {self.micro_batch_size}."
            )
        n = rows // self.micro_batch_size
        if num_items is None:  # evaluation without a step normaliser: the token mean of the whole global batch
            num_items = (target != -100).sum().to(self.device)
            if self._token_group is not None:
                dist.all_reduce(num_items, group=self._token_group)
        self._num_items = num_items
        move = lambda t: t.to(self.device) if isinstance(t, Tensor) else t  # noqa: E731
        arg_mbs = list(zip(*(_split(move(a), n) for a in args))) if self.has_first_stage else [()] * n
        kw_mbs = [dict(zip(kwargs, vals)) for vals in zip(*(_split(move(v), n) for v in kwargs.values()))] or [{}] * n
        targets = _split(move(target), n)
        self._saved: dict[int, tuple[Tensor | None, Tensor]] = {}
        self._pending: list[dist.Work] = []
        self._keep: list[Tensor] = []  # send buffers, alive until their sends complete
        losses: list[Tensor] = []
        order = self._order(n, train)
        for kind, m in order:
            if kind == "F":
                self._forward(m, arg_mbs[m], kw_mbs[m], targets[m], losses, train)
            else:
                self._backward(m, last=m == n - 1)
        for work in self._pending:
            work.wait()
        self._pending, self._keep = [], []
        return self._reduce_losses(losses, train)

    def _order(self, n: int, train: bool) -> list[tuple[str, int]]:
        if not train:
            return [("F", m) for m in range(n)]
        if self.schedule_name == "gpipe":
            return [("F", m) for m in range(n)] + [("B", m) for m in range(n)]
        warmup = min(len(self.groups) - self.group.index - 1, n)
        order = [("F", m) for m in range(warmup)]
        for i in range(n - warmup):
            order += [("F", warmup + i), ("B", i)]
        return order + [("B", m) for m in range(n - warmup, n)]

    def _forward(self, m: int, args: tuple, kwargs: dict, target: Tensor, losses: list, train: bool) -> None:
        module = self.stage_modules[0]
        x = None
        if not self.has_first_stage:
            x = self._recv(boundary_transfers(self._prev, self.group, self._rows()), tag=2 * m)
            x.requires_grad_(train)
            args = (x,)
        out = module(*args, **kwargs)
        if self.has_last_stage:
            loss = self._loss_fn(out, target, self._num_items)
            losses.append(loss.detach().float())
            self._saved[m] = (x, loss)
        else:
            self._send(out.detach(), boundary_transfers(self.group, self._next, self._rows()), tag=2 * m)
            self._saved[m] = (x, out)

    def _backward(self, m: int, *, last: bool) -> None:
        x, out = self._saved.pop(m)
        self._set_grad_sync(last)
        if self.has_last_stage:
            torch.autograd.backward(out)
        else:
            grad = self._recv(gradient_transfers(self.group, self._next, self._rows()), tag=2 * m + 1)
            torch.autograd.backward(out, grad.to(out.dtype))
        if x is not None:
            # Group r's gradients carry the last group's R; the group upstream averages over its own (docstring).
            scale = self._prev.token_shards / self.group.token_shards
            self._send(x.grad * scale, gradient_transfers(self._prev, self.group, self._rows()), tag=2 * m + 1)

    def _set_grad_sync(self, enabled: bool) -> None:
        for sub in self.stage_modules[0].modules():
            fn = getattr(sub, "set_requires_gradient_sync", None)
            if fn is not None:  # FSDP2 units: reduce-scatter only after the last micro-batch's backward
                fn(enabled, recurse=False)

    def _rows(self) -> int:
        """Samples of one micro-batch over the whole group (every rank holds its data-parallel slice of them)."""
        return self.micro_batch_size * self.group.data_parallel_size

    # ---- P2P with reslicing ----
    def _send(self, tensor: Tensor, transfers: list, tag: int) -> None:
        me = dist.get_rank()
        for tr in transfers:
            if tr.src != me:
                continue
            part = tensor[tr.src_lo : tr.src_hi].contiguous()
            header = torch.tensor([_DTYPES.index(part.dtype), part.dim(), *part.shape], dtype=torch.int64)
            header = torch.nn.functional.pad(header, (0, 10 - header.numel()))
            self._pending.append(dist.isend(header, tr.dst, tag=tag))
            self._pending.append(dist.isend(part, tr.dst, tag=tag))
            self._keep += [header, part]

    def _recv(self, transfers: list, tag: int) -> Tensor:
        me = dist.get_rank()
        parts = []
        for tr in transfers:
            if tr.dst != me:
                continue
            header = torch.empty(10, dtype=torch.int64)
            dist.recv(header, tr.src, tag=tag)
            dtype, ndim = _DTYPES[int(header[0])], int(header[1])
            buf = torch.empty(tuple(int(d) for d in header[2 : 2 + ndim]), dtype=dtype, device=self.device)
            dist.recv(buf, tr.src, tag=tag)
            parts.append((tr.dst_lo, buf))
        parts.sort(key=lambda p: p[0])
        return torch.cat([p[1] for p in parts], dim=0)

    def _reduce_losses(self, losses: list[Tensor], train: bool) -> Tensor:
        """The global token mean on every rank: times the loss scale when training (the last group's micro-batch
        losses carry ``loss scale x R_last``; the strategy divides by this rank's own ``R``), plain when evaluating."""
        out = torch.zeros((), dtype=torch.float32, device=self.device)
        last = self.groups[-1]
        if self.has_last_stage:
            out = torch.stack(losses).sum()
            if self._token_group is not None:
                dist.all_reduce(out, group=self._token_group)
            if train:
                out = out / last.token_shards
        dist.broadcast(out, src=last.ranks[0])
        return out


def build_hetero_pipelined_model(
    model: nn.Module, groups: list[StageGroup], meshes: ParallelMeshes, config: Any, device: torch.device
) -> PipelinedModel:
    """Cut ``model`` into the stage groups' layer counts and wrap this rank's stage (cf. ``build_pipelined_model``).

    ``config`` is this rank's group layout (its ``micro_batch_size`` is this rank's share of a micro-batch);
    recompute, TP, EP and ZeRO are applied to the stage afterwards by the parallelize plan, as without PP.
    """
    units = list(model.pipeline_units())
    check_units_cover_parameters(model, units)
    plan = plan_stages(units, len(groups), 1, pipeline_layers=[g.num_layers for g in groups])
    if tied_parameters(model, units) is not None:
        raise ValueError("Weights tied across heterogeneous stages are not supported yet; untie the embedding.")
    me = group_of_rank(groups, dist.get_rank())
    holder: list[PipelinedModel] = []
    runner = HeteroPipelineRunner(
        groups=groups, plan=plan, stage_module=build_stage_module(model, plan.units[me.index]),
        schedule_name=config.pipeline_schedule, micro_batch_size=config.micro_batch_size,
        loss_fn=lambda out, target, n: holder[0].scaled_stage_loss(out, target, n), device=device,
        token_group=meshes.group(MeshDim.DP_CP) if meshes.size(MeshDim.DP_CP) > 1 else None,
    )  # fmt: skip
    pipelined = PipelinedModel(runner, model)
    holder.append(pipelined)
    return pipelined


def build_hetero_layout(
    parallel: Any, num_layers: int, device_type: str, rank_order: list[int] | None = None
) -> tuple[list[StageGroup], ParallelMeshes, Any]:
    """Plan the stage groups of a heterogeneous ``ParallelConfig``, build every group's meshes (collectively) and
    return (groups, this rank's meshes, this rank's group layout); the chosen split is logged."""
    from lightning_flagscale.config.hetero import parse_hetero_meshes, plan_stage_groups

    meshes = parse_hetero_meshes(parallel.hetero_meshes)
    groups = plan_stage_groups(meshes, parallel.hetero_layers, num_layers, parallel.hetero_device_speed, rank_order)
    if dist.get_rank() == 0:
        logging.getLogger(__name__).info(
            "Heterogeneous stages: "
            + "; ".join(f"stage {g.index} on mesh {g.mesh} ({g.device_type or 'untyped'}, ranks {g.ranks}):"
                        f" {g.num_layers} blocks" for g in groups)
        )  # fmt: skip
    configs = parallel.stage_group_configs(num_layers)
    mine = build_group_meshes(groups, configs, device_type)
    return groups, mine, configs[group_of_rank(groups, dist.get_rank()).index]
