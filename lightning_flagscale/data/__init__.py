"""Data: the embedded synthetic corpus, tokenizers, local HF datasets, sequence packing and the ``LMDataModule``."""

from lightning_flagscale.data.datasets import (
    IGNORE_INDEX,
    PackedDataset,
    PaddedDataset,
    load_text_documents,
    resolve_data_files,
)
from lightning_flagscale.data.module import EpochShuffleSampler, LMDataModule, ResumableDataLoader
from lightning_flagscale.data.synthetic import SyntheticTextDataset, SyntheticWorld
from lightning_flagscale.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "EpochShuffleSampler",
    "HFTokenizer",
    "LMDataModule",
    "PackedDataset",
    "PaddedDataset",
    "ResumableDataLoader",
    "SyntheticTextDataset",
    "SyntheticWorld",
    "Tokenizer",
    "load_text_documents",
    "load_tokenizer",
    "resolve_data_files",
]
