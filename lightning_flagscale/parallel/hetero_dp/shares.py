"""Speed-aware heterogeneous data-parallel shares: ``hetero_dp_batch_sizes="auto"`` (issue 12, item 6).

The first-generation hetero-DP (``parallel/hetero_dp/batching.py``) gives each data-parallel rank a hand-written share of every
global batch. With ``"auto"`` the shares follow the ranks' speeds, from the same sources as the heterogeneous-mesh
layer split:

1. **Speeds** (:func:`gather_dp_speeds`, at strategy setup, before the model is sharded). With
   ``hetero_device_speed`` each rank's ``FLAGSCALE_DEVICE_TYPE`` looks its speed up in that dict (a type missing
   from it is an error naming the rank); otherwise every rank runs the profiling pass of
   ``parallel/hetero_mesh/profile.py`` (forward + backward of one block, under the emulated slowdown if any) and the
   speed of a device type is ``1 / median`` of its ranks' times (ranks without a type count alone). One
   ``all_gather_object`` gives every rank every entry, so all ranks compute the same list. A data-parallel rank made
   of several ranks (TP / CP) runs at the pace of its slowest member.
2. **Shares** (:func:`auto_shares`, at the first training loader, when the global batch is known: the DataLoader's
   batch size x DP, i.e. the same global batch as an even split). Shares are whole micro-batches of
   ``micro_batch_size`` samples, at least one per rank, in proportion to speed
   (:func:`parallel.hetero.proportional_shares`: floors, then each left-over micro-batch to the rank that would
   finish it soonest). The shares are gathered once and compared (all ranks must agree, e.g. on the loader's batch
   size), logged on rank 0, and written into the config's ``hetero_dp_batch_sizes``, where the batch samplers and
   the token count read them as if given by hand. Under pipeline parallelism every rank runs the same number of
   micro-batches, each of its own size (:func:`pipeline_shares` picks the count), and the pipeline runner takes the
   sizes when the loader is built (``apply_hetero_shares``).
3. **Resume** (:func:`resume_shares`): a checkpoint stores the resolved shares (the strategy's ``parallel_config``);
   an ``"auto"`` run resumed from it under the same data-parallel size keeps them instead of the speeds measured
   again at setup, so every rank reads the same samples as the uninterrupted run (issue 14's exact resume).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_flagscale.config.schedules import min_microbatches
from lightning_flagscale.models.protocol import model_config
from lightning_flagscale.parallel.hetero_dp.batching import proportional_shares
from lightning_flagscale.parallel.hetero_mesh.profile import _MAX_PROFILE_SEQ, time_one_block
from lightning_flagscale.parallel.hetero_mesh.ranks import DEVICE_TYPE_ENV, local_device_type

__all__ = ["auto_shares", "dp_speeds_from", "gather_dp_speeds", "pipeline_shares", "resume_shares"]

_log = logging.getLogger(__name__)


def dp_speeds_from(
    entries: list[tuple[int, str | None, float | None]], dp: int, device_speed: dict[str, float] | None = None
) -> list[float]:
    """Speed per data-parallel rank from every rank's ``(dp rank, device type, block seconds)`` (rank order).

    With ``device_speed``: the speed of each rank's type (each must be listed); otherwise ``1 / median`` of the
    block times per type. A data-parallel rank runs at the pace of its slowest member.
    """
    if device_speed is not None:
        missing = sorted({f"rank {r}: {kind!r}" for r, (_, kind, _) in enumerate(entries) if kind not in device_speed})
        if missing:
            raise ValueError(
                f"hetero_dp_batch_sizes='auto' with hetero_device_speed={device_speed}: no speed for the device type"
                f" of {', '.join(missing)}; set {DEVICE_TYPE_ENV} on every rank to one of {sorted(device_speed)} or"
                " add the type to hetero_device_speed."
            )
        per_rank = [float(device_speed[kind]) for _, kind, _ in entries]  # type: ignore[index]
    else:
        times: dict[str, list[float]] = {}
        keys = [kind if kind is not None else f"rank {r}" for r, (_, kind, _) in enumerate(entries)]
        for key, (_, _, seconds) in zip(keys, entries):
            times.setdefault(key, []).append(float(seconds))  # type: ignore[arg-type]
        speed = {key: 1.0 / max(statistics.median(ts), 1e-9) for key, ts in times.items()}
        per_rank = [speed[key] for key in keys]
    out: list[float | None] = [None] * dp
    for (d, _, _), s in zip(entries, per_rank):
        out[d] = s if out[d] is None else min(out[d], s)  # type: ignore[type-var]
    if any(s is None for s in out):
        raise ValueError(f"Data-parallel ranks {[d for d, s in enumerate(out) if s is None]} reported no speed.")
    return [float(s) for s in out]  # type: ignore[arg-type]


def gather_dp_speeds(parallel: Any, meshes: Any, model: nn.Module, device: torch.device) -> list[float] | None:
    """Every data-parallel rank's speed, the same list on every rank (module docstring, step 1); ``None`` (and no
    collective) unless ``parallel.hetero_dp_batch_sizes == "auto"``."""
    if parallel.hetero_dp_batch_sizes != "auto":
        return None
    dp_rank, dp = meshes.local_rank("dp"), meshes.size("dp")
    kind = local_device_type(device)
    seconds = None
    if parallel.hetero_device_speed is None:
        config = model_config(model)
        seq_len = min(config.max_seq_len if config is not None else 128, _MAX_PROFILE_SEQ)
        seconds = time_one_block(model, device, samples=parallel.micro_batch_size, seq_len=seq_len, device_type=kind)
    entries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (dp_rank, kind, seconds))
    return dp_speeds_from(entries, dp, parallel.hetero_device_speed)


def auto_shares(parallel: Any, speeds: list[float], loader_batch: int | None) -> list[int]:
    """Per-rank batch shares of the global batch ``loader_batch x DP`` in proportion to ``speeds`` (module docstring,
    step 2); checked identical on every rank and logged."""
    mbs, dp = parallel.micro_batch_size, len(speeds)
    if loader_batch is None:
        raise ValueError("hetero_dp_batch_sizes='auto' needs a training DataLoader with a batch_size.")
    global_batch = loader_batch * dp
    if global_batch % mbs or global_batch // mbs < dp:
        raise ValueError(
            f"hetero_dp_batch_sizes='auto': the global batch of {global_batch} samples (DataLoader batch_size"
            f" {loader_batch} x {dp} data-parallel ranks) must be a whole number of micro-batches of"
            f" micro_batch_size={mbs}, at least one per rank; change the batch size or micro_batch_size."
        )
    if parallel.pipeline_parallel_size > 1:
        shares = pipeline_shares(
            speeds, global_batch, mbs, parallel.pipeline_parallel_size,
            min_microbatches(parallel.pipeline_schedule, parallel.pipeline_parallel_size,
                             parallel.virtual_pipeline_parallel_size),
        )  # fmt: skip
    else:
        shares = [units * mbs for units in proportional_shares(speeds, global_batch // mbs)]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, shares)
    if any(other != shares for other in every):
        raise RuntimeError(
            f"hetero_dp_batch_sizes='auto': ranks chose different shares {every} (DataLoader batch sizes must be the"
            " same on every rank)."
        )
    if dist.get_rank() == 0:
        fastest = max(speeds)
        _log.info(
            "hetero_dp_batch_sizes='auto': relative speed per data-parallel rank %s -> shares %s of %d samples",
            [round(s / fastest, 3) for s in speeds], shares, global_batch,
        )  # fmt: skip
    return shares


def pipeline_shares(
    speeds: list[float], global_batch: int, micro_batch_size: int, pp: int, min_micro: int
) -> list[int]:
    """Shares of ``global_batch`` under pipeline parallelism, in proportion to ``speeds`` (module docstring, step 2).

    Every data-parallel rank runs the same number ``n`` of micro-batches (the schedule and the collectives inside it
    need it), each of its own size, the slowest rank's being ``micro_batch_size`` (:func:`hetero_micro_batch_sizes`):
    for each ``n`` that divides the global batch (at least the schedule's ``min_micro``), the ranks' micro-batch sizes
    are proportional whole samples summing to ``global_batch / n``; the ``n`` with the shortest step wins, priced as
    1F1B's ``(n + pp - 1)`` micro-batch slots of the slowest rank's micro-batch time (fewer, larger micro-batches
    round the proportions more finely but widen the pipeline's fill and drain); ties take more micro-batches."""
    best: tuple[float, int, list[int]] | None = None
    for n in range(min_micro, global_batch + 1):
        if global_batch % n or global_batch // n < len(speeds):
            continue
        sizes = proportional_shares(speeds, global_batch // n)
        if min(sizes) != micro_batch_size:
            continue
        step = (n + pp - 1) * max(b / v for b, v in zip(sizes, speeds))
        if best is None or step < best[0] * (1 - 1e-9) or (step <= best[0] * (1 + 1e-9) and n > best[1]):
            best = (step, n, [b * n for b in sizes])
    if best is None:
        raise ValueError(
            f"hetero_dp_batch_sizes='auto' under pipeline parallelism: no split of the global batch of {global_batch}"
            f" samples gives every data-parallel rank the same number (at least {min_micro}) of micro-batches with the"
            f" slowest rank's of micro_batch_size={micro_batch_size} samples at speeds {[round(v, 3) for v in speeds]};"
            " raise the DataLoader batch size or give hetero_dp_batch_sizes as a list."
        )
    return best[2]


def resume_shares(parallel: Any, saved: Any, dp: int) -> None:
    """Adopt the shares a checkpoint was trained with when resuming an ``"auto"`` run (module docstring, step 3).

    Speeds measured again at setup may round to other shares, which would hand each rank other samples than the
    interrupted run; under another data-parallel size the saved shares do not apply and are chosen afresh (logged).
    """
    if parallel.hetero_dp_batch_sizes != "auto" or not isinstance(saved, (list, tuple)):
        return
    if len(saved) != dp:
        _log.info("hetero_dp_batch_sizes='auto': the checkpoint's shares %s are for %d ranks, not %d; chosen afresh",
                  list(saved), len(saved), dp)  # fmt: skip
        return
    parallel.hetero_dp_batch_sizes = [int(n) for n in saved]
    if dist.is_initialized() and dist.get_rank() == 0:
        _log.info(
            "hetero_dp_batch_sizes='auto': resumed with the checkpoint's shares %s", parallel.hetero_dp_batch_sizes
        )
