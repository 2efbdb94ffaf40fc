"""Self-attention with a pluggable core-attention kernel.

``Attention`` owns the projections, QK-norm and RoPE; ``CoreAttention`` owns only ``softmax(q k^T) v`` so that
context parallelism can swap it for ring/Ulysses attention and GPU installs can pick flash-attn or
Transformer Engine. Core attention takes ``[B, S, H, D]`` tensors with grouped KV heads *not* expanded.

Packed documents are described by ``segment_ids`` [B, S]: a token attends only to earlier tokens of its own
segment. The torch backend turns them into a boolean mask; the GPU backends into ``cu_seqlens`` for their
variable-length kernels (which requires each segment to be contiguous, as packing produces).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models.layers import RMSNorm, apply_rotary, deinterleave, yarn_mscale

__all__ = [
    "Attention",
    "CoreAttention",
    "LatentAttention",
    "build_attention",
    "check_backend_available",
    "cu_seqlens_from_segments",
    "mla_softmax_scale",
]

Backend = Literal["torch", "flash_attn", "transformer_engine"]
_BACKEND_PACKAGES = {"flash_attn": "flash-attn", "transformer_engine": "transformer-engine[pytorch]"}


def check_backend_available(backend: str) -> None:
    """Raise a ``RuntimeError`` naming the fix when a GPU attention backend cannot run here."""
    if backend == "torch":
        return
    if backend not in _BACKEND_PACKAGES:
        raise ValueError(f"Unknown attn_backend {backend!r}; use 'torch', 'flash_attn' or 'transformer_engine'.")
    if importlib.util.find_spec(backend) is None:
        raise RuntimeError(
            f"attn_backend={backend!r} needs the {_BACKEND_PACKAGES[backend]!r} package, which is not installed; "
            "install it (pip install 'lightning-flagscale[gpu]') or set attn_backend='torch'."
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"attn_backend={backend!r} needs a CUDA device; none is available. Use attn_backend='torch'."
        )


def cu_seqlens_from_segments(segment_ids: Tensor) -> tuple[Tensor, int]:
    """Cumulative sequence lengths (int32, starting at 0) of the contiguous segments of ``segment_ids`` [B, S].

    Rows are concatenated in order and a new segment starts at every row start and wherever the id changes, which
    is the ``thd`` / varlen layout of flash-attn and Transformer Engine. Returns ``(cu_seqlens, max_seqlen)``.
    """
    b, s = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    idx = torch.nonzero(starts.flatten(), as_tuple=True)[0]
    total = torch.tensor([b * s], device=idx.device, dtype=idx.dtype)
    cu = torch.cat([idx, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max().item())


def _torch_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, segment_ids: Tensor | None, scale: float) -> Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants [B, H, S, D]
    gqa = q.shape[1] != k.shape[1]
    if segment_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    else:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        if causal:
            sq, sk = q.shape[2], k.shape[2]
            mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, segment_ids: Tensor | None, scale: float) -> Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    if segment_ids is None:  # flash-attn handles GQA natively (fewer KV heads than query heads)
        return flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal)
    b, s = q.shape[:2]
    cu, max_len = cu_seqlens_from_segments(segment_ids)
    out = flash_attn_varlen_func(
        q.reshape(b * s, *q.shape[2:]),
        k.reshape(b * s, *k.shape[2:]),
        v.reshape(b * s, *v.shape[2:]),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
    )
    return out.view(b, s, *out.shape[1:])


class CoreAttention(nn.Module):
    """``softmax(scale * q k^T + mask) v`` on [B, S, H, D] tensors, with a backend switch.

    Stateless (no parameters), so context parallelism may replace it with any module of the same interface.
    """

    def __init__(
        self, backend: Backend = "torch", head_dim: int | None = None, softmax_scale: float | None = None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim); read by context parallel when it swaps us out
        self._te: dict[tuple[int, int, int], nn.Module] = {}  # lazily built TE modules, keyed by local head shape

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, segment_ids: Tensor | None = None
    ) -> Tensor:
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        if self.backend == "torch":  # SDPA takes a value width different from the query/key width (MLA)
            return _torch_attention(q, k, v, causal, segment_ids, scale)
        check_backend_available(self.backend)
        if v.shape[-1] != q.shape[-1]:
            # flash-attn and TE's fused kernels want one head width for q, k and v: pad v with zero channels
            # (their outputs are zero) and drop them again, as Megatron-Core does for MLA.
            width = v.shape[-1]
            out = self(q, k, F.pad(v, (0, q.shape[-1] - width)), causal=causal, segment_ids=segment_ids)
            return out[..., :width].contiguous()
        if self.backend == "flash_attn":
            return _flash_attention(q, k, v, causal, segment_ids, scale)
        return self._te_attention(q, k, v, causal, segment_ids, scale)

    def _te_attention(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, segment_ids: Tensor | None, scale: float):
        # The TE module is built on first use from the *local* head counts, so it is correct after TP/Ulysses
        # re-partitioning of heads; it holds no parameters, so building it late does not affect checkpoints.
        b, s, hq, d = q.shape
        key = (hq, k.shape[2], d)
        if key not in self._te:
            import transformer_engine.pytorch as te

            self._te[key] = te.DotProductAttention(
                num_attention_heads=hq,
                kv_channels=d,
                num_gqa_groups=k.shape[2],
                attention_dropout=0.0,
                qkv_format="bshd",
                attn_mask_type="causal" if causal else "no_mask",
                softmax_scale=scale,
            )
        te_attn = self._te[key]
        if segment_ids is None:
            out = te_attn(q, k, v, qkv_format="bshd", attn_mask_type="causal" if causal else "no_mask")
            return out.view(b, s, hq, d)
        cu, max_len = cu_seqlens_from_segments(segment_ids)
        kwargs: dict[str, Any] = dict(
            qkv_format="thd",
            attn_mask_type="padding_causal" if causal else "padding",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )
        out = te_attn(q.reshape(b * s, hq, d), k.reshape(b * s, -1, d), v.reshape(b * s, -1, d), **kwargs)
        return out.view(b, s, hq, d)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with optional QKV bias (Qwen2) and QK-norm (Qwen3).

    Head counts are inferred from the projection outputs (``view(B, S, -1, head_dim)``), so the same code runs on
    the TP-local heads after column-parallel sharding of q/k/v.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core_attention = CoreAttention(config.attn_backend, d)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segment_ids: Tensor | None) -> Tensor:
        """``x`` [B, S, H] (full sequence; under SP the caller has all-gathered it), cos/sin [B, S, D]."""
        b, s = x.shape[:2]
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core_attention(q, k, v, causal=True, segment_ids=segment_ids)
        return self.o_proj(out.reshape(b, s, -1))


def mla_softmax_scale(config: TransformerConfig) -> float:
    """``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN
    (DeepSeek-V2/V3: the softmax temperature that goes with the YaRN-extended context)."""
    scale = config.head_dim**-0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA, DeepSeek-V2 https://arxiv.org/abs/2405.04434 section 2.1).

    Queries go through an optional low-rank bottleneck (``q_a_proj`` -> RMSNorm -> ``q_b_proj``); keys and values
    share one compressed latent (``kv_a_proj_with_mqa`` gives the latent and one rotary key head, RMSNorm, then
    ``kv_b_proj`` gives every head's non-rotary key and its value). RoPE acts only on the ``qk_rope_head_dim``
    channels (the rotary key is shared by all heads); values are ``v_head_dim`` wide. Core attention gets
    [B, S, H, nope + rope] queries and keys and [B, S, H, v] values, so any core-attention backend (and context
    parallelism, which swaps it) runs it. Module names are ``transformers``' ``DeepseekV3Attention`` ones.

    ``k_rope_fanout`` is an identity where the shared rotary key meets the heads: under tensor parallelism each rank
    holds some heads, so the key's gradient there is a partial sum over them, which the TP plan all-reduces there.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        h, n = config.hidden_size, config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.interleave = config.kv_lora_rank, config.rope_interleave
        self.head_dim = config.head_dim  # nope + rope
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * self.head_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, n * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, n * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(n * self.v_dim, h, bias=bias)
        self.k_rope_fanout = nn.Identity()
        self.core_attention = CoreAttention(config.attn_backend, self.head_dim, mla_softmax_scale(config))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segment_ids: Tensor | None) -> Tensor:
        """``x`` [B, S, H] (full sequence), cos/sin [B, S, qk_rope_head_dim]."""
        b, s = x.shape[:2]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(b, s, -1, self.head_dim).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.view(b, s, 1, self.rope)
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), self.k_rope_fanout(apply_rotary(k_rope, cos, sin))
        heads = q_nope.shape[2]
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, s, heads, self.rope)), dim=-1)
        out = self.core_attention(q, k, v, causal=True, segment_ids=segment_ids)
        return self.o_proj(out.reshape(b, s, -1))


def build_attention(config: TransformerConfig) -> nn.Module:
    """The attention of a decoder block: :class:`LatentAttention` when ``config.is_mla``, else :class:`Attention`."""
    return LatentAttention(config) if config.is_mla else Attention(config)
