"""Routed SwiGLU experts stored stacked (HF v5 layout) and the shared-expert MLP.

``GroupedExperts.gate_up_proj`` [E, 2I, H] (gate rows first, then up rows) and ``down_proj`` [E, H, I], exactly
as ``transformers`` v5 ``MixtralExperts`` / ``Qwen2MoeExperts`` store them, so HF conversion is a rename.
Under expert parallelism both are DTensors sharded on dim 0 over the EP mesh (``parallel.expert.apply_ep``).

Two compute paths over tokens already sorted by expert:

- dropless: one grouped GEMM per projection (``torch._grouped_mm`` where the device/dtype/strides allow it),
  otherwise a loop over the contiguous per-expert segments (no gather, one GEMM per segment);
- capacity: every expert holds exactly ``C`` rows (dropped/padded upstream), so all experts run as ONE batched
  GEMM (``torch.bmm``) -- the "pad/drop to equal counts, then batched GEMM" scheme of the MXMACA seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_flagscale.distributed.dtensor import local_tensor

__all__ = ["GroupedExperts", "SwiGLUMLP", "grouped_linear", "grouped_mm_usable", "local_tensor"]


def maybe_checkpoint(enabled: bool, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """Run ``fn`` under non-reentrant activation checkpointing when ``enabled`` and autograd is recording."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``torch._grouped_mm``'s backward rejects expanded (stride-0) gradients such as the one ``out.sum()`` produces.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def grouped_mm_usable(x: Tensor, w: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run ``x @ w[e].T`` here: present, dtype/device supported, 16-byte strides."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if x.device.type == "cuda":
        # The CUDA kernel is bf16-only and needs Hopper (sm90) or newer.
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.dtype != w.dtype:
        return False
    size = x.element_size()
    return all((d * size) % 16 == 0 for d in (w.shape[1], w.shape[2]))


def grouped_linear(x: Tensor, w: Tensor, counts: Sequence[int], use_grouped_mm: bool = True) -> Tensor:
    """``cat_e(x_e @ w[e].T)`` for row segments ``x_e`` of sizes ``counts`` (x [N, in], w [E, out, in])."""
    if use_grouped_mm and grouped_mm_usable(x, w):
        offs = torch.tensor(counts, device=x.device, dtype=torch.int64).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    # Sorted-segment fallback: every expert's rows are contiguous, so each GEMM reads a slice, never a gather.
    # Empty segments still run (0-row GEMM) so every expert weight gets a (zero) gradient on every rank.
    return torch.cat([seg @ w[e].T for e, seg in enumerate(x.split(list(counts)))], dim=0)


def _swiglu(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as two stacked parameters (see module docstring for the layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.use_grouped_mm = True
        """Set False to force the sorted-segment fallback (benchmarks, debugging)."""

    def stacked_parameters(self) -> list[tuple[nn.Module, str]]:
        """(owner, name) of every ``[num_experts, ...]`` Parameter that expert parallelism shards on dim 0; LoRA's
        per-expert adapters add theirs (``models/lora.py``)."""
        return [(self, "gate_up_proj"), (self, "down_proj")]

    def local_weights(self) -> tuple[Tensor, Tensor]:
        """The weights of the experts this rank owns (all of them without EP)."""
        return local_tensor(self.gate_up_proj), local_tensor(self.down_proj)

    def forward(
        self,
        x: Tensor,
        counts: Sequence[int],
        *,
        batched: bool = False,
        weights: tuple[Tensor, Tensor] | None = None,
        recompute: frozenset[str] = frozenset(),
    ) -> Tensor:
        """Apply expert ``e`` to the ``counts[e]`` rows of ``x`` (sorted by expert); returns [N, H].

        ``batched`` (capacity path): all counts are equal, one ``bmm`` runs every expert. ``weights`` overrides the
        local weights (hot-expert replicas). ``recompute`` may hold "fc1" and/or "act" (multi-level recompute).
        """
        w1, w2 = weights if weights is not None else self.local_weights()
        if batched:
            if len(set(counts)) > 1:
                raise AssertionError(f"batched experts need equal counts, got {list(counts)}")
            e = len(counts)

            def fc1(inp: Tensor) -> Tensor:
                return torch.bmm(inp.view(e, -1, inp.shape[-1]), w1.transpose(-2, -1))

            def fc2(inp: Tensor) -> Tensor:
                return torch.bmm(inp, w2.transpose(-2, -1)).reshape(-1, w2.shape[1])

        else:

            def fc1(inp: Tensor) -> Tensor:
                return grouped_linear(inp, w1, counts, self.use_grouped_mm)

            def fc2(inp: Tensor) -> Tensor:
                return grouped_linear(inp, w2, counts, self.use_grouped_mm)

        if "fc1" in recompute and "act" in recompute:
            act = maybe_checkpoint(True, lambda inp: _swiglu(fc1(inp)), x)
        else:
            h = maybe_checkpoint("fc1" in recompute, fc1, x)
            act = maybe_checkpoint("act" in recompute, _swiglu, h)
        return fc2(act)


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP with HF names (``gate_proj``, ``up_proj``, ``down_proj``), used for shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
