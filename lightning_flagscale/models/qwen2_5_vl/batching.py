"""The batch-first image layout: the VLM's inputs cut along the batch (pipeline micro-batches) and the sequence (CP).

Hugging Face's layout is not batch-first: ``pixel_values`` [patches, C] holds the patches of *all* images of the
batch back to back, ``image_grid_thw`` [images, 3] their grids, and M-RoPE positions are [3, B, S]. Pipeline
parallelism splits every keyword tensor along dim 0 into micro-batches, and context parallelism shards per-token
tensors along dim 1 and runs the model on a permuted slice of each row, where an image-pad token can no longer tell
which image token it is by counting. The batch-first layout fixes both:

=======================  ===================  ==============================================================
key                      shape                meaning
=======================  ===================  ==============================================================
``pixel_values``         [B, P, C]            row ``b``'s patches: its real images, then its padding images
                                              (pre-allocation), zero-padded to the batch's largest ``P``
``image_grid_thw``       [B, I, 3]            row ``b``'s real image grids, in order; all-zero rows are absent
``padding_grid_thw``     [B, J, 3]            padding images (only on the last row), same convention
``image_token_index``    [B, S]               per row: which of the row's image tokens an image-pad token is
                                              (0, 1, ...), -1 for any other token
``mrope_position_ids``   [B, S, 3]            M-RoPE positions (temporal, height, width) of every token
=======================  ===================  ==============================================================

Images belong to rows in order of appearance: row ``b`` takes the next images until their ``t*h*w/m^2`` tokens
add up to its image-pad count (a mismatch raises ``ValueError``). :func:`to_batch_first` builds the layout from the
HF one; :func:`from_batch_first` turns a (micro-)batch of it back into the tower's flat inputs plus each row's
offset into the tower's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "FlatImages",
    "batch_segment_ids",
    "from_batch_first",
    "image_token_counts",
    "row_image_index",
    "to_batch_first",
]


def batch_segment_ids(batch: dict) -> Tensor | None:
    """The batch's ``segment_ids``, or its padding mask as segments (padding a segment of its own), or None."""
    segment_ids = batch.get("segment_ids")
    mask = batch.get("attention_mask")
    if segment_ids is None and mask is not None and not bool(mask.all()):
        segment_ids = mask.long()
    return segment_ids


def image_token_counts(grid: Tensor, merge: int) -> Tensor:
    """LLM tokens of each image of ``grid`` [n, 3]: ``t * (h / m) * (w / m)``."""
    return grid[:, 0] * (grid[:, 1] // merge) * (grid[:, 2] // merge)


def row_image_index(input_ids: Tensor, image_token_id: int) -> Tensor:
    """[B, S]: for each image-pad token its ordinal among the row's image-pad tokens, -1 elsewhere."""
    mask = input_ids == image_token_id
    return torch.where(mask, mask.long().cumsum(1) - 1, torch.full_like(input_ids, -1))


def _rows_of_images(pad_counts: list[int], tokens: list[int]) -> list[list[int]]:
    """Image indices of each row: consecutive images until the row's image-pad count is used up."""
    rows, k = [], 0
    for b, need in enumerate(pad_counts):
        mine = []
        while need > 0:
            if k == len(tokens) or tokens[k] > need:
                got = "no image left" if k == len(tokens) else f"the next image has {tokens[k]} tokens"
                raise ValueError(
                    f"batch row {b}: {need} image-pad tokens are not covered by whole images ({got}); each image "
                    "needs t * h * w / m^2 pad tokens in its row."
                )
            mine.append(k)
            need -= tokens[k]
            k += 1
        rows.append(mine)
    if k != len(tokens):
        raise ValueError(f"image_grid_thw has {len(tokens)} images but the rows' image-pad tokens cover only {k}.")
    return rows


def _stack_grids(grids: list[Tensor], like: Tensor) -> Tensor:
    width = max((len(g) for g in grids), default=0)
    out = like.new_zeros(len(grids), max(width, 1), 3)
    for b, g in enumerate(grids):
        out[b, : len(g)] = g
    return out


def to_batch_first(
    input_ids: Tensor,
    pixel_values: Tensor,
    image_grid_thw: Tensor,
    padding_grid_thw: Tensor | None,
    *,
    image_token_id: int,
    merge: int,
) -> dict[str, Tensor]:
    """``pixel_values``, ``image_grid_thw``, ``padding_grid_thw`` (if any) and ``image_token_index`` of the
    batch-first layout (module docstring) from the flat HF tensors."""
    batch = input_ids.shape[0]
    grid = image_grid_thw.reshape(-1, 3)
    pad_counts = (input_ids == image_token_id).sum(1).tolist()
    rows = _rows_of_images(pad_counts, image_token_counts(grid, merge).tolist())
    patches = grid.prod(-1).tolist()
    starts = [0]
    for n in patches:
        starts.append(starts[-1] + n)
    pieces = [[pixel_values[starts[i] : starts[i + 1]] for i in row] for row in rows]
    pad_grids = [grid.new_zeros(0, 3)] * batch
    if padding_grid_thw is not None and len(padding_grid_thw):
        # Pre-allocation's padding images follow the real ones; their tokens are dropped, so any row may carry them.
        pad_grids[-1] = padding_grid_thw.reshape(-1, 3).to(grid)
        pieces[-1].append(pixel_values[starts[-1] :])
    rows_pixels = [torch.cat(p) if p else pixel_values.new_zeros(0, pixel_values.shape[1]) for p in pieces]
    width = max(len(p) for p in rows_pixels)
    pixels = pixel_values.new_zeros(batch, max(width, 1), pixel_values.shape[1])
    for b, p in enumerate(rows_pixels):
        pixels[b, : len(p)] = p
    out = {
        "pixel_values": pixels,
        "image_grid_thw": _stack_grids([grid[row] for row in rows], grid),
        "image_token_index": row_image_index(input_ids, image_token_id),
    }
    if padding_grid_thw is not None and len(padding_grid_thw):
        out["padding_grid_thw"] = _stack_grids(pad_grids, grid)
    return out


@dataclass(frozen=True)
class FlatImages:
    """A batch-first (micro-)batch turned back into the vision tower's flat inputs."""

    pixel_values: Tensor
    """[patches, C]: every row's real images, then every row's padding images."""
    image_grid_thw: Tensor
    """[images, 3] of the real images, row by row."""
    padding_grid_thw: Tensor | None
    """[padding images, 3], or None."""
    row_offsets: Tensor
    """[B]: index of each row's first image token in the tower's output."""


def _present(grid: Tensor) -> Tensor:
    return grid[grid[:, 0] > 0]


def from_batch_first(
    pixel_values: Tensor, image_grid_thw: Tensor, padding_grid_thw: Tensor | None, *, merge: int
) -> FlatImages:
    """The tower's inputs for a batch-first (micro-)batch (see the module docstring)."""
    real, pad, real_px, pad_px, tokens = [], [], [], [], []
    for b in range(pixel_values.shape[0]):
        g = _present(image_grid_thw[b])
        pg = _present(padding_grid_thw[b]) if padding_grid_thw is not None else g.new_zeros(0, 3)
        n_real, n_pad = int(g.prod(-1).sum()), int(pg.prod(-1).sum())
        real.append(g)
        pad.append(pg)
        real_px.append(pixel_values[b, :n_real])
        pad_px.append(pixel_values[b, n_real : n_real + n_pad])
        tokens.append(int(image_token_counts(g, merge).sum()))
    offsets = torch.tensor([0, *tokens[:-1]], device=pixel_values.device).cumsum(0)
    padding = torch.cat(pad)
    return FlatImages(
        pixel_values=torch.cat(real_px + pad_px),
        image_grid_thw=torch.cat(real),
        padding_grid_thw=padding if len(padding) else None,
        row_offsets=offsets,
    )
