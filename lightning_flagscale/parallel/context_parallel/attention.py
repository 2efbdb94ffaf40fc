"""Context parallelism: load-balanced ring attention, Ulysses, and the two combined (FlagScale's hybrid CP).

Why our own: torch's ``context_parallel`` needs SDPA's CUDA/flash kernels (no CPU) and has no Ulysses; Megatron's
and TE's implementations are tied to their GPU kernels and global state. Here attention is expressed over an
LSE-returning block kernel (``attention_kernels.py``), so the same code runs on gloo/CPU and with flash-attn/TE.

Layout (issue 4). The sequence of length ``N`` is cut into ``2 * cp`` chunks and CP rank ``i`` holds chunks ``i``
and ``2cp-1-i`` (in that order), so every rank does the same causal work. :func:`shard_batch_for_cp` applies this
permutation to the batch; RoPE then uses the global ``position_ids`` it carries, and the attention modules derive
the absolute positions of their tokens from ``(cp_rank, cp_size, local_len)`` (``position_ids`` may restart per
packed document, so they cannot serve for the causal mask).

* Ring (Liu et al. 2023, "Ring Attention"; the zigzag balance of Megatron/TE): K/V (and segment ids) travel around
  the ring with non-blocking P2P while the current block is computed; blocks merge with online softmax. The
  hand-written backward lets dK/dV accumulators travel with K/V and returns them home after a full turn.
* Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-all from sequence-sharded/all-heads to
  full-sequence/head-sharded, local attention, inverse all-to-all. K/V heads are replicated when fewer than the
  degree.
* Hybrid: ``cp = ring x ulysses``, Ulysses over consecutive CP ranks (inside), ring across the groups. After the
  Ulysses all-to-all a group holds CP chunks ``{g*u .. g*u+u-1}`` and their mirrors, which is exactly the
  load-balanced layout of a ring of size ``cp / u``; tokens are sorted into it and the ring runs unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_flagscale.models.protocol import CoreAttentionSettings, attention_modules, model_config
from lightning_flagscale.parallel.context_parallel.kernels import AttentionKernel, get_attention_kernel, merge_attention

__all__ = [
    "HybridAttention",
    "RingAttention",
    "UlyssesAttention",
    "apply_cp",
    "load_balanced_indices",
    "local_positions",
    "ring_attention",
    "shard_batch_for_cp",
    "ulysses_all_to_all",
]

CPMode = Literal["ring", "ulysses", "hybrid"]
_BATCH_SEQ_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "attention_mask")


# ---------------------------------------------------------------------------------------------------------------------
# Load-balanced layout
# ---------------------------------------------------------------------------------------------------------------------


def _check_divisible(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"Sequence length {seq_len} is not divisible by 2 x context_parallel_size = {2 * cp_size} (the load-balanced"
            f" split cuts it into 2 x cp chunks); pad or pack sequences to a multiple of {2 * cp_size}."
        )


def load_balanced_indices(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """Global token indices held by ``cp_rank``: chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank`` of ``2*cp_size``."""
    _check_divisible(seq_len, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, {cp_size}).")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([first, second])


def local_positions(local_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """Absolute positions of the ``local_len`` tokens a rank holds in the load-balanced layout (CPU, int64)."""
    return load_balanced_indices(local_len * cp_size, cp_size, cp_rank)


def _rank_and_size(cp: DeviceMesh | tuple[int, int]) -> tuple[int, int]:
    if isinstance(cp, DeviceMesh):
        return cp.get_local_rank(), cp.size()
    rank, size = cp
    return int(rank), int(size)


def shard_batch_for_cp(
    batch: dict[str, Any], cp: DeviceMesh | tuple[int, int], sequence_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    """This rank's load-balanced slice of a batch (``cp`` is the CP mesh or ``(cp_rank, cp_size)``).

    ``input_ids``, ``labels``, ``position_ids``, ``segment_ids`` and ``attention_mask`` are sliced along dim 1
    with the same permutation; ``position_ids`` are created as ``arange`` when absent so RoPE keeps using global
    positions. ``sequence_keys`` names further per-token tensors [B, S, ...] to slice alike (a model's
    ``cp_sequence_keys``, e.g. multimodal positions). Other keys pass through untouched. Labels are already aligned
    next-token targets, so no shift.
    """
    rank, size = _rank_and_size(cp)
    ids = batch["input_ids"]
    seq_len = ids.shape[1]
    out = dict(batch)
    if "position_ids" not in batch or batch["position_ids"] is None:
        out["position_ids"] = torch.arange(seq_len, device=ids.device).expand(ids.shape[0], -1)
    if size == 1:
        return out
    index = load_balanced_indices(seq_len, size, rank).to(ids.device)
    for key in (*_BATCH_SEQ_KEYS, *sequence_keys):
        value = out.get(key)
        if value is None:
            continue
        if value.dim() < 2 or value.shape[1] != seq_len or (value.dim() != 2 and key in _BATCH_SEQ_KEYS):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}; context parallelism shards [batch, seq={seq_len}]"
                " tensors only (pass 2-D padding masks, not 4-D attention masks)."
            )
        out[key] = value.index_select(1, index)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------------------------------


def _step_plan(rank: int, src: int, causal: bool, half: int) -> tuple[slice, slice] | None:
    """Query/key sub-blocks that can interact when ``rank``'s queries meet ``src``'s keys (None: nothing).

    With chunks (i, 2cp-1-i) per rank: the diagonal step is the only causal one; a ring predecessor's first chunk
    is fully visible to both local chunks; a successor's keys are visible only to the local second chunk.
    """
    everything = slice(None)
    if not causal or src == rank:
        return everything, everything
    if src < rank:
        return everything, slice(0, half)
    return slice(half, None), everything


class _Ring:
    """Point-to-point plumbing of one ring: send to the next rank, receive from the previous one."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, tensors: list[Tensor]) -> tuple[list[Any], list[Tensor]]:
        """Start sending ``tensors`` forward and receiving their successors' copies; returns (requests, buffers)."""
        tensors = [t.contiguous() for t in tensors]
        buffers = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in buffers]
        return dist.batch_isend_irecv(ops), buffers


def _wait(requests: list[Any]) -> None:
    for req in requests:
        req.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg, group, kernel, causal, scale):  # type: ignore[override]
        ring = _Ring(group)
        half = q.shape[1] // 2
        pos = local_positions(q.shape[1], ring.size, ring.rank)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)  # MLA: v width
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        cur = [k, v] if seg is None else [k, v, seg]
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            # Post the next block's transfer before computing on the current one: comm overlaps compute.
            reqs, nxt = ring.exchange(cur) if step < ring.size - 1 else ([], cur)
            plan = _step_plan(ring.rank, src, causal, half)
            if plan is not None:
                qs, ks = plan
                kpos = local_positions(q.shape[1], ring.size, src)
                ck, cv = cur[0][:, ks], cur[1][:, ks]
                cseg = None if seg is None else cur[2][:, ks]
                qseg = None if seg is None else seg[:, qs]
                b_out, b_lse = kernel.forward(
                    q[:, qs], ck, cv, scale=scale, causal=causal, q_pos=pos[qs], k_pos=kpos[ks], q_seg=qseg, k_seg=cseg
                )
                out[:, qs], lse[:, :, qs] = merge_attention(out[:, qs], lse[:, :, qs], b_out, b_lse)
                del b_out, b_lse, ck, cv  # free before the next block's kernel runs
            _wait(reqs)
            cur = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([] if seg is None else [seg]))
        ctx.group, ctx.kernel, ctx.causal, ctx.scale = group, kernel, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, *rest = ctx.saved_tensors
        seg = rest[0] if rest else None
        ring, kernel = _Ring(ctx.group), ctx.kernel
        half = q.shape[1] // 2
        pos = local_positions(q.shape[1], ring.size, ring.rank)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur = [k, v] if seg is None else [k, v, seg]
        dkv_reqs: list[Any] = []
        dkv_in: list[Tensor] | None = None
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            reqs, nxt = ring.exchange(cur) if step < ring.size - 1 else ([], cur)
            plan = _step_plan(ring.rank, src, ctx.causal, half)
            grads = None
            if plan is not None:
                qs, ks = plan
                kpos = local_positions(q.shape[1], ring.size, src)
                b_dq, b_dk, b_dv = kernel.backward(
                    dout[:, qs], q[:, qs], cur[0][:, ks], cur[1][:, ks], out[:, qs], lse[:, :, qs],
                    scale=ctx.scale, causal=ctx.causal, q_pos=pos[qs], k_pos=kpos[ks],
                    q_seg=None if seg is None else seg[:, qs], k_seg=None if seg is None else cur[2][:, ks],
                )  # fmt: skip
                dq[:, qs] += b_dq
                grads = (ks, b_dk, b_dv)
            # dK/dV of the block we hold arrive from the previous rank (accumulated along the way): add ours in place
            # and pass them on; after the last step they have gone full circle and are the gradients of our own K/V.
            _wait(dkv_reqs)
            if dkv_in is None:
                dkv_in = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
            if grads is not None:
                ks, b_dk, b_dv = grads
                dkv_in[0][:, ks] += b_dk
                dkv_in[1][:, ks] += b_dv
                del grads, b_dq, b_dk, b_dv  # free block gradients before the next block's kernel runs
            if ring.size > 1:
                dkv_reqs, dkv_in = ring.exchange(dkv_in)
            _wait(reqs)
            cur = nxt
        _wait(dkv_reqs)
        assert dkv_in is not None
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool = True,
    segment_ids: Tensor | None = None,
    kernel: AttentionKernel | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention of local q [B, L, Hq, D] over the ring's whole sequence; k/v [B, L, Hkv, D] in the same layout.

    Local tokens must be in the load-balanced layout of ``group`` (chunks ``r`` and ``2R-1-r``); ``group=None``
    means a single rank (plain blockwise attention).
    """
    size = 1 if group is None else dist.get_world_size(group)
    if q.shape[1] % 2 and size > 1:
        raise ValueError(f"Local sequence length {q.shape[1]} must be even (two load-balanced chunks per rank).")
    kernel = kernel or get_attention_kernel("torch")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, segment_ids, group, kernel, causal, scale)


# ---------------------------------------------------------------------------------------------------------------------
# Ulysses all-to-all
# ---------------------------------------------------------------------------------------------------------------------


def _all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):  # type: ignore[override]
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def ulysses_all_to_all(x: Tensor, group: dist.ProcessGroup, *, to_heads: bool) -> Tensor:
    """[B, S/u, H, D] -> [B, S, H/u, D] when ``to_heads`` (scatter heads, gather sequence), else the inverse.

    Differentiable: its backward is the inverse all-to-all. The gathered sequence is rank-major.
    """
    return _AllToAll.apply(x, group, 2, 1) if to_heads else _AllToAll.apply(x, group, 1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------------------------


def _as_group(g: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup | None:
    if isinstance(g, DeviceMesh):
        g = g.get_group()
    if g is not None and dist.get_world_size(g) == 1:
        return None
    return g


def _kv_replication(num_kv_heads: int, ulysses: int) -> int:
    """How many times each KV head is repeated so Ulysses can scatter KV heads; raise when impossible."""
    if num_kv_heads % ulysses == 0:
        return 1
    if ulysses % num_kv_heads == 0:
        return ulysses // num_kv_heads
    raise ValueError(
        f"Ulysses degree {ulysses} and the local KV head count {num_kv_heads} do not divide one another; choose a"
        " ulysses_size that divides, or is a multiple of, the KV heads (or use ring CP)."
    )


def _check_heads(num_heads: int, num_kv_heads: int, ulysses: int) -> None:
    if num_heads % ulysses:
        raise ValueError(
            f"Ulysses degree {ulysses} does not divide the local query head count {num_heads}; lower ulysses_size"
            " (or the TP size), or use context_parallel_mode='ring'."
        )
    _kv_replication(num_kv_heads, ulysses)


class HybridAttention(nn.Module):
    """CoreAttention replacement: Ulysses inside ``ulysses_group``, ring across ``ring_group`` (either may be None).

    ``backend`` names the block kernel (see ``attention_kernels.get_attention_kernel``); ``kernel`` passes a
    configured one instead (e.g. ``TorchBlockKernel(q_block=256)``).

    CP rank = ring_rank * ulysses_size + ulysses_rank (Ulysses ranks are consecutive), and the local tokens follow
    :func:`shard_batch_for_cp` over the whole CP group. Holds no parameters.
    """

    def __init__(
        self,
        ring_group: dist.ProcessGroup | DeviceMesh | None,
        ulysses_group: dist.ProcessGroup | DeviceMesh | None,
        *,
        backend: str = "torch",
        softmax_scale: float | None = None,
        kernel: AttentionKernel | None = None,
    ) -> None:
        super().__init__()
        self.ring_group = _as_group(ring_group)
        self.ulysses_group = _as_group(ulysses_group)
        # Resolved here, at apply time, so a backend without LSE fails before training starts.
        self.kernel = kernel if kernel is not None else get_attention_kernel(backend)
        self.backend = self.kernel.name
        self.softmax_scale = softmax_scale
        self.ring_size = 1 if self.ring_group is None else dist.get_world_size(self.ring_group)
        self.ulysses_size = 1 if self.ulysses_group is None else dist.get_world_size(self.ulysses_group)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, segment_ids: Tensor | None = None
    ) -> Tensor:
        u = self.ulysses_size
        scale = self.softmax_scale
        if u == 1:
            return ring_attention(
                q, k, v, self.ring_group, causal=causal, segment_ids=segment_ids, kernel=self.kernel, scale=scale
            )
        _check_heads(q.shape[2], k.shape[2], u)
        rep = _kv_replication(k.shape[2], u)
        if rep > 1:  # each rank needs the KV head of its query heads: repeat before scattering (autograd sums back)
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (ulysses_all_to_all(t, self.ulysses_group, to_heads=True) for t in (q, k, v))
        order = self._gathered_order(q.shape[1] // u)
        q, k, v = q[:, order], k[:, order], v[:, order]
        if segment_ids is not None:
            parts = [torch.empty_like(segment_ids) for _ in range(u)]
            dist.all_gather(parts, segment_ids.contiguous(), group=self.ulysses_group)
            segment_ids = torch.cat(parts, dim=1)[:, order]
        out = ring_attention(
            q, k, v, self.ring_group, causal=causal, segment_ids=segment_ids, kernel=self.kernel, scale=scale
        )
        out = out[:, torch.argsort(order)]
        return ulysses_all_to_all(out, self.ulysses_group, to_heads=False)

    def _gathered_order(self, local_len: int) -> Tensor:
        """Permutation sorting the Ulysses-gathered tokens into this ring rank's load-balanced layout."""
        u, r = self.ulysses_size, self.ring_size
        ring_rank = 0 if self.ring_group is None else dist.get_rank(self.ring_group)
        cp = u * r
        pos = torch.cat([local_positions(local_len, cp, ring_rank * u + j) for j in range(u)])
        # Sorting by absolute position gives [super-chunk g, super-chunk 2r-1-g] of a 2r-chunk split: the ring layout.
        return torch.argsort(pos)

    def extra_repr(self) -> str:
        return f"ring={self.ring_size}, ulysses={self.ulysses_size}, backend={self.backend!r}"


class RingAttention(HybridAttention):
    """Load-balanced ring attention over ``cp_group`` (CoreAttention interface)."""

    def __init__(self, cp_group: dist.ProcessGroup | DeviceMesh | None, **kwargs: Any) -> None:
        super().__init__(cp_group, None, **kwargs)


class UlyssesAttention(HybridAttention):
    """DeepSpeed-Ulysses attention over ``cp_group`` (CoreAttention interface)."""

    def __init__(self, cp_group: dist.ProcessGroup | DeviceMesh | None, **kwargs: Any) -> None:
        super().__init__(None, cp_group, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# apply_cp
# ---------------------------------------------------------------------------------------------------------------------


def _cp_groups(cp_mesh: DeviceMesh, mode: CPMode, ulysses_size: int | None) -> tuple[Any, Any]:
    cp = cp_mesh.size()
    if mode == "ring":
        if ulysses_size not in (None, 1):
            raise ValueError(
                f"mode='ring' got ulysses_size={ulysses_size}; use mode='hybrid' to combine ring and Ulysses."
            )
        return cp_mesh, None
    if mode == "ulysses":
        if ulysses_size not in (None, cp):
            raise ValueError(f"mode='ulysses' uses the whole CP group; got ulysses_size={ulysses_size} != cp={cp}.")
        return None, cp_mesh
    if mode != "hybrid":
        raise ValueError(f"Unknown context-parallel mode {mode!r}; use 'ring', 'ulysses' or 'hybrid'.")
    if ulysses_size is None or ulysses_size < 1 or cp % ulysses_size:
        raise ValueError(f"mode='hybrid' needs ulysses_size dividing the CP size {cp}; got {ulysses_size}.")
    if ulysses_size in (1, cp):
        return (cp_mesh, None) if ulysses_size == 1 else (None, cp_mesh)
    # Split the CP axis (ring outer, Ulysses inner: consecutive ranks). DeviceMesh._unflatten creates the groups
    # collectively over the mesh's root, which every rank reaches here; it is torch's only way to split a sub-mesh.
    name = cp_mesh.mesh_dim_names[0] if cp_mesh.mesh_dim_names else "cp"
    split = cp_mesh._unflatten(0, (cp // ulysses_size, ulysses_size), (f"{name}_ring", f"{name}_ulysses"))
    return split[f"{name}_ring"], split[f"{name}_ulysses"]


def apply_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh,
    *,
    mode: CPMode = "ring",
    ulysses_size: int | None = None,
    backend: str | None = None,
    tp_size: int = 1,
) -> nn.Module:
    """Replace every ``core_attention`` of ``model`` with ring / Ulysses / hybrid attention over the 1-D ``cp_mesh``.

    Apply after TP (heads are then TP-local: pass ``tp_size`` so the head checks use local counts). ``backend``
    defaults to the replaced module's ``backend`` (or ``model.config.attn_backend``, else ``"torch"``). Batches
    must then be sharded with :func:`shard_batch_for_cp` over the same mesh. Returns the model (changed in place).
    """
    parents = attention_modules(model)  # not those with `context_parallel = False`
    if not parents:
        raise ValueError(
            f"{type(model).__name__} has no module with a 'core_attention' child; context parallelism needs attention"
            " modules with a pluggable core attention (see lightning_flagscale.models.attention)."
        )
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp needs a 1-D CP mesh, got {cp_mesh.ndim} dims ({cp_mesh.mesh_dim_names}).")
    if cp_mesh.size() == 1:
        return model
    ring_group, ulysses_group = _cp_groups(cp_mesh, mode, ulysses_size)
    u = 1 if ulysses_group is None else ulysses_group.size()
    config = model_config(model)
    if config is not None and u > 1:
        _check_heads(config.num_attention_heads // tp_size, config.num_key_value_heads // tp_size, u)
    for parent in parents:
        old = parent.core_attention
        kept = old if isinstance(old, CoreAttentionSettings) else None  # the replaced backend's name and scale
        name = (
            backend
            or (kept.backend if kept is not None else None)
            or (config.attn_backend if config is not None else None)
            or "torch"
        )
        scale = kept.softmax_scale if kept is not None else None
        parent.core_attention = HybridAttention(ring_group, ulysses_group, backend=name, softmax_scale=scale)
    return model
