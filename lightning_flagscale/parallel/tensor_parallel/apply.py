"""Tensor parallelism (Megatron-style) with sequence parallelism, on DTensor parallel styles.

Layout (Shoeybi et al. 2019, Korthikanti et al. 2022), following torchtitan's llama plan:
- embedding: vocab-parallel (rows sharded, ``RowwiseParallel`` on ``nn.Embedding``); output replicated, or
  reduce-scattered along the sequence under SP;
- attention q/k/v and MLP gate/up: column-parallel (heads / inner width sharded); o/down: row-parallel;
- under SP the norms run on sequence shards (``LocalSequenceParallel``: torch's ``SequenceParallel`` layouts, the
  weights plain under the strategy, their partial gradients summed over TP once per step) and the attention/MLP
  inputs are all-gathered along the sequence (``PrepareModuleInput``), row-parallel outputs reduce-scattered back;
- LM head: column-parallel with the *local* vocab shard as output, consumed by ``vocab_parallel_cross_entropy``
  (never materialising full logits) or gathered by ``CausalLM.logits``.

torch has loss parallelism (``loss_parallel``) only for DTensor logits without padded-column masking or a local
shard interface, so the vocab-parallel cross-entropy is written here as one autograd function (three
all-reduces: max, target logit, sum-exp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from lightning_flagscale.parallel.tensor_parallel.lora import adapt_tp_plan
from lightning_flagscale.parallel.tensor_parallel.partial_grads import LocalSequenceParallel
from lightning_flagscale.parallel.tensor_parallel.protocol import (
    TensorParallelConstraints,
    TensorParallelHook,
    TensorParallelModel,
)

__all__ = [
    "ReplicateParallel",
    "WaitedRowwiseParallel",
    "apply_tp",
    "check_tp_divisible",
    "vocab_parallel_cross_entropy",
]


def check_tp_divisible(model: nn.Module, tp: int) -> None:
    """Raise ``ValueError`` naming the offending size when ``model`` cannot be split ``tp`` ways.

    The model knows its own constraints (heads, widths, padded vocab): it states them in ``check_tensor_parallel``.
    """
    if isinstance(model, TensorParallelConstraints):
        model.check_tensor_parallel(tp)


class ReplicateParallel(ParallelStyle):
    """Parameters become ``Replicate()`` DTensors; inputs and outputs stay plain (replicated) tensors.

    For the norms when sequence parallelism is off: every TP rank sees the full activations, so the gradients are
    already identical, but making them DTensors keeps the whole model on one mesh for gradient clipping, ZeRO
    and checkpointing (torch has no built-in style for this; torchtitan carries a similar ``NoParallel``).
    """

    replicates_parameters = True
    """Every parameter of the module and its children is replicated: LoRA adapters inside need no variant."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, input_fn=self._to_dtensor, output_fn=self._to_local)

    @staticmethod
    def _to_dtensor(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(t, mesh, [Replicate()], run_check=False)
            if isinstance(t, Tensor) and not isinstance(t, DTensor)
            else t
            for t in inputs
        )

    @staticmethod
    def _to_local(module: nn.Module, output: Tensor, mesh: DeviceMesh) -> Tensor:
        return output.to_local() if isinstance(output, DTensor) else output


class WaitedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` whose output leaves the module as a plain tensor: its reduction is waited for inside.

    For the vocab-parallel embedding, whose output is the first compiled block's input (``torch_compile``). torch's
    style returns the all-reduce / reduce-scatter as an ``AsyncCollectiveTensor``
    (``redistribute(async_op=True).to_local()``), and torch 2.13's AOT autograd resolves such an input with
    ``trigger_wait()`` outside its autograd function (``_functorch/_aot_autograd/frontend_utils.py`` at trace time,
    ``subclass_codegen.py`` at run time): the gradient leaving the compiled block then bypasses ``to_local()``'s
    backward and reaches the redistribution's backward as a plain tensor (``AttributeError: ... '_local_tensor'``)
    or, through an op on the input inside the block, arrives wrong (``docs/gpu.md``). Waiting here costs nothing:
    the block's first op waited for the same collective.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, partial_grads_at_step: bool = False
) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` with its own ``tp_plan`` (Megatron TP, optionally SP).

    ``partial_grads_at_step``: the weights of the plan's ``LocalSequenceParallel`` modules (norms on sequence
    shards, QK-norm on head shards) stay plain tensors whose TP-partial gradients the caller's optimizer step sums
    over TP (``tensor_parallel.partial_grads``; the strategy does, after ``tag_tp_partial_params``). False: replicated
    DTensors summed over TP in every backward, exact on their own.

    The model states its divisibility constraints (``check_tensor_parallel(tp)``) and records what its loss and
    logits need afterwards (``on_tensor_parallel(tp_mesh, sequence_parallel)``, e.g. the vocab shard it holds and
    re-tying a shared embedding). Both are optional parts of the model protocol.

    Order (torchtitan's): TP first, then CP (swaps core attention on the TP-local heads), recompute, compile and
    ZeRO/FSDP last (it shards the TP-local DTensors further); pipeline splitting happens before all of them.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D TP mesh, got {tp_mesh.ndim} dims ({tp_mesh.mesh_dim_names}).")
    if not isinstance(model, TensorParallelModel):
        raise ValueError(
            f"{type(model).__name__} has no tp_plan(sequence_parallel); tensor parallelism needs one (see"
            " lightning_flagscale/models/protocol.py)."
        )
    if model.__dict__.get("_fs_tp_applied", False):
        raise ValueError("apply_tp was already applied to this model; apply it once, to the unparallelised model.")
    check_tp_divisible(model, tp_mesh.size())
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    # Layers carrying LoRA adapters get the LoRA variant of their style (A/B sharded with the weight, issue 40).
    plan = adapt_tp_plan(model, model.tp_plan(sequence_parallel))
    for style in plan.values():
        if isinstance(style, LocalSequenceParallel):
            style.grads_at_step = partial_grads_at_step
    parallelize_module(model, tp_mesh, plan)
    for name, p in model.named_parameters():  # torch's SequenceParallel re-creates its weights trainable
        if name in frozen:
            p.requires_grad_(False)
    model._fs_tp_applied = True
    if isinstance(model, TensorParallelHook):
        model.on_tensor_parallel(tp_mesh, sequence_parallel)
    return model


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE from vocab-sharded logits (Megatron ``_VocabParallelCrossEntropy``); gradient computed
    in closed form (``softmax - onehot``) so the backward needs no communication."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group, vocab_start: int, real_vocab: int) -> Tensor:
        dtype = logits.dtype
        logits = logits.float()
        local_v = logits.shape[-1]
        cols = torch.arange(vocab_start, vocab_start + local_v, device=logits.device)
        logits = logits.masked_fill(cols >= real_vocab, float("-inf"))  # padded vocab columns
        logits_max = logits.amax(dim=-1)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        valid = labels != -100
        in_shard = valid & (labels >= vocab_start) & (labels < vocab_start + local_v)
        local_target = torch.where(in_shard, labels - vocab_start, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_shard
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        # One all-reduce for both sums (Megatron does two; the payloads are tiny, the latency is not).
        both = torch.stack([target_logit, sum_exp])
        dist.all_reduce(both, group=group)
        target_logit, sum_exp = both[0], both[1]
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, in_shard, valid)
        ctx.input_dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_target, in_shard, valid = ctx.saved_tensors
        # Out of place so that a retained graph can run backward twice.
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -in_shard.unsqueeze(-1).to(softmax.dtype))
        grad = grad * (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor, labels: Tensor, tp_group: dist.ProcessGroup, vocab_start: int, real_vocab: int
) -> Tensor:
    """Per-token cross-entropy [*labels.shape] from this rank's vocab shard ``local_logits`` [..., V/tp].

    ``vocab_start`` is the global index of the shard's first column; columns ``>= real_vocab`` are padding and
    masked out; labels ``-100`` give loss 0 and no gradient. The gradient has the input's dtype.
    """
    return _VocabParallelCrossEntropy.apply(local_logits, labels, tp_group, vocab_start, real_vocab)
