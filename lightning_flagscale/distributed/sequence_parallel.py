"""Sequence-parallel regions as autograd functions on plain tensors (Megatron's ``mappings.py``), for modules that run
on the whole sequence inside a sequence-parallel model and handle their own layout (the MoE block under SP).

The sequence is dim 1 of ``[B, S, H]`` and splits evenly over the group, rank r holding chunk r:

- :func:`gather_sequence`: all-gather the chunks; backward: this rank's chunk of the gradient, or, with
  ``partial_grad`` (each rank's gradient is a partial sum, e.g. of expert FFN chunks), a reduce-scatter;
- :func:`scatter_sequence`: this rank's chunk; with ``partial_over`` (each rank holds a partial sum over that group:
  the whole group, or a subgroup of it, e.g. expert-tensor-parallel ranks inside a TP group) a reduce-scatter over
  it of its members' chunks; backward: all-gather;
- :func:`scale_grad` / :func:`scale_forward`: identity one way, a constant factor the other (a term every rank of
  a reduce-scatter holds alike enters the sum once);
- :func:`sum_grad`: identity whose backward all-reduces the gradient (Megatron's ``copy_to_..._region``);
  :func:`sum_grads` the same for several tensors at once (one all-reduce), e.g. the weights of a module that runs on
  each rank's own sequence chunk (their gradients are partial sums over the group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_sequence", "scale_forward", "scale_grad", "scatter_sequence", "sum_grad", "sum_grads"]

_DIM = 1


def _chunks(x: Tensor, group: dist.ProcessGroup) -> list[Tensor]:
    size = dist.get_world_size(group)
    if x.shape[_DIM] % size:
        raise ValueError(f"Sequence length {x.shape[_DIM]} does not split evenly over {size} sequence-parallel ranks.")
    return [c.contiguous() for c in x.chunk(size, dim=_DIM)]


def _all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=_DIM)


def _reduce_scatter(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    chunks = _chunks(x, group)
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _local_chunk(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _chunks(x, group)[dist.get_rank(group)]


def _member_chunks(group: dist.ProcessGroup, sub: dist.ProcessGroup) -> list[int]:
    """The chunk (rank in ``group``) of each rank of ``sub``, in ``sub``'s rank order."""
    members = [dist.get_global_rank(sub, i) for i in range(dist.get_world_size(sub))]
    inside = set(dist.get_process_group_ranks(group))
    if not inside.issuperset(members):
        raise ValueError(f"The partial-sum group {members} is not inside the sequence-parallel group {sorted(inside)}.")
    return [dist.get_group_rank(group, r) for r in members]


def _reduce_scatter_members(x: Tensor, group: dist.ProcessGroup, sub: dist.ProcessGroup) -> Tensor:
    """This rank's chunk of the sum over ``sub``: the ranks of ``sub`` reduce-scatter only their own chunks of
    ``group``'s split (all of them when ``sub`` is ``group``); other subgroups sum the other chunks."""
    chunks = _chunks(x, group)
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, [chunks[c] for c in _member_chunks(group, sub)], group=sub)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, partial_grad: bool) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.partial_grad = group, partial_grad
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        reduce = _reduce_scatter if ctx.partial_grad else _local_chunk
        return reduce(grad, ctx.group), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, partial_over: dist.ProcessGroup | None) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _local_chunk(x, group) if partial_over is None else _reduce_scatter_members(x, group, partial_over)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _all_gather(grad, ctx.group), None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


class _ScaleForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        return x * factor

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumGrads(torch.autograd.Function):
    """Identity on several tensors whose backward all-reduces their gradients as one flat buffer."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *xs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.group, ctx.meta = group, [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # Tensors without a gradient here still take part (zeros): every rank must send the same buffer layout.
        parts = [g if g is not None else torch.zeros(s, dtype=d, device=v) for g, (s, d, v) in zip(grads, ctx.meta)]
        flat = torch.cat([p.reshape(-1).to(torch.float32 if p.is_floating_point() else p.dtype) for p in parts])
        dist.all_reduce(flat, group=ctx.group)
        out, start = [], 0
        for part in parts:
            out.append(flat[start : start + part.numel()].view(part.shape).to(part.dtype))
            start += part.numel()
        return (None, *out)


def gather_sequence(x: Tensor, group: dist.ProcessGroup, *, partial_grad: bool = False) -> Tensor:
    """``[B, S/n, H]`` chunks -> ``[B, S, H]`` on every rank; backward: the chunk's gradient (``partial_grad``: the
    sum of every rank's gradient of it, a reduce-scatter)."""
    return _GatherSequence.apply(x, group, partial_grad)


def scatter_sequence(x: Tensor, group: dist.ProcessGroup, *, partial_over: dist.ProcessGroup | None = None) -> Tensor:
    """``[B, S, H]`` -> this rank's ``[B, S/n, H]`` chunk; backward: the gradient all-gathered over ``group``.

    ``partial_over``: ``x`` is a partial sum over that group (``group`` itself, or a subgroup of it whose ranks hold
    the same sum as every other subgroup, as ETP ranks inside a TP group do), and the chunk is of the sum: a
    reduce-scatter over ``partial_over`` of its members' chunks, ``(size - 1) / n`` of ``x`` on the wire per rank."""
    return _ScatterSequence.apply(x, group, partial_over)


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """``x`` unchanged; its gradient times ``factor``."""
    return _ScaleGrad.apply(x, factor)


def scale_forward(x: Tensor, factor: float) -> Tensor:
    """``x * factor``; the gradient passes unscaled."""
    return _ScaleForward.apply(x, factor)


def sum_grad(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``x`` unchanged; its gradient summed over ``group``."""
    return _SumGrad.apply(x, group)


def sum_grads(xs: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """``xs`` unchanged; their gradients summed over ``group`` in one all-reduce (in fp32: the sum of a few partial
    gradients should not round more than one process's accumulation)."""
    if not xs:
        return []
    return list(_SumGrads.apply(group, *xs))
