"""Heterogeneous data parallelism: stronger devices take larger shares of every global batch (FlagScale's first
generation of heterogeneous training, SEEDS.md section 3).

Every data-parallel rank draws its share of the same global batch from one seeded permutation per epoch: global
batch ``k`` is ``perm[k*G : (k+1)*G]`` with ``G = sum(batch_sizes)``, and rank ``r`` takes the contiguous slice of
``batch_sizes[r]`` samples after those of ranks ``0..r-1``. Gradients are weighted correctly without any special
reduction: ``CausalLM.loss_fn`` already weights each rank's loss by its share of the global token count (the
``token_group`` the strategy sets), so the data-parallel average of the gradients is the gradient of the token mean
over the whole global batch, exactly as in one process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

__all__ = ["HeteroBatchSampler", "check_hetero_batch_sizes"]


def check_hetero_batch_sizes(batch_sizes: Sequence[int], dp: int) -> None:
    """Raise a ``ValueError`` naming the fix when the per-rank batch sizes do not describe ``dp`` ranks."""
    if len(batch_sizes) != dp:
        raise ValueError(
            f"hetero_dp_batch_sizes has {len(batch_sizes)} entries but there are {dp} data-parallel ranks; give one"
            " batch size per data-parallel rank."
        )
    if any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"hetero_dp_batch_sizes={list(batch_sizes)} must hold positive integers.")


class HeteroBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_sizes[rank]`` indices: this rank's slice of each global batch (see module docstring).

    ``set_epoch`` (called by Lightning's loop) reseeds the permutation, like ``DistributedSampler``; incomplete
    global batches at the end of an epoch are dropped so that every rank runs the same number of steps.
    """

    def __init__(
        self, num_samples: int, batch_sizes: Sequence[int], rank: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        self.num_samples = num_samples
        self.batch_sizes = list(batch_sizes)
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.global_batch = sum(self.batch_sizes)
        self.offset = sum(self.batch_sizes[:rank])
        if num_samples < self.global_batch:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than one global batch of {self.global_batch}"
                f" (hetero_dp_batch_sizes={self.batch_sizes})."
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        mine = self.batch_sizes[self.rank]
        for k in range(len(self)):
            start = k * self.global_batch + self.offset
            yield order[start : start + mine].tolist()
