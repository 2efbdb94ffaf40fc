"""The data layouts ``FlagScaleStrategy`` imposes on Lightning's (already distributed) dataloaders.

* Heterogeneous meshes: every rank reads its data-parallel slice of each micro-batch, for training and evaluation
  alike, so that pipeline stage boundaries line up (``parallel.hetero_dp.batching.MicroBatchSliceSampler``).
* Heterogeneous data parallelism: ``hetero_dp_batch_sizes`` shares of each global batch (training only; ``"auto"``
  shares are chosen here from the speeds gathered at setup, ``parallel/hetero_dp/shares.py``).
* Evaluation sets that do not divide over the data-parallel ranks: Lightning's ``DistributedSampler`` evens the ranks
  out by repeating the first samples, which then count twice in the token-weighted ``val_loss`` / ``test_loss``; the
  padding is made of copies whose labels are all ignored instead (``_exact_eval_loader``; dict samples with
  ``labels``), so the evaluation loss is the token mean over the set.
* Context parallelism: each rank's sequence chunks of a batch (``shard_for_cp``).
* Training loaders of modules that opt in (``global_token_loss``) then carry the step's token count
  (``strategies/_tokens.py``).

Which loader is the training one is read from the trainer's state (Lightning processes the training loader while
``trainer.training`` is set), not from the sampler's ``shuffle`` flag: Lightning wraps custom samplers (e.g. the
data module's own epoch-seeded shuffling) with ``shuffle=False``. Replacing the batch sampler keeps the dataset and
collate function and the batches a resumed ``LMDataModule`` loader skips, but not other custom ``DataLoader``
subclasses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from lightning_flagscale.data.module import ResumableDataLoader
from lightning_flagscale.models.protocol import ContextParallelBatch
from lightning_flagscale.parallel.context_parallel.attention import shard_batch_for_cp
from lightning_flagscale.parallel.hetero_dp.batching import HeteroBatchSampler, MicroBatchSliceSampler
from lightning_flagscale.parallel.hetero_dp.shares import auto_shares
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes
from lightning_flagscale.strategies._tokens import TokenCountingLoader

__all__ = ["distribute_loader", "shard_for_cp"]


def distribute_loader(
    dataloader: Any,
    *,
    training: bool,
    parallel: Any,
    meshes: ParallelMeshes,
    hetero_groups: list | None,
    accumulate: int,
    count_tokens: bool,
    dp_speeds: list[float] | None = None,
) -> Any:
    """The loader this rank iterates (see the module docstring)."""
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        return dataloader
    seed = getattr(sampler, "seed", 0)
    if hetero_groups is not None:
        dp = meshes.size(MeshDim.DP)
        # the loader's batch is per DP rank of the first mesh as listed (hetero_mesh_order may move it)
        first = next(g for g in hetero_groups if g.mesh == 0)
        batches = MicroBatchSliceSampler(
            len(dataloader.dataset), dataloader.batch_size * first.data_parallel_size,
            parallel.micro_batch_size * dp, dp, meshes.local_rank(MeshDim.DP), seed=seed, shuffle=training,
        )  # fmt: skip
        dataloader = _with_batch_sampler(dataloader, batches)
    elif not training:
        dataloader = _exact_eval_loader(dataloader, sampler)
    elif parallel.hetero_dp_batch_sizes is not None:
        if parallel.hetero_dp_batch_sizes == "auto":  # resolved once, now that the global batch is known
            parallel.hetero_dp_batch_sizes = auto_shares(parallel, dp_speeds, dataloader.batch_size)
        batches = HeteroBatchSampler(
            len(dataloader.dataset), parallel.hetero_dp_batch_sizes, meshes.local_rank(MeshDim.DP), seed=seed
        )
        dataloader = _with_batch_sampler(dataloader, batches)
    if not training or not count_tokens:
        return dataloader
    return TokenCountingLoader(dataloader, accumulate, meshes.group(MeshDim.DP))


class _EvalShardSampler(Sampler[int]):
    """``DistributedSampler(shuffle=False)``'s positions for one rank (``rank, rank + W, ...`` of the set evened out
    to a multiple of ``W``), where the positions past the set's end stay past it (``_IgnoredLabelPadding`` serves
    them) instead of wrapping round to its first samples."""

    def __init__(self, num_samples: int, num_replicas: int, rank: int) -> None:
        self.positions = range(rank, math.ceil(num_samples / num_replicas) * num_replicas, num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.positions)

    def __len__(self) -> int:
        return len(self.positions)


class _IgnoredLabelPadding(Dataset):
    """The evaluation set, and past its end copies of its samples whose labels are all ``-100``: padding that evens
    the ranks' batches out without a token in the loss."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.size = len(dataset)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        if index < self.size:
            return self.dataset[index]
        sample = dict(self.dataset[index % self.size])
        sample["labels"] = torch.full_like(sample["labels"], -100)
        return sample


def _exact_eval_loader(dataloader: Any, sampler: DistributedSampler) -> Any:
    """An evaluation loader whose padding carries no label (module docstring); the loader as it is when the set
    divides over the ranks, when Lightning's sampler wraps one of the user's (its order is not the set's), or when
    the samples are not dicts with ``labels``."""
    dataset = dataloader.dataset
    if type(sampler) is not DistributedSampler or sampler.shuffle or sampler.drop_last or dataloader.batch_size is None:
        return dataloader
    try:
        size, first = len(dataset), dataset[0]
    except (TypeError, IndexError, KeyError):
        return dataloader
    if size % sampler.num_replicas == 0 or not isinstance(first, Mapping):
        return dataloader
    if not isinstance(first.get("labels"), torch.Tensor):
        return dataloader
    return DataLoader(
        _IgnoredLabelPadding(dataset), batch_size=dataloader.batch_size,
        sampler=_EvalShardSampler(size, sampler.num_replicas, sampler.rank), collate_fn=dataloader.collate_fn,
        num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory, drop_last=dataloader.drop_last,
    )  # fmt: skip


def _with_batch_sampler(dataloader: Any, batch_sampler: Any) -> DataLoader:
    # A resumed run's loader (``ResumableDataLoader``) skips the batches its epoch already consumed: the skip must
    # survive the new batch sampler, or a run resumed mid-epoch re-reads the epoch from its start (issue 14).

    return ResumableDataLoader(
        dataloader.dataset, batch_sampler=batch_sampler, collate_fn=dataloader.collate_fn,
        num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory,
        skip_batches=getattr(dataloader, "skip_batches", 0),
    )  # fmt: skip


def shard_for_cp(args: tuple, batch_model: Any, cp_mesh: Any) -> tuple:
    """This context-parallel rank's chunks of a dict batch (load-balanced causal split). The model protocol's batch
    hooks (``models/protocol.py``) run first: per-token tensors (e.g. vision position ids) need the full sequence."""
    if not args or not isinstance(args[0], Mapping):
        return args

    if not isinstance(batch_model, ContextParallelBatch):
        return (shard_batch_for_cp(dict(args[0]), cp_mesh, sequence_keys=()), *args[1:])
    batch = batch_model.prepare_batch(dict(args[0]))
    return (shard_batch_for_cp(batch, cp_mesh, sequence_keys=tuple(batch_model.cp_sequence_keys)), *args[1:])
