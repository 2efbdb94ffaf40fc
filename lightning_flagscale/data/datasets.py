"""Local text corpora (text / jsonl / parquet via HF ``datasets``) and the two ways of batching them.

- :class:`PackedDataset`: documents (each followed by EOS, preceded by BOS when the tokenizer has one) concatenated
  into one token stream and cut into fixed blocks of ``seq_len + 1`` tokens; block ``k`` starts at token
  ``k * seq_len`` so consecutive blocks share one token and every token is a target exactly once. Each sample has
  ``input_ids = block[:-1]``, ``labels = block[1:]`` (aligned next-token targets), ``position_ids`` restarting at 0 at
  every document start (and at the block start), and ``segment_ids`` (document index within the block) so the model
  masks attention per document. Targets that would cross into another document, and padding, are ``-100``.
- :class:`PaddedDataset`: one document per sample, truncated/padded to ``seq_len`` with an ``attention_mask``.

Both are map-style datasets of dicts of ``[seq_len]`` int64 tensors, so Lightning's ``DistributedSampler`` shards them
and the default collate stacks them into the HF-named batch dicts of the model contract. Tokenisation is done once,
eagerly, in memory (numpy), which is right for the corpora this project trains on in tests and demos; pre-tokenise
larger corpora.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_flagscale.data.tokenizers import Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "PackedDataset",
    "PaddedDataset",
    "load_text_documents",
    "resolve_data_files",
]

IGNORE_INDEX = -100
"""Label value ignored by the loss (the HF / ``torch.nn.functional.cross_entropy`` convention)."""

_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


def _builder_of(path: str) -> str | None:
    name = path[:-3] if path.endswith(".gz") else path  # the json and text builders read gzip transparently
    return _BUILDERS.get(os.path.splitext(name)[1].lower())


def resolve_data_files(source: str) -> tuple[str, list[str]]:
    """The HF ``datasets`` builder (``"text"``, ``"json"`` or ``"parquet"``) and sorted file list of ``source``.

    ``source`` is a file, a glob (``data/*.jsonl``, ``**`` allowed) or a folder (searched recursively for files with a
    known extension: .txt/.text/.md, .json/.jsonl, .parquet, optionally .gz). All files must share one builder.
    """
    if os.path.isdir(source):
        files = [
            os.path.join(root, f) for root, _, names in os.walk(source) for f in names if _builder_of(f) is not None
        ]
    elif os.path.isfile(source):
        files = [source]
    else:
        files = [f for f in glob.glob(source, recursive=True) if os.path.isfile(f)]
    files = sorted(files)
    if not files:
        raise FileNotFoundError(
            f"No data files found for source {source!r}: give a file, a glob or a folder of "
            f"{', '.join(sorted(_BUILDERS))} files (or source='synthetic')."
        )
    builders = {_builder_of(f) for f in files}
    if None in builders:
        unknown = [f for f in files if _builder_of(f) is None][:3]
        raise ValueError(f"Unknown data file type for {unknown}; known extensions: {', '.join(sorted(_BUILDERS))}.")
    if len(builders) > 1:
        raise ValueError(f"Data files of {source!r} mix formats {sorted(builders)}; keep one format per source.")
    return builders.pop(), files


class _Column(Sequence[str]):
    """A lazy ``Sequence[str]`` over one column of an Arrow-backed HF dataset (rows are read on demand)."""

    def __init__(self, dataset: Any, field: str) -> None:
        self._dataset = dataset
        self._field = field

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        value = self._dataset[int(index)][self._field]
        return "" if value is None else str(value)


def load_text_documents(source: str, *, text_field: str = "text", cache_dir: str | None = None) -> Sequence[str]:
    """Documents of local text / jsonl / parquet files, loaded with HF ``datasets`` (see :func:`resolve_data_files`).

    Text files give one document per line (the ``text`` builder's convention); json(l) and parquet one document per
    row, read from column ``text_field``.
    """
    try:
        from datasets import load_dataset
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Loading local corpora needs the `datasets` package: pip install 'lightning-flagscale[data]'."
        ) from err
    builder, files = resolve_data_files(source)
    dataset = load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir)
    field = "text" if builder == "text" else text_field
    if field not in dataset.column_names:
        raise ValueError(
            f"Column {field!r} not found in {source!r}; its columns are {dataset.column_names}. Set text_field."
        )
    return _Column(dataset, field)


def _document_ids(text: str, tokenizer: Tokenizer) -> list[int]:
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [*bos, *tokenizer.encode(text), tokenizer.eos_id]


class PackedDataset(Dataset[dict[str, torch.Tensor]]):
    """Documents packed into fixed blocks of ``seq_len + 1`` tokens (see the module docstring for the layout).

    Args:
        documents: texts, consumed in order and only as far as needed (an unbounded iterable is fine with
            ``max_samples``). Empty texts are skipped.
        tokenizer: any :class:`~lightning_flagscale.data.tokenizers.Tokenizer`.
        seq_len: tokens per sample.
        max_samples: stop once this many blocks are full; ``None`` packs every document.
        cross_document_attention: ``False`` (default) masks targets across documents and emits ``segment_ids`` so the
            model attends within each document; ``True`` trains plain causal LM over the whole block (positions
            ``0..seq_len-1``, no ``segment_ids``; only padding is masked).
    """

    def __init__(
        self,
        documents: Iterable[str],
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        max_samples: int | None = None,
        cross_document_attention: bool = False,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        if max_samples is not None and max_samples < 0:
            raise ValueError(f"max_samples must be >= 0 or None, got {max_samples}.")
        self.seq_len = seq_len
        self.pad_id = tokenizer.pad_id
        self.cross_document_attention = cross_document_attention
        needed = None if max_samples is None else max_samples * seq_len + 1
        chunks: list[list[int]] = []
        total = 0
        self.num_documents_used = 0
        """How many items of ``documents`` were consumed (including skipped empty ones)."""
        source: Iterable[str] = documents if needed is None or needed > 1 else ()
        for text in source:
            self.num_documents_used += 1
            if not text:
                continue
            chunks.append(_document_ids(text, tokenizer))
            total += len(chunks[-1])
            if needed is not None and total >= needed:
                break
        self.tokens = np.fromiter((t for c in chunks for t in c), dtype=np.int64, count=total)
        self.doc_ids = np.repeat(np.arange(len(chunks), dtype=np.int64), [len(c) for c in chunks])
        num = -(-(total - 1) // seq_len) if total > 1 else 0  # the last, partial block is padded
        self.num_samples = num if max_samples is None else min(num, max_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} packed samples.")
        length = self.seq_len
        start = index * length
        block = self.tokens[start : start + length + 1]
        docs = self.doc_ids[start : start + length + 1]
        if len(block) < length + 1:  # padding is document -1, so it never matches a real document
            missing = length + 1 - len(block)
            block = np.concatenate([block, np.full(missing, self.pad_id, dtype=np.int64)])
            docs = np.concatenate([docs, np.full(missing, -1, dtype=np.int64)])
        valid = docs[1:] != -1
        if not self.cross_document_attention:
            valid &= docs[1:] == docs[:-1]
        labels = np.where(valid, block[1:], IGNORE_INDEX)
        sample = {"input_ids": torch.from_numpy(block[:-1].copy()), "labels": torch.from_numpy(labels)}
        if self.cross_document_attention:
            sample["position_ids"] = torch.arange(length)
            return sample
        in_docs = docs[:-1]
        starts = np.ones(length, dtype=bool)
        starts[1:] = in_docs[1:] != in_docs[:-1]
        positions = np.arange(length)
        sample["position_ids"] = torch.from_numpy(positions - np.maximum.accumulate(np.where(starts, positions, 0)))
        sample["segment_ids"] = torch.from_numpy(np.cumsum(starts) - 1)
        return sample


class PaddedDataset(Dataset[dict[str, torch.Tensor]]):
    """One document per sample: ``[bos] text eos`` truncated to ``seq_len + 1`` tokens, then right-padded.

    Samples hold ``input_ids``, ``labels`` (-100 at padding), ``attention_mask`` (1 on real input tokens) and
    ``position_ids``. Empty texts are skipped; ``max_samples`` stops consuming ``documents`` once enough are kept.
    """

    def __init__(
        self, documents: Iterable[str], tokenizer: Tokenizer, seq_len: int, *, max_samples: int | None = None
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        self.seq_len = seq_len
        self.pad_id = tokenizer.pad_id
        self.samples: list[np.ndarray] = []
        self.num_documents_used = 0
        for text in _take(documents, max_samples, self.samples):
            self.num_documents_used += 1
            if text:
                self.samples.append(np.asarray(_document_ids(text, tokenizer)[: seq_len + 1], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.samples[index]
        length, n = self.seq_len, len(ids)
        block = np.full(length + 1, self.pad_id, dtype=np.int64)
        block[:n] = ids
        positions = np.arange(length)
        labels = np.where(positions + 1 < n, block[1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(block[:-1].copy()),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy((positions < n).astype(np.int64)),
            "position_ids": torch.from_numpy(positions),
        }


def _take(documents: Iterable[str], limit: int | None, kept: list[Any]) -> Iterator[str]:
    """Yield from ``documents`` until ``kept`` (filled by the caller) holds ``limit`` items."""
    if limit == 0:
        return
    for text in documents:
        yield text
        if limit is not None and len(kept) >= limit:
            return
