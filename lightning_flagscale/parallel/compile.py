"""``torch.compile`` of a model's repeated blocks and its loss, in place (``ParallelConfig.torch_compile``).

Each block is compiled with ``nn.Module.compile``, which keeps the module and its parameter names (no ``_orig_mod``
prefix): checkpoints, HF export and the optimizer's parameter groups see the same model. Blocks are compiled after
TP / CP / EP and recompute have changed what runs inside them, and before ZeRO-3 shards them, as torchtitan orders it:
the compiled region is the block's math, recompute's checkpoint included (under ``selective`` recompute the op policy
is then applied once, while tracing, not at every op of every step). The model's ``loss_fn`` is compiled too: the
fp32 cast of the logits, the log-softmax and the gather become a few fused kernels instead of an fp32 copy of the
logits (4 GiB for a 128k vocabulary at 8k tokens) and its gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_flagscale.moe.balance import moe_layers
from lightning_flagscale.parallel.pipeline_parallel.recompute import checkpointed

__all__ = ["apply_compile"]


def _compile_block(block: nn.Module) -> None:
    """``block.compile()``; a tensor-parallel block under ``full`` recompute instead keeps its checkpoint eager around
    its compiled body: torch 2.13's AOT autograd cannot trace the checkpoint region over DTensor ops (it hands the TP
    device mesh to ``save_for_backward``). Same semantics as the checkpoint inside (the block input kept, the body
    re-run in backward, compiled both times); only the checkpoint's own bookkeeping runs eagerly."""
    tensor_parallel = any(isinstance(p, DTensor) for p in block.parameters())
    if getattr(block, "_recompute_mode", None) == "full" and tensor_parallel:
        body = block.forward.__wrapped__  # the block's own forward, under apply_recompute's checkpoint
        block.forward = checkpointed(torch.compile(body), "full")
        block._compiled_inside_checkpoint = True
    else:
        block.compile()


def apply_compile(model: nn.Module, blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Compile every block of ``model`` (default: ``model.layers``) and its ``loss_fn``, in place; returns ``model``.

    MoE models are refused: their expert GEMMs take a routing-dependent number of tokens each step (a shape the
    compiler would specialise on or guard, and recompile for), and the expert-parallel all-to-all is not traced."""
    if moe_layers(model):
        raise ValueError(
            "torch_compile=True is not supported for MoE models yet (per-expert token counts change every step);"
            " set torch_compile=False."
        )
    for block in model.layers.values() if blocks is None else blocks:
        if getattr(block, "_compiled_call_impl", None) is not None or getattr(
            block, "_compiled_inside_checkpoint", False
        ):
            raise ValueError(f"{type(block).__name__} is already compiled; apply torch_compile once.")
        _compile_block(block)
    loss_fn = getattr(model, "loss_fn", None)
    if loss_fn is not None and not hasattr(loss_fn, "_torchdynamo_orig_callable"):
        model.loss_fn = torch.compile(loss_fn)  # instance attribute: the class's method stays the eager one
    return model
