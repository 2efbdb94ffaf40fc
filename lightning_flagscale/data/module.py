"""``LMDataModule``: the embedded synthetic corpus or local files, tokenised, packed and resumable.

Sharding over data-parallel ranks is left to Lightning: in a distributed run it wraps the training sampler with a
``DistributedSamplerWrapper`` built from the strategy's ``distributed_sampler_kwargs`` (DP ranks only, so TP/PP/CP
peers of one DP rank read the same batch). The training sampler draws one permutation per epoch from
``(seed, epoch)`` and the wrapper gives DP rank ``r`` positions ``r, r + W, ...`` of it, so the global order of samples
is the same for any number of DP ranks, and a run can be resumed mid-epoch under another layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_flagscale.data.datasets import PackedDataset, PaddedDataset, load_text_documents
from lightning_flagscale.data.synthetic import SyntheticTextDataset
from lightning_flagscale.data.tokenizers import Tokenizer, check_tokenizer, load_tokenizer

__all__ = ["EpochShuffleSampler", "LMDataModule", "ResumableDataLoader"]


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(num_samples)`` that is a pure function of ``(seed, data_epoch)``.

    Unlike ``RandomSampler(generator=g)``, whose order depends on how often ``g`` was drawn before, the order of a
    data epoch can be rebuilt after a restart. Lightning calls ``set_epoch`` with its own epoch counter (directly, or
    through its distributed wrapper); ``epoch_offset`` maps that counter to the data epoch, because Lightning counts a
    run stopped mid-epoch by ``max_steps`` as a finished epoch while its data is only partly consumed.
    """

    def __init__(
        self, num_samples: int, seed: int, *, epoch_offset: int = 0, resume_data_epoch: int | None = None
    ) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.epoch_offset = epoch_offset
        self.epoch = 0
        # After a restore: the data epoch to yield at the next ``set_epoch``/iteration, whatever counter Lightning
        # passes then (it may advance its epoch counter after building the loader, e.g. when the checkpoint was
        # written on the last batch of an epoch), so the offset is fixed at that moment, not at construction.
        self.resume_data_epoch = resume_data_epoch

    @property
    def data_epoch(self) -> int:
        """Which permutation this sampler yields."""
        return self.epoch + self.epoch_offset

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._apply_resume()

    def _apply_resume(self) -> None:
        if self.resume_data_epoch is not None:
            self.epoch_offset, self.resume_data_epoch = self.resume_data_epoch - self.epoch, None

    def __iter__(self) -> Iterator[int]:
        self._apply_resume()
        generator = torch.Generator().manual_seed(self.seed + self.data_epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose next iteration skips its first ``skip_batches`` batches (once), to resume mid-epoch.

    The skip is lazy (done at the first ``next``) because Lightning creates the iterator before it calls
    ``set_epoch`` on the sampler. Skipped batches are loaded and dropped: the datasets here are in memory, so this
    costs milliseconds, and it keeps the sampler (which Lightning replaces) untouched.
    """

    def __init__(self, dataset: Dataset, *args: Any, skip_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        iterator = super().__iter__()
        skip, self.skip_batches = self.skip_batches, 0
        return _skip_first(iterator, skip) if skip else iterator


def _skip_first(iterator: Iterator[Any], count: int) -> Iterator[Any]:
    for _ in range(count):
        if next(iterator, _END) is _END:
            return
    yield from iterator


_END = object()


class LMDataModule(L.LightningDataModule):
    """Language-model data: the embedded synthetic corpus or local text/jsonl/parquet files.

    Args:
        source: ``"synthetic"`` (embedded corpus, see ``lightning_flagscale.data.synthetic``) or a file, glob or
            folder of .txt/.jsonl/.json/.parquet files. Files are split by document: a seeded ~10% (at most what
            ``num_val_samples`` needs) goes to validation.
        tokenizer: ``"byte"`` (256 ids, EOS = 0) or a local Hugging Face tokenizer folder.
        seq_len: tokens per sample.
        batch_size: samples per batch on each data-parallel rank.
        num_train_samples: training samples (packed blocks, or documents without packing). The synthetic corpus
            generates exactly this many; files give at most this many (``-1``: all of them).
        num_val_samples: validation samples, same rules.
        packing: pack documents into full blocks with per-document ``position_ids``/``segment_ids``; if ``False`` one
            padded document per sample with an ``attention_mask``.
        text_field: column holding the text in json/parquet files.
        seed: picks the synthetic corpus, the file train/val split and the per-epoch shuffle.
        num_workers: ``DataLoader`` worker processes.
        cross_document_attention: with packing, let tokens attend (and predict) across document boundaries instead of
            masking per document.
        cache_dir: HF ``datasets`` cache for file sources (default: the HF cache).
    """

    def __init__(
        self,
        source: str = "synthetic",
        *,
        tokenizer: str = "byte",
        seq_len: int = 128,
        batch_size: int = 8,
        num_train_samples: int = 4096,
        num_val_samples: int = 256,
        packing: bool = True,
        text_field: str = "text",
        seed: int = 1234,
        num_workers: int = 0,
        cross_document_attention: bool = False,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"LMDataModule {name} must be >= 1, got {value}.")
        for name, value in (("num_train_samples", num_train_samples), ("num_val_samples", num_val_samples)):
            if value < -1 or (value == -1 and source == "synthetic"):
                raise ValueError(f"LMDataModule {name} must be >= 0 (or -1 for all of a file source), got {value}.")
        if num_workers < 0:
            raise ValueError(f"LMDataModule num_workers must be >= 0, got {num_workers}.")
        check_tokenizer(tokenizer)  # file names only: a wrong folder fails here, before any worker starts
        self.source = source
        self.tokenizer_name = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_train_samples = num_train_samples
        self.num_val_samples = num_val_samples
        self.packing = packing
        self.text_field = text_field
        self.seed = seed
        self.num_workers = num_workers
        self.cross_document_attention = cross_document_attention
        self.cache_dir = cache_dir
        self.tokenizer: Tokenizer | None = None
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._resume: dict[str, Any] | None = None
        self._train_sampler: EpochShuffleSampler | None = None
        self._epoch_offset = 0

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (the model's ``vocab_size`` must be at least this); loads the tokenizer."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        return self.tokenizer.vocab_size

    # ---- datasets ----------------------------------------------------------------------------------------------

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node before ``setup``: warm the HF cache so ranks do not race on it.
        if self.source != "synthetic":
            load_text_documents(self.source, text_field=self.text_field, cache_dir=self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        if self.source == "synthetic":
            train_docs = SyntheticTextDataset(None if self.packing else self.num_train_samples, seed=self.seed)
            val_docs = SyntheticTextDataset(
                None if self.packing else self.num_val_samples, seed=self.seed, split="validation"
            )
            self.train_dataset = self._build(train_docs, self.num_train_samples)
            self.val_dataset = self._build(val_docs, self.num_val_samples)
        else:
            self._setup_files()

    def _build(self, documents: Any, num_samples: int) -> PackedDataset | PaddedDataset:
        assert self.tokenizer is not None
        limit = None if num_samples == -1 else num_samples
        if self.packing:
            return PackedDataset(
                documents,
                self.tokenizer,
                self.seq_len,
                max_samples=limit,
                cross_document_attention=self.cross_document_attention,
            )
        return PaddedDataset(documents, self.tokenizer, self.seq_len, max_samples=limit)

    def _setup_files(self) -> None:
        documents = load_text_documents(self.source, text_field=self.text_field, cache_dir=self.cache_dir)
        if len(documents) < 2:
            raise ValueError(
                f"{self.source!r} holds {len(documents)} document(s); at least 2 are needed for train/val."
            )
        # A seeded document-level split, so no document is in both; validation takes from the front of the
        # permutation until it has ``num_val_samples`` (capped at ~10% of the documents).
        order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(self.seed)).tolist()
        val_cap = max(1, len(documents) // 10)
        self.val_dataset = self._build((documents[i] for i in order[:val_cap]), self.num_val_samples)
        used = self.val_dataset.num_documents_used
        train_indices = sorted(order[used:])
        self.train_dataset = self._build((documents[i] for i in train_indices), self.num_train_samples)
        if self.num_train_samples > len(self.train_dataset):
            rank_zero_warn(
                f"{self.source!r} gives {len(self.train_dataset)} training samples, fewer than num_train_samples="
                f"{self.num_train_samples}; epochs will be shorter."
            )

    # ---- loaders -----------------------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None, "call setup() first"
        if self._train_sampler is not None:  # a reloaded loader keeps the mapping of a restored run
            self._epoch_offset = self._train_sampler.epoch_offset
        resume_epoch, skip = self._resume_position()
        self._train_sampler = EpochShuffleSampler(
            len(self.train_dataset), self.seed, epoch_offset=self._epoch_offset, resume_data_epoch=resume_epoch
        )
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler,
            drop_last=True,  # fixed shapes: pipeline micro-batching and CP sharding need full batches
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            skip_batches=skip,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_dataset is not None, "call setup() first"
        # A small corpus's validation split may hold fewer samples per rank than a batch; with drop_last that would
        # silently skip validation, so the batch shrinks to what each rank has.
        per_rank = math.ceil(len(self.val_dataset) / self._dp_size())
        batch_size = max(1, min(self.batch_size, per_rank))
        if batch_size < self.batch_size:
            rank_zero_info(
                f"LMDataModule: {len(self.val_dataset)} validation samples over {self._dp_size()} data-parallel"
                f" rank(s); validation batches hold {batch_size} samples instead of batch_size={self.batch_size}."
            )
        return DataLoader(
            self.val_dataset,
            batch_size=batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def test_dataloader(self) -> DataLoader:
        """``trainer.test`` / ``lightning-flagscale test``: the held-out split (this module keeps one: train and
        validation), batched as for validation."""
        return self.val_dataloader()

    # ---- resumption --------------------------------------------------------------------------------------------
    # The data position is (data epoch, samples consumed in it over all DP ranks); the per-epoch permutation is
    # global, so the position means the same thing under any DP size. On restore, ``train_dataloader`` maps
    # Lightning's epoch counter onto the data epoch (``epoch_offset``) and skips the consumed batches once.

    def _dp_size(self) -> int:
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return int(kwargs.get("num_replicas", 1)) if kwargs else 1

    def _batches_per_epoch(self, dp_size: int) -> int:
        assert self.train_dataset is not None
        # Lightning's distributed wrapper pads the permutation to a multiple of the DP size, then drop_last applies.
        return math.ceil(len(self.train_dataset) / dp_size) // self.batch_size

    def state_dict(self) -> dict[str, Any]:
        """The data position, read from the sampler (data epoch) and the trainer's progress (batches run in it)."""
        trainer, sampler = self.trainer, self._train_sampler
        if trainer is None or sampler is None or self.train_dataset is None:
            return {}
        dp_size = self._dp_size()
        global_batch = self.batch_size * dp_size
        epoch = sampler.data_epoch
        in_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.processed * global_batch
        if in_epoch >= self._batches_per_epoch(dp_size) * global_batch:  # a finished epoch: next one, from the start
            epoch, in_epoch = epoch + 1, 0
        return {
            "epoch": epoch,
            "samples_in_epoch": in_epoch,
            "samples_consumed": epoch * self._batches_per_epoch(dp_size) * global_batch + in_epoch,
            "seed": self.seed,
            "num_train_samples": len(self.train_dataset),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Remember the data position; the next ``train_dataloader`` resumes from it."""
        self._resume = dict(state_dict) if state_dict else None

    def _resume_position(self) -> tuple[int | None, int]:
        """``(data epoch to resume, batches to skip)`` for the loader built right after a restore, else ``(None, 0)``.

        The sampler maps Lightning's epoch counter onto that data epoch when Lightning first sets it.
        """
        state, self._resume = self._resume, None
        trainer = self.trainer
        if not state or trainer is None:
            return None, 0
        if state["seed"] != self.seed or state["num_train_samples"] != len(self.train_dataset or ()):
            rank_zero_warn("LMDataModule: seed or dataset size changed since the checkpoint; not resuming the data.")
            return None, 0
        global_batch = self.batch_size * self._dp_size()
        skip, rest = divmod(state["samples_in_epoch"], global_batch)
        if rest:
            rank_zero_warn(
                f"LMDataModule: {state['samples_in_epoch']} samples were consumed in this epoch, not a multiple of the "
                f"new global batch {global_batch}; {rest} samples will be seen twice."
            )
        return state["epoch"], skip
