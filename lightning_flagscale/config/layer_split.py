"""Layer-split rules (pure, no torch): even splits padded with empty layer slots, and the heterogeneous planner that
turns meshes, layer counts or device speeds into stage groups. The config validates layouts with them; the runtime
builds stages from the same functions."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Literal

from lightning_flagscale.config.hetero import (
    HeteroMesh,
    StageGroup,
)
from lightning_flagscale.config.schedules import stage_placement
from lightning_flagscale.config.transformer import TransformerConfig


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


def edge_block_costs(model: TransformerConfig, seq_len: int) -> tuple[float, float]:
    """(embedding, LM head) cost of a decoder in blocks: forward FLOPs per token over one block's (issue 42 item 5).

    A block is ``2 x`` its active parameters plus attention's ``Q K^T`` and ``P V`` (``2 x heads x (head_dim +
    v_head_dim) x seq_len``, causal half not discounted, as ``accounting/flops.py`` counts); the LM head is the
    ``vocab x hidden`` GEMM (``2 V h``), once more per MTP module, which also runs one block on the last stage. The
    backward of every GEMM is twice its forward, so the ratio holds for training. The embedding is a lookup: 0. The
    cross-entropy (a few operations per logit against the head's ``2 h``) is left out. At small hidden sizes and
    large vocabularies the head is several blocks (hidden 128, vocab 32k: about 20); at llama-tiny's vocab of 256, a
    sixth of one.
    """
    h, mtp = model.hidden_size, model.num_nextn_predict_layers
    blocks = model.num_layers + mtp
    v_dim = (model.v_head_dim if model.is_mla else None) or model.head_dim
    attention = 2 * model.num_attention_heads * (model.head_dim + v_dim) * seq_len
    block = (2 * (model.num_params(include_embedding=False, active=True) - h) + blocks * attention) / blocks
    head = 2 * model.vocab_size * h * (1 + mtp) + mtp * block
    return 0.0, head / block


def edge_extra_blocks(
    model: TransformerConfig, seq_len: int, stages: int, *, virtual: int = 1, schedule: str = "1f1b"
) -> list[float]:
    """Per stage group, the blocks' worth of embedding and LM head it carries (:func:`edge_block_costs`): the
    embedding on the group of global stage 0, the head on the group of the last (group 0 too under a V schedule)."""
    embed, head = edge_block_costs(model, seq_len)
    extra = [0.0] * stages
    extra[stage_placement(0, stages, schedule)[0]] += embed
    extra[stage_placement(stages * virtual - 1, stages, schedule)[0]] += head
    return extra


def speed_aware_layers(
    meshes: list[HeteroMesh],
    num_layers: int,
    device_speed: dict[str, float] | None = None,
    *,
    min_layers: int = 1,
    extra_blocks: Sequence[float] | None = None,
) -> list[int]:
    """Blocks per pipeline stage that equalise stage times, from each device type's relative speed.

    A stage runs every sample of a micro-batch through its blocks on its ``tp x dp x cp`` ranks, so its time is
    proportional to ``(layers + extra) / (speed x ranks)``, ``extra`` the blocks' worth of other work the stage
    carries on its own device (``extra_blocks``, one per stage: the embedding and the LM head,
    :func:`edge_extra_blocks`; none by default). Blocks are split in proportion to ``speed x ranks`` less each
    stage's extra (largest shortfalls, at least ``min_layers`` per stage: one per model chunk); when whole blocks
    leave that split with a slower slowest stage than another split, the split that minimises the slowest stage
    wins (the head's stage then takes fewer blocks: the pipeline order of the meshes fixes which stage holds it).
    Without ``device_speed`` every device counts as equally fast.
    """
    weights = _stage_weights(meshes, device_speed)
    if num_layers < min_layers * len(weights):
        raise ValueError(
            f"num_layers={num_layers} is fewer than {min_layers} block(s) for each of the {len(weights)} heterogeneous"
            " pipeline stages."
        )
    extra = [0.0] * len(weights) if extra_blocks is None else [float(e) for e in extra_blocks]
    if len(extra) != len(weights) or min(extra) < 0:
        raise ValueError(f"extra_blocks={extra_blocks} needs one value >= 0 per pipeline stage ({len(weights)}).")
    pace = (num_layers + sum(extra)) / sum(weights)  # the common stage time of a split into fractions of blocks
    exact = [pace * w - e for w, e in zip(weights, extra)]
    counts = [max(min_layers, int(x)) for x in exact]
    while sum(counts) < num_layers:  # largest shortfall first
        counts[max(range(len(counts)), key=lambda i: exact[i] - counts[i])] += 1
    while sum(counts) > num_layers:  # every stage keeps its minimum
        counts[max((i for i in range(len(counts)) if counts[i] > min_layers), key=lambda i: counts[i] - exact[i])] -= 1
    best = _min_slowest(weights, extra, num_layers, min_layers)
    if _slowest(best, weights, extra) < _slowest(counts, weights, extra) * (1 - 1e-9):
        return best
    return counts


def _stage_weights(meshes: Sequence[HeteroMesh], device_speed: dict[str, float] | None) -> list[float]:
    """Per pipeline stage, ``speed x ranks`` (every device equally fast without ``device_speed``)."""
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
    return weights


MAX_ORDERED_MESHES = 6
"""``hetero_mesh_order="speed"`` tries every order of the meshes: 720 at 6, each a split of a few blocks."""


def check_orderable(meshes: Sequence[HeteroMesh]) -> None:
    """Refuse more meshes than :func:`speed_mesh_order` tries every order of."""
    if len(meshes) > MAX_ORDERED_MESHES:
        raise ValueError(
            f"hetero_mesh_order='speed' tries every order of the meshes, at most {MAX_ORDERED_MESHES}; with"
            f" {len(meshes)} meshes list them in the order you want and use hetero_mesh_order='given'."
        )


def speed_mesh_order(
    meshes: list[HeteroMesh],
    num_layers: int,
    device_speed: dict[str, float] | None,
    *,
    min_layers: int = 1,
    extra_blocks: Sequence[float] | None = None,
) -> tuple[int, ...]:
    """The order in which the meshes become pipeline stages (``order[p]``: the ``meshes`` index at position ``p``)
    whose :func:`speed_aware_layers` split has the fastest slowest stage (issue 42 item 5).

    ``extra_blocks`` stays with the pipeline position (the embedding on the first stage group, the LM head on the
    last, or on the first under a V schedule: :func:`edge_extra_blocks`), so an order that puts a faster mesh there
    carries the head on faster devices. Every permutation is tried (:data:`MAX_ORDERED_MESHES` at most); ties keep
    the earlier one in lexicographic order, so the given order wins unless another is strictly faster.
    """
    check_orderable(meshes)
    extra = [0.0] * sum(m.pipeline_parallel_size for m in meshes) if extra_blocks is None else list(extra_blocks)
    best, best_time = tuple(range(len(meshes))), math.inf
    for order in itertools.permutations(range(len(meshes))):
        ordered = [meshes[i] for i in order]
        counts = speed_aware_layers(ordered, num_layers, device_speed, min_layers=min_layers, extra_blocks=extra)
        time = _slowest(counts, _stage_weights(ordered, device_speed), extra)
        if time < best_time * (1 - 1e-9):
            best, best_time = order, time
    return best


def pipeline_rank_order(
    meshes: Sequence[HeteroMesh], order: Sequence[int], rank_order: Sequence[int] | None = None
) -> list[int] | None:
    """The global rank at each position of the world laid out mesh by mesh in pipeline ``order``, from
    ``rank_order`` (the same over the meshes as given: ``rank_order_by_type``, ``None`` = rank order). Each mesh
    keeps its own ranks, whatever its pipeline position; ``None`` when that is plain rank order."""
    starts = list(itertools.accumulate((m.size for m in meshes), initial=0))
    given = list(rank_order) if rank_order is not None else list(range(starts[-1]))
    out = [given[p] for i in order for p in range(starts[i], starts[i + 1])]
    return None if out == list(range(starts[-1])) else out


def _slowest(counts: list[int], weights: list[float], extra: list[float]) -> float:
    return max((n + e) / w for n, w, e in zip(counts, weights, extra))


def _min_slowest(weights: list[float], extra: list[float], num_layers: int, min_layers: int) -> list[int]:
    """The split with the fastest slowest stage: from the minimum, each block to the stage it slows least (optimal
    for stage times increasing in their blocks)."""
    counts = [min_layers] * len(weights)
    for _ in range(num_layers - sum(counts)):
        i = min(range(len(counts)), key=lambda j: (counts[j] + 1 + extra[j]) / weights[j])
        counts[i] += 1
    return counts


def speed_warmup(times: Sequence[float], backward_share: float = 2 / 3) -> int:
    """1F1B warm-up forwards of the first stage group so that it does not wait for the first micro-batch's gradient,
    from every group's time per micro-batch (forward + backward; ``hetero_warmup="speed"``, issue 42 item 5).

    Group 0 reaches the backward of micro-batch 0 after ``w + 1`` forwards, and its gradient is back after one forward
    of group 0 and the forward + backward of every later group (which are idle when it arrives): no wait once
    ``w x forward_0 >= sum(later times)``. The same ``w`` covers the drain: group 0 then has ``w`` backwards
    (each longer than a forward) to run while the last micro-batch goes down and back. Never fewer than the standard
    ``G - 1``; the runner caps it at the micro-batch count. ``backward_share``: the backward's share of a group's time
    (a GEMM's backward is twice its forward: 2/3). Each extra warm-up keeps one more micro-batch's activations alive
    on the first group; it pays where that group sets the pace (a slower first mesh), and costs only memory elsewhere.
    With one group there is nothing to wait for: 0.
    """
    if len(times) < 2:
        return 0
    if min(times) <= 0 or not 0 < backward_share < 1:
        raise ValueError(f"speed_warmup needs positive stage times and 0 < backward_share < 1, got {times}, "
                         f"{backward_share}.")  # fmt: skip
    forward = (1 - backward_share) * times[0]
    return max(len(times) - 1, math.ceil(sum(times[1:]) / forward - 1e-9))


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
    extra_blocks: Sequence[float] | None = None,
    mesh_order: Literal["given", "speed"] = "given",
    warmup: Literal["1f1b", "speed"] = "1f1b",
) -> list[StageGroup]:
    """The stage groups in pipeline order: mesh by mesh, each mesh's pipeline stages in order (``schedule`` places the
    model chunks of per-virtual-stage ``layers``). ``extra_blocks``: with ``layers=None``, each stage group's
    embedding and LM head in blocks (:func:`edge_extra_blocks`) for :func:`speed_aware_layers`. ``mesh_order="speed"``
    (``layers=None``): the meshes in the order :func:`speed_mesh_order` chooses, else as given; ``StageGroup.mesh``
    is always the index in ``meshes``.

    ``rank_order[p]`` is the global rank at position ``p`` of the world laid out mesh by mesh in the given order (from
    ``rank_order_by_type``); ``None`` = rank order. A reordered mesh keeps its ranks (:func:`pipeline_rank_order`).
    ``warmup="speed"`` (1F1B, ``device_speed``): the first group's warm-up forwards from the modelled stage times
    (:func:`speed_warmup`, ``StageGroup.warmup``).
    """
    if rank_order is not None and sorted(rank_order) != list(range(sum(m.size for m in meshes))):
        raise ValueError(f"rank_order={rank_order} is not a permutation of the {sum(m.size for m in meshes)} ranks.")
    if mesh_order not in ("given", "speed"):
        raise ValueError(f"hetero_mesh_order={mesh_order!r}; use 'given' or 'speed'.")
    order = tuple(range(len(meshes)))
    if mesh_order == "speed":
        if layers is not None:
            raise ValueError("hetero_mesh_order='speed' chooses the split too; leave hetero_layers at None.")
        order = speed_mesh_order(meshes, num_layers, device_speed, min_layers=virtual, extra_blocks=extra_blocks)
    rank_order = pipeline_rank_order(meshes, order, rank_order)  # None: contiguous groups
    ordered = [meshes[i] for i in order]
    if layers is None:
        layers = speed_aware_layers(ordered, num_layers, device_speed, min_layers=virtual, extra_blocks=extra_blocks)
    if sum(layers) != num_layers:
        raise ValueError(f"hetero_layers={layers} sums to {sum(layers)} but the model has num_layers={num_layers}.")
    chunks = split_into_chunks(list(layers), sum(m.pipeline_parallel_size for m in meshes), virtual, schedule)
    groups, rank, index = [], 0, 0
    for m_idx, mesh in zip(order, ordered):
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
    if warmup == "speed":
        groups[0] = _with_speed_warmup(groups, ordered, device_speed, extra_blocks, schedule)
    return groups


def _with_speed_warmup(
    groups: list[StageGroup], ordered: list[HeteroMesh], device_speed: dict[str, float] | None,
    extra_blocks: Sequence[float] | None, schedule: str,
) -> StageGroup:  # fmt: skip
    """The first group with :func:`speed_warmup`'s warm-up from the modelled times ``(blocks + extra) / (speed x
    ranks)`` (``_slowest``'s model)."""
    if schedule != "1f1b" or device_speed is None or any(len(g.chunk_layers) > 1 for g in groups):
        raise ValueError(
            "hetero_warmup='speed' sets the warm-up of pipeline_schedule='1f1b' without virtual stages from"
            f" hetero_device_speed; got pipeline_schedule={schedule!r}, hetero_device_speed={device_speed}."
        )
    extra = [0.0] * len(groups) if extra_blocks is None else list(extra_blocks)
    weights = _stage_weights(ordered, device_speed)
    times = [(g.num_layers + e) / w for g, e, w in zip(groups, extra, weights, strict=True)]
    return dataclasses.replace(groups[0], warmup=speed_warmup(times))


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
