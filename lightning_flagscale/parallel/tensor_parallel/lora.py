"""Tensor-parallel styles for linear layers that carry LoRA adapters (issue 40), Megatron's LoRA layout:

- column-parallel base (weight ``Shard(0)``, output features split): ``A`` [r, in] replicated, ``B`` [out, r]
  ``Shard(0)`` like the weight, so ``B A x`` comes out split along the output features like ``W x``;
- row-parallel base (weight ``Shard(1)``, input features split): ``A`` ``Shard(1)`` like the weight (it reads this
  rank's slice of ``x``), ``B`` replicated; ``A x`` is then a partial sum that DTensor reduces together with
  ``W x`` (one all-reduce, or reduce-scatter under SP, for both).
- DoRA's magnitude ``m`` [out] lies like the output rows: ``Shard(0)`` on a column-parallel layer, whose row norms
  of ``W + s B A`` are local; replicated on a row-parallel one, whose row norms DTensor sums (squared) over TP.

Written as subclasses of torch's ``ColwiseParallel`` / ``RowwiseParallel`` that only partition the extra
parameters; the inputs, outputs and their layouts are the base style's, so a model's plan needs no change:
:func:`adapt_tp_plan` swaps the style of every adapted layer. A layer counts as adapted when it is an
``nn.Linear`` with ``lora_A`` / ``lora_B`` linear children (``models/lora.py``'s ``LoRALinear``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["LoRAColwiseParallel", "LoRARowwiseParallel", "adapt_tp_plan", "is_adapted_linear"]


def is_adapted_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` carrying LoRA adapters (``lora_A`` / ``lora_B`` children)."""
    return isinstance(module, nn.Linear) and all(
        isinstance(getattr(module, k, None), nn.Linear) for k in ("lora_A", "lora_B")
    )


def _distribute(
    module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement, src_data_rank: int | None
) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    dist_param = nn.Parameter(
        distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank), requires_grad=param.requires_grad
    )
    module.register_parameter(name, dist_param)


class LoRAColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for an adapted linear: weight/bias/B ``Shard(0)``, A replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name:  # distribute_module calls this for every submodule too: lora_A/B are placed with their layer
            return
        _distribute(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        _distribute(module, "bias", device_mesh, Shard(0), self.src_data_rank)
        _distribute(module.lora_A, "weight", device_mesh, Replicate(), self.src_data_rank)
        _distribute(module.lora_B, "weight", device_mesh, Shard(0), self.src_data_rank)
        _distribute(module, "lora_magnitude_vector", device_mesh, Shard(0), self.src_data_rank)  # DoRA: per row


class LoRARowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for an adapted linear: weight and A ``Shard(1)``, bias and B replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name:  # distribute_module calls this for every submodule too: lora_A/B are placed with their layer
            return
        _distribute(module, "weight", device_mesh, Shard(1), self.src_data_rank)
        _distribute(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        _distribute(module.lora_A, "weight", device_mesh, Shard(1), self.src_data_rank)
        _distribute(module.lora_B, "weight", device_mesh, Replicate(), self.src_data_rank)
        _distribute(module, "lora_magnitude_vector", device_mesh, Replicate(), self.src_data_rank)


_ADAPTED_STYLES: dict[type, type] = {ColwiseParallel: LoRAColwiseParallel, RowwiseParallel: LoRARowwiseParallel}


def adapt_tp_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with the style of every adapted linear swapped for its LoRA variant (same layouts); unchanged when
    the model has no adapters. Raises ``ValueError`` for an adapted layer whose style has no LoRA variant."""
    out = dict(plan)
    for name, style in plan.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue  # a pattern or a part this pipeline stage lacks: parallelize_module handles it
        if not is_adapted_linear(module) or getattr(style, "replicates_parameters", False):
            continue  # a style that replicates every parameter (ReplicateParallel) replicates the adapters too
        variant = _ADAPTED_STYLES.get(type(style))
        if variant is None:
            raise ValueError(
                f"{name!r} carries LoRA adapters but its tensor-parallel style {type(style).__name__} has no LoRA "
                "variant (ColwiseParallel and RowwiseParallel have); leave it out of LoRA target_modules."
            )
        adapted = variant.__new__(variant)
        adapted.__dict__.update(style.__dict__)  # the base style's layouts and options, unchanged
        out[name] = adapted
    return out
