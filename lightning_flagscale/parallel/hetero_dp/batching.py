"""Heterogeneous data parallelism: stronger devices take larger shares of every global batch (FlagScale's first
generation of heterogeneous training, SEEDS.md section 3).

Every data-parallel rank draws its share of the same global batch from one seeded permutation per epoch: global
batch ``k`` is ``perm[k*G : (k+1)*G]`` with ``G = sum(batch_sizes)``, and rank ``r`` takes the contiguous slice of
``batch_sizes[r]`` samples after those of ranks ``0..r-1``. Gradients are weighted correctly without any special
reduction: every rank's loss is its token-loss sum over the global label count of the step
(``num_items_in_batch``, see ``strategies/_tokens.py``), so the data-parallel reduction yields the gradient of the
token mean over the whole global batch, exactly as in one process. Under pipeline parallelism every rank runs the same
number of micro-batches, of proportionally different sizes (:func:`hetero_micro_batch_sizes`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Sampler

__all__ = [
    "HeteroBatchSampler",
    "MicroBatchSliceSampler",
    "proportional_shares",
]


def proportional_shares(speeds: Sequence[float], units: int) -> list[int]:
    """``units`` indivisible pieces of work shared in proportion to ``speeds``, every rank taking at least one.

    Floors of the exact proportional shares (at least 1), then each missing unit goes to the rank that would finish
    it soonest (smallest ``(share + 1) / speed``) and each excess unit is taken from the rank that finishes last
    (largest ``share / speed``): the slowest rank's time ``max(share / speed)`` is as small as whole units allow.
    Deterministic in its inputs, so ranks holding the same speeds agree on the shares.
    """
    if units < len(speeds):
        raise ValueError(f"{units} units of work cannot give each of {len(speeds)} ranks at least one.")
    if any(not s > 0 for s in speeds):
        raise ValueError(f"Speeds must be positive, got {list(speeds)}.")
    total = sum(speeds)
    share = [max(1, int(units * s / total)) for s in speeds]
    while sum(share) < units:
        i = min(range(len(share)), key=lambda j: ((share[j] + 1) / speeds[j], j))
        share[i] += 1
    while sum(share) > units:
        i = max((j for j in range(len(share)) if share[j] > 1), key=lambda j: (share[j] / speeds[j], -j))
        share[i] -= 1
    return share


class EpochCounter:
    """The epoch a batch sampler draws its permutation for.

    Lightning's loop calls ``set_epoch`` on ``loader.sampler`` and on ``loader.batch_sampler.sampler``, never on the
    batch sampler itself: the batch samplers below expose one of these as their ``sampler``.
    """

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _GlobalBatchSampler(Sampler[list[int]]):
    """Shared by the batch samplers below: one permutation of the dataset per epoch (reseeded by ``set_epoch``, like
    ``DistributedSampler``), read in whole global batches of ``global_batch`` samples (the incomplete last one is
    dropped so that every rank runs the same number of steps)."""

    num_samples: int
    global_batch: int
    seed: int
    shuffle: bool
    sampler: EpochCounter

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.num_samples // self.global_batch

    def _order(self) -> Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)


class HeteroBatchSampler(_GlobalBatchSampler):
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
        self.sampler = EpochCounter()
        self.global_batch = sum(self.batch_sizes)
        self.offset = sum(self.batch_sizes[:rank])
        if num_samples < self.global_batch:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than one global batch of {self.global_batch}"
                f" (hetero_dp_batch_sizes={self.batch_sizes})."
            )

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        mine = self.batch_sizes[self.rank]
        for k in range(len(self)):
            start = k * self.global_batch + self.offset
            yield order[start : start + mine].tolist()


class MicroBatchSliceSampler(_GlobalBatchSampler):
    """Heterogeneous meshes: this rank's slices of every micro-batch of one global batch.

    Global batch ``k`` is ``perm[k*G : (k+1)*G]``, cut into micro-batches of ``micro`` samples; data-parallel rank
    ``i`` of a stage group with ``dp`` ranks takes the ``i``-th of ``dp`` equal slices of each micro-batch. Stage groups
    with different data-parallel sizes thus hold different slices of the same samples, and the pipeline reslices
    activations between them (``parallel/hetero_mesh/build.py``). Incomplete global batches are dropped.
    """

    def __init__(
        self, num_samples: int, global_batch: int, micro: int, dp: int, rank: int, *, seed: int = 0, shuffle: bool
    ) -> None:
        if global_batch % micro or micro % dp:
            raise ValueError(
                f"A global batch of {global_batch} samples in micro-batches of {micro} cannot be split over"
                f" data_parallel_size={dp}; make the micro-batch (micro_batch_size x the first mesh's data-parallel"
                " size) a multiple of every mesh's data-parallel size and divide the global batch."
            )
        if num_samples < global_batch:
            raise ValueError(f"The dataset has {num_samples} samples, fewer than one global batch of {global_batch}.")
        self.num_samples, self.global_batch, self.micro = num_samples, global_batch, micro
        self.dp, self.rank, self.seed, self.shuffle = dp, rank, seed, shuffle
        self.sampler = EpochCounter()

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        part = self.micro // self.dp
        for k in range(len(self)):
            batch = []
            for m in range(self.global_batch // self.micro):
                start = k * self.global_batch + m * self.micro + self.rank * part
                batch += order[start : start + part].tolist()
            yield batch
