"""TP-replicated weights that see only this TP rank's shard of the activations, summed over TP once per step.

Under sequence parallelism the norms run on sequence shards; QK-norm runs on the TP-local heads whatever SP; MTP's
``eh_proj`` runs on sequence shards. Each rank's weight gradient is then a partial sum. torch's ``SequenceParallel``
keeps such weights as replicated DTensors, whose partial gradients DTensor all-reduces over TP in every backward of
every micro-batch (2-5 small, latency-bound all-reduces per block per micro-batch). Megatron keeps them as plain
tensors tagged ``sequence_parallel`` and all-reduces their gradients over TP once per step (``finalize_model_grads``).

:class:`LocalSequenceParallel` does the latter under the strategy: ``apply_tp(..., partial_grads_at_step=True)``
keeps the weights plain local tensors and :func:`tag_tp_partial_params` hands their TP sum to the optimizer step
(``CHUNK_GRAD_GROUP``: DDP / ZeRO-1/2 reduce them over dp x cp x tp divided by dp x cp, ZeRO-3 sums their reduced
shards over TP, ``parallel.step.sum_chunk_grads``), as for the chunk-routed MoE weights. A plan applied on its own
(the default) keeps torch's behaviour, summed at use: exact without the strategy's step.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_flagscale.parallel.expert_parallel.apply import CHUNK_GRAD_GROUP, EXPERT_GRAD_GROUP_ATTR

__all__ = ["LocalSequenceParallel", "tag_tp_partial_params"]

PARTIAL_GRADS_ATTR = "_fs_tp_partial_grads"
"""Set on a module whose weights :class:`LocalSequenceParallel` kept local (their gradients TP-partial)."""


class LocalSequenceParallel(SequenceParallel):
    """torch's ``SequenceParallel`` (same activation layouts: in, this rank's shard along ``sequence_dim``; out, the
    same shard, a DTensor unless ``use_local_output``) whose weights can stay plain local tensors.

    ``grads_at_step`` False (default, a plan applied on its own): exactly torch's style, replicated DTensor weights
    whose gradients are summed over TP in every backward. True (``apply_tp(..., partial_grads_at_step=True)``, what
    the strategy passes): the module runs on the local shard with its plain weights, whose gradients stay this
    rank's partial sums until the optimizer step sums them over TP (:func:`tag_tp_partial_params`)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__(sequence_dim=sequence_dim, use_local_output=use_local_output)
        self.grads_at_step = False

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.grads_at_step:
            return super()._apply(module, device_mesh)
        setattr(module, PARTIAL_GRADS_ATTR, True)
        # hooks as distribute_module registers them, without its replication of the parameters as DTensors
        sharding, use_local = self.sequence_sharding, self.use_local_output
        module.register_forward_pre_hook(lambda mod, inputs: _local_input(sharding, inputs))
        module.register_forward_hook(lambda mod, inputs, out: _sharded_output(sharding, use_local, out, device_mesh))
        return module


def _local_input(sharding: tuple[Placement, ...], inputs: tuple) -> tuple:
    x = inputs[0]
    if isinstance(x, DTensor):
        x = (x if x.placements == sharding else x.redistribute(placements=sharding)).to_local()
    elif isinstance(x, Tensor):
        # A view, as torch's style makes a DTensor view: the module's own input-gradient terms (an RMSNorm's two) are
        # summed before the residual's is added, in the order they were; without it the rounding moved (~1e-9).
        x = x.view_as(x)
    return (x, *inputs[1:])


def _sharded_output(sharding: tuple[Placement, ...], use_local: bool, output: Tensor, mesh: DeviceMesh) -> Tensor:
    return output if use_local else DTensor.from_local(output, mesh, sharding, run_check=False)


def tag_tp_partial_params(model: nn.Module) -> list[nn.Parameter]:
    """Tag the trainable weights of every module :class:`LocalSequenceParallel` kept local ``CHUNK_GRAD_GROUP``: the
    optimizer step sums their gradients over TP, inside the data-parallel reduction (DDP / ZeRO-1/2) or after it
    (ZeRO-3). Tags live on Parameter objects: call it last (``Parallelized.tag_parameters``). Returns them."""
    tagged = [
        p for m in model.modules() if getattr(m, PARTIAL_GRADS_ATTR, False) for p in m.parameters() if p.requires_grad
    ]
    for p in tagged:
        setattr(p, EXPERT_GRAD_GROUP_ATTR, CHUNK_GRAD_GROUP)
    return tagged
