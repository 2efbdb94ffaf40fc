"""Helpers for single-process oracles of distributed runs."""

from __future__ import annotations

import torch


def global_batch_indices(num_samples: int, global_batch: int, step: int, seed: int = 0) -> torch.Tensor:
    """Sample indices that form global batch ``step`` under Lightning's shuffled ``DistributedSampler``.

    Lightning always shuffles training data with ``DistributedSampler(seed=seed)`` and calls ``set_epoch(epoch)``:
    the permutation is ``randperm(n, generator seeded with seed + epoch)`` and rank r takes positions r, r+N, ... .
    With a per-rank batch of B = G / N, the union over ranks of batch k is positions [kG, (k+1)G) for every N, so
    the oracle sees the same global batch whatever the data-parallel size.
    """
    steps_per_epoch = num_samples // global_batch
    epoch, k = divmod(step, steps_per_epoch)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(num_samples, generator=g)
    return perm[k * global_batch : (k + 1) * global_batch]
