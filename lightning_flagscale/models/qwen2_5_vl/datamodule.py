"""``VLMDataModule``: the synthetic shapes set or local conversations, collated (padded or packed) for ``VLMModule``.

Data-parallel sharding is Lightning's (it wraps the samplers with the strategy's ``distributed_sampler_kwargs``: DP
ranks only, so the TP peers of a DP rank read the same batch).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

from lightning_flagscale.models.qwen2_5_vl.config import VLMConfig
from lightning_flagscale.models.qwen2_5_vl.data import (
    ConversationDataset,
    SyntheticShapesDataset,
    VLMCollator,
    load_vlm_tokenizer,
)
from lightning_flagscale.models.qwen2_5_vl.module import _resolve_config

__all__ = ["VLMDataModule"]


class VLMDataModule(L.LightningDataModule):
    """``source="synthetic"`` (embedded shapes) or the path of a ``.json`` / ``.jsonl`` conversation file."""

    def __init__(
        self,
        source: str = "synthetic",
        *,
        config: VLMConfig | str | dict[str, Any] = "qwen2.5-vl-tiny",
        image_dir: str | None = None,
        tokenizer: str = "byte",
        batch_size: int = 4,
        num_samples: int = 512,
        val_samples: int = 0,
        pack_len: int | None = None,
        pad_to_multiple_of: int = 1,
        min_pixels: int = 56 * 56,
        max_pixels: int = 28 * 28 * 256,
        system_prompt: str | None = "You are a helpful assistant.",
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.config = _resolve_config(config)
        self.source = source
        self.image_dir = image_dir
        self.tokenizer = load_vlm_tokenizer(tokenizer)
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ValueError(
                f"The tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{self.config.vocab_size}; use a matching config."
            )
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.system_prompt = system_prompt
        self.num_workers = num_workers
        self.seed = seed
        self.collate = VLMCollator(
            config=self.config, pad_id=self.tokenizer.pad_id, pad_to_multiple_of=pad_to_multiple_of, pack_len=pack_len
        )
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.source == "synthetic":
            self.train_set = SyntheticShapesDataset(
                self.config, self.num_samples, seed=self.seed, tokenizer=self.tokenizer
            )
            if self.val_samples:
                self.val_set = SyntheticShapesDataset(
                    self.config, self.val_samples, seed=self.seed + 1, tokenizer=self.tokenizer
                )
            return
        full = ConversationDataset(
            self.source, self.config, image_dir=self.image_dir, tokenizer=self.tokenizer, system=self.system_prompt,
            min_pixels=self.min_pixels, max_pixels=self.max_pixels,
        )  # fmt: skip
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(self.seed)).tolist()
        self.val_set = Subset(full, order[: self.val_samples]) if self.val_samples else None
        self.train_set = Subset(full, order[self.val_samples :])

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate,
            num_workers=self.num_workers, drop_last=True,
            generator=torch.Generator().manual_seed(self.seed),
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self.collate)
