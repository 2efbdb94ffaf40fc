"""Speed-aware layer split of heterogeneous meshes from a short profiling pass on the real ranks (issue 12, item 6).

With ``hetero_layers=None`` and no ``hetero_device_speed``, every rank times forward + backward of one model block
with the clock of the emulation hooks (CPU: the thread's CPU time, immune to other jobs' load; see ``hetero_ranks``)
(a copy of the first block, materialised alone, on a fixed workload: ``micro_batch_size`` samples of
``min(max_seq_len, 256)`` tokens, identical on every rank so that the times compare devices, not layouts). Each rank
takes the median of a few repetitions after a warm-up; one ``all_gather_object`` gives every rank every median, and
each device type's time is the median over its ranks, so all ranks agree on the speeds ``1 / time`` bit for bit.
``speed_aware_layers`` then splits the blocks in proportion to speed x ranks per stage, counting the embedding and
the LM head (in blocks' worth of FLOPs, ``edge_extra_blocks``) on the stages that hold them. The emulated slowdown of
``parallel/hetero_mesh/ranks.py`` is applied to the profiled block as to the training step, so the pass sees it.

Micro-batch shares: a heterogeneous-mesh micro-batch is one set of samples that every stage group splits over its
own data-parallel ranks, so there are no per-mesh shares to choose; only the layer split follows the speeds. The same
pass times the ranks of a hetero-DP job with ``hetero_dp_batch_sizes="auto"`` (``parallel/hetero_dp/shares.py``), whose
per-rank batch shares then follow the speeds.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.config.hetero import StageGroup, parse_hetero_meshes
from lightning_flagscale.config.layer_split import edge_extra_blocks, speed_aware_layers, split_into_chunks
from lightning_flagscale.models.protocol import PipelineInputs, WeightInit, model_config
from lightning_flagscale.parallel.hetero_mesh.ranks import (
    BusyTimer,
    attach_busy_timer,
    install_emulated_slowdown,
    rank_device_type,
)
from lightning_flagscale.parallel.pipeline_parallel.plan import build_stage_module, is_layer_unit

__all__ = ["apply_profiled_split", "gather_device_speed", "time_one_block"]

_log = logging.getLogger(__name__)
_MAX_PROFILE_SEQ = 256


def time_one_block(
    model: nn.Module, device: torch.device, *, samples: int, seq_len: int, reps: int = 5, device_type: str | None = None
) -> float:
    """Median seconds of forward + backward of ``model``'s first block on ``samples x seq_len`` tokens.

    ``model`` may live on the meta device (as under the strategy): the units before the first block (which produce
    its input from token ids) and the block are copied out and materialised alone.
    """
    units = list(model.pipeline_units())
    first = next((i for i, u in enumerate(units) if is_layer_unit(u)), None)
    if first is None:
        raise ValueError("The profiling pass needs a model whose pipeline_units() contain blocks ('layers.<i>').")
    pre = _materialise(build_stage_module(model, units[:first]), device) if first else None
    block = _materialise(build_stage_module(model, [units[first]]), device)
    # The training step's hooks (and clock); without emulation the same hooks with factor 1.
    timer = install_emulated_slowdown([block], device_type, device) or attach_busy_timer(
        [block], BusyTimer(1.0, device)
    )
    x = torch.zeros(samples, seq_len, dtype=torch.long, device=device)  # token 0 exists in every vocabulary
    kwargs: dict[str, Any] = {}
    if isinstance(model, PipelineInputs):
        x, kwargs = model.pipeline_inputs(x)
    with torch.no_grad():
        hidden = pre(x, **kwargs) if pre is not None else x.float()
    times = []
    for _ in range(reps + 1):  # the first repetition warms up allocators and kernels
        h = hidden.detach().requires_grad_(True)
        timer.reset()
        block(h, **kwargs).float().square().mean().backward()
        times.append(timer.busy_s)  # forward + backward of the block, stretched by the emulated factor
    return statistics.median(times[1:])


def _materialise(stage: nn.Module, device: torch.device) -> nn.Module:
    if any(p.is_meta for p in stage.parameters()):
        stage = stage.to_empty(device=device)
        if isinstance(stage, WeightInit):
            stage.init_weights(0)
        else:
            for p in stage.parameters():
                nn.init.normal_(p, std=0.02)
    return stage.to(device)


def gather_device_speed(seconds: float, device_type: str | None) -> dict[str | None, float]:
    """Every rank's block time, gathered once; per device type the speed ``1 / median time`` (same on all ranks)."""
    every: list[tuple[str | None, float]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every, (device_type, seconds))
    per_type: dict[str | None, list[float]] = {}
    for kind, t in every:
        per_type.setdefault(kind, []).append(t)
    return {kind: 1.0 / max(statistics.median(ts), 1e-9) for kind, ts in per_type.items()}


def apply_profiled_split(
    hetero: Any, groups: list[StageGroup], model: nn.Module | None, device: torch.device
) -> list[StageGroup]:
    """``groups`` with block counts from a profiling pass when ``hetero`` (the job's ``ParallelConfig``) leaves the
    split open (``hetero_layers`` and ``hetero_device_speed`` both ``None``); otherwise ``groups`` unchanged."""
    if hetero.hetero_layers is not None or hetero.hetero_device_speed is not None or model is None:
        return groups
    me = next(g for g in groups if dist.get_rank() in g.ranks)
    config = model_config(model)
    seq_len = min(config.max_seq_len if config is not None else 128, _MAX_PROFILE_SEQ)
    kind = me.device_type
    seconds = time_one_block(
        model, device, samples=hetero.micro_batch_size, seq_len=seq_len, device_type=rank_device_type(groups)
    )
    speed = gather_device_speed(seconds, kind)
    meshes = parse_hetero_meshes(hetero.hetero_meshes)
    virtual = len(groups[0].chunk_layers)  # model chunks per stage group (interleaved / V schedules: 2 or more)
    # the embedding and LM head in blocks, on the stage groups that hold them (FLOPs from the config; issue 42 item 5)
    extra = None
    if isinstance(config, TransformerConfig):
        extra = edge_extra_blocks(config, seq_len, len(groups), virtual=virtual, schedule=hetero.pipeline_schedule)
    layers = speed_aware_layers(
        meshes, sum(g.num_layers for g in groups), speed, min_layers=virtual, extra_blocks=extra
    )
    chunks = split_into_chunks(layers, len(groups), virtual, hetero.pipeline_schedule)
    if dist.get_rank() == 0:
        fastest = max(speed.values())
        _log.info(
            "Heterogeneous split from the profiling pass: relative speed per device type %s -> blocks per stage %s",
            {k: round(v / fastest, 3) for k, v in speed.items()}, layers,
        )  # fmt: skip
    # chunk_layers too: the pipeline is cut by it (each group's blocks split evenly over its chunks, as for a
    # hetero_layers entry per stage), and replace() would keep the planned split's value.
    return [dataclasses.replace(g, num_layers=n, chunk_layers=c) for g, n, c in zip(groups, layers, chunks)]
