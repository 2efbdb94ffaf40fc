"""Granular activation recompute per decoder block, settable differently per pipeline stage (issue 3, item 5).

Modes (the seeds' "non-uniform fine-grained recompute"):

* ``"none"``: keep every activation.
* ``"selective"``: recompute the cheap, memory-heavy ops (norms, activation functions, RoPE and other elementwise
  ops) and keep the outputs of the expensive ones (matmuls, fused attention, collectives), via torch's selective
  activation checkpointing policy over the block. Its price is mostly host time: torch's dispatch mode consults the
  policy on every op, in forward and in the recompute (measured on CPU: ~2.5 ms a block at h = 512 and 64 tokens,
  more than ``"full"`` costs there; at h = 1024 and 512 tokens +5% a block against full's +23%). ``tune --calibrate``
  measures it as ``selective_overhead``.
* ``"full"``: keep only the block input; recompute the whole block in backward.

A stage is recomputed block by block with ``torch.utils.checkpoint`` (non-reentrant). The block's ``forward`` is
rebound on the instance instead of wrapping the block in a ``CheckpointWrapper`` so that every parameter FQN stays
``layers.<i>.<...>``: TP plans, checkpoints and HF export address parameters by those names. Apply it to the
final (stage) module: a deep copy keeps the rebound forward of the original.

Zero-bubble schedules (``zero_bubble``, ``zbv``, ``dualpipev``) run each backward as two autograd passes (input
gradient, then weight gradient), and a recomputed block is recomputed in both. torch's selective checkpointing
allows one backward per region, so under those schedules ``selective`` uses a replayable cache (``_Replayable``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["RECOMPUTE_MODES", "RecomputeMode", "apply_recompute", "resolve_recompute", "selective_policy"]

RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset[Any]:
    found = []
    for name in names:
        pkt, _, overload = name.partition(".")
        packet = getattr(_aten, pkt, None) or getattr(getattr(torch.ops, "_c10d_functional", None), pkt, None)
        if packet is not None and hasattr(packet, overload or "default"):
            found.append(getattr(packet, overload or "default"))
    return frozenset(found)


# Outputs worth keeping: they cost FLOPs or communication to recompute; everything else is cheap to redo.
_SAVE_OPS = _ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul/attention/collective outputs, recompute norms, activations and other elementwise ops."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def resolve_recompute(recompute: str | Sequence[str], num_stages: int) -> list[str]:
    """One mode per global stage from a single mode or a per-stage list; raises naming the valid modes."""
    modes = [recompute] * num_stages if isinstance(recompute, str) else list(recompute)
    if len(modes) != num_stages:
        raise ValueError(f"recompute={list(modes)} needs one mode per pipeline stage ({num_stages} stages).")
    for mode in modes:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode {mode!r} is unknown; use one of {list(RECOMPUTE_MODES)}.")
    return modes


class _Replayable:
    """Re-enterable recompute context whose cached (saved) op outputs survive each backward pass.

    torch's selective checkpointing marks a cached output consumed when a recompute reads it, so a second
    backward over the region fails. Zero-bubble schedules run two (input-, then weight-gradient), each
    recomputing the block; this wrapper restores the cache after every recompute. The cache then lives until the
    block's graph is freed (after the weight-gradient pass) instead of being released during the first pass.
    """

    def __init__(self, cached_mode: Any) -> None:
        self._mode = cached_mode
        self._snapshot: dict[Any, dict[int, Any]] = {}

    def __enter__(self) -> Any:
        self._snapshot = {key: dict(entries) for key, entries in self._mode.storage.items()}
        return self._mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._mode.__exit__(*exc)
        finally:
            self._mode.storage.clear()
            self._mode.storage.update(self._snapshot)
            self._snapshot = {}


def _replayable_contexts() -> tuple[Any, Any]:
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(selective_policy)
    return forward_ctx, _Replayable(recompute_ctx)


def _checkpointed(forward: Callable[..., Any], mode: str, replayable: bool) -> Callable[..., Any]:
    context_fn = None
    if mode == "selective":
        context_fn = (
            _replayable_contexts
            if replayable
            else functools.partial(create_selective_checkpoint_contexts, selective_policy)
        )

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved anyway
            return forward(*args, **kwargs)
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def apply_recompute(
    module: nn.Module, mode: str, *, replayable: bool = False, blocks: Iterable[nn.Module] | None = None
) -> nn.Module:
    """Recompute every block (default: ``module.layers``) in backward according to ``mode``; returns ``module``.

    ``replayable=True`` lets ``selective`` regions be backpropagated more than once (zero-bubble schedules run an
    input-gradient and a weight-gradient pass), at the cost of keeping the saved matmul outputs until the last one.
    """
    resolve_recompute(mode, 1)
    if mode == "none":
        return module
    for block in module.layers.values() if blocks is None else blocks:
        if getattr(block, "_recompute_mode", None) is not None:
            raise ValueError(f"Block already has recompute={block._recompute_mode!r}; apply recompute once.")
        block.forward = _checkpointed(
            block.forward, mode, replayable
        )  # instance attribute: FQNs unchanged (module doc)
        block._recompute_mode = mode
    return module
