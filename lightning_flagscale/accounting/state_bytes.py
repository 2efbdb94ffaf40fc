"""Memory accounting: bytes of training state held by this rank, process RSS, and the ZeRO paper's formulas.

``state_bytes`` measures what this rank really holds (local shards of DTensor parameters, gradients, optimizer
master copies and states), so ZeRO and every other layout can be checked against ``zero_theory_bytes``
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020, Fig. 1 and
Sec. 5), against ``expected_state_bytes`` (the layout this package really uses) and their traffic against
``comm_theory_bytes`` (Sec. 7). These are the only copies of the formulas: ``tune``, ``bench/`` and the tests
import them.
"""

from __future__ import annotations

import math
import os
import resource
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL, ZERO2_MAX_STAGING

__all__ = [
    "CommTheory",
    "StateBytes",
    "ZeroTheory",
    "comm_theory_bytes",
    "current_rss_bytes",
    "expected_flat_zero3_state_bytes",
    "expected_state_bytes",
    "model_parallel_numel",
    "peak_rss_bytes",
    "state_bytes",
    "zero_theory_bytes",
]


# --------------------------------------------------------------------------------------------------------------------
# Measured state
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state held by this rank, each storage counted once (in the first category it appears).

    Measured by :func:`state_bytes` (whole numbers) or predicted by :func:`expected_state_bytes`.
    """

    params: float
    """Model parameters (local shards of DTensors)."""
    grads: float
    """Gradients of model parameters and of optimizer-owned parameter copies."""
    master_params: float
    """Parameters the optimizers own that are not model parameters (fp32 master weights, ZeRO shard params)."""
    optimizer_states: float
    """Every tensor in ``optimizer.state`` (Adam moments, step counters, ...)."""

    @property
    def optimizer(self) -> float:
        """Master copies + optimizer states: the ZeRO paper's "optimizer states" term (K x Ψ)."""
        return self.master_params + self.optimizer_states

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master_params + self.optimizer_states


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _StorageCounter:
    """Counts the bytes of each distinct storage once."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def __call__(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            t = _local(t)
            if t.device.type == "meta":
                continue  # holds no memory
            storage = t.untyped_storage()
            # The whole storage is held, even if the tensor is a view of part of it (e.g. a padded shard).
            key = (str(t.device), storage.data_ptr())
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def _state_tensors(optimizer: Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def state_bytes(model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> StateBytes:
    """Bytes of parameters, gradients, optimizer-owned parameter copies and optimizer states held by this rank.

    Deduplicated by storage: tied weights, views into one flat buffer and a tensor that is both a model parameter
    and an optimizer parameter are counted once. A storage is counted in full, padding included.
    """
    count = _StorageCounter()
    model_params = list(model.parameters())
    params = count(model_params)
    opt_params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    master = count(opt_params)
    grads = count(p.grad for p in [*model_params, *opt_params])
    states = count(t for opt in optimizers for t in _state_tensors(opt))
    return StateBytes(params=params, grads=grads, master_params=master, optimizer_states=states)


def model_parallel_numel(model: nn.Module) -> int:
    """Parameters of this rank's model-parallel part (TP shard / pipeline stage), before any data-parallel sharding.

    The Ψ of the ZeRO formulas for one rank: a DTensor's global numel is divided by the sizes of the mesh dims it is
    sharded over, except data-parallel ones (mesh dims whose name contains ``dp`` or ``data``). Tied weights count once.
    """
    total, seen = 0, set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not isinstance(p, DTensor):
            total += p.numel()
            continue
        n = p.shape.numel()
        names = p.device_mesh.mesh_dim_names or ()
        for i, placement in enumerate(p.placements):
            name = names[i] if i < len(names) else ""
            if isinstance(placement, Shard) and "dp" not in name and "data" not in name:
                n //= p.device_mesh.size(i)
        total += n
    return total


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    peak = peak if sys.platform == "darwin" else peak * 1024
    # Linux keeps RSS counters in per-thread caches, so the recorded peak can trail the current RSS by a few pages.
    return max(peak, current_rss_bytes())


def current_rss_bytes() -> int:
    """Current resident set size of this process (psutil when installed, else ``/proc/self/statm``)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


# --------------------------------------------------------------------------------------------------------------------
# Theory (ZeRO paper)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroTheory:
    """Bytes per rank of model states predicted by the ZeRO paper."""

    params: float
    grads: float
    optimizer: float
    """Optimizer states including any fp32 master copy (the paper's K x Ψ)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


# Bytes per parameter of (params, grads, optimizer) for each layout, Adam/AdamW optimizer.
_LAYOUTS: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 8),  # fp32 params and grads, Adam m and v
    "bf16-master": (2, 2, 12),  # bf16 params and grads; fp32 master, m, v (the paper's 2 + 2 + K=12)
}


def zero_theory_bytes(
    num_params: int, dp: int, stage: Literal[0, 1, 2, 3], layout: Literal["fp32", "bf16-master"] = "bf16-master"
) -> ZeroTheory:
    """Model-state bytes per rank for ``num_params`` (Ψ) parameters data-parallel over ``dp`` (N) ranks.

    Stage 0 (DDP) replicates everything; ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients,
    ZeRO-3 also the parameters. For ``bf16-master``: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {sorted(_LAYOUTS)}.")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be 0 (DDP), 1, 2 or 3.")
    if dp < 1 or num_params < 0:
        raise ValueError(f"Need dp >= 1 and num_params >= 0, got dp={dp}, num_params={num_params}.")
    p, g, o = (b * num_params for b in _LAYOUTS[layout])
    return ZeroTheory(
        params=p / dp if stage >= 3 else float(p),
        grads=g / dp if stage >= 2 else float(g),
        optimizer=o / dp if stage >= 1 else float(o),
    )


_MODEL_DTYPE_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}


def expected_state_bytes(
    num_params: float,
    dp: int,
    stage: Literal[0, 1, 2, 3],
    precision: Literal["32-true", "bf16-mixed", "16-mixed"] = "32-true",
    *,
    when: Literal["optimizer_step", "backward_peak"] = "optimizer_step",
    bucket_numel: float = DEFAULT_BUCKET_NUMEL,
    frozen_params: float = 0.0,
) -> StateBytes:
    """Model-state bytes per rank that this package holds for Ψ = ``num_params`` parameters over ``dp`` ranks (Adam).

    ``frozen_params`` (LoRA's frozen base, issue 40): parameters held without gradient, master copy or optimizer
    state, in the model dtype (stages 0-2) or as ZeRO-3's fp32 shards (FSDP2; 4 bytes / N each); Ψ then counts the
    trainable parameters only.

    The same categories as :func:`state_bytes` measures, so a run can be compared field by field. Differences from
    the paper's layout (:func:`zero_theory_bytes`): gradients live in fp32 buckets (4 bytes whatever the parameter
    dtype; ``parallel/data_parallel/grad_buckets.py``), into which hooks move each gradient as backward produces it; stages 1-2
    keep an fp32 main copy of their 1/N slice even in fp32 training; ZeRO-3 (FSDP2) stores fp32 sharded parameters
    and casts them per block. Stages 0 and 1 keep the full fp32 gradient buckets (4Ψ; ZeRO-1's reduced slice is a
    view of its own bucket), at the optimizer step and during backward alike. Stage 2 keeps only the fp32
    main-gradient shard (4Ψ/N) at the optimizer step; during backward (``"backward_peak"``) at most two buckets of
    ``bucket_numel`` fp32 gradients (one reducing, one filling) exist beside it.
    """
    if precision not in _MODEL_DTYPE_BYTES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(_MODEL_DTYPE_BYTES)}.")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be 0 (DDP), 1, 2 or 3.")
    if when not in ("optimizer_step", "backward_peak"):
        raise ValueError(f"when={when!r}: use 'optimizer_step' or 'backward_peak'.")
    if dp < 1 or num_params < 0:
        raise ValueError(f"Need dp >= 1 and num_params >= 0, got dp={dp}, num_params={num_params}.")
    if frozen_params < 0:
        raise ValueError(f"Need frozen_params >= 0, got {frozen_params}.")
    psi, n, model, frozen = num_params, dp, _MODEL_DTYPE_BYTES[precision], frozen_params
    if stage == 3:
        return StateBytes(
            params=4 * (psi + frozen) / n, grads=4 * psi / n, master_params=0, optimizer_states=8 * psi / n
        )
    if stage == 0:
        master = 4 * psi if model != 4 else 0  # mixed precision: fp32 master weights (whole, unsharded)
        return StateBytes(params=model * (psi + frozen), grads=4 * psi, master_params=master, optimizer_states=8 * psi)
    if stage == 1:
        grads = 4 * psi
    else:
        staging = 4 * min(psi, ZERO2_MAX_STAGING * bucket_numel) if when == "backward_peak" else 0
        grads = 4 * psi / n + staging
    return StateBytes(
        params=model * (psi + frozen), grads=grads, master_params=4 * psi / n, optimizer_states=8 * psi / n
    )


def expected_flat_zero3_state_bytes(
    units: Sequence[Sequence[tuple[Sequence[int], bool]]], dp: int, rank: int
) -> StateBytes:
    """Model-state bytes of ``rank`` under flat ZeRO-3 (``zero3_impl="flat"``, fp32 shards, Adam), padding included.

    ``units``: each flat unit's parameters as (local shape, trainable) in registration order. The layout of
    ``zero3_flat_unit.py``: a unit's trainable parameters, then its frozen ones (two regions when it has both), each
    parameter starting at a multiple of its row length (elements per dim-0 row); a region of ``L`` elements whose rows
    have least common multiple ``l`` gives every rank ``S = max(1, ceil(L / N / l)) * l`` elements, rank ``r`` the
    range ``[r S, (r + 1) S)``. Parameters: 4 bytes per shard element of every region; gradients: 4 per element of
    the trainable region's shard; Adam: 8 per trainable element in this rank's range (Adam's step counters left
    out). :func:`expected_state_bytes` is this without the padding: ``4 (Ψ + frozen) / N``, ``4 Ψ / N``, ``8 Ψ / N``.
    """
    params = grads = held = 0
    for unit in units:
        regions = [[p for p in unit if p[1]], [p for p in unit if not p[1]]]
        regions = [r for r in regions if r] if all(regions) else [list(unit)]
        for region in regions:
            offset, lcm, spans = 0, 1, []
            for shape, _ in region:
                row = math.prod(shape[1:]) if len(shape) > 1 else 1
                offset = math.ceil(offset / row) * row
                lcm = math.lcm(lcm, row)
                spans.append((offset, offset + math.prod(shape)))
                offset = spans[-1][1]
            size = max(1, math.ceil(offset / dp / lcm)) * lcm
            params += size
            if region[0][1]:
                grads += size
                lo, hi = rank * size, (rank + 1) * size
                held += sum(max(0, min(b, hi) - max(a, lo)) for a, b in spans)
    return StateBytes(params=4 * params, grads=4 * grads, master_params=0, optimizer_states=8 * held)


@dataclass(frozen=True)
class CommTheory:
    """Wire bytes per rank per step predicted by the ZeRO paper, per op (names as in ``CommTracker``)."""

    by_op: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.by_op.values())


def comm_theory_bytes(
    num_params_bytes: float, dp: int, stage: Literal[0, 1, 2, 3], *, grad_bytes: float | None = None
) -> CommTheory:
    """Data-parallel wire bytes per rank per step for parameters of ``num_params_bytes`` (Ψ) bytes.

    DDP all-reduces the gradients: 2Ψ(N-1)/N. ZeRO-1/2 reduce-scatter the gradients and all-gather the updated
    parameters: Ψ(N-1)/N each, 2Ψ(N-1)/N in total. ZeRO-3 all-gathers the parameters in forward and again in
    backward, and reduce-scatters the gradients: 3Ψ(N-1)/N. Ψ is counted in bytes so callers pass the dtype
    actually communicated (e.g. 2 x params for bf16); ``grad_bytes`` is the size of the gradients as reduced
    when it differs from the parameters' (e.g. 4 x params for an fp32 reduction of bf16 gradients).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be 0 (DDP), 1, 2 or 3.")
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1.")
    params = num_params_bytes * (dp - 1) / dp
    grads = (num_params_bytes if grad_bytes is None else grad_bytes) * (dp - 1) / dp
    if stage == 0:
        return CommTheory({"all_reduce": 2 * grads})
    if stage in (1, 2):
        return CommTheory({"reduce_scatter": grads, "all_gather": params})
    return CommTheory({"reduce_scatter": grads, "all_gather": 2 * params})
