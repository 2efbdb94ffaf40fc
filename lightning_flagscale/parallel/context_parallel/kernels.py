"""Block attention kernels that return the log-sum-exp, the building block of ring / Ulysses context parallelism.

A kernel computes attention of one query block against one key/value block and returns ``(out, lse)``, where
``out`` is normalised within the block and ``lse`` [B, Hq, Sq] (fp32) is the log of the block's softmax
denominator. Blocks are merged exactly with :func:`merge_attention` (online softmax), and the backward of a block
is exact given the *final* ``out``/``lse`` of the whole row (FlashAttention-2's ``D = rowsum(dO * O)`` trick), so
ring attention never has to materialise more than one block of scores.

Masks are described by absolute token positions (``q_pos``/``k_pos``, 1-D, shared by the batch) and optional
segment ids (packed documents, [B, S]): query i may see key j iff ``k_pos[j] <= q_pos[i]`` (when causal) and
``q_seg[i] == k_seg[j]``. The pure-torch kernel builds exactly that mask, so it is the CPU path and the reference.
The flash-attn and Transformer Engine kernels only know "full" and "causal" (diagonal) blocks, which is all the
load-balanced ring schedule produces; any other position pattern raises. Both import their package lazily.

GQA: K/V carry ``Hkv`` heads, q carries ``Hq = G * Hkv``; nothing is expanded (neither here nor in communication),
and dK/dV come back with ``Hkv`` heads.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "AttentionKernel",
    "FlashAttnKernel",
    "TorchBlockKernel",
    "TransformerEngineKernel",
    "get_attention_kernel",
    "merge_attention",
]

# Attention implementations that only return the normalised output: CP cannot merge their blocks.
_NO_LSE_BACKENDS = {
    "sdpa": "torch's scaled_dot_product_attention does not return the log-sum-exp of its rows",
    "math": "the math SDPA path does not return the log-sum-exp of its rows",
    "eager": "eager attention does not return the log-sum-exp of its rows",
    "flex": "flex_attention's log-sum-exp is not wired into this CP implementation",
}


class AttentionKernel(Protocol):
    """Forward/backward of one (q-block, kv-block) pair; see the module docstring for the mask semantics."""

    name: str

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        causal: bool,
        q_pos: Tensor,
        k_pos: Tensor,
        q_seg: Tensor | None = None,
        k_seg: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32 (-inf: no visible key)."""
        ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        scale: float,
        causal: bool,
        q_pos: Tensor,
        k_pos: Tensor,
        q_seg: Tensor | None = None,
        k_seg: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of this block given the row-final ``out``/``lse``: (dq, dk, dv), fp32 or input dtype."""
        ...


def merge_attention(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial results of the same query rows (fp32); rows may be empty (-inf)."""
    new_lse = torch.logaddexp(lse, block_lse)
    # Rows with no visible key anywhere stay at lse=-inf and out=0; subtracting 0 instead of -inf avoids NaN.
    ref = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out.float() * w_new, new_lse


# ---------------------------------------------------------------------------------------------------------------------
# Pure torch: the CPU path and the reference
# ---------------------------------------------------------------------------------------------------------------------


def _visible(
    q_pos: Tensor, k_pos: Tensor, causal: bool, q_seg: Tensor | None, k_seg: Tensor | None, device: torch.device
) -> Tensor | None:
    """Boolean [B or 1, Sq, Sk] mask of visible keys, or None when everything is visible."""
    mask = None
    if causal:
        mask = (k_pos.to(device)[None, :] <= q_pos.to(device)[:, None]).unsqueeze(0)
    if q_seg is not None:
        same = q_seg[:, :, None] == k_seg[:, None, :]
        mask = same if mask is None else mask & same
    return mask


class TorchBlockKernel:
    """Exact fp32 attention of one block with any mask, on any device.

    Query rows are processed ``q_block`` at a time, so at most ``q_block x Sk`` scores per head are alive: memory
    stays linear in the sequence for a fixed tile, as in FlashAttention, at the price of a Python loop over tiles.
    """

    name = "torch"

    def __init__(self, q_block: int = 512) -> None:
        if q_block < 1:
            raise ValueError(f"q_block must be >= 1, got {q_block}.")
        self.q_block = q_block

    def _probs(self, qf: Tensor, kf: Tensor, scale: float, mask: Tensor | None, lse: Tensor | None):
        s = torch.einsum("bhgqd,bhkd->bhgqk", qf, kf) * scale
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None], float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return torch.exp(s - ref.unsqueeze(-1)), lse

    def _tiles(self, sq: int) -> list[slice]:
        return [slice(i, min(i + self.q_block, sq)) for i in range(0, sq, self.q_block)]

    def forward(self, q, k, v, *, scale, causal, q_pos, k_pos, q_seg=None, k_seg=None):
        b, sq, hq, d = q.shape
        hkv = k.shape[2]
        kf, vf = k.float().transpose(1, 2), v.float().transpose(1, 2)
        outs, lses = [], []
        for t in self._tiles(sq):
            qf = q[:, t].float().reshape(b, -1, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)
            mask = _visible(q_pos[t], k_pos, causal, None if q_seg is None else q_seg[:, t], k_seg, q.device)
            p, lse = self._probs(qf, kf, scale, mask, None)
            # The value width may differ from the query/key width (MLA): the output takes the value's.
            outs.append(torch.einsum("bhgqk,bhkd->bhgqd", p, vf).permute(0, 3, 1, 2, 4).reshape(b, -1, hq, v.shape[-1]))
            lses.append(lse.reshape(b, hq, -1))
        return torch.cat(outs, dim=1), torch.cat(lses, dim=2)

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, q_pos, k_pos, q_seg=None, k_seg=None):
        b, sq, hq, d = q.shape
        hkv, g = k.shape[2], hq // k.shape[2]
        kf, vf = k.float().transpose(1, 2), v.float().transpose(1, 2)
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        dqs = []
        for t in self._tiles(sq):
            qf, dof, of = (
                x[:, t].float().reshape(b, -1, hkv, g, x.shape[-1]).permute(0, 2, 3, 1, 4) for x in (q, dout, out)
            )
            mask = _visible(q_pos[t], k_pos, causal, None if q_seg is None else q_seg[:, t], k_seg, q.device)
            # Probabilities against the row-FINAL lse: the block's share of the full softmax, hence exact gradients.
            p, _ = self._probs(qf, kf, scale, mask, lse[:, :, t].reshape(b, hkv, g, -1))
            delta = (dof * of).sum(-1, keepdim=True)
            dv += torch.einsum("bhgqk,bhgqd->bhkd", p, dof)
            ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", dof, vf) - delta)
            dqs.append((torch.einsum("bhgqk,bhkd->bhgqd", ds, kf) * scale).permute(0, 3, 1, 2, 4).reshape(b, -1, hq, d))
            dk += torch.einsum("bhgqk,bhgqd->bhkd", ds, qf) * scale
        return torch.cat(dqs, dim=1), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# GPU kernels: flash-attn 2 and Transformer Engine (imported lazily)
# ---------------------------------------------------------------------------------------------------------------------


def _block_kind(q_pos: Tensor, k_pos: Tensor, causal: bool) -> bool:
    """Whether a (q, kv) block is the causal diagonal (True) or fully visible (False); raise otherwise.

    Positions live on the CPU (built from the CP layout), so this costs no device sync.
    """
    if not causal or int(k_pos.max()) <= int(q_pos.min()):
        return False
    if torch.equal(q_pos.cpu(), k_pos.cpu()):
        return True
    raise ValueError(
        "This attention backend only handles fully visible or diagonal causal blocks; the ring schedule produced"
        " another pattern. Use attn_backend='torch' for arbitrary position masks."
    )


def _common_segments(q_seg: Tensor, k_seg: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int, int]:
    """Varlen metadata for documents present on both sides of a block.

    Returns (q_index, k_index, cu_q, cu_k, max_q, max_k): flat token indices (into [B*S]) of the query/key tokens
    whose (row, segment) occurs on both sides, and int32 cumulative lengths per common document. Tokens of
    documents absent on the other side see nothing (lse=-inf), which the caller fills in. Segments must be
    contiguous within a row (as packing produces).
    """
    b = q_seg.shape[0]
    row_q = torch.arange(b, device=q_seg.device)[:, None].expand_as(q_seg)
    row_k = torch.arange(b, device=k_seg.device)[:, None].expand_as(k_seg)
    span = int(torch.maximum(q_seg.max(), k_seg.max())) + 1
    key_q = (row_q * span + q_seg).flatten()
    key_k = (row_k * span + k_seg).flatten()
    uq = torch.unique(key_q)
    common = uq[torch.isin(uq, torch.unique(key_k))]
    q_index = torch.nonzero(torch.isin(key_q, common), as_tuple=True)[0]
    k_index = torch.nonzero(torch.isin(key_k, common), as_tuple=True)[0]
    _, cnt_q = torch.unique_consecutive(key_q[q_index], return_counts=True)
    _, cnt_k = torch.unique_consecutive(key_k[k_index], return_counts=True)
    zero = torch.zeros(1, dtype=torch.int32, device=q_seg.device)
    cu_q = torch.cat([zero, cnt_q.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, cnt_k.cumsum(0).to(torch.int32)])
    return (
        q_index,
        k_index,
        cu_q,
        cu_k,
        int(cnt_q.max()) if cnt_q.numel() else 0,
        int(cnt_k.max()) if cnt_k.numel() else 0,
    )


def _scatter_rows(x: Tensor, index: Tensor, total: int, fill: float) -> Tensor:
    """Place rows ``x`` [n, ...] at ``index`` of a new [total, ...] tensor filled with ``fill``."""
    full = x.new_full((total, *x.shape[1:]), fill)
    full[index] = x
    return full


class FlashAttnKernel:
    """flash-attn >= 2.6.3: ``_flash_attn_forward``/``_flash_attn_backward`` and their varlen variants (LSE-returning)."""

    name = "flash_attn"

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_interface
        except ImportError as err:
            raise RuntimeError(
                "attn_backend='flash_attn' needs the 'flash-attn' package (pip install 'lightning-flagscale[gpu]');"
                " use attn_backend='torch' on machines without it."
            ) from err
        self._fa = flash_attn_interface

    def forward(self, q, k, v, *, scale, causal, q_pos, k_pos, q_seg=None, k_seg=None):
        diag = _block_kind(q_pos, k_pos, causal)
        common = dict(dropout_p=0.0, softmax_scale=scale, causal=diag, window_size_left=-1, window_size_right=-1)
        common.update(softcap=0.0, alibi_slopes=None, return_softmax=False)
        if q_seg is None:
            out, lse, _, _ = self._fa._flash_attn_forward(q, k, v, **common)
            return out, lse  # lse [B, Hq, Sq]
        b, sq, hq, d = q.shape
        qi, ki, cu_q, cu_k, mq, mk = _common_segments(q_seg, k_seg)
        qf, kf, vf = (
            q.reshape(-1, hq, d)[qi],
            k.reshape(b * k.shape[1], -1, d)[ki],
            v.reshape(b * k.shape[1], -1, d)[ki],
        )
        out, lse, _, _ = self._fa._flash_attn_varlen_forward(qf, kf, vf, cu_q, cu_k, mq, mk, **common)
        out = _scatter_rows(out, qi, b * sq, 0.0).view(b, sq, hq, d)
        lse = _scatter_rows(lse.t(), qi, b * sq, float("-inf")).view(b, sq, hq).transpose(1, 2)  # lse [Hq, total_q]
        return out, lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, q_pos, k_pos, q_seg=None, k_seg=None):
        diag = _block_kind(q_pos, k_pos, causal)
        common = dict(dropout_p=0.0, softmax_scale=scale, causal=diag, window_size_left=-1, window_size_right=-1)
        common.update(softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None)
        if q_seg is None:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            self._fa._flash_attn_backward(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, **common)
            return dq, dk, dv
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        qi, ki, cu_q, cu_k, mq, mk = _common_segments(q_seg, k_seg)
        qf, dof, of = (t.reshape(-1, hq, d)[qi] for t in (q, dout, out))
        kf, vf = k.reshape(-1, hkv, d)[ki], v.reshape(-1, hkv, d)[ki]
        lse_f = lse.transpose(1, 2).reshape(-1, hq)[qi].t().contiguous()
        dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        self._fa._flash_attn_varlen_backward(dof, qf, kf, vf, of, lse_f, dq, dk, dv, cu_q, cu_k, mq, mk, **common)
        return (
            _scatter_rows(dq, qi, b * sq, 0.0).view(b, sq, hq, d),
            _scatter_rows(dk, ki, b * sk, 0.0).view(b, sk, hkv, d),
            _scatter_rows(dv, ki, b * sk, 0.0).view(b, sk, hkv, d),
        )


class TransformerEngineKernel:
    """Transformer Engine 2.x ``fused_attn_fwd``/``fused_attn_bwd`` (cuDNN F16_arbitrary_seqlen: returns softmax stats)."""

    name = "transformer_engine"

    def __init__(self) -> None:
        try:
            from transformer_engine.pytorch.constants import TE_DType
            from transformer_engine.pytorch.cpp_extensions import fused_attn
        except ImportError as err:
            raise RuntimeError(
                "attn_backend='transformer_engine' needs 'transformer-engine[pytorch]' (pip install"
                " 'lightning-flagscale[gpu]'); use attn_backend='torch' on machines without it."
            ) from err
        self._fused = fused_attn
        self._te_dtype = TE_DType

    def _cu(self, b: int, s: int, device: torch.device) -> Tensor:
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)

    def _args(self, q, k, q_seg, k_seg):
        b, sq = q.shape[:2]
        if q_seg is None:
            cu_q, cu_k = self._cu(b, sq, q.device), self._cu(b, k.shape[1], q.device)
            return None, None, cu_q, cu_k, sq, k.shape[1], "bshd_bshd_bshd"
        qi, ki, cu_q, cu_k, mq, mk = _common_segments(q_seg, k_seg)
        return qi, ki, cu_q, cu_k, mq, mk, "thd_thd_thd"

    def forward(self, q, k, v, *, scale, causal, q_pos, k_pos, q_seg=None, k_seg=None):
        diag = _block_kind(q_pos, k_pos, causal)
        b, sq, hq, d = q.shape
        qi, ki, cu_q, cu_k, mq, mk, layout = self._args(q, k, q_seg, k_seg)
        mask = ("padding_causal" if diag else "padding") if qi is not None else ("causal" if diag else "no_mask")
        if qi is not None:
            q, k, v = q.reshape(-1, hq, d)[qi], k.reshape(-1, k.shape[2], d)[ki], v.reshape(-1, v.shape[2], d)[ki]
        backend = self._fused.FusedAttnBackend["F16_arbitrary_seqlen"]
        out, aux = self._fused.fused_attn_fwd(
            True, mq, mk, cu_q, cu_k, q, k, v, q.dtype, backend,
            attn_scale=scale, dropout=0.0, qkv_layout=layout, attn_mask_type=mask,
        )  # fmt: skip
        stats = aux[0]  # softmaxStats: [B, Hq, Sq, 1] (bshd) or [T, Hq, 1] (thd)
        if qi is None:
            return out.view(b, sq, hq, d), stats.squeeze(-1).float()
        out = _scatter_rows(out, qi, b * sq, 0.0).view(b, sq, hq, d)
        lse = _scatter_rows(stats.reshape(-1, hq).float(), qi, b * sq, float("-inf"))
        return out, lse.view(b, sq, hq).transpose(1, 2).contiguous()

    def backward(self, dout, q, k, v, out, lse, *, scale, causal, q_pos, k_pos, q_seg=None, k_seg=None):
        diag = _block_kind(q_pos, k_pos, causal)
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        qi, ki, cu_q, cu_k, mq, mk, layout = self._args(q, k, q_seg, k_seg)
        mask = ("padding_causal" if diag else "padding") if qi is not None else ("causal" if diag else "no_mask")
        if qi is None:
            stats = lse.unsqueeze(-1)
        else:
            stats = lse.transpose(1, 2).reshape(-1, hq)[qi].unsqueeze(-1)
            q, dout, out = (t.reshape(-1, hq, d)[qi] for t in (q, dout, out))
            k, v = k.reshape(-1, hkv, d)[ki], v.reshape(-1, hkv, d)[ki]
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # dropout is 0: the state is unused
        backend = self._fused.FusedAttnBackend["F16_arbitrary_seqlen"]
        dq, dk, dv, *_ = self._fused.fused_attn_bwd(
            mq, mk, cu_q, cu_k, q, k, v, out, dout, q.dtype, self._te_dtype[q.dtype],
            [stats.contiguous(), rng_state], backend,
            attn_scale=scale, dropout=0.0, qkv_layout=layout, attn_mask_type=mask,
        )  # fmt: skip
        if qi is None:
            return dq, dk, dv
        return (
            _scatter_rows(dq, qi, b * sq, 0.0).view(b, sq, hq, d),
            _scatter_rows(dk, ki, b * sk, 0.0).view(b, sk, hkv, d),
            _scatter_rows(dv, ki, b * sk, 0.0).view(b, sk, hkv, d),
        )


def get_attention_kernel(backend: str) -> AttentionKernel:
    """The LSE-returning block kernel for an ``attn_backend`` name; raises when it cannot serve context parallelism."""
    if backend == "torch":
        return TorchBlockKernel()
    if backend == "flash_attn":
        return FlashAttnKernel()
    if backend == "transformer_engine":
        return TransformerEngineKernel()
    if backend in _NO_LSE_BACKENDS:
        raise ValueError(
            f"Context parallelism needs an attention backend that returns the log-sum-exp of each row to merge"
            f" blocks, but {_NO_LSE_BACKENDS[backend]} (backend {backend!r}). Use attn_backend='torch' (any device),"
            " 'flash_attn' or 'transformer_engine'."
        )
    raise ValueError(f"Unknown attention backend {backend!r}; use 'torch', 'flash_attn' or 'transformer_engine'.")
