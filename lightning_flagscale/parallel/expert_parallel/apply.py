"""Expert parallelism: shard MoE experts over an EP group and move tokens with all-to-all (issue 5).

``apply_ep(model, ep_mesh)`` turns every :class:`~lightning_flagscale.moe.layer.MoELayer` of ``model`` into an
expert-parallel layer:

- ``experts.gate_up_proj`` / ``experts.down_proj`` become DTensors ``Shard(0)`` over the 1-D ``ep`` mesh: rank r
  owns experts ``[r * E/ep, (r + 1) * E/ep)``. State-dict keys and global shapes do not depend on ep, and DCP
  reshards them on load (``full_tensor()`` gathers one);
- the layer's dispatcher becomes :class:`AllToAllDispatcher`: permute locally -> exchange per-expert counts
  (all-gather, so every rank knows the uneven split sizes and the per-rank load) -> all-to-all dispatch -> regroup
  by local expert -> grouped/batched expert GEMMs -> all-to-all combine -> unpermute. Both all-to-alls are
  differentiable (the backward of a dispatch is a combine with swapped split sizes);
- hot-expert replication (``hot_experts=HotExpertReplication(...)``): tokens of the replicated experts skip the
  all-to-all and run on a local replica whose weights are all-reduced from the owner (a sum where only the owner
  contributes); the backward of that all-reduce sums every replica's gradient into the owner's shard.

Token group (``set_moe_token_group``): the strategy tells the MoE layers which ranks hold the step's tokens (the
data x context ranks of their stage, and its TP ranks when each routes its own sequence-parallel chunk); global
aux/z losses and the bias-balancing counts are summed over it.

MoE parallel folding (Megatron): the EP group is cut out of a pipeline stage's dp x cp x tp ranks, on a second mesh
("edp", "ep", "etp") over the same ranks (``parallel/mesh.py`` builds it).

Expert tensor parallelism (ETP, issue 39 item 4), on the "etp" dim of that mesh: each expert's ``gate_up_proj``
[E, 2I, H] is column-sharded (rank s holds the gate rows and the up rows of intermediate chunk s: a
``_StridedShard(1, split_factor=2)`` placement, so ``full_tensor()`` and the init see the true global layout) and its
``down_proj`` [E, H, I] row-sharded (``Shard(2)``). After the EP all-to-all, the rows an ETP rank received run
through its intermediate chunk and the partial outputs are summed over the ETP group:

- ETP inside a TP group (``ParallelConfig.etp_tokens_replicated``): MoE blocks run on the whole sequence on every TP
  rank, so the ETP ranks hold the same rows; each runs them through its chunk, the partial outputs are all-reduced
  and the input gradients all-reduced in backward (Megatron's column/row-parallel pair). Under sequence parallelism
  (``ParallelConfig.etp_sequence_parallel``, ETP = TP or ETP dividing TP) the partial outputs are not reduced here:
  the MoE block combines them and reduce-scatters its output over the ETP group (each rank its sequence chunk),
  and its input's all-gather reduce-scatters the partial gradients over TP in backward (Megatron's
  sequence-parallel pair, ``MoELayer.forward``), instead of an all-reduce of every routed row, forward and
  backward, of which each rank keeps its sequence chunk;
- otherwise the ETP ranks hold different rows: they all-gather them (per local expert), run them through their chunk
  and reduce-scatter the partial outputs back to their owners (Megatron's ETP token dispatcher).

Gradient reduction contract (the data-parallel / ZeRO code honours it): expert parameters carry
``param._flagscale_grad_group = "edp"``. Their gradient on the owner already sums the contributions of every token
of the EP group (the combine backward brought them home), so it must be reduced (summed) over the **edp** group
only, never over ep, and divided by how many times each token reached the experts (``1 / (dp * cp)`` for a mean
loss when each TP rank routes its own sequence chunk; ``ParallelConfig.expert_grad_divisor``).
ZeRO shards expert optimizer states over edp. All other parameters (router, shared experts) follow the normal
dp x cp reduction, or, when each TP rank routes its own sequence chunk, the dp x cp x tp one that also sums them over
TP (``tag_chunk_routed_params``). Under ETP the divisor is ``ParallelConfig.expert_grad_divisor`` (the ETP ranks' shards are distinct
parameters, never reduced over etp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_flagscale.distributed.sequence_parallel import sum_grad
from lightning_flagscale.moe.balance import HotExpertReplication, moe_layers
from lightning_flagscale.moe.layer import MoELayer

__all__ = [
    "EXPERT_GRAD_GROUP_ATTR",
    "AllToAllDispatcher",
    "all_to_all",
    "apply_ep",
    "is_expert_param",
    "set_moe_token_group",
    "tag_chunk_routed_params",
    "tag_expert_params",
]

EXPERT_GRAD_GROUP_ATTR = "_flagscale_grad_group"
"""Attribute on a parameter naming the mesh dim its gradient is reduced over (``"edp"`` for experts,
``CHUNK_GRAD_GROUP`` for the weights of a block that routes its own sequence chunk)."""
CHUNK_GRAD_GROUP = "dp_cp_tp"
"""Their group (``MeshDim.STAGE``): summed over the TP ranks, averaged over the data x context ranks."""


def is_expert_param(param: Tensor) -> bool:
    """Whether ``param`` is an expert-parallel parameter (gradient reduced over "edp" only)."""
    return getattr(param, EXPERT_GRAD_GROUP_ATTR, None) == "edp"


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange.

    Written here because torch's autograd-aware variant lives in the private ``_functional_collectives`` module.
    """

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Differentiable uneven all-to-all along dim 0: send ``in_splits[r]`` rows to rank r, receive ``out_splits``."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward sums the gradients (each rank's output depends on every rank's input)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum of partial outputs over the group; the backward is the identity: each rank's output is used alike on
    every rank (Megatron's ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _regroup_index(counts: Tensor) -> Tensor:
    """Row order turning chunks laid out [src][expert] (sizes ``counts`` [src, e]) into [expert][src]."""
    src, ne = counts.shape
    offsets = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(src, ne)
    chunks = [
        torch.arange(int(offsets[s, e]), int(offsets[s, e] + counts[s, e])) for e in range(ne) for s in range(src)
    ]
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)


class AllToAllDispatcher:
    """Dispatcher of an expert-parallel :class:`MoELayer` (see module docstring)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        ep_size: int,
        ep_rank: int,
        *,
        etp_group: dist.ProcessGroup | None = None,
        etp_size: int = 1,
        etp_tokens_replicated: bool = False,
        etp_partial_outputs: bool = False,
    ) -> None:
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank
        self.etp_group, self.etp_size, self.etp_tokens_replicated = etp_group, etp_size, etp_tokens_replicated
        if etp_partial_outputs and not etp_tokens_replicated:
            raise ValueError("etp_partial_outputs needs etp_tokens_replicated (ETP ranks holding the same rows).")
        self.partial_group = etp_group if etp_partial_outputs else None
        """Set: the outputs are this rank's partial sums over the ETP group, which the MoE layer sums (ETP inside TP
        under sequence parallelism: a reduce-scatter of the ETP ranks' sequence chunks, ``MoELayer.forward``)."""
        self.replica_bytes = 0
        """Bytes of replica weights all-reduced by this rank in the last forward (hot-expert replication)."""

    def _run_local(self, layer: MoELayer, x: Tensor, counts: list[int], busiest: int) -> Tensor:
        """The local experts on rows sorted by local expert; under ETP, each through this rank's FFN chunk."""
        if self.etp_size == 1:
            return layer.run_experts(x, counts, busiest)
        group, k = self.etp_group, self.etp_size
        if self.partial_group is not None:  # the layer sums the partial outputs, and the input's partial gradients
            return layer.run_experts(x, counts, busiest)
        if self.etp_tokens_replicated:
            y = layer.run_experts(sum_grad(x, group), counts, busiest)
            return _ReduceFromGroup.apply(y, group)
        local = torch.tensor(counts, dtype=torch.long)
        gathered = [torch.zeros_like(local) for _ in range(k)]
        dist.all_gather(gathered, local, group=group)
        etp_counts = torch.stack(gathered)  # [etp rank, local expert]
        rows, n = etp_counts.sum(1).tolist(), x.shape[0]
        # An uneven all-gather as an all-to-all that sends every rank the same rows (differentiable both ways: the
        # backward sums each rank's gradient of our rows).
        x_all = all_to_all(torch.cat([x] * k), rows, [n] * k, group)
        order = _regroup_index(etp_counts).to(x.device)
        y_sorted = layer.run_experts(x_all[order], etp_counts.sum(0).tolist(), busiest * k)
        y_all = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
        # Reduce-scatter: every rank's partial outputs of our rows come home and are summed.
        return all_to_all(y_all, [n] * k, rows, group).view(k, n, -1).sum(0)

    def _replica_weights(self, layer: MoELayer, experts: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        w1, w2 = layer.experts.local_weights()
        per_rank = w1.shape[0]
        parts = []
        for w in (w1, w2):
            rows = [
                w[e - self.ep_rank * per_rank] if e // per_rank == self.ep_rank else w.new_zeros(w.shape[1:])
                for e in experts
            ]
            contribution = torch.stack(rows)
            if w.requires_grad and not contribution.requires_grad:
                # A rank owning none of the replicated experts must still run the backward all-reduce, or the
                # owners wait for it forever: make its all-zero contribution part of the graph.
                contribution.requires_grad_()
            parts.append(_AllReduceSum.apply(contribution, self.group))
        self.replica_bytes = sum(p.numel() * p.element_size() for p in parts)
        return parts[0], parts[1]

    def __call__(self, layer: MoELayer, x_perm: Tensor, counts: list[int]) -> Tensor:
        ep, rank = self.ep_size, self.ep_rank
        if ep == 1:  # ETP alone: every expert is local, split over the ETP group
            layer.record_dispatch(torch.tensor([counts]), a2a_bytes=0)
            return self._run_local(layer, x_perm, counts, sum(counts))
        per_rank = layer.num_experts // ep
        local = torch.tensor(counts, dtype=torch.long)
        gathered = [torch.zeros_like(local) for _ in range(ep)]
        dist.all_gather(gathered, local, group=self.group)  # split sizes first: every rank learns all counts
        all_counts = torch.stack(gathered)  # [src rank, global expert]
        replicated = layer.replicated_experts if layer.capacity_factor is None else ()
        a2a_counts = all_counts.clone()
        if replicated:
            a2a_counts[:, list(replicated)] = 0
        send = a2a_counts[rank].view(ep, per_rank).sum(1).tolist()
        recv_counts = a2a_counts[:, rank * per_rank : (rank + 1) * per_rank]  # [src, local expert]
        recv = recv_counts.sum(1).tolist()
        busiest = int(a2a_counts.view(ep, ep, per_rank).sum((0, 2)).max())
        row_expert = torch.repeat_interleave(torch.arange(layer.num_experts), local)
        is_rep = torch.isin(row_expert, torch.tensor(replicated, dtype=torch.long))
        a2a_rows = (~is_rep).nonzero().squeeze(1).to(x_perm.device)

        x_recv = all_to_all(x_perm[a2a_rows] if replicated else x_perm, recv, send, self.group)
        order = _regroup_index(recv_counts).to(x_perm.device)
        y_local = self._run_local(layer, x_recv[order], recv_counts.sum(0).tolist(), busiest)
        y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)
        y = all_to_all(y_recv, send, recv, self.group)

        h = x_perm.shape[-1]
        sent_rows = sum(send) - send[rank]
        layer.record_dispatch(all_counts, a2a_bytes=2 * sent_rows * h * x_perm.element_size())
        self.replica_bytes = 0
        if not replicated:
            return y
        rep_rows = is_rep.nonzero().squeeze(1).to(x_perm.device)
        # Backward order of the collectives is the same on every rank: autograd runs the ready node created last
        # first, and every node of the replica branch was created after the combine all-to-all.
        weights = self._replica_weights(layer, replicated)
        y_rep = layer.run_experts(x_perm[rep_rows], [counts[e] for e in replicated], busiest, weights=weights)
        out = x_perm.new_zeros((x_perm.shape[0], y.shape[-1]))
        return out.index_copy(0, a2a_rows, y).index_copy(0, rep_rows, y_rep)


def _expert_submesh(ep_mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The ("ep", "etp") mesh to shard over and its "etp" dim (None when ETP is 1: experts 1-D over "ep")."""
    names = ep_mesh.mesh_dim_names or ()
    if ep_mesh.ndim == 1 and names != ("etp",):
        return ep_mesh, None
    if "ep" not in names:
        raise ValueError(f"The expert mesh needs an 'ep' dimension; got dims {names}.")
    if "etp" not in names or ep_mesh["etp"].size() == 1:
        return ep_mesh["ep"], None
    return ep_mesh[("ep", "etp")], ep_mesh["etp"]


def _local_expert_part(param: Tensor, name: str, ep: int, ep_rank: int, etp: int, etp_rank: int) -> Tensor:
    """This rank's part of a stacked expert weight: its experts, and under ETP its FFN chunk (gate and up rows of
    chunk ``etp_rank`` for ``gate_up_proj``, its columns for ``down_proj``)."""
    per_rank = param.shape[0] // ep
    w = param.detach()[ep_rank * per_rank : (ep_rank + 1) * per_rank]
    if etp > 1 and name == "gate_up_proj":
        gate, up = w.chunk(2, dim=1)
        w = torch.cat([gate.chunk(etp, dim=1)[etp_rank], up.chunk(etp, dim=1)[etp_rank]], dim=1)
    elif etp > 1:
        w = w.chunk(etp, dim=2)[etp_rank]
    return w.clone()


def _shard_param(param: nn.Parameter, name: str, mesh: DeviceMesh, etp_mesh: DeviceMesh | None) -> nn.Parameter:
    if etp_mesh is None:
        local = _local_expert_part(param, name, mesh.size(), mesh.get_local_rank(), 1, 0)
        placements: list = [Shard(0)]
    else:
        ep_mesh = mesh["ep"]
        local = _local_expert_part(
            param, name, ep_mesh.size(), ep_mesh.get_local_rank(), etp_mesh.size(), etp_mesh.get_local_rank()
        )
        # gate_up_proj holds [gate; up]: chunk s of each is rows {s, k + s} of 2k equal row blocks, the layout of
        # `_StridedShard(1, split_factor=2)`; down_proj's chunk is one block of columns.
        etp_placement = _StridedShard(1, split_factor=2) if name == "gate_up_proj" else Shard(2)
        placements = [Shard(0), etp_placement]
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
    new = nn.Parameter(dt, requires_grad=param.requires_grad)
    setattr(new, EXPERT_GRAD_GROUP_ATTR, "edp")
    return new


def apply_ep(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    hot_experts: HotExpertReplication | None = None,
    etp_tokens_replicated: bool = False,
    etp_sequence_parallel: bool = False,
) -> nn.Module:
    """Shard the experts of every MoE layer of ``model`` over ``ep_mesh``: 1-D over "ep", or a mesh with "ep" (and
    "etp") dims; an "etp" dim of size k > 1 splits each expert's FFN over k ranks (module docstring).

    ``etp_tokens_replicated``: the ETP ranks feed their MoE blocks the same tokens (ETP inside a TP group,
    ``ParallelConfig.etp_tokens_replicated``), so they split the same rows instead of all-gathering them.
    ``etp_sequence_parallel``: moreover sequence parallelism is on (``ParallelConfig.etp_sequence_parallel``): the
    expert outputs stay partial sums, which the MoE block reduce-scatters over the ETP group, each rank its sequence
    chunk, instead of all-reducing every routed row (``MoELayer.forward``). Call it
    before ZeRO/FSDP wrapping and after TP (the rest of the block is tensor-parallel); works on meta-device models
    (materialise with ``to_empty`` + ``init_weights`` afterwards). Returns ``model``, modified in place.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError("apply_ep found no MoE layers in the model; expert parallelism needs num_experts > 0.")
    mesh, etp_mesh = _expert_submesh(ep_mesh)
    ep_dim = mesh if etp_mesh is None else mesh["ep"]
    ep, etp = ep_dim.size(), 1 if etp_mesh is None else etp_mesh.size()
    for name, layer in layers:
        if layer.num_experts % ep:
            raise ValueError(
                f"{name}: num_experts={layer.num_experts} is not divisible by the expert-parallel size {ep};"
                " change expert_parallel_size."
            )
        if layer.experts.intermediate_size % etp:
            raise ValueError(
                f"{name}: the expert intermediate size {layer.experts.intermediate_size} is not divisible by the"
                f" expert-tensor-parallel size {etp}; change expert_tensor_parallel_size."
            )
        if etp > 1 and (hot_experts is not None or layer.hot_expert_config is not None):
            raise ValueError(f"{name}: hot-expert replication is not supported with expert tensor parallelism.")
        if isinstance(layer.experts.gate_up_proj, DTensor):
            raise ValueError(f"{name}: experts are already sharded; apply_ep was called twice.")
        stacked = layer.experts.stacked_parameters()
        if len(stacked) > 2 and (etp > 1 or hot_experts is not None or layer.hot_expert_config is not None):
            raise ValueError(
                f"{name}: per-expert LoRA adapters are not supported with expert tensor parallelism or hot-expert "
                "replication; set expert_tensor_parallel_size=1 and no hot experts, or leave the experts out of "
                "LoRA target_modules."
            )
        for owner, pname in stacked:
            setattr(owner, pname, _shard_param(getattr(owner, pname), pname, mesh, etp_mesh))
        layer.dispatcher = AllToAllDispatcher(
            ep_dim.get_group(), ep, ep_dim.get_local_rank(), etp_group=None if etp_mesh is None else
            etp_mesh.get_group(), etp_size=etp, etp_tokens_replicated=etp_tokens_replicated,
            etp_partial_outputs=etp > 1 and etp_sequence_parallel,
        )  # fmt: skip
        if hot_experts is not None:  # else keep what the config asked for (``moe_hot_expert_replicas``)
            layer.hot_expert_config = hot_experts
    return model


def set_moe_token_group(
    model: nn.Module, group: dist.ProcessGroup | None, *, grad_scale: float | None = None
) -> nn.Module:
    """Tell every MoE layer of ``model`` which ranks hold the step's tokens: the data x context ranks of its stage,
    with its TP ranks when MoE blocks route their own sequence-parallel chunk (``moe_routes_sequence_chunks``).

    Global aux/z losses and the bias-balancing counts are summed over ``group`` (``None``: this process only).
    Under EP the expert group folds inside the stage's dp x cp x tp ranks, so it adds no tokens beyond those. Without
    SP the TP ranks hold copies and stay out of the group. ``grad_scale`` multiplies each rank's share of a global
    loss so that the gradient reduction yields the single-process gradient: ``None`` means the group's size (over
    the sequence-parallel ranks when the block routes its own chunk: their gradients are summed), right when
    gradients are averaged over the data replicas (DDP, ZeRO, ``FlagScaleStrategy``); pass 1.0 if they are summed.
    Returns ``model``.
    """
    for _, layer in moe_layers(model):
        layer.token_group, layer.token_grad_scale = group, grad_scale
    return model


def tag_chunk_routed_params(model: nn.Module) -> list[nn.Parameter]:
    """Hand the TP sum of the chunk-routed MoE blocks' partial gradients to the optimizer step (once per step instead
    of in every micro-batch's backward, as Megatron sums its sequence-parallel weights in ``finalize_model_grads``).

    For every MoE layer of ``model`` that routes its own sequence chunk (``MoELayer.chunk_group``): its
    ``chunk_partial_params`` are tagged ``CHUNK_GRAD_GROUP`` (DDP / ZeRO-1/2 reduce them over the stage's dp x cp x tp
    ranks divided by dp x cp: the TP sum inside the data-parallel reduction; ZeRO-3 sums their reduced shards over TP
    at the step, ``parallel.step.prepare_step_grads``) and the layer stops summing them at use
    (``chunk_grads_at_step``). Call it where the tags cannot be lost again (``Parallelized.tag_parameters``); returns
    the tagged parameters."""
    tagged = []
    for _, layer in moe_layers(model):
        params = layer.chunk_partial_params()
        for param in params:
            setattr(param, EXPERT_GRAD_GROUP_ATTR, CHUNK_GRAD_GROUP)
        layer.chunk_grads_at_step = bool(params)
        tagged += params
    return tagged


def tag_expert_params(model: nn.Module) -> None:
    """(Re)mark expert weights for the edp gradient reduction, e.g. after materialising replaced the Parameters."""
    for _, layer in moe_layers(model):
        for param in layer.experts.parameters():
            setattr(param, EXPERT_GRAD_GROUP_ATTR, "edp")
