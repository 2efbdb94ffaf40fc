"""Building blocks of the reference decoder: RMSNorm, rotary embeddings (default and Llama-3 scaling), SwiGLU MLP.

Numerics follow Hugging Face ``transformers`` exactly (fp32 norm statistics, ``rotate_half`` RoPE layout, cos/sin
computed in fp32 from the position ids) so that HF Llama/Qwen checkpoints load by name with no weight permutation
and give the same logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flagscale.config import TransformerConfig

__all__ = [
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "deinterleave",
    "rope_attention_factor",
    "rope_inv_freq",
    "rotate_half",
    "yarn_mscale",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in fp32, result cast back to the input dtype (as HF ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None, device: torch.device | None = None
) -> Tensor:
    """Inverse frequencies [head_dim // 2] of RoPE, optionally with Llama-3.1 frequency-dependent scaling.

    Same formula and op order as ``transformers.modeling_rope_utils._compute_llama3_parameters`` so that the
    values are bitwise identical: long wavelengths are divided by ``factor``, short ones kept, the band in between
    interpolated smoothly (https://github.com/meta-llama/llama-models, ``apply_scaling``).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None or scaling.get("rope_type", "llama3") == "default":
        return inv_freq
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, device)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], device: torch.device | None) -> Tensor:
    """YaRN (Peng et al. 2023, https://arxiv.org/abs/2309.00071): interpolate the long wavelengths by ``factor``,
    keep the short ones, blend linearly between the ``beta_fast`` / ``beta_slow`` rotation counts. Same op order as
    ``transformers.modeling_rope_utils._compute_yarn_parameters`` (DeepSeek-V3's RoPE)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    keep = 1 - ramp  # 1: the original frequency (short wavelengths), 0: the interpolated one
    return interpolation * (1 - keep) + extrapolation * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """Factor on cos/sin: YaRN's ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (or its explicit
    ``attention_factor``); 1 for every other RoPE (as ``transformers``' rotary embeddings)."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all))
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [B, S, head_dim] for given (global) position ids.

    The inverse frequencies are recomputed on every call instead of being stored in a buffer: they are
    ``head_dim / 2`` numbers, and without state the module survives meta-device construction, ``to_empty`` and
    checkpoint loading without a re-initialisation step.

    Multimodal RoPE (M-RoPE, Qwen2-VL/Qwen2.5-VL): with ``mrope_section`` (e.g. ``[16, 24, 24]``, summing to
    ``head_dim / 2``) the position ids may have three rows ``[3, B, S]`` (temporal, height, width); frequency band
    ``j`` then takes its angle from the row of the section it falls in, as ``transformers``'
    ``Qwen2_5_VLRotaryEmbedding``. Plain ``[B, S]`` ids are the text case (all three rows equal).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        mrope_section: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        if self.mrope_section is not None and sum(self.mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section={self.mrope_section} must sum to head_dim // 2 = {head_dim // 2} (one entry per "
                "temporal/height/width band)."
            )

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device=position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq
        if position_ids.dim() == 3:  # [3, B, S, D/2]: pick each band's row (M-RoPE)
            if self.mrope_section is None or position_ids.shape[0] != 3:
                raise ValueError(
                    f"position_ids of shape {tuple(position_ids.shape)} need mrope_section and 3 rows "
                    "(temporal, height, width); text models take [B, S]."
                )
            bands = freqs.split(self.mrope_section, dim=-1)
            freqs = torch.cat([band[i % 3] for i, band in enumerate(bands)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(self.scaling)
        if factor != 1.0:  # YaRN only: the other RoPEs keep the exact tables they had
            return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        extra = f", mrope_section={self.mrope_section}" if self.mrope_section else ""
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}{extra}"


def rotate_half(x: Tensor) -> Tensor:
    """HF/GPT-NeoX layout: the head is split in two halves (not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [B, S, H, D] by cos/sin [B, S, D] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def deinterleave(x: Tensor) -> Tensor:
    """Interleaved pairs ``(x0, x1), (x2, x3), ...`` -> halves ``(x0, x2, ...), (x1, x3, ...)`` on the last dim.

    DeepSeek checkpoints rotate adjacent channel pairs; after this permutation the rotate-half RoPE gives the same
    result (``transformers``' ``apply_rotary_pos_emb_interleave``). q and k are permuted alike, so scores are equal.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: TransformerConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inner = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
