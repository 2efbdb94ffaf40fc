"""The data layouts ``FlagScaleStrategy`` imposes on Lightning's (already distributed) dataloaders.

* Heterogeneous meshes: every rank reads its data-parallel slice of each micro-batch, for training and evaluation
  alike, so that pipeline stage boundaries line up (``parallel.hetero_dp.batching.MicroBatchSliceSampler``).
* Heterogeneous data parallelism: ``hetero_dp_batch_sizes`` shares of each global batch (training only; ``"auto"``
  shares are chosen here from the speeds gathered at setup, ``parallel/hetero_dp/shares.py``).
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

from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

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
    elif training and parallel.hetero_dp_batch_sizes is not None:
        if parallel.hetero_dp_batch_sizes == "auto":  # resolved once, now that the global batch is known
            parallel.hetero_dp_batch_sizes = auto_shares(parallel, dp_speeds, dataloader.batch_size)
        batches = HeteroBatchSampler(
            len(dataloader.dataset), parallel.hetero_dp_batch_sizes, meshes.local_rank(MeshDim.DP), seed=seed
        )
        dataloader = _with_batch_sampler(dataloader, batches)
    if not training or not count_tokens:
        return dataloader
    return TokenCountingLoader(dataloader, accumulate, meshes.group(MeshDim.DP))


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
