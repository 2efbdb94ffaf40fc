"""The Qwen2.5-VL vision tower: 3D-conv patch embedding, 2D RoPE, window attention, SwiGLU blocks, 2x2 merger.

Module and parameter names mirror ``transformers``' ``Qwen2_5_VisionTransformerPretrainedModel`` (``patch_embed.proj``,
``blocks.N.norm1``, ``blocks.N.attn.qkv``, ``blocks.N.mlp.gate_proj``, ``merger.ln_q``, ``merger.mlp.0``), so HF
checkpoints map one to one, and the numerics follow it (fp32 RoPE on q/k, RMSNorm eps 1e-6, exact GELU).

Images arrive flattened, as the HF processor emits them: ``pixel_values`` [N, C*T*P*P] with the patches of all
images concatenated, each image's patches in merge-block-major order (``(t, h/m, w/m, m, m)``), and
``grid_thw`` [n_images, 3] giving each image's (frames, patch rows, patch columns). Attention runs over all images
at once as one packed sequence with segment ids: each block attends within a window (or, for the blocks listed in
``fullatt_block_indexes``, within the whole frame), never across images. The segments are contiguous, so the GPU
backends of :class:`~lightning_flagscale.models.attention.CoreAttention` get varlen ``cu_seqlens`` for free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flagscale.models.attention import CoreAttention
from lightning_flagscale.models.layers import RMSNorm, rope_inv_freq, rotate_half
from lightning_flagscale.models.qwen2_5_vl.config import VisionConfig

__all__ = [
    "PatchEmbed",
    "PatchMerger",
    "VisionBlock",
    "VisionTower",
    "apply_vision_recompute",
    "check_vision_inputs",
    "vision_position_ids",
    "window_index",
]

_VISION_EPS = 1e-6  # fixed in Qwen2.5-VL (not a config field)


def check_vision_inputs(pixel_values: Tensor, grid_thw: Tensor, config: VisionConfig) -> None:
    """Raise ``ValueError`` naming the mismatch between ``pixel_values`` rows / width and ``grid_thw``."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be [num_images, 3] (t, h, w), got shape {tuple(grid_thw.shape)}.")
    m = config.spatial_merge_size
    for i, (t, h, w) in enumerate(grid_thw.tolist()):
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(
                f"image {i}: grid (t={t}, h={h}, w={w}) must have t >= 1 and h, w positive multiples of "
                f"spatial_merge_size={m} (images are resized to multiples of {m * config.patch_size} pixels)."
            )
    patches = int(grid_thw.prod(-1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape != (patches, config.patch_dim):
        raise ValueError(
            f"pixel_values has shape {tuple(pixel_values.shape)} but image_grid_thw describes {patches} patches of "
            f"{config.patch_dim} values (channels x temporal_patch_size x patch_size^2)."
        )


def vision_position_ids(grid_thw: Tensor, merge: int) -> Tensor:
    """(row, column) of every patch [N, 2], in the merge-block-major order of ``pixel_values``."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).unsqueeze(1).expand(h, w)
        cols = torch.arange(w).unsqueeze(0).expand(h, w)
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def window_index(grid_thw: Tensor, config: VisionConfig) -> tuple[Tensor, Tensor]:
    """Order of the merged tokens grouped window by window, and each patch's window id (in that order).

    Windows are ``window_size / patch_size / spatial_merge_size`` merged tokens on a side, tiled from the top left
    of each frame (the last row/column of windows may be partial), as ``transformers.vision_utils
    .get_vision_window_index``. Returns ``(index [N/u] long, window_ids [N] long)``.
    """
    m = config.spatial_merge_size
    side = config.window_size // m // config.patch_size
    order, sizes, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = (-gh) % side, (-gw) % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        windows = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
        for win in windows:
            win = win[win >= 0]
            if win.numel():
                order.append(win + offset)
                sizes.append(win.numel() * config.merge_unit)
        offset += t * gh * gw
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return torch.cat(order).to(grid_thw.device), ids.to(grid_thw.device)


def _frame_ids(grid_thw: Tensor) -> Tensor:
    """Segment id of every patch for full attention: one segment per frame of each image."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return torch.repeat_interleave(torch.arange(len(lengths), device=grid_thw.device), lengths)


class PatchEmbed(nn.Module):
    """Conv3d over (T x P x P) patches with stride = kernel, i.e. one matmul over the flattened patch rows."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        # Kept as a Conv3d so the weight has HF's shape [E, C, T, P, P]; run as a matmul since every patch is
        # already cut out (same math as HF's conv with kernel == stride).
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.proj.weight
        return F.linear(x.to(weight.dtype), weight.flatten(1))


class VisionAttention(nn.Module):
    """Bidirectional attention over the packed patches of all images, restricted to segments (windows/frames)."""

    context_parallel = False
    """Model protocol: context parallelism leaves this attention local (every CP rank runs the tower on all the
    batch's patches; only the LLM's sequence is sharded)."""

    def __init__(self, config: VisionConfig, backend: str) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.core_attention = CoreAttention(backend, config.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segment_ids: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        # RoPE in fp32 as HF's apply_rotary_pos_emb_vision, then back to the activation dtype.
        c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(v.dtype)
        out = self.core_attention(q[None], k[None], v[None], causal=False, segment_ids=segment_ids[None])
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with biases: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, config: VisionConfig, backend: str) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, _VISION_EPS)
        self.norm2 = RMSNorm(config.hidden_size, _VISION_EPS)
        self.attn = VisionAttention(config, backend)
        self.mlp = VisionMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segment_ids: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each ``m x m`` group of patches concatenated and projected to the LLM width by a GELU MLP."""

    def __init__(self, config: VisionConfig, out_hidden_size: int) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.merge_unit
        self.ln_q = RMSNorm(config.hidden_size, _VISION_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_hidden_size)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class VisionTower(nn.Module):
    """``pixel_values`` [N, patch_dim] + ``grid_thw`` [n, 3] -> merged image tokens [N / m^2, out_hidden_size]."""

    def __init__(self, config: VisionConfig, out_hidden_size: int, attn_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config, attn_backend) for _ in range(config.depth))
        self.merger = PatchMerger(config, out_hidden_size)

    def replicated_units(self) -> list[str]:
        """Leaf modules holding parameters (relative names): what TP replicates (``ReplicateParallel``)."""
        names = ["patch_embed", "merger.ln_q", "merger.mlp.0", "merger.mlp.2"]
        for i in range(len(self.blocks)):
            p = f"blocks.{i}."
            names += [p + n for n in ("norm1", "norm2", "attn.qkv", "attn.proj")]
            names += [p + f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
        return names

    def rotary(self, grid_thw: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """2D RoPE tables [N, head_dim]: the first half of each head rotates by row, the second by column."""
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.head_dim // 2, cfg.rope_theta, device=grid_thw.device)
        freqs = vision_position_ids(grid_thw, cfg.spatial_merge_size)[..., None].float() * inv_freq  # [N, 2, D/4]
        freqs = freqs.flatten(1)  # rows then columns, [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        cfg = self.config
        check_vision_inputs(pixel_values, grid_thw, cfg)
        unit = cfg.merge_unit
        order, window_ids = window_index(grid_thw, cfg)
        frame_ids = _frame_ids(grid_thw)  # frames stay contiguous under the window permutation

        def permute(t: Tensor) -> Tensor:  # reorder whole merge groups window by window
            return t.reshape(-1, unit, *t.shape[1:])[order].flatten(0, 1)

        x = permute(self.patch_embed(pixel_values))
        cos, sin = (permute(t) for t in self.rotary(grid_thw, torch.float32))
        full = set(cfg.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_ids if i in full else window_ids)
        return self.merger(x)[torch.argsort(order)]


def apply_vision_recompute(tower: VisionTower, mode: str, step: int = 1) -> VisionTower:
    """Full activation recompute of every ``step``-th vision block (``mode="full"``), independent of the LLM's.

    The vision tower's policy is separate from the decoder's (``FlagScaleStrategy(recompute=...)`` applies to the
    LLM blocks only): its activations scale with the number of patches, not with the text length. As in
    ``parallel/pipeline_parallel/recompute.py`` the block's ``forward`` is rebound on the instance, so parameter names
    (TP plans, checkpoints, HF export) do not change.
    """
    if mode not in ("none", "full"):
        raise ValueError(f"vision_recompute={mode!r} is unknown; use 'none' or 'full'.")
    if step < 1:
        raise ValueError(f"vision_recompute_step must be >= 1, got {step}.")
    if mode == "none":
        return tower
    for i, block in enumerate(tower.blocks):
        if i % step:
            continue
        if getattr(block, "_recompute_mode", None) is not None:
            raise ValueError("Vision recompute was already applied to this tower; apply it once.")
        block.forward = _recomputed(block.forward)
        block._recompute_mode = mode
    return tower


def _recomputed(forward):
    from torch.utils.checkpoint import checkpoint

    def run(*args: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False)

    return run
