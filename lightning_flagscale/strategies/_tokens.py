"""The loss normaliser of an optimizer step, known before its first backward.

One token mean per optimizer step (issue 10): the cross-entropy of every micro-batch, accumulation step and data x
context rank is summed and divided by one number, the global count of label tokens (``labels != -100``) of the
whole step. Hugging Face calls it ``num_items_in_batch``; torchtitan ``global_valid_tokens``. The training
dataloader is wrapped so that each window of ``accumulate_grad_batches`` batches is read ahead, its local label
count all-reduced once over the data-parallel ranks, and every batch of the window handed to ``training_step`` with
``batch["num_items_in_batch"]`` set (a Python int, so Lightning's batch-size inference and device moves ignore it).
The all-reduce is asynchronous: the loader attaches a :class:`PendingCount` and the strategy's ``batch_to_device``
replaces it by the int (:func:`resolve_token_count`) before any hook of the step sees the batch. Lightning fetches a
batch one step ahead, so the reduction runs under the step before instead of holding every rank at the start of its
own.
Context-parallel ranks of one replica read the same unsharded batch, so the data-parallel group suffices.

The model divides its token-loss sum by it (``loss_fn(..., num_items_in_batch)``); the strategy multiplies the
returned loss by ``R x A`` before Lightning's backward, where ``R`` is the number of data x context ranks the gradient
reduction averages over and ``A`` the accumulation count Lightning divides by, so the reduced gradient is exactly the
gradient of the global token mean. This is the per-token-loss approach of Megatron and Hugging Face
(``average_tokens_across_devices``); it costs one scalar all-reduce per optimizer step, not one per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_flagscale.models.protocol import uses_global_token_loss
from lightning_flagscale.parallel.data_parallel.grad_buckets import profiler_active

__all__ = [
    "NUM_ITEMS_KEY",
    "PendingCount",
    "StepScales",
    "TokenCountingLoader",
    "apply_accumulation",
    "batch_size_of",
    "count_label_tokens",
    "global_tokens",
    "resolve_token_count",
    "scale_loss",
    "step_scales",
    "uses_global_token_loss",
]

NUM_ITEMS_KEY = "num_items_in_batch"


def count_label_tokens(batch: Any) -> int:
    """Label tokens (``labels != -100``) of a dict batch; 0 for batches without labels."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    return int((labels != -100).sum()) if isinstance(labels, torch.Tensor) else 0


class PendingCount:
    """A window's global label count whose all-reduce may still be in flight (no ``to`` method and not a tensor:
    Lightning's device moves and batch-size inference pass it by)."""

    def __init__(self, total: Tensor, work: dist.Work | None) -> None:
        self._total = total
        self._work = work
        self._value: int | None = None

    def value(self) -> int:
        if self._value is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            self._value = int(self._total)
        return self._value

    def __repr__(self) -> str:
        return f"PendingCount({'pending' if self._value is None else self._value})"


def resolve_token_count(batch: Any) -> None:
    """Replace a batch's :class:`PendingCount` by the int it stands for (waiting for its all-reduce)."""
    if isinstance(batch, MutableMapping) and isinstance(batch.get(NUM_ITEMS_KEY), PendingCount):
        batch[NUM_ITEMS_KEY] = batch[NUM_ITEMS_KEY].value()


class TokenCountingLoader:
    """Wraps a training ``DataLoader``: yields its batches with the window's global label count attached.

    Windows are ``accumulate`` consecutive batches from the start of each iteration (Lightning's accumulation
    windows: it steps after every ``accumulate``-th batch and on the last one, which may close a shorter window).
    Every rank must iterate the same number of batches, as Lightning's samplers guarantee. Attributes other than
    iteration (``sampler``, ``batch_sampler``, ``dataset``, ``state_dict`` of stateful loaders ...) are the wrapped
    loader's, so Lightning's epoch bookkeeping and loop state keep working.
    """

    def __init__(self, loader: Any, accumulate: int, group: dist.ProcessGroup | None) -> None:
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}.")
        self.loader = loader
        self.accumulate = accumulate
        self.group = group

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not yet set (e.g. during unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        while True:
            window = []
            for batch in it:
                window.append(batch)
                if len(window) == self.accumulate:
                    break
            if not window:
                return
            total = torch.tensor(sum(count_label_tokens(b) for b in window), dtype=torch.int64)
            work = None
            if self.group is not None and dist.get_world_size(self.group) > 1:
                # not asynchronous while the profiler records: the work would outlive the session (profiler_active)
                work = dist.all_reduce(total, group=self.group, async_op=not profiler_active())
            count = int(total) if work is None else PendingCount(total, work)
            for batch in window:
                yield {**batch, NUM_ITEMS_KEY: count} if isinstance(batch, Mapping) else batch
            if len(window) < self.accumulate:
                return


def batch_size_of(args: tuple) -> int:
    batch = args[0] if args else None
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor):
        raise TypeError("Under pipeline parallelism training batches must be dicts with `labels` (HF key names).")
    return labels.shape[0]


def scale_loss(output: Any, factor: float) -> Any:
    if isinstance(output, Tensor):
        return output * factor
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": output["loss"] * factor}
    return output


@dataclass(frozen=True, kw_only=True)
class StepScales:
    """How one micro-step's losses and gradients are scaled under the token-mean protocol."""

    loss_factor: int
    """Multiplies the module's loss: the gradient reduction averages over the data x context ranks and Lightning
    divides by the accumulation count, while the loss already is this rank's share of the step's token mean."""
    pipeline_grad_scale: float
    """Under PP the schedule backpropagates each micro-batch itself (Lightning's division by the accumulation count
    never reaches it): the loss scale times the data x context factor, or 1 / A for a per-micro-batch mean."""
    aux_loss_scale: float
    """MoE aux-loss gradients are attached inside the layers: a mean over accumulation steps and, under PP, over the
    schedule's micro-batches (their gradients are summed, not averaged), times the loss scale."""


def step_scales(args: tuple, *, dp_cp: int, accumulate: int, loss_scale: float, microbatches: int) -> StepScales:
    normalised = bool(args) and isinstance(args[0], Mapping) and NUM_ITEMS_KEY in args[0]
    factor = dp_cp * accumulate if normalised else 1
    return StepScales(
        loss_factor=factor,
        pipeline_grad_scale=loss_scale * (factor / accumulate if normalised else 1 / accumulate),
        aux_loss_scale=loss_scale / (accumulate * microbatches),
    )


def apply_accumulation(parallel: Any, trainer: Any) -> None:
    """``gradient_accumulation_steps`` (Megatron's name) drives Lightning's ``accumulate_grad_batches``."""
    steps = parallel.gradient_accumulation_steps
    if steps > 1:
        if trainer.accumulate_grad_batches not in (1, steps):
            raise ValueError(
                f"gradient_accumulation_steps={steps} conflicts with"
                f" Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}); set only one of them."
            )
        trainer.accumulate_grad_batches = steps


def global_tokens(local_tokens: int, parallel: Any, meshes: Any) -> int:
    """Tokens of the whole step given this rank's share (for tokens/s): data x context ranks hold disjoint tokens,
    in equal shares or in ``hetero_dp_batch_sizes`` proportions."""
    cp = meshes.size("cp")
    shares = parallel.hetero_dp_batch_sizes
    if shares is not None:
        return local_tokens * cp * sum(shares) // shares[meshes.local_rank("dp")]
    return local_tokens * cp * meshes.size("dp")
