"""Layer-split rules (pure, no torch): even splits padded with empty layer slots, and the heterogeneous planner that
turns meshes, layer counts or device speeds into stage groups. The config validates layouts with them; the runtime
builds stages from the same functions."""

from __future__ import annotations

import math

from lightning_flagscale.config.hetero import (
    HeteroMesh,
    StageGroup,
)
from lightning_flagscale.config.schedules import stage_placement


def even_layer_counts(num_layers: int, pp: int, vpp: int) -> tuple[list[int], list[int]]:
    """Real layers and padding slots per stage for an even split, padding to equal layers per pipeline rank."""
    stages = pp * vpp
    if num_layers % stages == 0:
        return [num_layers // stages] * stages, [0] * stages
    padded = math.ceil(num_layers / pp) * pp
    per_rank = padded // pp
    if per_rank % vpp:
        fits = [v for v in range(1, per_rank + 1) if per_rank % v == 0]
        raise ValueError(
            f"virtual_pipeline_parallel_size={vpp} does not divide the {per_rank} layer slots per pipeline rank "
            f"({num_layers} layers padded to {padded} for pipeline_parallel_size={pp}); use a virtual size in "
            f"{fits}, or give pipeline_layers explicitly."
        )
    slots = padded // stages
    padding = [0] * stages
    order = _padding_order(stages)
    for i in range(padded - num_layers):
        padding[order[i % stages]] += 1
    return [slots - pad for pad in padding], padding


def speed_aware_layers(
    meshes: list[HeteroMesh], num_layers: int, device_speed: dict[str, float] | None = None, *, min_layers: int = 1
) -> list[int]:
    """Blocks per pipeline stage that equalise stage times, from each device type's relative speed.

    A stage runs every sample of a micro-batch through its blocks on its ``tp x dp x cp`` ranks, so its time is
    proportional to ``layers / (speed x ranks)``: blocks are split in proportion to ``speed x ranks`` (largest
    shortfalls, at least ``min_layers`` per stage: one per model chunk). Without ``device_speed`` every device counts
    as equally fast.
    """
    weights = []
    for i, mesh in enumerate(meshes):
        speed = 1.0
        if device_speed is not None:
            if mesh.device_type not in device_speed:
                raise ValueError(
                    f"hetero_device_speed has no entry for hetero_meshes[{i}].device_type={mesh.device_type!r};"
                    f" give one for each of {sorted({str(m.device_type) for m in meshes})}."
                )
            speed = float(device_speed[mesh.device_type])
            if speed <= 0:
                raise ValueError(f"hetero_device_speed[{mesh.device_type!r}]={speed} must be positive.")
        stage_ranks = mesh.size // mesh.pipeline_parallel_size
        weights += [speed * stage_ranks] * mesh.pipeline_parallel_size
    if num_layers < min_layers * len(weights):
        raise ValueError(
            f"num_layers={num_layers} is fewer than {min_layers} block(s) for each of the {len(weights)} heterogeneous"
            " pipeline stages."
        )
    exact = [num_layers * w / sum(weights) for w in weights]
    counts = [max(min_layers, int(x)) for x in exact]
    while sum(counts) < num_layers:  # largest shortfall first
        counts[max(range(len(counts)), key=lambda i: exact[i] - counts[i])] += 1
    while sum(counts) > num_layers:  # every stage keeps its minimum
        counts[max((i for i in range(len(counts)) if counts[i] > min_layers), key=lambda i: counts[i] - exact[i])] -= 1
    return counts


def split_into_chunks(layers: list[int], stages: int, virtual: int, schedule: str) -> list[tuple[int, ...]]:
    """Per stage group, the blocks of each model chunk: given per virtual stage in pipeline order (global stage ``s``
    is chunk ``k`` of group ``g``, ``(g, k) = stage_placement(s)``: ``k G + g`` looped, ``g`` / ``2G - 1 - g`` in a
    V), or per group and split as evenly as possible (earlier chunks take the remainder)."""
    if len(layers) == stages * virtual and virtual > 1:
        out = [[0] * virtual for _ in range(stages)]
        for s, n in enumerate(layers):
            g, k = stage_placement(s, stages, schedule)
            out[g][k] = n
        return [tuple(chunks) for chunks in out]
    out = []
    for g, n in enumerate(layers):
        if n < virtual:
            raise ValueError(
                f"Pipeline stage {g} has {n} blocks, fewer than virtual_pipeline_parallel_size={virtual}; give it more"
                " blocks (hetero_layers) or lower virtual_pipeline_parallel_size."
            )
        out.append(tuple(n // virtual + (k < n % virtual) for k in range(virtual)))
    return out


def plan_stage_groups(
    meshes: list[HeteroMesh],
    layers: list[int] | None,
    num_layers: int,
    device_speed: dict[str, float] | None = None,
    rank_order: list[int] | None = None,
    *,
    virtual: int = 1,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
) -> list[StageGroup]:
    """The stage groups in pipeline order: mesh by mesh, each mesh's pipeline stages in order (``schedule`` places the
    model chunks of per-virtual-stage ``layers``).

    ``rank_order[p]`` is the global rank at position ``p`` of the world laid out mesh by mesh (from
    ``rank_order_by_type``); ``None`` = rank order.
    """
    if rank_order is not None and sorted(rank_order) != list(range(sum(m.size for m in meshes))):
        raise ValueError(f"rank_order={rank_order} is not a permutation of the {sum(m.size for m in meshes)} ranks.")
    if rank_order is not None and list(rank_order) == sorted(rank_order):
        rank_order = None  # identity: keep the groups contiguous
    if layers is None:
        layers = speed_aware_layers(meshes, num_layers, device_speed, min_layers=virtual)
    if sum(layers) != num_layers:
        raise ValueError(f"hetero_layers={layers} sums to {sum(layers)} but the model has num_layers={num_layers}.")
    chunks = split_into_chunks(list(layers), sum(m.pipeline_parallel_size for m in meshes), virtual, schedule)
    groups, rank, index = [], 0, 0
    for m_idx, mesh in enumerate(meshes):
        for _ in range(mesh.pipeline_parallel_size):
            span = tuple(rank_order[rank : rank + mesh.size // mesh.pipeline_parallel_size]) if rank_order else ()
            group = StageGroup(
                index=index, mesh=m_idx, first_rank=rank, tensor_parallel_size=mesh.tensor_parallel_size,
                data_parallel_size=mesh.data_parallel_size, context_parallel_size=mesh.context_parallel_size,
                expert_parallel_size=mesh.expert_parallel_size, num_layers=sum(chunks[index]),
                expert_tensor_parallel_size=mesh.expert_tensor_parallel_size,
                device_type=mesh.device_type, chunk_layers=chunks[index],
                sequence_parallel=sequence_parallel and mesh.tensor_parallel_size > 1, global_ranks=span,
            )  # fmt: skip
            groups.append(group)
            rank += group.size
            index += 1
    return groups


def _padding_order(num_stages: int) -> list[int]:
    # Placeholders go first where the non-layer work is: last stage (norm + LM head), first stage (embedding),
    # then inwards, so the real layers shift towards the middle stages that carry nothing else.
    order: list[int] = []
    lo, hi = 0, num_stages - 1
    while lo <= hi:
        order.append(hi)
        if lo != hi:
            order.append(lo)
        lo, hi = lo + 1, hi - 1
    return order
