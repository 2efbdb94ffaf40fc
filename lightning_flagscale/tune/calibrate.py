"""``tune --calibrate``: micro-benchmarks that turn this machine into a :class:`HardwareProfile` (issue 16 item 2).

- **GEMM throughput by shape**: square and tall-skinny linear-layer GEMMs of growing size in the training dtype
  (``--calibrate-dtype``); the fastest size's forward rate (median over shapes of that size) sets ``peak_flops``
  (and, timed again in fp32 when the dtype is not, ``fp32_peak_flops`` and the ``fp32_gemm`` curve: the MoE
  router's GEMM runs in fp32),
  each size's rate over it is a ``gemm`` point (and 8-256 tokens through a 1024-wide layer, against that curve,
  the ``gemm_rows`` factors: a few rows run below what their FLOPs say), and
  the median rate of the input- and weight-gradient layouts over the forward one gives the backward GEMM factors. Small shapes include the per-call dispatch overhead on purpose: a
  tiny model on a CPU is overhead-bound, and that is what its step time will show.
- **SDPA attention**: causal ``scaled_dot_product_attention`` forward at a few sequence lengths; the achieved
  fraction of peak on the half of ``4 b s^2 h`` FLOPs a causal kernel does is ``attention_efficiency``. Calls from
  16 to 1024 tokens, forward and backward timed apart, give ``attention_calls`` (at 64 tokens on this CPU the
  backward took 6.5 forwards, not 2.5), and the ``torch`` ring-attention block kernel by block size gives
  ``ring_blocks`` (ring CP runs it on CPU: fp32 scores of the whole block).
- **Memory bandwidth**: an out-of-place add over tensors much larger than the caches.
- **Optimizer phase**: what a rank runs between backward and the next step on flat fp32 main parameters (the step
  guard's finiteness sum, ``parallel.data_parallel.optimizer.clip_grad_norm_``, torch's ``AdamW`` with its default implementation, the
  copy back into bf16 weights), per parameter (``optimizer_seconds_per_param``). It is memory-bound, so it is timed
  the way training runs it: by every rank of the spawned world at once (they share the memory bus), over 16M
  parameters per rank (past the caches, like a real model's states), and converted to busy time per rank (wall
  time x the cores over the ranks when the ranks outnumber the cores: the cost model's shared-core accounting
  multiplies it back). Timed by one process on 4M parameters it varied 2.4-5.4 ns a parameter between runs on this
  machine; all ranks at once on 16M, 4.0-5.0 (the median over the worlds below).
- **Collectives**: small gloo process worlds (spawned here, CPU; ``worlds`` of them, 3 by default, each point the
  median over them: with more ranks than cores, one world's small-message latency is one draw of how the scheduler
  placed its ranks) time all-reduce, all-gather, reduce-scatter, all-to-all and P2P send/recv per group size and
  message size, every group of that size at once (as training runs its data-, tensor- and expert-parallel groups:
  two 2-rank reductions side by side on 2 cores take ~1.65x one alone), up to one fp32 gradient bucket (the size data parallelism's collectives run at: on a CPU, messages
  past the caches run at about half the bandwidth of 4 MiB ones); each ``LinkPoint`` of
  ``time = alpha + factor(n) * bytes / busbw`` (nccl-tests conventions, ``hardware.py``) takes its bandwidth from a
  least-squares line and its latency from the latency-bound points (``fit_alpha_beta``).
  One machine has no inter-node link: ``inter`` points copy the ``intra`` ones (say so when planning clusters:
  use a built-in or a profile measured on the cluster).

- **End-to-end factor**: forward + backward of a small decoder (``REFERENCE``: our own layers, autograd, the host)
  run by every rank of the spawned worlds at once, as busy time; ``compute_scale`` is what makes the cost model
  predict it. Training adds Lightning's loop and the loss on top, so a measured step may still run slower.
- **TP host time**: the same decoder with 1 and 3 blocks, plain and under the DTensor TP plan on a one-rank mesh
  (``tp_overhead``: per block and at the ends, forward and backward; ~4 ms a block on this CPU), applied as the
  strategy applies it (``partial_grads_at_step=True``: QK-norm's weights, and under SP the norms', stay plain local
  tensors, :func:`planned_decoder`). The plan is the one without sequence parallelism (norms replicated DTensors);
  SP layouts take the same per-block time.
- **MoE block**: the decoder with routed experts (``MOE_REFERENCE``), 1 and 3 blocks: what a block takes beyond
  the model's kernels (``moe_overhead``).
- **Selective recompute**: the decoder with 1 and 3 blocks under ``recompute="selective"``: what torch's selective
  checkpointing (a dispatch mode that asks the policy about every op, forward and recompute) adds to a block beyond
  the recomputed kernels (``selective_overhead``; ~1 ms forward and ~1.5 ms backward a block on this CPU).
- **Pipeline schedule host time**: every rank of the spawned worlds is a stage of one 8x8 linear in a GPipe run of
  ``PIPELINE_MICROBATCHES`` micro-batches (``torch.distributed.pipelining``); nothing is computed, so the run is
  torch's bookkeeping and P2P calls per action plus the hops between stages. ``pipeline_action_overhead`` is the
  host time per action that makes ``tune/shared_cores.py``'s simulation of that run take the measured time.
- **Blocking collectives amid compute**: every rank alternates a few GEMMs and a small all-reduce in groups of
  each size, against the GEMMs alone (``blocking_collective``): with more ranks than cores the call waits for a
  descheduled peer, which is what TP / EP / CP collectives cost inside a step.
- **The training loop**: every rank of the spawned worlds trains :data:`LOOP_MODEL`, a decoder of negligible size,
  under ``Trainer`` + ``FlagScaleStrategy`` (data parallel, bf16-mixed, AdamW, clipping, as the recipes train);
  what its step takes beyond what the cost model prices for it is ``step_overhead``: Lightning's loop and hooks, the
  step guard and loss exchange with their scalar collectives (~20 ms a step here, with 4 ranks on 2 cores).

**On GPUs** (``device="cuda"``, the default on a machine with one) the same measurements run with one GPU a rank
and NCCL between them, at a GPU's sizes (:data:`CUDA_SHAPES`: GEMMs to 8192, attention calls to 16K tokens at head
dim 128, messages to 256 MiB; reference decoders of Llama-3-8B blocks on 4096 tokens, :data:`CUDA_REFERENCE`, so
the fitted factors see kernel-bound steps, not a tiny model's launches), in bf16 unless told otherwise. Every
timing waits for the device to finish (``torch.cuda.synchronize``), and each fused attention backend installed
(flash-attn, Transformer Engine) gets its own curve in ``attention_kernels``, through the block kernel ring
attention calls. GPUs do not share compute the way CPU ranks share cores (``compute_units_per_node`` 0: busy time
is wall time). One node cannot measure the network between nodes: an H100, H200 or A100 takes its built-in
profile's inter-node links (:func:`builtin_inter_node_links`), another GPU copies its intra-node ones (and says so in
the profile's ``source``). The GPU path is written against torch's CUDA and NCCL APIs and flash-attn's / Transformer Engine's
kernels, and has not run on a GPU in this project's CI (it has none): the CPU path is the tested one.

Timing is the median of repeats after a warm-up; on a shared machine it is noisy, which is why a profile stores
medians and ``cost.calibrate_compute_scale`` can refit the end-to-end factor on a measured step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.distributed.collectives import all_gather, reduce_scatter
from lightning_flagscale.models import CausalLM, CausalLMModule
from lightning_flagscale.models.lightning import adamw_impl
from lightning_flagscale.parallel.context_parallel.kernels import get_attention_kernel
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.parallel.data_parallel.optimizer import clip_grad_norm_, grads_finite
from lightning_flagscale.parallel.pipeline_parallel.recompute import apply_recompute
from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp
from lightning_flagscale.tune.cost import _rank_pass, estimate_step
from lightning_flagscale.tune.hardware import (
    BUILTIN_PROFILES,
    COLLECTIVES,
    HardwareProfile,
    LinkPoint,
    _log_linear,
    algorithm_factor,
)
from lightning_flagscale.tune.inflight import schedule_actions
from lightning_flagscale.tune.shared_cores import pipeline_seconds

__all__ = [
    "calibrate",
    "fit_alpha_beta",
    "measure_attention_calls",
    "measure_collectives",
    "measure_gemm_rows",
    "measure_gemms",
    "measure_linear_gemms",
    "measure_optimizer_step",
    "measure_pipeline_run",
    "measure_reference_step",
    "measure_ring_blocks",
    "measure_training_loop",
    "pipeline_action_overhead",
    "planned_decoder",
    "reference_compute_scale",
]


CPU = torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (CUDA runs asynchronously: the host would otherwise time launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device = CPU) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_gemms(
    sizes: Sequence[int], dtype: torch.dtype = torch.float32, repeats: int = 3, device: torch.device = CPU
) -> list[tuple[float, float]]:
    """``(flops, flop/s)`` of square ``n x n x n``, tall ``8n x n x n`` and (``n >= 256``) short ``n/8 x n x n``
    matmuls."""
    return sorted((flops, rate) for flops, rate, _, _ in measure_linear_gemms(sizes, dtype, repeats, device))


def measure_linear_gemms(
    sizes: Sequence[int], dtype: torch.dtype = torch.float32, repeats: int = 3, device: torch.device = CPU
) -> list[tuple[float, float, float, float]]:
    """``(flops, forward flop/s, input-grad flop/s, weight-grad flop/s)`` of a linear layer's three GEMMs at the
    shapes of :func:`measure_gemms`: forward ``X @ W^T``, input gradient ``dY @ W``, weight gradient ``dY^T @ X``
    (the layouts autograd runs; their rates differ on CPUs without native ``dtype`` kernels)."""
    out = []
    for n in sizes:
        # square, tall (many tokens) and, for wide layers, short (a small micro-batch's tokens through a wide layer)
        for rows in (n, 8 * n, *((n // 8,) if n >= 256 else ())):
            x, w, g = (
                torch.randn(rows, n, dtype=dtype, device=device),
                torch.randn(n, n, dtype=dtype, device=device),
                torch.randn(rows, n, dtype=dtype, device=device),
            )
            flops = 2.0 * rows * n * n
            runs = (
                lambda x=x, w=w: torch.nn.functional.linear(x, w),
                lambda g=g, w=w: g @ w,
                lambda g=g, x=x: g.t() @ x,
            )
            out.append((flops, *(flops / _median_seconds(fn, repeats, device) for fn in runs)))
    return sorted(out)


def measure_gemm_rows(
    rows: Sequence[int] = (8, 16, 32, 64, 128, 256),
    width: int = 1024,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    device: torch.device = CPU,
) -> list[tuple[int, float, float]]:
    """``(rows, FLOPs, forward flop/s)`` of ``rows`` tokens through a ``width x width`` linear layer."""
    w = torch.randn(width, width, dtype=dtype, device=device)
    out = []
    for r in rows:
        x = torch.randn(r, width, dtype=dtype, device=device)
        flops = 2.0 * r * width * width
        seconds = _median_seconds(lambda x=x: torch.nn.functional.linear(x, w), repeats, device)
        out.append((r, flops, flops / seconds))
    return out


def measure_attention(
    seq_lens: Sequence[int],
    heads: int = 4,
    head_dim: int = 64,
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> float:
    """Best achieved FLOP/s of causal SDPA forward (on the causal half of the score FLOPs)."""
    best = 0.0
    for s in seq_lens:
        q, k, v = (torch.randn(1, heads, s, head_dim, dtype=dtype, device=device) for _ in range(3))
        flops = 0.5 * 4 * s * s * heads * head_dim

        def run(q=q, k=k, v=v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        best = max(best, flops / _median_seconds(run, repeats, device))
    return best


def _forward_backward_seconds(
    run: Callable[[], tuple[torch.Tensor, Callable[[], object]]], repeats: int, device: torch.device = CPU
):
    """Median (forward, backward) seconds of ``run()``, which returns the forward's output and its backward."""
    fwd, bwd = [], []
    for i in range(repeats + 1):  # the first is a warm-up
        _sync(device)
        start = time.perf_counter()
        _, backward = run()
        _sync(device)
        mid = time.perf_counter()
        backward()
        _sync(device)
        if i:
            fwd.append(mid - start)
            bwd.append(time.perf_counter() - mid)
    return statistics.median(fwd), statistics.median(bwd)


def measure_attention_calls(
    seq_lens: Sequence[int] = (16, 32, 64, 128, 256, 1024),
    heads: int = 8,
    head_dim: int = 64,
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    backend: str = "torch",
) -> list[tuple[float, float, float]]:
    """``(causal-half FLOPs, forward seconds, backward seconds)`` of one causal attention call per sequence length
    through ``backend``: torch's SDPA with autograd as training runs it (the backward separately: on a CPU it is not
    2.5 forwards at small sizes), or a fused kernel (``flash_attn``, ``transformer_engine``: the block kernel ring
    attention calls, ``parallel.context_parallel.kernels``, over the whole causal sequence)."""
    if backend != "torch":
        return _kernel_calls(backend, seq_lens, heads, heads, head_dim, repeats, dtype, device, causal=True)
    out = []
    for s in seq_lens:
        q, k, v = (torch.randn(1, heads, s, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, s, head_dim, dtype=dtype, device=device)

        def run(q=q, k=k, v=v, grad=grad):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return o, lambda: o.backward(grad)

        out.append((0.5 * 4 * s * s * heads * head_dim, *_forward_backward_seconds(run, repeats, device)))
    return out


def _kernel_calls(
    backend: str,
    lens: Sequence[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    repeats: int,
    dtype: torch.dtype,
    device: torch.device,
    causal: bool,
) -> list[tuple[float, float, float]]:
    """``(FLOPs, forward seconds, backward seconds)`` of one ``n x n`` call of ``backend``'s attention block kernel
    per ``n`` in ``lens``: the whole block's score FLOPs, or their causal half when ``causal``."""
    kernel, out = get_attention_kernel(backend), []
    for n in lens:
        q = torch.randn(1, n, heads, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(1, n, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
        pos, scale = torch.arange(n, device=device), head_dim**-0.5

        def run(q=q, k=k, v=v, pos=pos, scale=scale):
            o, lse = kernel.forward(q, k, v, scale=scale, causal=causal, q_pos=pos, k_pos=pos)
            dout = torch.ones_like(o)
            return o, lambda: kernel.backward(dout, q, k, v, o, lse, scale=scale, causal=causal, q_pos=pos, k_pos=pos)

        flops = 4.0 * n * n * heads * head_dim * (0.5 if causal else 1.0)
        out.append((flops, *_forward_backward_seconds(run, repeats, device)))
    return out


def measure_ring_blocks(
    block_lens: Sequence[int] = (8, 16, 32, 64, 128, 256),
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int = 64,
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> list[tuple[float, float, float]]:
    """``(FLOPs of the whole block, forward seconds, backward seconds)`` of one fully visible ring-attention block
    of ``n x n`` tokens through ``attn_backend="torch"``'s kernel (``TorchBlockKernel``, what ring CP runs without
    flash-attn or Transformer Engine)."""
    return _kernel_calls("torch", block_lens, heads, kv_heads, head_dim, repeats, dtype, device, causal=False)


REFERENCE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, max_seq_len=64)  # fmt: skip
"""The small decoder whose forward + backward (one sequence of ``max_seq_len`` tokens) sets a calibrated profile's
``compute_scale``: what our layers, autograd and the host add to the kernels timed above."""


CUDA_REFERENCE = dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, max_seq_len=4096)  # fmt: skip
"""A GPU's reference decoder: Llama-3-8B blocks on 4096 tokens (~13 TFLOPs a step), so the step is bound by the
kernels, as a real model's is, not by the launches of a tiny one (which would set ``compute_scale`` ~100x low)."""


def measure_reference_step(
    dtype: torch.dtype = torch.float32, repeats: int = 5, device: torch.device = CPU, reference: dict = REFERENCE
) -> float:
    """Median seconds of forward + backward (cross-entropy on the logits) of the ``reference`` decoder."""
    config = TransformerConfig(**reference)
    generator = torch.Generator().manual_seed(0)
    model = CausalLM(config).to(device=device, dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (1, config.max_seq_len), generator=generator).to(device)
    labels = torch.randint(0, config.vocab_size, (config.max_seq_len,), generator=generator).to(device)

    def step() -> None:
        logits = model(ids).float().reshape(-1, config.vocab_size)
        torch.nn.functional.cross_entropy(logits, labels).backward()

    return _median_seconds(step, repeats, device)


LOOP_MODEL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, max_seq_len=64)  # fmt: skip
"""A decoder whose training step is almost only the training loop's own cost (:func:`measure_training_loop`)."""


def measure_training_loop(steps: int = 8, warmup: int = 2, device: torch.device = CPU) -> float:
    """Wall seconds of one optimizer step of :data:`LOOP_MODEL` trained by every rank of the initialized process
    group under ``Trainer`` + ``FlagScaleStrategy`` (data parallel, ``FlagScalePrecision("bf16-mixed")``, AdamW,
    clipping at 1.0, as the recipes train): each step timed from a barrier to the end of its batch, the median over
    the steps after ``warmup``, the slowest rank's."""
    import lightning as L

    world, rank = dist.get_world_size(), dist.get_rank()
    # Lightning joins the process group this world already runs (as under torchrun)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    times: list[float] = []

    class _Timer(L.Callback):
        def on_train_batch_start(self, *args: object) -> None:
            _sync(device)
            dist.barrier()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: object) -> None:
            _sync(device)
            times.append(time.perf_counter() - self.start)

    config = TransformerConfig(**LOOP_MODEL)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config.vocab_size, (world * (steps + warmup), config.max_seq_len + 1), generator=generator)
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in rows]
    module = CausalLMModule(config, learning_rate=1e-4, warmup_steps=0)
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.ERROR)  # the calibration's output stays its own (no device banner, no tips)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = L.Trainer(
                accelerator="gpu" if device.type == "cuda" else "cpu", devices=world,
                strategy=FlagScaleStrategy(zero_stage=0),
                plugins=[FlagScalePrecision("bf16-mixed")], max_steps=steps + warmup, gradient_clip_val=1.0,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0, callbacks=[_Timer()],
            )  # fmt: skip
            trainer.fit(module, loader)
    finally:
        lightning_log.setLevel(level)
    per_rank: list[float] = [0.0] * world
    dist.all_gather_object(per_rank, statistics.median(times[warmup:]))
    return max(per_rank)


def training_loop_overhead(profile: HardwareProfile, seconds: float, world: int) -> float:
    """``step_overhead``: the measured :func:`measure_training_loop` step beyond what ``profile`` prices for it."""
    config = ParallelConfig(zero_stage=0).resolve(world)
    model = TransformerConfig(**LOOP_MODEL)
    priced = estimate_step(model, config, LOOP_MODEL["max_seq_len"], world, profile.replace(step_overhead=0.0))
    return max(0.0, seconds - priced.step_seconds)


MOE_REFERENCE = dict(REFERENCE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=704)
"""The :data:`REFERENCE` decoder with routed experts (every block MoE): its blocks' time beyond what the GEMMs,
attention and memory-bound kernels predict is a calibrated profile's ``moe_overhead``."""
CUDA_MOE_REFERENCE = dict(CUDA_REFERENCE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=3584)


def references(device_type: str) -> tuple[dict, dict]:
    """(dense, MoE) reference decoders a calibration on ``device_type`` times."""
    return (CUDA_REFERENCE, CUDA_MOE_REFERENCE) if device_type == "cuda" else (REFERENCE, MOE_REFERENCE)


def _decoder_seconds(
    config: dict,
    layers: int,
    dtype: torch.dtype,
    repeats: int,
    tp_mesh=None,
    recompute: str = "none",
    device: torch.device = CPU,
) -> tuple[float, float]:
    """Median (forward, backward) seconds of a ``CausalLM`` of ``config`` with ``layers`` blocks on one sequence of
    ``max_seq_len`` tokens (loss included), under the DTensor TP plan on ``tp_mesh`` if given, each block recomputed
    per ``recompute``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (1, config["max_seq_len"]), generator=generator).to(device)
    model = planned_decoder(config, layers, dtype, tp_mesh, device)
    if recompute != "none":
        apply_recompute(model, recompute)

    def run():
        loss = model.loss_fn(model(ids), ids)
        return loss, loss.backward

    return _forward_backward_seconds(run, repeats, device)


def planned_decoder(
    config: dict, layers: int, dtype: torch.dtype, tp_mesh=None, device: torch.device = CPU
) -> CausalLM:
    """A ``CausalLM`` of ``config`` with ``layers`` blocks (seed 0), under the DTensor TP plan on ``tp_mesh`` if given,
    applied as the strategy applies it (``parallel/plan.py``): the weights of the plan's ``LocalSequenceParallel``
    modules (QK-norm on head shards; the norms under SP) stay plain local tensors, their TP-partial gradients left to
    the optimizer step (``partial_grads_at_step=True``, c8712d7), not DTensors summed over TP in every backward. The
    timed passes have no step, so their parameters need no reduction tags."""
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(**dict(config, num_layers=layers))).to(device=device, dtype=dtype)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=False, partial_grads_at_step=True)
    return model


def measure_blocks(
    config: dict,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    recompute: str = "none",
    device: torch.device = CPU,
) -> tuple[float, float, float, float]:
    """(forward, backward) seconds of a decoder of ``config`` with one block, then with three (``_decoder_seconds``):
    what :func:`_block_residual` turns into a per-block overhead."""
    one, three = (_decoder_seconds(config, n, dtype, repeats, recompute=recompute, device=device) for n in (1, 3))
    return (*one, *three)


def _block_residual(
    profile: HardwareProfile, config: dict, parallel: dict, busy: Sequence[float]
) -> tuple[float, float]:
    """(forward, backward) seconds one block of ``config`` under ``parallel`` took beyond what ``profile`` predicts
    for it, from busy times ``(forward, backward)`` of 1 then 3 blocks (their difference: the ends cancel)."""
    one_rank = ParallelConfig(**parallel).resolve(1)
    pred = [_rank_pass(TransformerConfig(**dict(config, num_layers=n)), one_rank, config["max_seq_len"], profile)
            for n in (1, 3)]  # fmt: skip
    pred_f, pred_b = (pred[1].f - pred[0].f) / 2, (pred[1].b - pred[0].b) / 2
    meas_f, meas_b = (busy[2] - busy[0]) / 2, (busy[3] - busy[1]) / 2
    return max(0.0, meas_f - pred_f), max(0.0, meas_b - pred_b)


def selective_block_overhead(
    profile: HardwareProfile, busy: Sequence[float], reference: dict = REFERENCE
) -> tuple[float, float]:
    """(forward, backward) seconds selective recompute adds to a :data:`REFERENCE` block beyond what ``profile``
    predicts for it (the recomputed memory-bound kernels), from :func:`measure_blocks`' busy times (under selective recompute): torch's
    selective-checkpoint dispatch mode asks the policy about every op in forward and again in the recompute, and
    caches the saved outputs. On this CPU ~1 ms forward and ~1.5 ms backward a block (at this size selective
    recompute costs more time than full recompute; at h = 1024 and 512 tokens it costs 5% against full's 23%)."""
    return _block_residual(profile, reference, {"recompute": "selective"}, busy)


def moe_block_overhead(
    profile: HardwareProfile, busy: Sequence[float], reference: dict = MOE_REFERENCE
) -> tuple[float, float]:
    """(forward, backward) seconds one MoE block of :data:`MOE_REFERENCE` took beyond what ``profile`` predicts for
    it, from :func:`measure_blocks`' busy times (the difference of three blocks and one: the ends cancel): the
    routing, the dispatch's index gathers and their scatter-add backward, per-expert launches. On this CPU
    0.4-0.6 ms forward and nothing in backward, once the GEMMs are priced by their row count (``gemm_rows``)."""
    return _block_residual(profile, reference, {}, busy)


def measure_tp_overhead(
    tp_mesh, dtype: torch.dtype = torch.float32, repeats: int = 5, device: torch.device = CPU, reference=REFERENCE
) -> tuple[float, ...]:
    """Host seconds the DTensor tensor-parallel plan adds to the :data:`REFERENCE` decoder, by pass: ``(per block
    forward, per block backward, embedding + head + loss forward, their backward)``.

    ``tp_mesh`` is a tensor-parallel mesh of one rank: the plan's DTensor wrapping, sharding propagation and
    redistribution run, the collectives over one rank do not (they are priced as links). Two depths (1 and 3
    blocks) separate the per-block part from the ends. On this CPU: ~4 ms per block, about a block's compute."""
    extra = {}
    for layers in (1, 3):
        plain = _decoder_seconds(reference, layers, dtype, repeats, device=device)
        planned = _decoder_seconds(reference, layers, dtype, repeats, tp_mesh, device=device)
        extra[layers] = [max(0.0, t - p) for p, t in zip(plain, planned, strict=True)]
    block = [max(0.0, (three - one) / 2) for one, three in zip(extra[1], extra[3], strict=True)]
    ends = [max(0.0, one - b) for one, b in zip(extra[1], block, strict=True)]
    return (*block, *ends)


def measure_blocking_collective(
    group, calls: int = 60, gemms: int = 4, repeats: int = 3, device: torch.device = CPU
) -> float:
    """Wall seconds a blocking collective adds to a loop that computes between calls, every rank at once.

    Each rank of ``group`` runs ``gemms`` small GEMMs then a 4 KiB all-reduce over ``group``, against the GEMMs
    alone. With more ranks than cores a peer is often descheduled when the call comes: the wait (0.6-0.9 ms for 2 of
    4 ranks on 2 cores here) is what tensor- and expert-parallel collectives cost inside a step, not the latency
    of an idle ping-pong."""
    x = torch.randn(64, 512, dtype=torch.bfloat16, device=device)
    w = torch.randn(1536, 512, dtype=torch.bfloat16, device=device)
    buf = torch.ones(1024, device=device)

    def loop(collective: bool) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            for _ in range(gemms):
                torch.nn.functional.linear(x, w)
            if collective:
                dist.all_reduce(buf, group=group)
        _sync(device)
        return time.perf_counter() - start

    loop(True)  # warm-up
    alone, synced = [], []
    for _ in range(repeats):  # alternated, so drifts of the machine hit both
        dist.barrier()
        alone.append(loop(False))
        dist.barrier()
        synced.append(loop(True))
    return max(0.0, (statistics.median(synced) - statistics.median(alone)) / calls)


PIPELINE_MICROBATCHES = 8


def measure_pipeline_run(
    microbatches: int = PIPELINE_MICROBATCHES, repeats: int = 5, device: torch.device = CPU
) -> float:
    """Wall seconds of one GPipe run over every rank of the default process group, each a stage of one 8x8 linear
    (the median over ``repeats`` runs after a warm-up, each run timed from a barrier to the last rank's end)."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(nn.Linear(8, 8).to(device), rank, world, device)
    schedule = ScheduleGPipe(stage, microbatches, loss_fn=lambda out, target: out.float().pow(2).mean())
    x = torch.randn(microbatches, 8, device=device)
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    per_rank: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(per_rank, times[2:])
    return statistics.median(max(run) for run in zip(*per_rank))


def pipeline_action_overhead(seconds: float, p: int, microbatches: int, hop: float, units: float) -> float:
    """Host seconds per schedule action that make the simulated GPipe run of ``p`` trivial stages
    (``tune/shared_cores.py``, ``units`` shared compute units, ``hop`` between ranks) take ``seconds``; 0 when the
    hops alone take that long."""
    actions = schedule_actions("gpipe", p, 1, microbatches)

    def run(h: float) -> float:
        return pipeline_seconds(actions, dict.fromkeys(range(p), (h, h, 0.0)), hop, units)

    if run(0.0) >= seconds:
        return 0.0
    lo, hi = 0.0, seconds
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run(mid) < seconds else (lo, mid)
    return (lo + hi) / 2


def reference_compute_scale(profile: HardwareProfile, busy_seconds: float, reference: dict = REFERENCE) -> float:
    """The ``compute_scale`` with which ``profile`` predicts the ``reference`` step's measured busy time."""
    config = TransformerConfig(**reference)
    one = _rank_pass(config, ParallelConfig().resolve(1), config.max_seq_len, profile.replace(compute_scale=1.0))
    return (one.f + one.b) / busy_seconds


def measure_memory_bandwidth(
    numel: int = 8 * 1024 * 1024, repeats: int = 3, dtype: torch.dtype = torch.float32, device: torch.device = CPU
) -> float:
    """Bytes/s of an out-of-place add in ``dtype`` (two reads, one write)."""
    a, b = (torch.randn(numel, dtype=dtype, device=device) for _ in range(2))
    c = torch.empty(numel, dtype=dtype, device=device)
    return 3 * a.element_size() * numel / _median_seconds(lambda: torch.add(a, b, out=c), repeats, device)


def measure_optimizer_step(
    numel: int = 4 * 1024 * 1024, repeats: int = 3, tensors: int = 2, device: torch.device = CPU
) -> float:
    """Seconds per parameter of the optimizer phase over ``numel`` fp32 main parameters in ``tensors`` flat buffers
    (our gradient buckets): finiteness check, global-norm clip, AdamW step (weight decay on), bf16 weight copy."""
    sizes = [numel // tensors] * tensors
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    weights = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in sizes]
    # the implementation training picks (fused on CUDA: models/lightning.py adamw_impl)
    optimizer = torch.optim.AdamW(
        params, lr=1e-6, betas=(0.9, 0.95), weight_decay=0.1, **adamw_impl([{"params": params}])
    )

    def step() -> None:
        bool(grads_finite(params))
        clip_grad_norm_(params, 1e-3)  # clips: the norm of N(0, 1) gradients is ~sqrt(numel)
        optimizer.step()
        for w, p in zip(weights, params, strict=True):
            w.copy_(p.detach())

    step()  # allocates the Adam moments
    return _median_seconds(step, repeats, device) / numel


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``time = alpha + x / busbw`` over ``(x = factor * bytes, time)``; returns (alpha, busbw).

    The bandwidth is the least-squares slope (the large messages decide it). The latency is the median of
    ``time - x / busbw`` over the latency-bound points (bandwidth term under half the time), not the line's
    intercept: on a CPU, messages past the caches run slower per byte, the line bends, and its intercept came out
    negative, i.e. a free 64 KiB all-gather (a calibration here had all-gather and reduce-scatter over 2 ranks at
    0 us against ~200 us measured), which made TP + SP look 40% faster than it ran."""
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / var if var else 0.0
    if slope <= 0:  # latency-bound everywhere: bandwidth from the largest message alone
        x_max, t_max = max(points)
        return min(ts), x_max / max(t_max, 1e-9)
    residuals = [t - x * slope for x, t in zip(xs, ts, strict=True) if x * slope < t / 2]
    alpha = statistics.median(residuals) if residuals else mt - slope * mx
    return max(0.0, alpha), 1.0 / slope


def _run_collective(
    kind: str, nbytes: int, group, n: int, rank: int, device: torch.device = CPU
) -> Callable[[], object]:
    numel = max(n, nbytes // 4 // n * n)
    x = torch.ones(numel, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":  # nccl-tests' size is the gathered output
        shard, out = torch.ones(numel // n, device=device), torch.empty(numel, device=device)
        return lambda: all_gather(out, shard, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(numel // n, device=device)
        return lambda: reduce_scatter(out, x, group=group)
    if kind == "all_to_all":
        out = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, x, group=group)
    peer = rank ^ 1  # p2p: ranks 2i and 2i+1 exchange one buffer each way per call (send then receive)

    def p2p():
        if rank % 2 == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)

    return p2p


def _all_ranks_median(seconds: float, world: int) -> float:
    per_rank: list[float] = [0.0] * world
    dist.all_gather_object(per_rank, seconds)
    return statistics.median(per_rank)


def _collective_worker(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    groups: list[int],
    repeats: int,
    optimizer_numel: int,
    dtype: torch.dtype | None,
    queue,
    device_type: str = "cpu",
):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device_type == "cuda":  # one GPU a rank, NCCL between them (what training runs)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = CPU
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        times = _WorldTimes()
        if optimizer_numel:  # every rank at once, as in training (they share the memory bus and the cores)
            dist.barrier()
            seconds = measure_optimizer_step(optimizer_numel, max(repeats, 5), tensors=4, device=device)
            times = dataclasses.replace(times, optimizer=_all_ranks_median(seconds, world))
        if dtype is not None:  # the reference decoder step, every rank at once too
            from torch.distributed.device_mesh import init_device_mesh

            dense, sparse = references(device_type)
            dist.barrier()
            reference = _all_ranks_median(measure_reference_step(dtype, max(repeats, 5), device, dense), world)
            mesh = init_device_mesh(device_type, (world, 1), mesh_dim_names=("dp", "tp"))["tp"]
            dist.barrier()
            overhead = measure_tp_overhead(mesh, dtype, max(repeats, 5), device, dense)
            dist.barrier()
            moe = measure_blocks(sparse, dtype, max(repeats, 5), device=device)
            dist.barrier()
            selective = measure_blocks(dense, dtype, max(repeats, 5), recompute="selective", device=device)
            dist.barrier()
            pipeline = measure_pipeline_run(repeats=max(repeats, 5), device=device)
            times = dataclasses.replace(
                times,
                reference=reference,
                pipeline=pipeline,
                tp_overhead=tuple(_all_ranks_median(v, world) for v in overhead),
                moe=tuple(_all_ranks_median(v, world) for v in moe),
                selective=tuple(_all_ranks_median(v, world) for v in selective),
                blocking={
                    n: _all_ranks_median(
                        measure_blocking_collective(dist.new_subgroups(group_size=n)[0], device=device), world
                    )
                    for n in groups
                    if world % n == 0
                },
            )
        results: dict[str, dict[int, list[tuple[float, float]]]] = {k: {} for k in COLLECTIVES}
        for n in groups:
            # Every group of n ranks at once, as training runs its data-, tensor- and expert-parallel groups (two
            # 2-rank reductions side by side on 2 cores take ~1.65x one alone); one group if n does not divide.
            concurrent = world % n == 0
            group = dist.new_subgroups(group_size=n)[0] if concurrent else dist.new_group(list(range(n)))
            for kind in COLLECTIVES:
                if kind == "p2p" and n != 2:
                    continue
                for nbytes in sizes:
                    dist.barrier()
                    if concurrent or rank < n:
                        fn = _run_collective(kind, nbytes, group, n, rank, device)
                        seconds = _median_seconds(fn, repeats, device)
                        if kind == "p2p":
                            seconds /= 2  # one call moves the buffer both ways
                        results[kind].setdefault(n, []).append((algorithm_factor(kind, n) * nbytes, seconds))
            dist.barrier()
        if dtype is not None:  # last: Lightning's Trainer joins this world's process group
            times = dataclasses.replace(times, loop=measure_training_loop(device=device))
        if rank == 0:
            queue.put((results, times))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_collectives(
    group_sizes: Sequence[int], sizes: Sequence[int], repeats: int = 3, worlds: int = 1, device_type: str = "cpu"
) -> dict[str, dict[int, LinkPoint]]:
    """Fitted alpha-beta points per collective and group size, from spawned worlds of ``max(group_sizes)`` ranks
    (gloo on CPU processes, NCCL with one GPU a rank for ``device_type="cuda"``)."""
    return _measure_world(group_sizes, sizes, repeats, optimizer_numel=0, worlds=worlds, device_type=device_type)[0]


@dataclasses.dataclass(frozen=True)
class _WorldTimes:
    """What every rank of the spawned worlds timed at once (median over ranks, then over worlds); None when not
    asked for."""

    optimizer: float | None = None
    """Seconds per parameter of the optimizer phase."""
    reference: float | None = None
    """Seconds of the :data:`REFERENCE` step."""
    tp_overhead: tuple[float, ...] | None = None
    """:func:`measure_tp_overhead`."""
    blocking: dict[int, float] = dataclasses.field(default_factory=dict)
    """Group size -> :func:`measure_blocking_collective`."""
    moe: tuple[float, ...] | None = None
    """:func:`measure_blocks` of :data:`MOE_REFERENCE`."""
    selective: tuple[float, ...] | None = None
    """:func:`measure_blocks` of :data:`REFERENCE` under selective recompute."""
    pipeline: float | None = None
    """:func:`measure_pipeline_run` over the world."""
    loop: float | None = None
    """:func:`measure_training_loop` over the world."""


WORLD_TIMEOUT_S = 900.0
"""Seconds a spawned calibration world may take (one takes ~25 s here) before it is killed as hung."""


def _run_world(fn: Callable, args: tuple, nprocs: int, results, timeout: float = WORLD_TIMEOUT_S):
    """Spawn ``nprocs`` ranks of ``fn(rank, *args)`` and return what rank 0 puts on the queue ``results``.

    A rank that raises or dies before rank 0 reported fails the call with torch's error naming it (one that dies
    while exiting afterwards is named in a warning: the results are complete); a world that is still running after
    ``timeout`` seconds (a collective some rank never joined) is killed and raises ``TimeoutError``, instead of
    waiting forever on a deadlock."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        # The result first: a rank that exits with unread data on a queue waits for the reader (multiprocessing).
        while True:
            try:
                result = results.get(timeout=1.0)
                break
            except queue.Empty:  # dead ranks fail the join, naming them; then the deadline
                context.join(timeout=0)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"tune --calibrate: a calibration world of {nprocs} ranks did not finish within {timeout:.0f}"
                        " s and was killed (a collective that some rank never joined?). Rerun it; if it hangs again,"
                        " calibrate fewer group sizes (--calibrate-groups)."
                    ) from None
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"tune --calibrate: a rank of a calibration world of {nprocs} ranks did not exit within"
                        f" {timeout:.0f} s after the world reported, and was killed."
                    )
        except mp.ProcessExitedException as exc:
            # Killed by a signal or a native abort while exiting, after rank 0 reported what every rank measured
            # (torch 2.13 on gloo sometimes ends a process with "terminate called without an active exception").
            warnings.warn(f"{exc} after its world reported; its results are complete and kept.", stacklevel=2)
        return result
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _measure_world(
    group_sizes: Sequence[int],
    sizes: Sequence[int],
    repeats: int,
    optimizer_numel: int,
    worlds: int = 1,
    dtype: torch.dtype | None = None,
    device_type: str = "cpu",
) -> tuple[dict[str, dict[int, LinkPoint]], _WorldTimes]:
    """(collective points, what all ranks timed at once: :class:`_WorldTimes`, the parts that need ``dtype`` only
    with it), each the median over ``worlds`` freshly spawned process worlds: with more ranks than cores, how the
    scheduler places a world's ranks decides its small-message latency for the whole run (one world timed a
    2-rank all-reduce at 0.9 ms, the next at 3.3 ms), so one world is one draw."""
    world = max(max(group_sizes), 2)
    groups = sorted(set(group_sizes) | {2})
    ctx = mp.get_context("spawn")
    draws: list[tuple] = []
    for _ in range(worlds):
        results = ctx.Queue()
        args = (world, _free_port(), list(sizes), groups, repeats, optimizer_numel, dtype, results, device_type)
        draws.append(_run_world(_collective_worker, args, world, results))
    out: dict[str, dict[int, LinkPoint]] = {}
    for kind, by_n in draws[0][0].items():
        out[kind] = {}
        for n, pts in by_n.items():
            # the same (message size) points in every world, in the same order: median time per point
            med = [(x, statistics.median(d[0][kind][n][i][1] for d in draws)) for i, (x, _) in enumerate(pts)]
            alpha, busbw = fit_alpha_beta(med)
            out[kind][n] = LinkPoint(group_size=n, latency=alpha, bus_bandwidth=busbw)
    return out, _median_times([d[1] for d in draws])


def _median_times(draws: list[_WorldTimes]) -> _WorldTimes:
    """Each timing's median over the worlds (element-wise for tuples and per group size)."""
    first = draws[0]

    def median(get: Callable[[_WorldTimes], float]) -> float:
        return statistics.median(get(d) for d in draws)

    def tuples(name: str) -> tuple[float, ...] | None:
        values = getattr(first, name)
        return None if values is None else tuple(median(lambda d, i=i: getattr(d, name)[i]) for i in range(len(values)))

    return _WorldTimes(
        optimizer=None if first.optimizer is None else median(lambda d: d.optimizer),
        reference=None if first.reference is None else median(lambda d: d.reference),
        pipeline=None if first.pipeline is None else median(lambda d: d.pipeline),
        loop=None if first.loop is None else median(lambda d: d.loop),
        tp_overhead=tuples("tp_overhead"),
        moe=tuples("moe"),
        selective=tuples("selective"),
        blocking={n: median(lambda d, n=n: d.blocking[n]) for n in first.blocking},
    )


def _busy_seconds(wall: float, ranks: int, units: float) -> float:
    """Busy time of one rank whose work took ``wall`` seconds while ``ranks`` ranks shared ``units`` cores."""
    return wall * units / ranks if 0 < units < ranks else wall


def _gemm_rates(linear: list[tuple[float, float, float, float]]) -> list[tuple[float, float]]:
    """``(flops, forward flop/s)`` per distinct GEMM size: shapes of equal FLOPs (square, tall, short) get their
    median rate, so the log-linear interpolation sees one point per size."""
    by_flops: dict[float, list[float]] = {}
    for flops, fwd, _, _ in linear:
        by_flops.setdefault(flops, []).append(fwd)
    return [(f, statistics.median(rates)) for f, rates in sorted(by_flops.items())]


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes a calibration times: small enough for a CPU, large enough to reach a GPU's rates."""

    gemm_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    """Causal SDPA forward lengths for ``attention_efficiency``."""
    message_bytes: tuple[int, ...]
    attention_calls: tuple[int, ...]
    """Sequence lengths of the per-call attention curves (``attention_calls``, ``attention_kernels``)."""
    attention_heads: int
    attention_head_dim: int
    ring_blocks: tuple[int, ...]
    rows_width: int
    """Width of the layer ``gemm_rows`` runs few tokens through."""
    memory_numel: int


CPU_SHAPES = Shapes(
    gemm_sizes=(64, 128, 256, 512, 1024), seq_lens=(256, 1024),
    message_bytes=(4 << 10, 256 << 10, 4 << 20, 4 * DEFAULT_BUCKET_NUMEL),
    attention_calls=(16, 32, 64, 128, 256, 1024), attention_heads=8, attention_head_dim=64,
    ring_blocks=(8, 16, 32, 64, 128, 256), rows_width=1024, memory_numel=8 * 1024 * 1024,
)  # fmt: skip
CUDA_SHAPES = Shapes(
    gemm_sizes=(512, 1024, 2048, 4096, 8192), seq_lens=(2048, 8192),
    message_bytes=(64 << 10, 1 << 20, 16 << 20, 4 * DEFAULT_BUCKET_NUMEL, 256 << 20),
    attention_calls=(512, 1024, 2048, 4096, 8192, 16384), attention_heads=16, attention_head_dim=128,
    ring_blocks=(256, 512, 1024, 2048, 4096), rows_width=4096, memory_numel=256 * 1024 * 1024,
)  # fmt: skip
"""A GPU's sizes: GEMMs to 8192 (an H100 reaches its rate past 4096), attention calls to 16K tokens at head dim 128
(the FlashAttention-3 paper's benchmark range), messages to 256 MiB (NCCL's bandwidth plateau)."""

FUSED_BACKENDS = ("flash_attn", "transformer_engine")


def calibrate(
    *,
    group_sizes: Sequence[int] = (2, 4),
    message_bytes: Sequence[int] | None = None,
    gemm_sizes: Sequence[int] | None = None,
    seq_lens: Sequence[int] | None = None,
    repeats: int = 3,
    memory_bytes: float | None = None,
    name: str = "calibrated",
    dtype: torch.dtype | None = None,
    threads: int | None = None,
    optimizer_numel: int = 16 * 1024 * 1024,
    worlds: int = 3,
    device: str | None = None,
) -> HardwareProfile:
    """Measure this machine (see the module docstring) and return its profile; ``devices_per_node`` is the largest
    group measured (the processes that share this machine's links). ``device``: ``"cpu"`` (CPU processes over gloo)
    or ``"cuda"`` (one GPU a rank, NCCL, every kernel timed to the device's completion, and the ``attention_kernels``
    of each fused backend installed: flash-attn, Transformer Engine); default: ``cuda`` when this machine has a GPU.
    Sizes left ``None`` take the device's :class:`Shapes`. ``dtype``: the compute dtype training runs its GEMMs,
    attention and elementwise kernels in (``torch.bfloat16`` for ``bf16-mixed``; default: fp32 on CPU, bf16 on a
    GPU). ``threads``: the intra-op threads of one training rank (CPU ranks launched with ``OMP_NUM_THREADS=1`` run
    single-threaded; on a loaded machine a multi-threaded kernel waits for its descheduled helper threads, ~20 ms
    per call, which is not what a single-threaded rank sees); default: this process's setting. ``optimizer_numel``:
    fp32 main parameters per rank the optimizer phase is timed on. ``worlds``: process worlds spawned for the
    collectives and the optimizer phase (the median of each point over them)."""
    if optimizer_numel <= 0:
        raise ValueError(f"optimizer_numel={optimizer_numel}: the optimizer phase needs parameters to time; pass > 0.")
    if worlds < 1:
        raise ValueError(f"worlds={worlds}: spawn at least one process world to time the collectives.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: calibrate 'cpu' processes or 'cuda' devices.")
    world = max(max(group_sizes), 2)
    if device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world:
            raise ValueError(
                f"Calibrating CUDA devices over groups of {world} needs {world} GPUs (one a rank); this machine has"
                f" {gpus}. Pass smaller --calibrate-groups (at least 2 GPUs: the links are measured between them)."
            )
    shapes = CUDA_SHAPES if device == "cuda" else CPU_SHAPES
    shapes = dataclasses.replace(
        shapes,
        gemm_sizes=tuple(gemm_sizes or shapes.gemm_sizes),
        seq_lens=tuple(seq_lens or shapes.seq_lens),
        message_bytes=tuple(message_bytes or shapes.message_bytes),
    )
    if dtype is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _calibrate(
            group_sizes, shapes, repeats, memory_bytes, name, dtype, optimizer_numel, worlds, torch.device(device)
        )
    finally:
        torch.set_num_threads(saved)


def builtin_inter_node_links(device_name: str) -> tuple[str, dict[str, list[LinkPoint]]] | None:
    """(built-in profile name, its inter-node links per collective) for a GPU whose name contains a built-in
    profile's device type (``NVIDIA H100 80GB HBM3`` -> ``h100``), else None. One node cannot measure the network
    between nodes; copying NVLink's rates there would price every multi-node plan as if it stayed in one node."""
    for name, profile in BUILTIN_PROFILES.items():
        if profile.device_type.lower() in device_name.lower():
            return name, {kind: scopes["inter"] for kind, scopes in profile.links.items()}
    return None


def _fused_kernels(device: torch.device) -> list[str]:
    """The fused attention backends this device can run (installed, on a GPU)."""
    if device.type != "cuda":
        return []
    out = []
    for backend in FUSED_BACKENDS:
        try:
            get_attention_kernel(backend)
        except RuntimeError:  # not installed
            continue
        out.append(backend)
    return out


def _calibrate(
    group_sizes: Sequence[int],
    shapes: Shapes,
    repeats: int,
    memory_bytes: float | None,
    name: str,
    dtype: torch.dtype,
    optimizer_numel: int,
    worlds: int,
    device: torch.device = CPU,
) -> HardwareProfile:
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    linear = measure_linear_gemms(shapes.gemm_sizes, dtype, repeats=repeats, device=device)
    gemm_rates = _gemm_rates(linear)
    peak = max(rate for _, rate in gemm_rates)
    # backward layouts relative to the forward one at the same size: the median over shapes
    dgrad = statistics.median(ig / fwd for _, fwd, ig, _ in linear)
    wgrad = statistics.median(wg / fwd for _, fwd, _, wg in linear)
    gemm = [(f, rate / peak) for f, rate in gemm_rates]
    # the GEMMs the model runs in fp32 whatever the training dtype (the MoE router): their fastest rate, under this
    # process's float32_matmul_precision (torch's default "highest", no TF32: what training runs unless its script
    # changes it); a calibration in fp32 measured them above
    fp32_peak, fp32_gemm = peak, []
    if dtype != torch.float32:
        fp32_rates = _gemm_rates(measure_linear_gemms(shapes.gemm_sizes, torch.float32, repeats=repeats, device=device))
        fp32_peak = max(rate for _, rate in fp32_rates)
        fp32_gemm = [(f, rate / fp32_peak) for f, rate in fp32_rates]
    # each row count's rate over what its FLOPs alone give on the curve; from 512 rows up, the curve itself
    gemm_rows = [
        (float(r), rate / (peak * _log_linear(gemm, flops)))
        for r, flops, rate in measure_gemm_rows(width=shapes.rows_width, dtype=dtype, repeats=repeats, device=device)
    ] + [(512.0, 1.0)]
    attention = measure_attention(shapes.seq_lens, repeats=repeats, dtype=dtype, device=device)

    def rates(points: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
        return [(f, f / (fwd * peak), 2.5 * f / (bwd * peak)) for f, fwd, bwd in points]

    heads, head_dim = shapes.attention_heads, shapes.attention_head_dim
    attention_calls = rates(measure_attention_calls(shapes.attention_calls, heads, head_dim, repeats, dtype, device))
    # the block kernel ring CP runs with attn_backend="torch" (exact fp32 scores, on any device)
    ring_blocks = rates(
        measure_ring_blocks(shapes.ring_blocks, heads, max(1, heads // 2), head_dim, repeats, dtype, device)
    )
    # fused backends installed on this GPU: their own curves (tune prices each attn_backend by it), in half
    # precision whatever the calibration dtype (flash-attn and TE's fused attention run nothing else)
    half = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    kernels = {
        b: rates(measure_attention_calls(shapes.attention_calls, heads, head_dim, repeats, half, device, backend=b))
        for b in _fused_kernels(device)
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the worlds' rank 0 shares this GPU: hand back what the kernels above cached
    links, times = _measure_world(
        group_sizes, shapes.message_bytes, repeats, optimizer_numel, worlds, dtype, device_type=device.type
    )
    assert times.optimizer is not None and times.reference is not None and times.pipeline is not None
    assert times.loop is not None and times.tp_overhead is not None
    assert times.moe is not None and times.selective is not None
    world = max(max(group_sizes), 2)
    dtype_name = str(dtype).removeprefix("torch.")
    per_scope = {kind: sorted(points.values(), key=lambda p: p.group_size) for kind, points in links.items()}
    inter, inter_note = per_scope, "inter-node points copy the intra-node ones"
    if device.type == "cuda":  # a GPU a rank: nothing shared to charge, busy time is wall time
        units = 0.0
        device_type = torch.cuda.get_device_name(device)
        if memory_bytes is None:
            memory_bytes = float(torch.cuda.get_device_properties(device).total_memory)
        setup = f"NCCL, {world} x {device_type}, {dtype_name}; attention kernels: {', '.join(kernels) or 'none'}"
        builtin = builtin_inter_node_links(device_type)
        if builtin is not None:
            inter = {kind: builtin[1].get(kind, pts) for kind, pts in per_scope.items()}
            inter_note = f"inter-node points from the built-in {builtin[0]!r} profile (one node cannot measure them)"
    else:
        units = float(os.cpu_count() or 0)
        device_type = f"cpu-{torch.get_num_threads()}threads"
        if memory_bytes is None:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
        setup = f"gloo, CPU, {dtype_name}"
    bandwidth = measure_memory_bandwidth(shapes.memory_numel, repeats, dtype, device)
    profile = HardwareProfile(
        name=name, device_type=device_type, peak_flops=peak, fp32_peak_flops=fp32_peak, memory_bytes=memory_bytes,
        hbm_bandwidth=bandwidth, devices_per_node=world,
        compute_units_per_node=units,
        gemm=gemm, gemm_rows=gemm_rows, fp32_gemm=fp32_gemm,
        attention_efficiency=min(1.0, attention / peak),
        attention_calls=attention_calls, ring_blocks=ring_blocks, attention_kernels=kernels,
        input_grad_gemm_factor=dgrad, weight_grad_gemm_factor=wgrad,
        optimizer_seconds_per_param=_busy_seconds(times.optimizer, world, units),
        tp_overhead=tuple(_busy_seconds(t, world, units) for t in times.tp_overhead),
        blocking_collective=sorted((float(n), t) for n, t in times.blocking.items()),
        links={kind: {"intra": pts, "inter": inter[kind]} for kind, pts in per_scope.items()},
        source=f"tune --calibrate on {socket.gethostname()} ({time.strftime('%Y-%m-%d %H:%M')}; {setup}; "
        f"{inter_note}; fp32 GEMMs at float32_matmul_precision {torch.get_float32_matmul_precision()!r};"
        " compute_scale from the reference decoder step)",
    )  # fmt: skip
    dense, sparse = references(device.type)
    profile = profile.replace(
        compute_scale=reference_compute_scale(profile, _busy_seconds(times.reference, world, units), dense)
    )

    def busy(walls: Sequence[float]) -> list[float]:
        return [_busy_seconds(t, world, units) for t in walls]

    hop = profile.collective_seconds("p2p", 8 * 4, 2)  # one micro-batch of the trivial stage between two ranks
    profile = profile.replace(
        moe_overhead=moe_block_overhead(profile, busy(times.moe), sparse),
        selective_overhead=selective_block_overhead(profile, busy(times.selective), dense),
        pipeline_action_overhead=pipeline_action_overhead(
            times.pipeline, world, PIPELINE_MICROBATCHES, hop, min(units, world) if units > 0 else world
        ),
    )
    return profile.replace(step_overhead=training_loop_overhead(profile, times.loop, world))
