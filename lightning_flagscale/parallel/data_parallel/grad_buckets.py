"""Flat gradient buckets for DDP / ZeRO-1 / ZeRO-2, reduced asynchronously while the backward pass still runs.

Why our own: torch's DDP reducer works only inside ``DistributedDataParallel`` (no ZeRO sharding, no DTensor/TP
parameters, no expert groups) and ``ZeroRedundancyOptimizer`` partitions whole parameters. The layout follows
Megatron-LM's distributed optimizer and the ZeRO paper (Rajbhandari et al., 2020):

- Parameters are bucketed in *reverse* registration order, so the first bucket to fill is the last layers' one:
  backward produces gradients roughly in that order, and the bucket can be reduced while earlier layers compute.
- A post-accumulate-grad hook moves each gradient into its bucket (in the fp32 reduction dtype) and frees
  ``param.grad``. When every parameter of a bucket has reported, the bucket is launched as an asynchronous
  all-reduce (stage 0) or reduce-scatter (stages 1-2). Buckets are launched strictly in index order, on every rank
  alike (collectives must be issued in the same order everywhere), as torch's DDP reducer does; a bucket that is
  complete early waits for the ones before it.
- Stages 0 and 1 keep one persistent fp32 buffer per bucket: micro-steps of an accumulation window add into it
  (reduction only on the last micro-step, see ``GradReducer.require_sync``), the reduced gradient (stage 0) or this
  rank's reduced slice (stage 1, copied into the buffer's own slice) is what the optimizer's main parameter sees as
  ``.grad`` (a view, no copy). Gradients therefore cost 4 bytes x Ψ at any time.
- Buffers are never zero-filled between steps: a parameter's first gradient of a window is copied into its slot
  (later ones are added), and only the slots that got no gradient are zeroed when the bucket is launched. That saves
  a pass over 4Ψ bytes per step (and, for ZeRO-2's staging buffers, allocating zeroed memory per bucket).
- Stage 2 keeps no full gradient: a bucket's fp32 staging buffer is allocated when its first gradient arrives,
  reduce-scattered, added into the fp32 main-gradient shard and freed. At most ``max_staging`` staging buffers are
  alive (the oldest in-flight reduction is waited on before a new one is allocated: double buffering), so the
  gradient memory during backward is 4Ψ/N plus two buckets. Stage 2 reduces after every backward, also inside an
  accumulation window: deferring would need the full gradient, which is exactly what ZeRO-2 removes.

The loss contract of the strategy is unchanged: each rank's gradient is its share of the step's token mean times
the number of data x context ranks; the reduction sums and divides by ``divisor`` (that number). The division is
folded into the copy into the bucket (each gradient enters as ``g / divisor``, as torch's DDP reducer does), so no
pass over the reduced buffer is spent on it; for a power-of-two divisor the result is bit-identical to dividing the
sum.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_flagscale.config.parallel import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.distributed.collectives import all_gather, reduce_scatter, release_input

__all__ = [
    "DEFAULT_BUCKET_NUMEL",
    "ZERO2_MAX_STAGING",
    "GradBucket",
    "GradReducer",
    "bucket_runs",
    "cut_runs",
    "grad_local",
    "profiler_active",
]

ZERO2_MAX_STAGING = 2  # ZeRO-2 staging buffers alive at once: one reducing while the next one fills


def profiler_active() -> bool:
    """Whether ``torch.profiler`` records on this thread. A c10d work launched then captures the profiler's
    thread-local state; destroying the work after the profiling session has ended frees that state a second time and
    crashes the process (torch 2.13, gloo: reproduced in a loop of four ranks). Work that would outlive the step it
    was launched in (``overlap_param_gather``, the asynchronous label count) therefore completes at once while the
    profiler runs."""
    return torch._C._autograd._profiler_enabled()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grad_local(p: Tensor) -> Tensor | None:
    """This rank's part of ``p.grad`` in ``p``'s own layout (re-laid out in place when autograd chose another)."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    if g is None:
        return None
    return _local(g)


class GradBucket:
    """A run of parameters whose gradients are flattened into one buffer and reduced (and sharded) as a unit."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        stage: int,
        divisor: int | None = None,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params = params
        self.group = group
        self.world = dist.get_world_size(group)
        # Gradients are summed over the group, then divided by how many distinct token shards fed them.
        self.divisor = divisor or self.world
        self._scale = 1.0 / self.divisor  # applied while a gradient is copied in (see the module docstring)
        self.rank = dist.get_rank(group)
        self.shard = stage > 0
        self.persistent = stage < 2
        self.reduce_dtype = reduce_dtype
        locals_ = [_local(p) for p in params]
        self.shapes = [t.shape for t in locals_]
        self.numels = [t.numel() for t in locals_]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.dtype = locals_[0].dtype
        self.device = locals_[0].device
        self.padded = math.ceil(self.numel / self.world) * self.world if self.shard else self.numel
        self.shard_numel = self.padded // self.world if self.shard else self.padded
        self.shard_start = self.rank * self.shard_numel if self.shard else 0
        self.index = {id(p): i for i, p in enumerate(params)}
        # What the optimizer steps for this bucket (set by the optimizer): this rank's fp32 slice (ZeRO) or the whole
        # bucket (DDP with master weights); None for DDP stepping the model's own parameters.
        self.main_param: nn.Parameter | None = None
        self._written = [False] * len(params)  # slots holding this window's gradient (the rest hold stale values)
        self.buffer: Tensor | None = self._fresh() if self.persistent else None
        self.seen = 0  # parameters that reported a gradient in the backward pass being reduced
        self.work: dist.Work | None = None
        self._out: Tensor | None = None
        self._gather: tuple[dist.Work, Tensor, Tensor] | None = None  # parameter all-gather in flight

    def _fresh(self) -> Tensor:
        """An uninitialised buffer whose slots are all unwritten (the padding, never written, is zeroed once)."""
        buffer = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.device)
        buffer[self.numel :].zero_()
        self._written = [False] * len(self.params)
        return buffer

    def _zero_unwritten(self) -> None:
        """Before the reduction: zero the slots of parameters that got no gradient in this window."""
        assert self.buffer is not None
        for i, written in enumerate(self._written):
            if not written:
                self.buffer[self.offsets[i] : self.offsets[i] + self.numels[i]].zero_()
                self._written[i] = True

    def add_grad(self, p: Tensor) -> None:
        """Add ``p``'s gradient into the bucket (in the reduction dtype) and free ``p.grad``."""
        g = grad_local(p)
        if g is None:
            return
        if self.buffer is None:
            self.buffer = self._fresh()
        i = self.index[id(p)]
        slot = self.buffer[self.offsets[i] : self.offsets[i] + self.numels[i]]
        g = g.reshape(-1)
        if self._written[i]:
            slot.add_(g, alpha=self._scale)
        else:  # the window's first gradient of this parameter: no zero fill needed
            if g.dtype == slot.dtype:
                torch.mul(g, self._scale, out=slot)
            else:  # widen first: the quotient is rounded to the bucket's dtype, not the gradient's
                slot.copy_(g).mul_(self._scale)
            self._written[i] = True
        p.grad = None

    def collect(self) -> None:
        """Add the gradients that did not pass a hook (pipeline schedules, hooks off, late autograd paths)."""
        for p in self.params:
            if p.grad is not None:
                self.add_grad(p)

    def launch(self) -> None:
        """Start the asynchronous reduction of the whole bucket over its group."""
        if self.buffer is None:  # no parameter got a gradient (e.g. experts without tokens): still a collective
            self.buffer = self._fresh()
        self._zero_unwritten()
        if self.shard:
            self._out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            self.work = reduce_scatter(self._out, self.buffer, group=self.group, async_op=True)
        else:
            self.work = dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for the reduction; hand the averaged gradient to the main parameter or back to the model's."""
        assert self.work is not None and self.buffer is not None
        main_param = self.main_param
        self.work.wait()
        self.work = None
        if self.shard:
            out, self._out = self._out, None
            if self.persistent:  # ZeRO-1: the reduced slice lives in the buffer's own slice (no second copy)
                grad = self.buffer[self.shard_start : self.shard_start + self.shard_numel]
                grad.copy_(out)
                main_param.grad = grad
            else:  # ZeRO-2: accumulate into the fp32 main-gradient shard, free the staging buffer now
                release_input(self.buffer)
                self.buffer = None
                main_param.grad = out if main_param.grad is None else main_param.grad.add_(out)
            return
        if main_param is not None:
            main_param.grad = self.buffer
            return
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):  # DDP on the model itself
            # The buffer is fp32; parameters without fp32 masters (e.g. bf16-true) take a gradient of their own dtype.
            view = self.buffer[off : off + n].view(shape).to(p.dtype)
            p.grad = (
                DTensor.from_local(view, p.device_mesh, p.placements, run_check=False)
                if isinstance(p, DTensor)
                else view
            )

    def sync_params(self, wait: bool = True) -> None:
        """Copy the updated main slice(s) back into every rank's model parameters (all-gather under ZeRO).

        ``wait=False`` (ZeRO, ``overlap_param_gather``) only launches the all-gather; :meth:`wait_params` completes it
        and writes the parameters (the next forward does so, module by module). Not while the profiler records
        (:func:`profiler_active`)."""
        if self.main_param is None:
            return
        self.wait_params()
        wait = wait or profiler_active()
        shard = self.main_param.detach().to(self.dtype)
        if not self.shard:
            self._write_params(shard)
            return
        full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        work = all_gather(full, shard, group=self.group, async_op=not wait)
        if wait:
            self._write_params(full)
        else:  # ``shard`` may be the main parameter itself (fp32): it must not change before the gather completes
            self._gather = (work, full, shard)

    @property
    def gather_pending(self) -> bool:
        return self._gather is not None

    def wait_params(self) -> None:
        """Complete a launched parameter all-gather and write the model's parameters from it."""
        if self._gather is None:
            return
        work, full, _ = self._gather
        self._gather = None
        work.wait()
        self._write_params(full)

    def _write_params(self, full: Tensor) -> None:
        with torch.no_grad():
            for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
                _local(p).copy_(full[off : off + n].view(shape))

    def gather_state(self, t: Tensor) -> Tensor:
        """The full (unsharded) buffer of a per-slice tensor (main weights, optimizer states): for checkpoints."""
        if not self.shard:
            return t
        full = torch.empty(self.padded, dtype=t.dtype, device=self.device)
        all_gather(full, t.contiguous(), group=self.group)
        return full

    def release(self) -> None:
        """Drop the gradient buffers and a reduction left in flight (after ``fit``: the strategy's teardown gives the
        device back); the next gradient allocates a fresh buffer, as every ZeRO-2 step does."""
        self.buffer, self._out, self.work = None, None, None
        self.seen = 0

    def zero_(self) -> None:
        """After the optimizer step: the next accumulation window starts from zero (lazily: every slot is marked
        unwritten, so the window's first gradient overwrites it and a slot without one is zeroed at launch)."""
        if self.buffer is not None and self.persistent:
            self._written = [False] * len(self.params)

    def flatten(self, tensors: Sequence[Tensor | None], dtype: torch.dtype) -> Tensor:
        """Per-parameter tensors (local shards) as one padded flat tensor in this bucket's layout."""
        parts = [
            torch.zeros(n, dtype=dtype, device=self.device) if t is None else t.reshape(-1).to(dtype)
            for t, n in zip(tensors, self.numels)
        ]
        if self.padded > self.numel:
            parts.append(torch.zeros(self.padded - self.numel, dtype=dtype, device=self.device))
        return torch.cat(parts)


def _on_grad_weak(reducer: weakref.ref[GradReducer], index: int, p: Tensor) -> None:
    live = reducer()
    if live is not None:
        live._on_grad(index, p)


class GradReducer:
    """Launches the buckets' reductions from post-accumulate-grad hooks, in bucket order, and waits for them.

    ``overlap=False`` still moves gradients into the buckets as they arrive but reduces only in ``finish``.
    ``hooks=False`` (pipeline schedules, whose weight-gradient passes may bypass autograd's accumulation) collects
    every gradient in ``finish``. ``require_sync`` is cleared by the strategy for the micro-steps of an accumulation
    window that must not reduce (stages 0-1; stage 2 always reduces).
    """

    def __init__(
        self,
        buckets: list[GradBucket],
        *,
        overlap: bool,
        hooks: bool,
        max_staging: int = ZERO2_MAX_STAGING,
    ) -> None:
        self.buckets = buckets
        self.overlap = overlap
        self.require_sync = True
        self.max_staging = max_staging
        self._next = 0
        self._in_flight: deque[int] = deque()
        self.peak_staging_numel = 0  # largest sum of live ZeRO-2 staging buffers (tests check the memory bound)
        self.launched_in_backward = 0  # buckets launched from a hook, i.e. before the backward pass ended
        self._handles = []
        if hooks:
            for i, bucket in enumerate(buckets):
                for p in bucket.params:
                    # The hook holds the reducer weakly: a strong reference would close a cycle parameter -> C++
                    # hook -> reducer -> bucket -> parameter that `gc` cannot see, and every parameter would outlive
                    # the run (issue 37: on a GPU each fit's weights stayed allocated).
                    hook = partial(_on_grad_weak, weakref.ref(self), i)
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def close(self) -> None:
        """Remove the hooks (the optimizer is being rebuilt)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def release(self) -> None:
        """Free every bucket's gradient buffers (:meth:`GradBucket.release`); the hooks stay."""
        for bucket in self.buckets:
            bucket.release()
        self._in_flight.clear()
        self._next = 0

    def _syncs(self, bucket: GradBucket) -> bool:
        return self.require_sync or not bucket.persistent

    def _on_grad(self, index: int, p: Tensor) -> None:
        bucket = self.buckets[index]
        if index < self._next:  # launched (maybe finished) in this backward pass: this gradient would be lost
            raise RuntimeError(
                "A gradient arrived after its bucket was reduced (a parameter used by two backward passes within"
                " one step?); pass overlap_grad_reduce=False to FlagScaleStrategy."
            )
        if bucket.buffer is None:
            self._make_room()
        bucket.add_grad(p)
        self._track_staging()
        if not self._syncs(bucket):
            return
        bucket.seen += 1
        if self.overlap:
            while self._next < len(self.buckets) and self.buckets[self._next].seen == len(
                self.buckets[self._next].params
            ):
                self._launch()
                self.launched_in_backward += 1

    def _staging(self) -> list[GradBucket]:
        return [b for b in self.buckets if not b.persistent and b.buffer is not None]

    def _track_staging(self) -> None:
        self.peak_staging_numel = max(self.peak_staging_numel, sum(b.padded for b in self._staging()))

    def _make_room(self) -> None:
        """ZeRO-2: wait for the oldest reduction in flight before another staging buffer is allocated."""
        while self._in_flight and len(self._staging()) >= self.max_staging:
            self._finish_oldest()

    def _launch(self) -> None:
        bucket = self.buckets[self._next]
        bucket.launch()
        self._track_staging()
        self._in_flight.append(self._next)
        self._next += 1

    def _finish_oldest(self) -> None:
        i = self._in_flight.popleft()
        self.buckets[i].finish()

    def finish(self) -> None:
        """Reduce every bucket not yet launched (in order), then wait for all of them."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.buffer is None and any(p.grad is not None for p in bucket.params):
                self._make_room()
            bucket.collect()
            self._launch()
        while self._in_flight:
            self._finish_oldest()
        self._next = 0
        for bucket in self.buckets:
            bucket.seen = 0


def bucket_runs(params: list[nn.Parameter], bucket_numel: int) -> list[tuple[tuple, list]]:
    """Consecutive runs of parameters that can share a flat bucket: same reduction group and dtype, at most
    ``bucket_numel`` elements (a larger parameter gets a bucket of its own). TP-sharded and TP-replicated parameters
    share buckets (their shares of the gradient norm are kept per run of elements, ``data._norm_segments``):
    keying on the sharding cut a TP layer's bucket at every norm weight, 27 buckets for 6 blocks under TP 2."""
    items = [((getattr(p, "_flagscale_grad_group", "dp_cp"), p.dtype), _local(p).numel()) for p in params]
    return [(key, [params[i] for i in run]) for key, run in cut_runs(items, bucket_numel)]


def cut_runs(items: Sequence[tuple[object, float]], bucket_numel: float) -> list[tuple[object, list[int]]]:
    """``(key, indices)`` of consecutive ``(key, numel)`` items grouped into buckets: one key per bucket, at most
    ``bucket_numel`` elements (an item larger than that alone). The rule :func:`bucket_runs` applies to parameters
    and the tuner (``tune.cost._bucket_sizes``) to the tensors it counts."""
    runs: list[tuple[object, list[int]]] = []
    size = 0.0
    for i, (key, n) in enumerate(items):
        if runs and runs[-1][0] == key and size + n <= bucket_numel:
            runs[-1][1].append(i)
            size += n
        else:
            runs.append((key, [i]))
            size = n
    return runs
