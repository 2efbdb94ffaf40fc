"""Granular activation recompute per decoder block, settable differently per pipeline stage (issue 3, item 5).

Modes (the seeds' "non-uniform fine-grained recompute"):

* ``"none"``: keep every activation.
* ``"selective"``: recompute the cheap, memory-heavy ops (norms, activation functions, RoPE and other elementwise
  ops) and keep the outputs of the expensive ones (matmuls, fused attention, collectives), via torch's selective
  activation checkpointing policy over the block. Its price is mostly host time: torch's dispatch mode consults the
  policy on every op, in forward and in the recompute (measured on CPU: ~2.5 ms a block at h = 512 and 64 tokens,
  more than ``"full"`` costs there; at h = 1024 and 512 tokens +5% a block against full's +23%). ``tune --calibrate``
  measures it as ``selective_overhead``.
* ``"selective_mm"``: ``"selective"``, and every second matmul of the block (``mm`` / ``addmm``, counted in the
  order the block runs them) recomputed too: torchtitan's op-level selective checkpointing ("save every other mm";
  its policy counts ``mm`` alone, which is every projection of its bias-free Llama; here a biased projection's
  ``addmm`` counts as well).
  On a Llama-style block (q, k, v, o, gate, up, down) that drops the k, o and up outputs, ~37% of the block's
  projection FLOPs re-run in backward, for memory between ``"selective"`` and ``"full"``. Dense blocks only: an MoE
  block's matmul count follows its routing (the per-expert fallback runs one per expert that got tokens), so it is
  refused there.
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

import copy
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, get_args

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_flagscale.config.parallel import SELECTIVE_MM_ON_MOE, RecomputeMode
from lightning_flagscale.moe.layer import MoELayer

__all__ = ["RECOMPUTE_MODES", "RecomputeMode", "apply_recompute", "resolve_recompute", "selective_policy"]

RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)
"""From the least to the most recomputation."""

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


_MATMULS = _ops("mm", "addmm")


class _EveryOtherMatmul:
    """``selective_mm``'s policy for one checkpointed call: :func:`selective_policy`, except that the 2nd, 4th, ...
    matmul is recomputed. torch >= 2.13 records the forward's decisions and replays them; older versions ask the
    policy again in the recompute, so forward and recompute count apart (the recompute sees the same ops in the same
    order) and a replayed recompute counts from the start again (:class:`_Replayable`)."""

    def __init__(self) -> None:
        self.count = {False: 0, True: 0}

    def restart_recompute(self) -> None:
        self.count[True] = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _MATMULS:
            self.count[ctx.is_recompute] += 1
            if self.count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return selective_policy(ctx, op, *args, **kwargs)


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

    def __init__(self, cached_mode: Any, on_enter: Callable[[], None] | None = None) -> None:
        self._mode = cached_mode
        self._on_enter = on_enter
        self._snapshot: dict[Any, Any] = {}

    def __enter__(self) -> Any:
        if self._on_enter is not None:  # each replay counts the region's ops from its start again
            self._on_enter()
        # a shallow copy of each op's cached outputs (index -> output on torch 2.13; earlier versions pop a list)
        self._snapshot = {key: copy.copy(entries) for key, entries in self._mode.storage.items()}
        return self._mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._mode.__exit__(*exc)
        finally:
            self._mode.storage.clear()
            self._mode.storage.update(self._snapshot)
            self._snapshot = {}


def _selective_contexts(mode: str, replayable: bool) -> tuple[Any, Any]:
    """The (forward, recompute) contexts of one checkpointed call under a selective ``mode``."""
    policy = selective_policy if mode == "selective" else _EveryOtherMatmul()
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
    if replayable:
        recompute_ctx = _Replayable(
            recompute_ctx, policy.restart_recompute if isinstance(policy, _EveryOtherMatmul) else None
        )
    return forward_ctx, recompute_ctx


def checkpointed(forward: Callable[..., Any], mode: str, replayable: bool = False) -> Callable[..., Any]:
    """``forward`` run under ``torch.utils.checkpoint`` (non-reentrant) with ``mode``'s policy; the original is the
    result's ``__wrapped__``."""
    context_fn = None
    if mode in ("selective", "selective_mm"):
        context_fn = functools.partial(_selective_contexts, mode, replayable)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved anyway
            return forward(*args, **kwargs)
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def _has_moe(block: nn.Module) -> bool:
    return any(isinstance(m, MoELayer) for m in block.modules())


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
        if mode == "selective_mm" and _has_moe(block):
            raise ValueError(SELECTIVE_MM_ON_MOE)
        if getattr(block, "_recompute_mode", None) is not None:
            raise ValueError(f"Block already has recompute={block._recompute_mode!r}; apply recompute once.")
        block.forward = checkpointed(block.forward, mode, replayable)  # instance attribute: FQNs unchanged (module doc)
        block._recompute_mode = mode
    return module
