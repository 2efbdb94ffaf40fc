"""Qwen2.5-VL-class vision-language model: the vision tower feeding our decoder, with multimodal RoPE.

:class:`VisionLanguageModel` *is* a :class:`~lightning_flagscale.models.decoder.CausalLM` (same embedding, blocks,
norm, head, loss, logits, init and TP plan) with a ``visual`` tower added. Its forward embeds the tokens, runs the
tower over all images of the batch, writes the merged image tokens into the embeddings at the ``<|image_pad|>``
positions (in order: row by row, left to right), builds the 3-row M-RoPE positions (:func:`mrope_position_ids`,
the ``get_rope_index`` of ``transformers``) and continues as the text model.

Parallel layout (the model protocol): the language model takes the decoder's TP plan; the vision tower is
*replicated* across TP ranks (each parameter a ``Replicate()`` DTensor, so clipping, ZeRO and checkpoints see one
mesh). Why replicated: the tower is small next to the LLM (0.67B of 7.6B in Qwen2.5-VL-7B, much less of the 72B),
runs on the short patch sequence, and replicating it costs no communication and keeps its gradients exact on
every rank (every TP rank computes the same tower on the same images; the spliced embeddings receive the full
gradient because the decoder's column-parallel inputs all-reduce theirs). Sharding it would save memory only.
Under sequence parallelism the embedding stays replicated until the images are spliced in, then the sequence is
scattered (backward: all-gather), because an image's tokens may straddle two ranks' shards.

Videos are not supported yet (``pixel_values_videos`` would need the temporal position spacing of
``second_per_grid_ts``); image inputs with any number of images of any size per sample are.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from lightning_flagscale.models.decoder import CausalLM
from lightning_flagscale.models.layers import RotaryEmbedding
from lightning_flagscale.models.qwen2_5_vl.batching import (
    batch_segment_ids,
    from_batch_first,
    image_token_counts,
    row_image_index,
    to_batch_first,
)
from lightning_flagscale.models.qwen2_5_vl.config import VLMConfig
from lightning_flagscale.models.qwen2_5_vl.vision import VisionTower
from lightning_flagscale.parallel.tensor_parallel.apply import ReplicateParallel, WaitedRowwiseParallel

__all__ = ["VisionLanguageModel", "mrope_position_ids"]


def _image_tokens(grid: list[int], merge: int) -> int:
    t, h, w = grid
    return t * (h // merge) * (w // merge)


def _doc_positions(tokens: list[int], image_token_id: int, grids, merge: int, where: str) -> Tensor:
    """[3, len(tokens)] M-RoPE positions of one document; consumes its images' grids from the iterator ``grids``."""
    pieces, pos, offset = [], 0, 0
    for is_image, run in itertools.groupby(tokens, key=lambda t: t == image_token_id):
        length = len(list(run))
        if not is_image:
            pieces.append(torch.arange(pos, pos + length).expand(3, -1))
            pos += length
            offset += length
            continue
        while length > 0:  # a run may hold several images back to back
            grid = next(grids, None)
            if grid is None:
                raise ValueError(f"{where}: image-pad tokens at offset {offset} have no image left in image_grid_thw.")
            n = _image_tokens(grid, merge)
            if n > length:
                raise ValueError(
                    f"{where}: {length} image-pad tokens at offset {offset}, but the next image (grid_thw={grid}) "
                    f"needs {n}; the image-pad count must equal t * h * w / {merge * merge} per image."
                )
            t, h, w = grid[0], grid[1] // merge, grid[2] // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w)  # as transformers' get_rope_index for images (no temporal spacing)
            length -= n
            offset += n
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)


def mrope_position_ids(
    input_ids: Tensor,
    image_grid_thw: Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
    segment_ids: Tensor | None = None,
) -> Tensor:
    """Multimodal RoPE positions [3, B, S] (temporal, height, width), ``get_rope_index`` of ``transformers``.

    Text tokens advance all three rows together; an image's ``t x h' x w'`` tokens (``h' = h / m``) take
    ``start + (t_i, h_i, w_i)`` and the text after it continues at ``start + max(h', w')``. Images are taken from
    ``image_grid_thw`` in order of appearance, row by row. Each segment of ``segment_ids`` (a packed document, or
    padding) restarts at 0, so a packed document gets exactly the positions it would have alone. Raises
    ``ValueError`` when the image-pad tokens do not match the grids.
    """
    batch, seq = input_ids.shape
    grids = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    out = torch.zeros(3, batch, seq, dtype=torch.long)
    ids = input_ids.tolist()
    segs = segment_ids.tolist() if segment_ids is not None else [[0] * seq for _ in range(batch)]
    for b in range(batch):
        col = 0
        for _, run in itertools.groupby(zip(ids[b], segs[b]), key=lambda pair: pair[1]):
            doc = [tok for tok, _ in run]
            pos = _doc_positions(doc, image_token_id, grids, spatial_merge_size, f"batch row {b}, column {col}")
            out[:, b, col : col + len(doc)] = pos
            col += len(doc)
    if next(grids, None) is not None:
        raise ValueError(
            f"image_grid_thw has {len(image_grid_thw)} images but the input_ids hold image-pad tokens for fewer; "
            "every image needs its t * h * w / m^2 pad tokens."
        )
    return out.to(input_ids.device)


def _rows_first(position_ids: Tensor) -> Tensor:
    """[3, B, S] M-RoPE (or [B, S] text) positions -> [B, S, 3], batch-first and sequence-second."""
    if position_ids.dim() == 2:
        return position_ids.unsqueeze(-1).expand(-1, -1, 3)
    return position_ids.permute(1, 2, 0)


def _scatter_sequence(h: Tensor, tp_mesh) -> Tensor:
    """This rank's sequence shard of the replicated ``h`` [B, S, H]; backward all-gathers the shard gradients."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    full = DTensor.from_local(h, tp_mesh, [Replicate()], run_check=False)
    return full.redistribute(tp_mesh, [Shard(1)]).to_local()


class VisionLanguageModel(CausalLM):
    """Qwen2.5-VL: ``visual`` tower + decoder LM with M-RoPE. See the module docstring."""

    def __init__(self, config: VLMConfig, vocab_multiple: int = 1, image_token_share: float = 0.5) -> None:
        if not isinstance(config, VLMConfig):
            raise TypeError(f"VisionLanguageModel needs a VLMConfig, got {type(config).__name__}.")
        super().__init__(config, vocab_multiple)
        self.config: VLMConfig = config
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, mrope_section=config.mrope_section
        )
        self.visual: VisionTower | None = VisionTower(config.vision, config.hidden_size, config.attn_backend)
        if not 0.0 <= image_token_share <= 1.0:
            raise ValueError(f"image_token_share must be in [0, 1], got {image_token_share}.")
        self.image_token_share = image_token_share
        """Expected fraction of image tokens in a row: weighs the tower in cost-balanced pipeline splits."""

    # ---- model protocol --------------------------------------------------------------------------------------
    def pipeline_units(self) -> list[str]:
        """The tower runs first, on the first stage, with the embedding (its weights count in cost balancing)."""
        return ["visual", *super().pipeline_units()]

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """The decoder's plan, with a replicated embedding output (images are spliced before any sequence scatter)
        and every parameter-holding leaf of the tower replicated."""
        from torch.distributed.tensor import Replicate

        plan = super().tp_plan(sequence_parallel)
        if self.embed_tokens is not None:
            plan["embed_tokens"] = WaitedRowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if self.visual is not None:
            plan.update({f"visual.{name}": ReplicateParallel() for name in self.visual.replicated_units()})
        return plan

    def pipeline_inputs(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        segment_ids: Tensor | None = None,
        **images: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor | None]]:
        """Stage inputs under pipeline parallelism, every keyword batch-first (torch splits them along dim 0).

        M-RoPE positions become explicit ``mrope_position_ids`` [B, S, 3] (later stages have no token ids to derive
        them from) and the images take the batch-first layout of :mod:`~lightning_flagscale.models.qwen2_5_vl.batching`,
        so each micro-batch carries exactly its rows' images.
        """
        return x, self._batch_first(x, position_ids, segment_ids, **images)

    def prepare_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The full (unsharded) batch with the per-token keys of :attr:`cp_sequence_keys` added (model protocol).

        Context parallelism then shards ``mrope_position_ids`` and ``image_token_index`` along the sequence with the
        token ids: each rank's image-pad tokens still know which image token they are, and the positions are those
        of the whole sequence. Every CP rank runs the tower on all of the batch's images (it is replicated, as under
        TP) and splices the tokens it holds; the data x context gradient reduction sums the parts.
        """
        if "mrope_position_ids" in batch:
            return batch  # already prepared
        extra = self._batch_first(
            batch["input_ids"], batch.get("position_ids"), batch_segment_ids(batch),
            pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
            padding_grid_thw=batch.get("padding_grid_thw"),
        )  # fmt: skip
        if extra["segment_ids"] is None:  # no padding anywhere in the batch
            del extra["segment_ids"]
        # Padding segments from the whole batch: a CP shard without padding must still pass segment ids, as its peers.
        return {**batch, **extra}

    cp_sequence_keys: tuple[str, ...] = ("mrope_position_ids", "image_token_index")
    """Per-token keys added by :meth:`prepare_batch`, sharded along dim 1 by context parallelism."""

    def pipeline_unit_costs(self) -> dict[str, float]:
        """Per-text-token FLOP proxy of each pipeline unit, for ``pipeline_balance="cost"``.

        A decoder unit costs its parameter count (2 x params FLOPs per token). The tower runs once per patch, and
        there are ``merge_unit`` patches per image token: its blocks cost ``params x merge_unit x share`` and its
        merger ``params x share``, where ``share = image_token_share`` is the expected fraction of image tokens in a
        row. This is what makes the first stage take fewer LLM blocks (FlagScale's
        ``decoder_first_pipeline_num_layers``, derived instead of set by hand).
        """
        costs = {}
        for unit in self.pipeline_units():
            params = self.get_submodule(unit).named_parameters(remove_duplicate=False)
            costs[unit] = float(sum(p.numel() for _, p in params))
        if self.visual is not None:
            share = self.image_token_share
            merger = float(sum(p.numel() for p in self.visual.merger.parameters()))
            costs["visual"] = (costs["visual"] - merger) * self.config.vision.merge_unit * share + merger * share
        return costs

    def _batch_first(
        self,
        x: Tensor,
        position_ids: Tensor | None,
        segment_ids: Tensor | None,
        *,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        padding_grid_thw: Tensor | None = None,
        mrope_position_ids: Tensor | None = None,
        image_token_index: Tensor | None = None,
    ) -> dict[str, Tensor | None]:
        out: dict[str, Tensor | None] = {"segment_ids": segment_ids}
        has_images = pixel_values is not None and pixel_values.shape[0] > 0
        if mrope_position_ids is None:
            if position_ids is None:
                position_ids = self.position_ids(x, image_grid_thw if has_images else None, segment_ids)
            mrope_position_ids = _rows_first(position_ids)
        out["mrope_position_ids"] = mrope_position_ids.contiguous()
        if has_images and pixel_values.dim() == 2:
            cfg = self.config
            merge = cfg.vision.spatial_merge_size
            images = to_batch_first(
                x, pixel_values, image_grid_thw, padding_grid_thw, image_token_id=cfg.image_token_id, merge=merge
            )
            out.update(images)
        elif has_images:  # already batch-first
            out.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw, padding_grid_thw=padding_grid_thw)
            out["image_token_index"] = image_token_index
        return out

    # ---- compute ----------------------------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        segment_ids: Tensor | None = None,
        *,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        padding_grid_thw: Tensor | None = None,
        mrope_position_ids: Tensor | None = None,
        image_token_index: Tensor | None = None,
    ) -> Tensor:
        """Token ids [B, S] (+ images) -> head output; a later pipeline stage (no embedding) runs the decoder part.

        Images come in the HF layout (``pixel_values`` [patches, C], ``image_grid_thw`` [images, 3]) or in the
        batch-first one of :mod:`~lightning_flagscale.models.qwen2_5_vl.batching` (3-D ``pixel_values``, with
        ``image_token_index`` for a sequence shard). ``position_ids``: [3, B, S] M-RoPE positions (default:
        :func:`mrope_position_ids`; [B, S] text positions are broadcast); ``mrope_position_ids`` [B, S, 3], when
        given, take precedence. ``padding_grid_thw``: grids of padding images appended after the real ones (memory
        pre-allocation); the tower runs on them and their tokens are dropped before splicing.
        """
        if mrope_position_ids is not None:
            position_ids = mrope_position_ids.permute(2, 0, 1)
        if self.embed_tokens is None:
            return super().forward(x, position_ids, segment_ids)
        h = self.embed_tokens(x)
        index = image_token_index
        if pixel_values is not None and pixel_values.dim() == 3:
            flat = from_batch_first(
                pixel_values, image_grid_thw, padding_grid_thw, merge=self.config.vision.spatial_merge_size
            )
            if index is None:
                index = row_image_index(x, self.config.image_token_id)
            index = torch.where(index >= 0, index + flat.row_offsets[:, None].to(index), index)
            pixel_values, image_grid_thw, padding_grid_thw = (
                flat.pixel_values,
                flat.image_grid_thw,
                flat.padding_grid_thw,
            )
        if pixel_values is not None and pixel_values.shape[0] == 0:
            pixel_values = None  # a collated batch (or micro-batch) without images
        if pixel_values is not None:
            h = self._splice_images(h, x, pixel_values, image_grid_thw, padding_grid_thw, index)
        elif self._vision_needs_grads():
            h = self._touch_vision(h)
        if position_ids is None:
            position_ids = self.position_ids(x, image_grid_thw if pixel_values is not None else None, segment_ids)
        elif position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if self.sequence_parallel:
            h = _scatter_sequence(h, self.tp_mesh)
        return self.run_layers(h, position_ids, segment_ids)

    def position_ids(self, input_ids: Tensor, image_grid_thw: Tensor | None, segment_ids: Tensor | None) -> Tensor:
        """M-RoPE positions [3, B, S] of a batch (see :func:`mrope_position_ids`)."""
        return mrope_position_ids(
            input_ids,
            image_grid_thw,
            image_token_id=self.config.image_token_id,
            spatial_merge_size=self.config.vision.spatial_merge_size,
            segment_ids=segment_ids,
        )

    def image_features(self, pixel_values: Tensor, image_grid_thw: Tensor) -> Tensor:
        """Merged image tokens [sum(t*h*w)/m^2, hidden] of all images, in order."""
        if self.visual is None:
            raise RuntimeError("This model part holds no vision tower (a later pipeline stage).")
        return self.visual(pixel_values, image_grid_thw)

    def _vision_needs_grads(self) -> bool:
        return (
            self.training and torch.is_grad_enabled() and self.visual is not None
            and any(p.requires_grad for p in self.visual.parameters())
        )  # fmt: skip

    def _touch_vision(self, h: Tensor) -> Tensor:
        """A text-only batch still runs the tower once (on one blank merged patch) with a zero-weighted output, so
        every tower parameter gets an (exactly zero) gradient: data-parallel ranks whose batches have images and
        ranks whose batches have none then reduce the same set of gradients."""
        vis = self.config.vision
        dummy = h.new_zeros(vis.merge_unit, vis.patch_dim)
        grid = torch.tensor([[1, vis.spatial_merge_size, vis.spatial_merge_size]], device=h.device)
        return h + 0.0 * self.image_features(dummy, grid).sum().to(h.dtype)

    def _splice_images(
        self,
        h: Tensor,
        input_ids: Tensor,
        pixel_values: Tensor,
        grid: Tensor,
        padding: Tensor | None,
        index: Tensor | None = None,
    ) -> Tensor:
        """Image tokens written over the image-pad embeddings; ``index`` [B, S] names each token's image token
        (in the tower's output order, -1 for text), default: the image-pad tokens of ``input_ids`` in order."""
        if grid is None:
            raise ValueError("pixel_values were given without image_grid_thw.")
        all_grid = grid if padding is None else torch.cat([grid.reshape(-1, 3), padding.to(grid)])
        features = self.image_features(pixel_values, all_grid)
        merge = self.config.vision.spatial_merge_size
        real = int(image_token_counts(grid.reshape(-1, 3), merge).sum())
        features = features[:real]  # padding images' tokens are computed (to reserve memory) and dropped
        if index is None:
            mask = input_ids == self.config.image_token_id
            count = int(mask.sum())
            if count != real:
                raise ValueError(
                    f"The batch has {count} image-pad tokens (id {self.config.image_token_id}) but image_grid_thw "
                    f"describes {real} image tokens ({grid.tolist()}); each image needs t * h * w / {merge * merge}."
                )
            index = torch.where(mask, mask.flatten().long().cumsum(0).view_as(mask) - 1, -1)
        mask = index >= 0
        # A gather, not masked_scatter: under context parallelism a rank holds only some of the image tokens, in a
        # permuted order, and ``index`` says which; every feature row is used at most once, so gradients are exact.
        picked = features.to(h.dtype)[index.clamp(min=0)]
        return torch.where(mask.unsqueeze(-1), picked, h)
