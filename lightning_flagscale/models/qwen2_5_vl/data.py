"""Image-text data: the Qwen2.5-VL chat template, an embedded synthetic set, a local JSON/JSONL loader, collation.

A sample is a dict ``input_ids`` [S], ``labels`` [S] (already-aligned next-token targets: the assistant's answer and
its ``<|im_end|>``, -100 elsewhere), ``pixel_values`` [patches, C*T*P*P], ``image_grid_thw`` [n_images, 3] and
``name`` (where it came from, for error messages). :class:`VLMCollator` pads a list of samples to the batch maximum
(``attention_mask``) or packs them several to a row (``segment_ids``: 1, 2, ... per document, 0 for padding).

- :class:`SyntheticShapesDataset`: coloured shapes (circle, square, triangle, cross) on a grey background at several
  image sizes, with the question "what is this?" and the answer naming colour and shape ("a red circle."). No file
  and no download; sample ``i`` is a pure function of ``(seed, i)``. The colour and shape words can only be
  predicted from the image, so a falling loss on them shows the vision path learns.
- :class:`ConversationDataset`: ``{"messages": [{"role", "content"}, ...], "images": [...]}`` records (JSON list
  or JSONL) whose ``content`` holds ``<image>`` placeholders, images read with Pillow from ``image_dir``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_flagscale.models.qwen2_5_vl.config import VLMConfig
from lightning_flagscale.models.qwen2_5_vl.image import ImageProcessor

__all__ = [
    "ChatTemplate",
    "ConversationDataset",
    "SyntheticShapesDataset",
    "VLMByteTokenizer",
    "VLMCollator",
    "check_sample",
    "load_vlm_tokenizer",
]

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<image>"


class VLMByteTokenizer:
    """UTF-8 bytes (ids 0-255, 0 = padding) plus Qwen2.5-VL's special tokens at ids 256-261 (``qwen2.5-vl-tiny``)."""

    vocab_size = 256 + len(SPECIAL_TOKENS)
    pad_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def special(self, token: str) -> int:
        return 256 + SPECIAL_TOKENS.index(token)


class _HFChatTokenizer:
    """A local HF tokenizer folder (e.g. Qwen2.5-VL's) with the special tokens looked up by name."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self._tok)
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self._tok.eos_token_id
        missing = [
            t for t in SPECIAL_TOKENS[:5] if self._tok.convert_tokens_to_ids(t) in (None, self._tok.unk_token_id)
        ]
        if missing:
            raise ValueError(f"The tokenizer in {path!r} lacks the Qwen2.5-VL special tokens {missing}.")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def special(self, token: str) -> int:
        return int(self._tok.convert_tokens_to_ids(token))


def load_vlm_tokenizer(name_or_path: str):
    """``"byte"`` (:class:`VLMByteTokenizer`) or a local HF tokenizer folder with the Qwen2.5-VL special tokens."""
    if name_or_path == "byte":
        return VLMByteTokenizer()
    if os.path.isdir(name_or_path):
        return _HFChatTokenizer(name_or_path)
    raise ValueError(f"Unknown tokenizer {name_or_path!r}: use 'byte' or a local Hugging Face tokenizer folder.")


@dataclass(kw_only=True)
class ChatTemplate:
    """Qwen2.5-VL's chat template (``<|im_start|>role\\n...<|im_end|>\\n``), each ``<image>`` expanded to
    ``<|vision_start|>`` + one ``<|image_pad|>`` per merged image token + ``<|vision_end|>``."""

    tokenizer: Any
    """``encode(text)`` and ``special(token)``."""
    system: str | None = "You are a helpful assistant."
    """System prompt prepended when the conversation has none (``None``: no system turn)."""
    merge_unit: int = 4
    """Patches per image token (``spatial_merge_size ** 2``)."""

    def encode(self, messages: Sequence[dict[str, str]], grids: Sequence[tuple[int, int, int]], name: str):
        """Token ids and next-token labels (assistant turns supervised) of one conversation."""
        tok = self.tokenizer
        if self.system is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": self.system}, *messages]
        placeholders = sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in messages)
        if placeholders != len(grids):
            raise ValueError(f"{name}: {placeholders} '{IMAGE_PLACEHOLDER}' placeholders but {len(grids)} images.")
        ids: list[int] = []
        target: list[bool] = []
        images = iter(grids)
        for message in messages:
            role, content = message.get("role"), str(message.get("content", ""))
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"{name}: unknown role {role!r}; use system, user or assistant.")
            head = [tok.special("<|im_start|>"), *tok.encode(f"{role}\n")]
            body: list[int] = []
            for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if i:
                    t, h, w = next(images)
                    pads = [tok.special("<|image_pad|>")] * (t * h * w // self.merge_unit)
                    body += [tok.special("<|vision_start|>"), *pads, tok.special("<|vision_end|>")]
                body += tok.encode(piece)
            tail = [tok.special("<|im_end|>")]
            supervised = role == "assistant"
            ids += head + body + tail + tok.encode("\n")
            target += [False] * len(head) + [supervised] * (len(body) + 1) + [False]
        labels = [ids[i + 1] if target[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]
        return torch.tensor(ids), torch.tensor(labels)


def _images_to_sample(images: list[tuple[Tensor, tuple[int, int, int]]], patch_dim: int) -> dict[str, Tensor]:
    if not images:
        return {"pixel_values": torch.zeros(0, patch_dim), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}
    return {
        "pixel_values": torch.cat([p for p, _ in images]),
        "image_grid_thw": torch.tensor([g for _, g in images], dtype=torch.long),
    }


def check_sample(sample: dict[str, Any], config: VLMConfig) -> None:
    """Raise ``ValueError`` naming the sample when its image-pad count does not match its ``image_grid_thw``."""
    grid = sample["image_grid_thw"]
    want = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum()) // config.vision.merge_unit if len(grid) else 0
    got = int((sample["input_ids"] == config.image_token_id).sum())
    if got != want:
        raise ValueError(
            f"{sample.get('name', 'sample')}: {got} image-pad tokens but image_grid_thw {grid.tolist()} needs {want} "
            f"(t * h * w / {config.vision.merge_unit} per image)."
        )


_COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 230), "yellow": (235, 215, 40)}
_SHAPES = ("circle", "square", "triangle", "cross")


def _draw(shape: str, rgb: tuple[int, int, int], height: int, width: int, rng: random.Random) -> np.ndarray:
    image = np.full((height, width, 3), 128, dtype=np.uint8)
    size = rng.uniform(0.3, 0.45) * min(height, width)
    cy, cx = rng.uniform(size, height - size), rng.uniform(size, width - size)
    y, x = np.mgrid[0:height, 0:width]
    dy, dx = y - cy, x - cx
    if shape == "circle":
        mask = dy**2 + dx**2 <= size**2
    elif shape == "square":
        mask = (abs(dy) <= size * 0.8) & (abs(dx) <= size * 0.8)
    elif shape == "triangle":
        mask = (dy <= size * 0.8) & (dy >= -size) & (abs(dx) <= (dy + size) * 0.55)
    else:
        mask = ((abs(dy) <= size) & (abs(dx) <= size * 0.3)) | ((abs(dx) <= size) & (abs(dy) <= size * 0.3))
    image[mask] = rgb
    return image


class SyntheticShapesDataset(Dataset):
    """Embedded, learnable image-text pairs: one coloured shape per image, the answer names colour and shape."""

    def __init__(
        self,
        config: VLMConfig,
        num_samples: int = 512,
        *,
        seed: int = 0,
        sizes: Sequence[tuple[int, int]] = ((56, 56), (56, 84), (84, 56), (84, 84)),
        tokenizer: Any | None = None,
    ) -> None:
        self.config = config
        self.num_samples = num_samples
        self.seed = seed
        self.sizes = [tuple(s) for s in sizes]
        self.processor = ImageProcessor.for_vision(config.vision, min_pixels=28 * 28, max_pixels=112 * 112)
        self.template = ChatTemplate(
            tokenizer=tokenizer or VLMByteTokenizer(), system=None, merge_unit=config.vision.merge_unit
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = random.Random(self.seed * 1_000_003 + index)
        colour, shape = rng.choice(sorted(_COLOURS)), rng.choice(_SHAPES)
        height, width = rng.choice(self.sizes)
        name = f"synthetic[{index}]"
        pixels, grid = self.processor(_draw(shape, _COLOURS[colour], height, width, rng), name)
        messages = [
            {"role": "user", "content": f"{IMAGE_PLACEHOLDER}what is this?"},
            {"role": "assistant", "content": f"a {colour} {shape}."},
        ]
        ids, labels = self.template.encode(messages, [grid], name)
        sample = {"input_ids": ids, "labels": labels, "name": name}
        sample.update(_images_to_sample([(pixels, grid)], self.config.vision.patch_dim))
        return sample


class ConversationDataset(Dataset):
    """Local JSON (a list) or JSONL conversations with ``<image>`` placeholders and image files (Pillow)."""

    def __init__(
        self,
        path: str | os.PathLike,
        config: VLMConfig,
        *,
        image_dir: str | os.PathLike | None = None,
        tokenizer: Any | None = None,
        system: str | None = "You are a helpful assistant.",
        min_pixels: int = 56 * 56,
        max_pixels: int = 28 * 28 * 256,
    ) -> None:
        self.path = Path(path)
        self.config = config
        self.image_dir = Path(image_dir) if image_dir is not None else self.path.parent
        self.records = _read_records(self.path)
        self.processor = ImageProcessor.for_vision(config.vision, min_pixels=min_pixels, max_pixels=max_pixels)
        self.template = ChatTemplate(
            tokenizer=tokenizer or VLMByteTokenizer(), system=system, merge_unit=config.vision.merge_unit
        )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from PIL import Image

        where, record = self.records[index]
        name = f"{self.path}:{where}"
        messages = record.get("messages")
        if not isinstance(messages, list):
            raise ValueError(f"{name}: a record needs a 'messages' list of {{'role', 'content'}} turns.")
        files = record.get("images", record.get("image", []))
        files = [files] if isinstance(files, str) else list(files)
        images = []
        for file in files:
            image_path = self.image_dir / file
            if not image_path.is_file():
                raise FileNotFoundError(f"{name}: image file {str(image_path)!r} does not exist.")
            with Image.open(image_path) as image:
                images.append(self.processor(image, f"{name} ({file})"))
        ids, labels = self.template.encode(messages, [g for _, g in images], name)
        sample = {"input_ids": ids, "labels": labels, "name": name}
        sample.update(_images_to_sample(images, self.config.vision.patch_dim))
        check_sample(sample, self.config)
        return sample


def _read_records(path: Path) -> list[tuple[str, dict]]:
    if not path.is_file():
        raise FileNotFoundError(f"Conversation file {str(path)!r} does not exist.")
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [(f"line {i + 1}", json.loads(line)) for i, line in enumerate(text.splitlines()) if line.strip()]
    records = json.loads(text)
    if not isinstance(records, list):
        raise ValueError(f"{path}: a .json conversation file must hold a list of records.")
    return [(f"record {i}", r) for i, r in enumerate(records)]


@dataclass(kw_only=True)
class VLMCollator:
    """Samples -> a batch dict: padded to the batch maximum, or packed several documents to a row."""

    config: VLMConfig
    """Checks each sample's image-pad count against its grids."""
    pad_id: int = 0
    """Token id of padding (its labels are -100)."""
    pad_to_multiple_of: int = 1
    """Round the row length up (e.g. to the TP size for sequence parallelism)."""
    pack_len: int | None = None
    """Pack documents greedily into rows of this many tokens (``segment_ids``); ``None`` pads one per row."""

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Tensor]:
        for sample in samples:
            check_sample(sample, self.config)
        rows = self._pack(samples) if self.pack_len else [[s] for s in samples]
        width = max(sum(len(s["input_ids"]) for s in row) for row in rows)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        segments = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            col = 0
            for d, sample in enumerate(row):
                n = len(sample["input_ids"])
                ids[r, col : col + n] = sample["input_ids"]
                labels[r, col : col + n] = sample["labels"]
                segments[r, col : col + n] = d + 1
                col += n
        batch = {"input_ids": ids, "labels": labels}
        if self.pack_len:
            batch["segment_ids"] = segments
        else:
            batch["attention_mask"] = (segments > 0).long()
        ordered = [s for row in rows for s in row]  # images in order of appearance, row by row
        batch["pixel_values"] = torch.cat([s["pixel_values"] for s in ordered])
        batch["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in ordered])
        return batch

    def _pack(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        rows: list[list[dict[str, Any]]] = []
        used: list[int] = []
        for sample in samples:  # first fit, in order
            n = len(sample["input_ids"])
            if n > self.pack_len:
                raise ValueError(f"{sample.get('name', 'sample')}: {n} tokens do not fit pack_len={self.pack_len}.")
            for r, u in enumerate(used):
                if u + n <= self.pack_len:
                    rows[r].append(sample)
                    used[r] += n
                    break
            else:
                rows.append([sample])
                used.append(n)
        return rows
