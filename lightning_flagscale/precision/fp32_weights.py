"""The module's fp32 weights around a trainer stage under Megatron's half-precision layout (bf16/fp16 parameters,
fp32 master weights in the optimizer, ``FlagScalePrecision.master_weights``).

Megatron keeps the masters as the truth; Lightning's mixed precision keeps the module in fp32. Here the module is
cast to the compute dtype when a stage sets up (``FlagScalePrecision.convert_module``) and, before this file, stayed
there: after ``fit`` the user's module held the bf16 rounding of the masters, and a second ``fit`` built its masters
from that rounding, so fit -> fit lost what the first fit's fp32 masters had accumulated. Now:

- :func:`keep_fp32_weights`, before the cast: the tensors the cast replaces, by name (no copy: the cast allocates
  new ones, these are the old ones kept alive).
- :func:`masters_from_kept`, in ``fit``'s setup: the masters start from those fp32 weights, not from their rounding,
  so fit -> fit continues exactly as one longer fit.
- :func:`gather_masters` (teardown, on the device, one bucket at a time) and :func:`restore_fp32_weights` (after the
  module went to the CPU, so no fp32 copy of it is ever on the device): the module is cast back to fp32; parameters
  with masters take the masters, tensors the stage left unchanged take their kept value (``validate`` / ``test`` /
  ``predict`` give the module back as it came), the rest (buffers a fit updated, e.g. MoE router statistics;
  parameters no optimizer steps) the value they have in half precision.

ZeRO-3 (FSDP2 and flat) is not cast: its sharded parameters are the fp32 masters already.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from lightning_flagscale.distributed.dtensor import local_tensor
from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer

__all__ = ["gather_masters", "keep_fp32_weights", "masters_from_kept", "restore_fp32_weights"]


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def keep_fp32_weights(module: nn.Module) -> dict[str, Tensor]:
    """The local values of ``module``'s floating parameters and buffers, before the cast to half precision."""
    return {name: local_tensor(t).detach() for name, t in _named_tensors(module) if t.is_floating_point()}


def _with_masters(module: nn.Module, dist_optimizers: Iterable[object]) -> list[DistributedOptimizer]:
    """The DDP / ZeRO-1/2 optimizers holding masters of ``module``'s own parameters (not of a module this strategy
    ran before)."""
    own = {id(p) for p in module.parameters()}
    return [
        d for d in dist_optimizers
        if isinstance(d, DistributedOptimizer) and d.master_weights and all(id(p) in own for p in d.names)
    ]  # fmt: skip


def masters_from_kept(
    module: nn.Module, kept: dict[str, Tensor], dist_optimizers: Iterable[object]
) -> dict[str, Tensor]:
    """Set the masters of ``fit``'s new optimizers from the kept fp32 weights. Returns what to keep until teardown:
    the buffers only (the trained parameters live on as masters, and keeping the others would hold a second copy of
    e.g. a frozen LoRA base on the device for the whole fit)."""
    for dopt in _with_masters(module, dist_optimizers):
        dopt.load_master_state_dict(kept)
    buffers = {name for name, _ in module.named_buffers()}
    return {name: t for name, t in kept.items() if name in buffers}


def gather_masters(
    module: nn.Module, dist_optimizers: Iterable[object], device: torch.device
) -> list[tuple[nn.Parameter, Tensor]]:
    """The masters of ``module``'s parameters on ``device`` (collective under ZeRO: the slices are gathered)."""
    return [pair for dopt in _with_masters(module, dist_optimizers) for pair in dopt.gathered_master_weights(device)]


def restore_fp32_weights(
    module: nn.Module, kept: dict[str, Tensor], masters: Iterable[tuple[nn.Parameter, Tensor]] = ()
) -> None:
    """Cast ``module`` back to fp32 after a stage: unchanged tensors take their ``kept`` values, then the parameters in
    ``masters`` (from :func:`gather_masters`, when the optimizers' masters are this stage's) take theirs."""
    current = dict(_named_tensors(module))
    unchanged = [
        name for name, value in kept.items()
        if name in current and torch.equal(local_tensor(current[name]), value.to(current[name].device, current[name].dtype))
    ]  # fmt: skip
    module.to(torch.float32)  # parameters stay the same objects (the masters are keyed by them); buffers are replaced
    current = dict(_named_tensors(module))
    with torch.no_grad():
        for name in unchanged:
            local_tensor(current[name]).copy_(kept[name])
        for param, value in masters:
            local_tensor(param).copy_(value)
