"""Hardware profiles: what the cost model knows about one device type and its links (issue 16 item 2).

A :class:`HardwareProfile` holds

- the device's dense bf16 peak and memory, and the HBM bandwidth memory-bound kernels run at;
- **GEMM efficiency by size**: measured points ``(flops of one GEMM, achieved fraction of peak)``, interpolated
  log-linearly (small GEMMs run far below peak, large ones approach the cuBLAS ceiling);
- **backward GEMM factors**: the rate of a linear layer's input-gradient (``dY @ W``) and weight-gradient
  (``dY^T @ X``) GEMMs relative to its forward one (1 on GPUs; measured by ``tune --calibrate``);
- **compute units per node** (0 for GPUs): how many cores the ranks of a CPU host share; on such a host the
  collectives (gloo) copy and reduce on those cores too, so their whole time is node work;
- **optimizer seconds per parameter** (0: derived from HBM bandwidth at 34 bytes a parameter, the traffic of a fused
  Adam kernel): measured by ``tune --calibrate`` as the real optimizer phase of one parameter (gradient-norm clip,
  torch's AdamW, copy back to the bf16 weight), which on a CPU moves ~6x those bytes (one pass per elementwise op);
- **attention efficiency**: achieved fraction of peak of the fused SDPA kernel on the FLOPs it really does
  (causal kernels skip the masked half): one number, calls measured by size (``tune --calibrate``), or published
  curves per ``attn_backend`` (``attention_kernels``: FlashAttention-2 and cuDNN differ by 1.6x on an H100);
- an **alpha-beta link model per collective and group size**, inside a node (``intra``) and across nodes (``inter``):
  ``t = alpha + factor(n) * bytes / bus_bandwidth``, with the nccl-tests conventions
  (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): ``bytes`` is the per-rank buffer size, and
  ``factor`` is 2(n-1)/n for all-reduce, (n-1)/n for all-gather / reduce-scatter / all-to-all and 1 for P2P, so
  ``bus_bandwidth`` is the number nccl-tests prints as *busbw*;
- ``compute_scale``: one end-to-end factor (kernel fusion, launch gaps, host overhead) fitted on a measured or
  published step (:func:`lightning_flagscale.tune.cost.calibrate_compute_scale`).

``tune --calibrate`` measures all of it on this machine (``tune/calibrate.py``) and writes JSON; the built-in
profiles below are for planning clusters you cannot measure from here. Their sources:

- Peaks: NVIDIA datasheets, dense (no sparsity) bf16: H100 SXM 989 TFLOP/s, H200 SXM 989, A100 SXM 312
  (``accounting/flops.py`` ``PEAK_FLOPS``); memory 80 / 141 / 80 GB; HBM 3.35 / 4.8 / 2.04 TB/s. FP32 (CUDA
  cores, what an fp32 matmul runs on without TF32: ``fp32_peak_flops``): H100 SXM 67 TFLOP/s, H200 SXM 67 (the
  same SMs and clocks), A100 SXM 19.5 (H100 datasheet: FP32 67, TF32 Tensor Core 989 "shown with sparsity", so
  495 dense; A100 datasheet: FP32 19.5, TF32 156 dense, 312 with sparsity).
- Intra-node: nccl-tests large-message busbw on 8x H100 SXM NVLink-4 460-480 GB/s, 8x A100 SXM NVLink-3 230-250
  GB/s (reference table in https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); we take 450 and 235
  (H200 has the same NVLink-4 switch as H100).
- Inter-node: one 400 Gb/s (H100/H200, NDR/RoCE) or 200 Gb/s (A100, HDR) NIC per GPU, as on DGX and Meta's Grand
  Teton (https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md); busbw taken
  as 90% of line rate: 45 GB/s and 22.5 GB/s. Latencies (alpha): ~10 us inside a node, ~20 us across nodes (ring
  latency grows with the group, modelled by the per-size points).
- GEMM efficiency: assumed saturating curves reaching ~75% of peak for large bf16 GEMMs (typical cuBLAS on
  H100/A100); *not a vendor number*: calibrate on the machine or fit ``compute_scale`` on a published step.
- Attention kernels (H100, H200: same SMs and clocks): the FlashAttention-3 paper's benchmark (Shah et al. 2024,
  arXiv:2407.08608, Figures 5 and 6: H100 80GB SXM5 at 700 W, bf16, head dim 128, 16k tokens per call, hidden
  2048), forward with the causal mask and backward without (the paper's only head-dim-128 backward).
  ``attn_backend="flash_attn"`` runs FlashAttention-2 (flash-attn's ``flash_attn_func`` /
  ``_flash_attn_forward``): 191-335 TFLOP/s forward, 214-322 backward from 512 to 16k tokens.
  ``"transformer_engine"`` runs cuDNN's fused attention (TE's ``FusedAttention``), and so does ``"torch"``: torch
  2.13's SDPA puts cuDNN first on sm90 when the runtime cuDNN is newer than 9.15
  (``check_prefer_cudnn_attention`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``; with an older
  cuDNN it runs FlashAttention-2): 315-539 forward, 305-516 backward (the paper's cuDNN of 2024: a lower bound for
  newer releases). The A100 profile keeps ``attention_efficiency`` = 0.5 for every backend, an assumption inside
  the 50-73% of peak forward the FlashAttention-2 paper (arXiv:2307.08691) reports on A100.
- ``compute_scale`` = 0.875: fitted on Llama 3 405B on 16,384 H100s (400 TFLOP/s per GPU, Llama 3 paper Table 4)
  by ``bench/tune_published.py`` (see ``bench/results/tune_published.md`` for the other published points it
  predicts); the A100 and H200 profiles reuse it for want of a published point of their own.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_flagscale.config.attention import ATTENTION_BACKENDS  # the attn_backend values a profile can price

__all__ = [
    "ATTENTION_BACKENDS",
    "BUILTIN_PROFILES",
    "COLLECTIVES",
    "Hardware",
    "HardwareProfile",
    "LinkPoint",
    "algorithm_factor",
    "builtin_profile",
    "load_profile",
]

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
Scope = Literal["intra", "inter"]


def algorithm_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: wire bytes per rank over buffer bytes for a ring of ``n`` ranks."""
    if kind not in COLLECTIVES:
        raise ValueError(f"Unknown collective {kind!r}; use one of {COLLECTIVES}.")
    if kind == "p2p":
        return 1.0
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


@dataclass(frozen=True, kw_only=True)
class LinkPoint:
    """One measured (or published) point of a collective: latency and bus bandwidth at a group size."""

    group_size: int
    latency: float
    """alpha, seconds per call (small-message time)."""
    bus_bandwidth: float
    """beta^-1, bytes/s as nccl-tests' busbw (large-message)."""


_POINT_FIELDS = ("gemm", "fp32_gemm", "gemm_rows", "attention_calls", "ring_blocks", "blocking_collective")
"""Profile fields that are lists of points (tuples in memory, lists in JSON)."""
_BLOCK_OVERHEADS = ("moe_overhead", "selective_overhead")
"""Per-block (forward, backward) host seconds of a calibrated profile."""
_OVERHEAD_FIELDS = ("tp_overhead", *_BLOCK_OVERHEADS)
"""Profile fields that are tuples of seconds (lists in JSON)."""


def _log_linear(pts: list[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` between ``(x, y)`` points sorted by ``x``, linear in ``log x``, clamped at the ends."""
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def _nearest_group(points: list, group_size: int, size_of) -> Any:
    """The point whose group size is nearest ``group_size`` in log scale (the smaller one on a tie)."""
    return min(points, key=lambda p: (abs(math.log(size_of(p)) - math.log(group_size)), size_of(p)))


def _flat_links(intra: tuple[float, float], inter: tuple[float, float]) -> dict[str, dict[str, list[LinkPoint]]]:
    """Same (latency, busbw) for every collective and group size; ring latency grows with log2 of the group."""
    out: dict[str, dict[str, list[LinkPoint]]] = {}
    for kind in COLLECTIVES:
        out[kind] = {
            scope: [
                LinkPoint(group_size=n, latency=lat * (1 + math.log2(n)), bus_bandwidth=bw)
                for n in (2, 4, 8, 16, 64, 1024)
            ]
            for scope, (lat, bw) in (("intra", intra), ("inter", inter))
        }
    return out


def _saturating_gemm(peak_fraction: float, half_flops: float) -> list[tuple[float, float]]:
    """GEMM efficiency points ``eff(F) = peak_fraction * F / (F + half_flops)`` from 1 MFLOP to 100 TFLOP."""
    return [(f, peak_fraction * f / (f + half_flops)) for f in (10.0**e for e in range(6, 15))]


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One device type and its links, as the cost model sees them (see the module docstring)."""

    name: str = "custom"
    """Profile name (``h100``, ``a100``, ``h200``, ``calibrated-cpu``...)."""
    device_type: str = "custom"
    """Device label; heterogeneous plans map ``hetero_meshes[i].device_type`` to a profile by it."""
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s of one device."""
    fp32_peak_flops: float = 0.0
    """FLOP/s of the GEMMs the model runs in fp32: the MoE router's (``moe/router.py``: ``x.float() @ w.float()``,
    whatever the precision plugin; under fp8 too, it is no ``nn.Linear``). torch runs an fp32 matmul in full fp32
    unless the training script calls ``torch.set_float32_matmul_precision("high")`` (TF32): the default is
    ``"highest"``, and neither this package nor Lightning changes it (Lightning's CUDA accelerator only suggests it).
    So this is the device's FP32 (non-tensor-core) peak; a script that enables TF32 puts the dense TF32 peak here.
    Timed at the ``fp32_gemm`` efficiency curve, ``compute_scale`` included, ``gemm_scale`` not (a Float8 speed-up
    is not the router's). 0: ``peak_flops`` (a profile whose GEMMs were measured in fp32, as ``tune --calibrate`` on
    a CPU does by default)."""
    fp32_gemm: list[tuple[float, float]] = field(default_factory=list)
    """``(FLOPs of one fp32 GEMM, fraction of fp32_peak_flops)`` points (``tune --calibrate`` in another dtype: on
    this CPU small fp32 GEMMs run faster than bf16 ones, 69 against 24 GFLOP/s at 0.5 MFLOP, large ones 4.5x
    slower). Empty: the ``gemm`` curve and its ``gemm_rows`` factors (the built-in GPU profiles: an assumption)."""
    memory_bytes: float = 80e9
    """Usable device memory."""
    hbm_bandwidth: float = 3.35e12
    """Bytes/s of device memory: memory-bound kernels (norms, activations, optimizer) run at this rate."""
    devices_per_node: int = 8
    """Devices that share the fast (``intra``) links."""
    compute_units_per_node: float = 0.0
    """0: every device computes on its own (GPUs). Otherwise the ``devices_per_node`` ranks of a node share this many
    compute units (CPU processes on a host's cores; ``tune --calibrate`` records ``os.cpu_count()``): a rank idle in a
    pipeline bubble lends its share to the busy ones."""
    gemm: list[tuple[float, float]] = field(default_factory=lambda: _saturating_gemm(0.75, 2e10))
    """``(FLOPs of one GEMM, fraction of peak)`` points, sorted by FLOPs."""
    gemm_rows: list[tuple[float, float]] = field(default_factory=list)
    """``(smallest GEMM dimension, factor)`` points on top of ``gemm`` (``tune --calibrate``): a GEMM with a dimension
    this small (a few tokens: MoE experts, small micro-batches) reaches ``factor`` times the efficiency its FLOPs
    alone give (16 rows through a 1024-wide layer: ~0.75 on this CPU). 1 from the largest point up; empty: 1."""
    attention_efficiency: float = 0.5
    """Fraction of peak the fused attention kernel reaches on the FLOPs it does."""
    attention_calls: list[tuple[float, float, float]] = field(default_factory=list)
    """Measured SDPA calls by size (``tune --calibrate``): ``(causal-half FLOPs of one call, forward fraction of
    peak, backward fraction of peak on 2.5x those FLOPs)``, sorted by FLOPs. Empty: ``attention_efficiency`` for
    both passes (fused GPU kernels). On a CPU a small call is overhead-bound and its backward costs far more than
    2.5 forwards (64 tokens: 0.14 ms forward, 0.94 ms backward)."""
    attention_kernels: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    """Published rates of the fused attention kernel each ``attn_backend`` runs on this device, in the
    ``attention_calls`` format: ``{"torch" | "flash_attn" | "transformer_engine": [(causal FLOPs of one call,
    forward fraction of peak, backward fraction of peak on 2.5x those FLOPs), ...]}``. A backend listed here is
    priced by its curve; one that is not falls back to ``attention_calls`` (this machine's SDPA, measured), then to
    ``attention_efficiency``. The built-in GPU profiles take them from kernel benchmarks (module docstring)."""
    ring_blocks: list[tuple[float, float, float]] = field(default_factory=list)
    """The same for one block of ring context-parallel attention through the kernel ``attn_backend="torch"``
    resolves to on this device (``parallel/context_parallel/kernels.TorchBlockKernel``: fp32 scores of the whole block,
    masked), by the block's full ``4 b sq sk h d`` FLOPs. Empty: ring blocks run a fused kernel at the
    ``attention_calls`` / ``attention_efficiency`` rates on their causal FLOPs (flash-attn, Transformer Engine)."""
    tp_overhead: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """Host seconds the DTensor tensor-parallel plan adds per micro-batch, beyond the kernels: ``(per block
    forward, per block backward, embedding + head + loss forward, their backward)``. Measured by ``tune
    --calibrate`` on a one-rank TP mesh (on this CPU ~4 ms a block, as much as the block's compute); 0 on GPUs,
    where the host runs ahead of the kernels."""
    moe_overhead: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds one MoE block adds per micro-batch beyond its GEMMs, attention and memory-bound
    kernels: routing, the dispatch's index gathers and their scatter-add backward, per-expert launches. Measured by
    ``tune --calibrate`` on a small MoE decoder (64 tokens, 4 experts, top-2), where it is a constant per block
    (host and launch bound); 0 on GPUs."""
    selective_overhead: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds selective recompute adds per block and micro-batch beyond the memory-bound kernels
    it recomputes: torch's selective-checkpoint dispatch mode runs the policy on every op, in forward and again in the
    recompute. Measured by ``tune --calibrate`` on the reference decoder (~1 + 1.5 ms a block on this CPU, more than
    full recompute costs at that size); 0 on GPUs, where the host runs ahead of the kernels."""
    blocking_collective: list[tuple[float, float]] = field(default_factory=list)
    """``(group size, seconds)``: on a host whose ranks share fewer cores than there are ranks, the wall time one
    blocking collective inside forward / backward (TP, SP, EP, CP) adds to the step, measured with every rank
    computing between calls (``tune --calibrate``): the wait for a peer the scheduler has descheduled, ~1 ms here,
    where an idle ping-pong of the same size takes 0.2-0.8 ms. It replaces the links' latency for those calls
    (their bytes stay work on the shared cores). Empty: the latency, as work."""
    pipeline_action_overhead: float = 0.0
    """Host seconds of one pipeline schedule action (one micro-batch's forward or backward on one stage): torch's
    schedule bookkeeping and its P2P calls. Measured by ``tune --calibrate`` from a GPipe run of trivial stages over
    the calibration world (~1 ms an action on this CPU); 0 on GPUs, where the host runs ahead of the kernels."""
    step_overhead: float = 0.0
    """Wall seconds an optimizer step costs beyond its model's work: Lightning's loop and hooks, the strategy's step
    guard and loss exchange with their scalar collectives, the closure machinery. Measured by ``tune --calibrate``
    as a step of a negligible decoder under ``Trainer`` + ``FlagScaleStrategy`` on the calibration world, less what
    the model prices for that decoder (~20 ms here, with 4 ranks on 2 cores); 0 on the built-in GPU profiles, where
    it is host time that the kernels of a step of seconds hide."""
    input_grad_gemm_factor: float = 1.0
    """Throughput of a linear layer's input-gradient GEMM (``dY @ W``) over its forward GEMM (``X @ W^T``) of the
    same size. 1 on GPUs (cuBLAS runs every layout near the same rate); measured by ``tune --calibrate``: on a CPU
    without native bf16 the non-transposed layout falls off a fast path and runs ~10x slower."""
    weight_grad_gemm_factor: float = 1.0
    """Same for the weight-gradient GEMM (``dY^T @ X``)."""
    optimizer_seconds_per_param: float = 0.0
    """Measured time of the optimizer phase per fp32 main parameter on one device (clip, AdamW step, bf16 copy),
    used as measured (not scaled by ``compute_scale``). 0: ``34 / hbm_bandwidth`` (a fused Adam kernel reads and
    writes the fp32 master, both moments and the gradient and writes the bf16 weight), scaled like other
    memory-bound kernels."""
    links: dict[str, dict[str, list[LinkPoint]]] = field(
        default_factory=lambda: _flat_links((10e-6, 450e9), (20e-6, 45e9))
    )
    """collective -> ``intra``/``inter`` -> points by group size."""
    compute_scale: float = 1.0
    """End-to-end factor on every compute time's efficiency, fitted on a measured or published step
    (``calibrate_compute_scale``); ``tune --calibrate`` sets it from a reference decoder step timed on the machine."""
    gemm_scale: float = 1.0
    """Extra factor on GEMM throughput only: a faster GEMM format (Float8 linears) that attention and memory-bound
    kernels do not share."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.memory_bytes <= 0 or self.hbm_bandwidth <= 0:
            raise ValueError(f"HardwareProfile {self.name!r}: peak_flops, memory_bytes, hbm_bandwidth must be > 0.")
        if self.fp32_peak_flops < 0:
            raise ValueError(f"HardwareProfile {self.name!r}: fp32_peak_flops must be >= 0 (0: peak_flops).")
        if self.input_grad_gemm_factor <= 0 or self.weight_grad_gemm_factor <= 0:
            raise ValueError(f"HardwareProfile {self.name!r}: backward GEMM factors must be > 0.")
        if self.optimizer_seconds_per_param < 0:
            raise ValueError(f"HardwareProfile {self.name!r}: optimizer_seconds_per_param must be >= 0 (0: derived).")
        if self.pipeline_action_overhead < 0:
            raise ValueError(f"HardwareProfile {self.name!r}: pipeline_action_overhead must be >= 0 seconds.")
        if self.step_overhead < 0:
            raise ValueError(f"HardwareProfile {self.name!r}: step_overhead must be >= 0 seconds.")
        if not self.gemm or any(e <= 0 for _, e in self.gemm):
            raise ValueError(f"HardwareProfile {self.name!r}: gemm needs points with positive efficiency.")
        if any(len(p) != 2 or min(p) <= 0 for p in self.fp32_gemm):
            raise ValueError(f"HardwareProfile {self.name!r}: fp32_gemm points are (FLOPs, efficiency), both > 0.")
        if any(len(p) != 2 or min(p) <= 0 for p in self.gemm_rows):
            raise ValueError(f"HardwareProfile {self.name!r}: gemm_rows points are (rows, factor), both > 0.")
        tables = {"attention_calls": self.attention_calls, "ring_blocks": self.ring_blocks}
        tables.update({f"attention_kernels[{b!r}]": pts for b, pts in self.attention_kernels.items()})
        for key, pts in tables.items():
            if any(len(p) != 3 or min(p) <= 0 for p in pts):
                raise ValueError(
                    f"HardwareProfile {self.name!r}: {key} points are (FLOPs, forward efficiency, backward efficiency),"
                    " all > 0."
                )
        unknown = sorted(set(self.attention_kernels) - set(ATTENTION_BACKENDS))
        if unknown or any(not pts for pts in self.attention_kernels.values()):
            raise ValueError(
                f"HardwareProfile {self.name!r}: attention_kernels maps attn_backend names {ATTENTION_BACKENDS} to"
                f" non-empty point lists; got keys {sorted(self.attention_kernels)}."
            )
        if len(self.tp_overhead) != 4 or min(self.tp_overhead) < 0:
            raise ValueError(
                f"HardwareProfile {self.name!r}: tp_overhead is 4 non-negative seconds, got {self.tp_overhead}."
            )
        for key in _BLOCK_OVERHEADS:
            if len(getattr(self, key)) != 2 or min(getattr(self, key)) < 0:
                raise ValueError(f"HardwareProfile {self.name!r}: {key} is 2 non-negative seconds.")
        if any(len(p) != 2 or p[0] < 2 or p[1] < 0 for p in self.blocking_collective):
            raise ValueError(
                f"HardwareProfile {self.name!r}: blocking_collective points are (group size >= 2, seconds >= 0)."
            )
        for kind in COLLECTIVES:
            for scope in ("intra", "inter"):
                if not self.links.get(kind, {}).get(scope):
                    raise ValueError(f"HardwareProfile {self.name!r} has no {scope}-node points for {kind}.")
        object.__setattr__(self, "_link_cache", {})  # not a field: lookups repeat millions of times in a search
        object.__setattr__(self, "_derived", {})  # profiles derived from this one (``without_latency``)
        # the point lists sorted once, and the forward / backward series of the call tables split once
        object.__setattr__(self, "_gemm_pts", sorted(self.gemm))
        object.__setattr__(self, "_fp32_pts", sorted(self.fp32_gemm))
        object.__setattr__(self, "_rows_pts", sorted(self.gemm_rows))
        calls = {key: sorted(getattr(self, key)) for key in ("attention_calls", "ring_blocks")}
        calls.update({("kernel", b): sorted(pts) for b, pts in self.attention_kernels.items()})
        object.__setattr__(
            self, "_call_series", {k: ([(f, e) for f, e, _ in v], [(f, e) for f, _, e in v]) for k, v in calls.items()}
        )

    # ---- compute ----
    def gemm_efficiency(self, flops: float) -> float:
        """Achieved fraction of peak of one GEMM of ``flops`` (log-linear between points, clamped at the ends)."""
        return _log_linear(self._gemm_pts, flops)  # type: ignore[attr-defined]

    def gemm_seconds(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        """Time of ``count`` GEMMs ``(m x k) @ (k x n)``."""
        flops = 2 * m * n * k
        if flops <= 0:
            return 0.0
        eff = self.gemm_efficiency(flops) * self.gemm_shape_factor(min(m, n, k))
        return count * flops / (self.peak_flops * eff * self.compute_scale * self.gemm_scale)

    def fp32_gemm_seconds(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        """Time of ``count`` fp32 GEMMs ``(m x k) @ (k x n)`` (the MoE router's): at ``fp32_peak_flops`` on the
        ``fp32_gemm`` curve (without one, ``gemm_seconds``' curve and shape factor), without ``gemm_scale``."""
        flops = 2 * m * n * k
        if flops <= 0:
            return 0.0
        peak = self.fp32_peak_flops or self.peak_flops
        pts = self._fp32_pts  # type: ignore[attr-defined]
        if pts:
            eff = _log_linear(pts, flops)
        else:
            eff = self.gemm_efficiency(flops) * self.gemm_shape_factor(min(m, n, k))
        return count * flops / (peak * eff * self.compute_scale)

    def gemm_shape_factor(self, smallest: float) -> float:
        """``gemm_rows`` at a GEMM's smallest dimension (1 from the largest point up, or without points)."""
        pts = self._rows_pts  # type: ignore[attr-defined]
        if not pts or smallest >= pts[-1][0]:
            return 1.0
        return _log_linear(pts, smallest)

    def backward_gemm_seconds(self, forward_seconds: float) -> tuple[float, float]:
        """(input-gradient, weight-gradient) seconds of the backward of GEMMs that take ``forward_seconds``."""
        return forward_seconds / self.input_grad_gemm_factor, forward_seconds / self.weight_grad_gemm_factor

    def attention_seconds(self, flops: float) -> float:
        return flops / (self.peak_flops * self.attention_efficiency * self.compute_scale)

    def attention_call_seconds(self, flops: float, calls: float = 1.0, backend: str = "torch") -> tuple[float, float]:
        """(forward, backward) seconds of ``calls`` fused attention calls of ``flops`` (causal half) each, through
        the kernel ``attn_backend=backend`` runs (``attention_kernels``, else this machine's ``attention_calls``,
        else ``attention_efficiency``)."""
        if flops <= 0 or calls <= 0:
            return 0.0, 0.0
        if backend in self.attention_kernels:
            return self._calls(("kernel", backend), flops, calls)
        if not self.attention_calls:
            one = self.attention_seconds(flops)
            return calls * one, calls * 2.5 * one
        return self._calls("attention_calls", flops, calls)

    def ring_block_seconds(
        self, flops: float, causal_flops: float, calls: float = 1.0, backend: str = "torch"
    ) -> tuple[float, float]:
        """(forward, backward) seconds of ``calls`` ring-attention blocks of ``flops`` (whole block) each, whose
        visible part is ``causal_flops`` (what a fused kernel computes). ``ring_blocks`` (measured here) price the
        ``torch`` block kernel; other backends, and profiles without the table, run a fused kernel. A profile whose
        ``attention_kernels`` price torch's SDPA (a GPU) but that has no ``ring_blocks`` cannot price the torch
        block kernel, which is not SDPA: it raises, naming the backends that run a fused ring."""
        reason = self.unpriced_ring(backend)
        if reason:
            raise ValueError(reason)
        if not self.ring_blocks or backend != "torch":
            return self.attention_call_seconds(causal_flops, calls, backend)
        if flops <= 0 or calls <= 0:
            return 0.0, 0.0
        return self._calls("ring_blocks", flops, calls)

    def unpriced_ring(self, backend: str) -> str | None:
        """Why this profile cannot price ring-attention blocks through ``backend`` (None when it can): its ``torch``
        curve is torch's fused SDPA (a GPU), while a ring through ``attn_backend="torch"`` runs the exact block
        kernel, and no ``ring_blocks`` were measured for it."""
        if backend == "torch" and not self.ring_blocks and "torch" in self.attention_kernels:
            return (
                f"Ring context parallelism with attn_backend='torch' runs the exact fp32 block kernel"
                f" (parallel/context_parallel/kernels.TorchBlockKernel, the reference path), which hardware profile"
                f" {self.name!r} does not price: its 'torch' curve is torch's fused SDPA. Set attn_backend='flash_attn'"
                " or 'transformer_engine' for a fused ring, use context_parallel_mode='ulysses', or measure the block"
                " kernel on the device (tune --calibrate)."
            )
        return None

    def _calls(self, table: str | tuple[str, str], flops: float, calls: float) -> tuple[float, float]:
        fwd, bwd = self._call_series[table]  # type: ignore[attr-defined]
        rate = self.peak_flops * self.compute_scale
        return calls * flops / (rate * _log_linear(fwd, flops)), calls * 2.5 * flops / (rate * _log_linear(bwd, flops))

    def memory_seconds(self, nbytes: float) -> float:
        """Time of a memory-bound kernel that moves ``nbytes``."""
        return nbytes / (self.hbm_bandwidth * self.compute_scale)

    def optimizer_seconds(self, params: float) -> float:
        """Time of the optimizer phase (clip, Adam step, bf16 copy) over ``params`` fp32 main parameters."""
        if self.optimizer_seconds_per_param > 0:
            return params * self.optimizer_seconds_per_param
        return self.memory_seconds(params * 34)

    # ---- communication ----
    def blocking_seconds(self, group_size: int) -> float:
        """``blocking_collective`` at the nearest measured group size (log scale); 0 without points or for one rank."""
        if not self.blocking_collective or group_size <= 1:
            return 0.0
        return _nearest_group(self.blocking_collective, group_size, lambda p: p[0])[1]

    def without_latency(self) -> HardwareProfile:
        """This profile with every link's latency 0 (their bytes only), for calls whose latency is priced apart."""
        cache = self._derived  # type: ignore[attr-defined]
        if "no_latency" not in cache:
            links = {
                kind: {scope: [dataclasses.replace(p, latency=0.0) for p in pts] for scope, pts in scopes.items()}
                for kind, scopes in self.links.items()
            }
            cache["no_latency"] = self.replace(links=links)
        return cache["no_latency"]

    def link(self, kind: str, group_size: int, scope: Scope) -> LinkPoint:
        """The point of the nearest group size (in log scale) for ``kind`` over ``scope`` links."""
        if kind not in COLLECTIVES:
            raise ValueError(f"Unknown collective {kind!r}; use one of {COLLECTIVES}.")
        key = (kind, group_size, scope)
        cache = self._link_cache  # type: ignore[attr-defined]
        if key not in cache:
            cache[key] = _nearest_group(self.links[kind][scope], max(group_size, 1), lambda p: p.group_size)
        return cache[key]

    def collective_seconds(self, kind: str, nbytes: float, group_size: int, *, inter_node: bool = False) -> float:
        """alpha + factor(n) * bytes / busbw for one call over ``group_size`` ranks (0 for a group of one)."""
        if nbytes <= 0 or (group_size <= 1 and kind != "p2p"):
            return 0.0
        point = self.link(kind, group_size, "inter" if inter_node else "intra")
        return point.latency + algorithm_factor(kind, group_size) * nbytes / point.bus_bandwidth

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in _POINT_FIELDS:
            out[key] = [list(p) for p in getattr(self, key)]
        out["attention_kernels"] = {b: [list(p) for p in pts] for b, pts in self.attention_kernels.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Hardware profile has unknown keys {unknown}; valid keys: {sorted(known)}.")
        data = dict(data)
        for key in _POINT_FIELDS:
            if key in data:
                data[key] = [tuple(map(float, p)) for p in data[key]]
        for key in _OVERHEAD_FIELDS:
            if key in data:
                data[key] = tuple(map(float, data[key]))
        if "attention_kernels" in data:
            data["attention_kernels"] = {
                b: [tuple(map(float, p)) for p in pts] for b, pts in data["attention_kernels"].items()
            }
        if "links" in data:
            data["links"] = {
                kind: {
                    scope: [p if isinstance(p, LinkPoint) else LinkPoint(**p) for p in pts]
                    for scope, pts in scopes.items()
                }
                for kind, scopes in data["links"].items()
            }
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def replace(self, **changes: Any) -> HardwareProfile:
        return dataclasses.replace(self, **changes)


_LEGACY = ("flops", "intra_node_bandwidth", "inter_node_bandwidth")


def Hardware(**kwargs: Any) -> HardwareProfile:  # the pre-profile class name, kept for callers
    """A :class:`HardwareProfile` from its fields, or from the pre-profile ``Hardware`` fields (``flops`` sustained
    FLOP/s, ``intra_node_bandwidth`` / ``inter_node_bandwidth`` bytes/s, ``memory_bytes``, ``devices_per_node``):
    every GEMM and attention kernel at ``flops``, latency-free links, no memory-bound time."""
    if not any(k in kwargs for k in _LEGACY):
        return HardwareProfile.from_dict(kwargs)  # fields, or a profile's JSON
    flops = kwargs.pop("flops", 400e12)
    intra = kwargs.pop("intra_node_bandwidth", 150e9)
    inter = kwargs.pop("inter_node_bandwidth", 25e9)
    links = {
        kind: {scope: [LinkPoint(group_size=2, latency=0.0, bus_bandwidth=bw)] for scope, bw in (("intra", intra),
               ("inter", inter))} for kind in COLLECTIVES
    }  # fmt: skip
    return HardwareProfile(**{"name": "legacy", "peak_flops": flops, "gemm": [(1.0, 1.0)], "attention_efficiency": 1.0,
                              "hbm_bandwidth": float("inf"), "links": links, **kwargs})  # fmt: skip


def _kernel_curve(
    forward_tflops: tuple[float, ...], backward_tflops: tuple[float, ...]
) -> list[tuple[float, float, float]]:
    """``attention_kernels`` points from the FlashAttention-3 paper's H100 benchmark (module docstring): sequence
    lengths 512..16k at 16k tokens per call and 16 heads of 128, so one call's causal forward FLOPs are
    ``2 x seq x 16384 x 2048``; rates are TFLOP/s on the 989 TFLOP/s dense bf16 peak."""
    seqs = (512, 1024, 2048, 4096, 8192, 16384)
    return [(2.0 * s * 16384 * 2048, f / 989, b / 989) for s, f, b in zip(seqs, forward_tflops, backward_tflops)]


# FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), H100 80GB SXM5 (700 W), bf16, head dim 128: forward
# with causal mask; backward without (the paper has no causal backward for head dim 128).
_FA2_H100 = _kernel_curve((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322))
_CUDNN_H100 = _kernel_curve((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516))
_HOPPER_KERNELS = {"flash_attn": _FA2_H100, "transformer_engine": _CUDNN_H100, "torch": _CUDNN_H100}
_SOURCES = "see lightning_flagscale/tune/hardware.py module docstring"
_FITTED_SCALE = 0.875  # bench/tune_published.py: Llama 3 405B, 16K H100s (FlashAttention-2 assumed)
BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100", device_type="H100", peak_flops=989e12, fp32_peak_flops=67e12,
        memory_bytes=80e9, hbm_bandwidth=3.35e12,
        links=_flat_links((10e-6, 450e9), (20e-6, 45e9)), compute_scale=_FITTED_SCALE,
        attention_kernels=_HOPPER_KERNELS, source=f"H100 SXM cluster, 400G/GPU; {_SOURCES}",
    ),
    "h200": HardwareProfile(
        name="h200", device_type="H200", peak_flops=989e12, fp32_peak_flops=67e12,
        memory_bytes=141e9, hbm_bandwidth=4.8e12,
        links=_flat_links((10e-6, 450e9), (20e-6, 45e9)), compute_scale=_FITTED_SCALE,
        attention_kernels=_HOPPER_KERNELS, source=f"H200 SXM cluster, 400G/GPU; {_SOURCES}",
    ),
    "a100": HardwareProfile(
        name="a100", device_type="A100", peak_flops=312e12, fp32_peak_flops=19.5e12,
        memory_bytes=80e9, hbm_bandwidth=2.04e12,
        gemm=_saturating_gemm(0.80, 6e9), links=_flat_links((10e-6, 235e9), (20e-6, 22.5e9)), compute_scale=_FITTED_SCALE,
        source=f"A100 SXM 80GB cluster, 200G/GPU; {_SOURCES}",
    ),
}  # fmt: skip


def builtin_profile(name: str) -> HardwareProfile:
    if name.lower() not in BUILTIN_PROFILES:
        raise ValueError(f"Unknown hardware profile {name!r}; use one of {sorted(BUILTIN_PROFILES)} or a JSON path.")
    return BUILTIN_PROFILES[name.lower()]


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name (``h100``, ``h200``, ``a100``) or a JSON file written by ``tune --calibrate``."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ValueError(f"Hardware profile file {str(path)!r} does not exist.")
        return HardwareProfile.from_dict(json.loads(path.read_text()))
    return builtin_profile(str(name_or_path))
