"""First-batch memory pre-allocation: run a step at the configured maximum shape so the allocator reserves its peak once.

Vision-language batches vary in two dimensions (text length and image-token count), so the caching allocator keeps
meeting new, larger block sizes and fragments (on CUDA: more ``cudaMalloc`` calls and allocator retries). Running
the first step, and any later batch whose image-token count exceeds the running maximum, at the configured maximum
shape makes the largest blocks exist from the start; later, smaller batches reuse them.

The padding never changes the gradients: text is padded at the end of each row with ``labels = -100`` and its own
segment (real tokens attend only to earlier tokens of their own segment, so the padding is invisible to them, and
it carries no loss), and the extra image tokens come from a *padding image* (zeros) appended after the real images:
the vision tower attends within each image only, and the model drops the padding image's tokens before splicing
(``padding_grid_thw``), so they reach no loss either. The unit test checks the gradients against the unpadded step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_flagscale.models.qwen2_5_vl.config import VLMConfig

__all__ = ["PreallocState", "image_token_count", "pad_batch_to_max"]


def image_token_count(batch: dict[str, Tensor], merge: int) -> int:
    """LLM image tokens of a batch (``sum(t * h * w) / merge^2`` over ``image_grid_thw``)."""
    grid = batch.get("image_grid_thw")
    if grid is None or batch.get("pixel_values") is None:
        return 0
    return int((grid[:, 0] * (grid[:, 1] // merge) * (grid[:, 2] // merge)).sum())


def pad_batch_to_max(
    batch: dict[str, Tensor], config: VLMConfig, *, max_seq_len: int, max_image_tokens: int, pad_id: int = 0
) -> dict[str, Tensor]:
    """``batch`` padded to ``max_seq_len`` tokens per row and ``max_image_tokens`` image tokens (a padding image).

    Raises ``ValueError`` when the batch is already larger than the maximum (nothing is ever truncated).
    """
    ids = batch["input_ids"]
    rows, seq = ids.shape
    merge = config.vision.spatial_merge_size
    tokens = image_token_count(batch, merge)
    if seq > max_seq_len or tokens > max_image_tokens:
        raise ValueError(
            f"A batch of {seq} tokens per row and {tokens} image tokens exceeds the pre-allocation maximum "
            f"(max_seq_len={max_seq_len}, max_image_tokens={max_image_tokens}); raise those limits."
        )
    out = dict(batch)
    extra = max_seq_len - seq
    if extra:
        out["input_ids"] = torch.cat([ids, ids.new_full((rows, extra), pad_id)], dim=1)
        out["labels"] = torch.cat([batch["labels"], ids.new_full((rows, extra), -100)], dim=1)
        segments = batch.get("segment_ids")
        mask = batch.get("attention_mask")
        if segments is None:  # padding as a segment of its own (0), the real tokens keep theirs
            segments = mask.long() if mask is not None else torch.ones_like(ids)
        out["segment_ids"] = torch.cat([segments, segments.new_zeros(rows, extra)], dim=1)
        if mask is not None:
            out["attention_mask"] = torch.cat([mask, mask.new_zeros(rows, extra)], dim=1)
        if batch.get("position_ids") is not None:
            raise ValueError("Pre-allocation pads the sequence and cannot extend explicit position_ids; drop them.")
    deficit = max_image_tokens - tokens
    if deficit:
        # One strip image of 1 x deficit merged tokens (2 x 2*deficit patches): the same number of image tokens.
        vis = config.vision
        pixels = batch.get("pixel_values")
        if pixels is None:
            pixels = ids.new_zeros((0, vis.patch_dim), dtype=torch.float32)
            out["image_grid_thw"] = ids.new_zeros((0, 3))
        pad_pixels = pixels.new_zeros(merge * merge * deficit, vis.patch_dim)
        out["pixel_values"] = torch.cat([pixels, pad_pixels])
        out["padding_grid_thw"] = ids.new_tensor([[1, merge, merge * deficit]])
    return out


@dataclass(kw_only=True)
class PreallocState:
    """When to pad: the first step, then whenever a batch's image-token count exceeds the running maximum."""

    max_seq_len: int
    """Tokens per row of the padded steps."""
    max_image_tokens: int
    """Image tokens of the padded steps."""
    seen_image_tokens: int = -1
    """Running maximum of real image-token counts (-1 before the first step)."""
    padded_steps: int = 0
    """How many steps ran padded (for logging and tests)."""

    def maybe_pad(self, batch: dict[str, Tensor], config: VLMConfig, pad_id: int = 0) -> dict[str, Tensor]:
        if "mrope_position_ids" in batch:
            # Prepared for context parallelism (sequence-sharded, batch-first images): padding the local shard at its
            # end would break the load-balanced token order, and the images are no longer flat.
            raise ValueError(
                "preallocate=True does not compose with context parallelism; set preallocate=False or "
                "context_parallel_size=1."
            )
        tokens = image_token_count(batch, config.vision.spatial_merge_size)
        if tokens <= self.seen_image_tokens:
            return batch
        self.seen_image_tokens = tokens
        self.padded_steps += 1
        return pad_batch_to_max(
            batch, config, max_seq_len=self.max_seq_len, max_image_tokens=self.max_image_tokens, pad_id=pad_id
        )
