"""Heterogeneous process meshes: the typed layout and its checks (pure; no process group, no torch).

A job spans several process meshes in rank order, each homogeneous with its own tensor / data / pipeline / expert
parallel sizes and device type, chained as pipeline stages with their own layer counts (FlagScale's second
generation of heterogeneous training, SEEDS.md section 3). Every pipeline stage of every mesh becomes a *stage group*:
the ranks of one stage of one mesh, laid out ``("dp", "cp", "tp")`` with tp fastest, like a homogeneous stage.
Context parallelism must be equal on every mesh (a token then lives on the same CP rank on both sides of a
boundary); sequence parallelism applies on the meshes with TP > 1; with ``virtual_pipeline_parallel_size=v``
(interleaved 1F1B, ``zero_bubble``) every stage group holds ``v`` model chunks, placed in a loop (global stage
``k G + g`` is chunk ``k`` of group ``g``). The V-shaped schedules (``zbv``, ``dualpipev``) hold two chunks per group
placed in a V: stage ``g`` down the groups, then stage ``2G - 1 - g`` back up, so the first group holds the first and
the last stage (``parallel/schedules.py::stage_placement``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_flagscale.parallel.schedules import SCHEDULE_SPECS, stage_placement

__all__ = [
    "MESH_KEYS", "HeteroMesh", "StageGroup", "hetero_virtual_size", "parse_hetero_meshes", "plan_stage_groups",
    "rank_order_by_type", "speed_aware_layers", "split_into_chunks",
]  # fmt: skip

MESH_KEYS = (
    "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size", "context_parallel_size",
    "expert_parallel_size", "device_type",
)  # fmt: skip


@dataclass(frozen=True)
class HeteroMesh:
    """One homogeneous process mesh of a heterogeneous job."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    device_type: str | None = None
    """A free label (e.g. "fast", "A100"): ranks reporting this type fill the mesh (``rank_order_by_type``)."""

    @property
    def size(self) -> int:
        return (
            self.tensor_parallel_size
            * self.data_parallel_size
            * self.pipeline_parallel_size
            * (self.context_parallel_size)
        )


@dataclass(frozen=True)
class StageGroup:
    """The ranks of one pipeline stage of one mesh: positions ``first_rank ... first_rank + size - 1`` of the
    world in mesh order, i.e. those global ranks, or ``global_ranks`` when ranks were assigned by device type."""

    index: int
    """Global pipeline stage index (over all meshes)."""
    mesh: int
    """Index of the mesh it belongs to."""
    first_rank: int
    tensor_parallel_size: int
    data_parallel_size: int
    context_parallel_size: int
    expert_parallel_size: int
    num_layers: int
    device_type: str | None = None
    chunk_layers: tuple[int, ...] = ()
    """Blocks of each of the group's model chunks (one per virtual stage; ``(num_layers,)`` without them)."""
    sequence_parallel: bool = False
    """Activations between blocks are split along the sequence over TP (sequence parallelism with TP > 1)."""

    def __post_init__(self) -> None:
        if not self.chunk_layers:
            object.__setattr__(self, "chunk_layers", (self.num_layers,))

    global_ranks: tuple[int, ...] = ()
    """The group's global ranks in its (dp, cp, tp) order when they are not ``first_rank ...`` (see
    ``rank_order_by_type``); empty = contiguous."""

    @property
    def size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size * self.context_parallel_size

    @property
    def ranks(self) -> list[int]:
        """Global ranks in the group's (dp, cp, tp) order, tp fastest."""
        return list(self.global_ranks) or list(range(self.first_rank, self.first_rank + self.size))

    def local_index(self, rank: int) -> int:
        """Position of global ``rank`` in :attr:`ranks` (``rank - first_rank`` when contiguous)."""
        return self.ranks.index(rank)

    @property
    def token_shards(self) -> int:
        """Data x context ranks: how many disjoint token shards of every micro-batch the group holds."""
        return self.data_parallel_size * self.context_parallel_size


def parse_hetero_meshes(meshes: list[dict[str, Any]] | list[HeteroMesh]) -> list[HeteroMesh]:
    """Typed meshes from dicts (as in a recipe), raising ``ValueError`` naming the bad entry and the valid keys."""
    if not isinstance(meshes, (list, tuple)) or not meshes:
        raise ValueError("hetero_meshes must be a non-empty list of per-mesh layouts (dicts).")
    out = []
    for i, mesh in enumerate(meshes):
        if isinstance(mesh, HeteroMesh):
            out.append(mesh)
            continue
        if not isinstance(mesh, dict):
            raise ValueError(f"hetero_meshes[{i}] must be a dict of {', '.join(MESH_KEYS)}; got {type(mesh).__name__}.")
        unknown = sorted(set(mesh) - set(MESH_KEYS))
        if unknown:
            raise ValueError(f"hetero_meshes[{i}] has unknown keys {unknown}; valid keys are {', '.join(MESH_KEYS)}.")
        for key, value in mesh.items():
            if key != "device_type" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"hetero_meshes[{i}].{key} must be a positive integer, got {value!r}.")
        out.append(HeteroMesh(**mesh))
    return out


def check_hetero_layout(
    meshes: list[HeteroMesh],
    layers: list[int] | None,
    *,
    schedule: str,
    sequence_parallel: bool,
    virtual: int | None = 1,
) -> None:
    """Every check that needs only the config (world size and model checks come later); ``virtual=None``: auto
    (:func:`hetero_virtual_size`)."""
    cps = {m.context_parallel_size for m in meshes}
    if len(cps) > 1:
        raise ValueError(
            f"context_parallel_size differs between hetero_meshes ({sorted(cps)}); it must be equal on every mesh"
            " (a token then lives on the same context-parallel rank on both sides of a boundary)."
        )
    if sequence_parallel and all(m.tensor_parallel_size == 1 for m in meshes):
        raise ValueError(
            "sequence_parallel=True needs tensor_parallel_size > 1 on at least one of the hetero_meshes (it shards"
            " activations over TP); raise a mesh's tensor_parallel_size or set sequence_parallel=False."
        )
    if SCHEDULE_SPECS[schedule].placement == "v" and virtual not in (None, 2):
        raise ValueError(
            f"pipeline_schedule={schedule!r} is V-shaped: every hetero stage group holds exactly 2 model chunks"
            f" (stage g and stage 2G-1-g), so it needs virtual_pipeline_parallel_size=2, got {virtual}; set it to 2 or"
            " leave it unset (auto)."
        )
    virtual = hetero_virtual_size(schedule, virtual)
    if virtual > 1 and schedule not in ("interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"):
        raise ValueError(
            f"virtual_pipeline_parallel_size={virtual} with hetero_meshes needs pipeline_schedule='interleaved_1f1b'"
            f" or 'zero_bubble' (got {schedule!r}); or set virtual_pipeline_parallel_size=1."
        )
    stages = sum(m.pipeline_parallel_size for m in meshes)
    if stages < 2:
        raise ValueError("hetero_meshes needs at least two pipeline stages in total (two meshes, or pp > 1).")
    if layers is not None:
        if len(layers) not in (stages, stages * virtual):
            counts = f"{stages}" if virtual == 1 else f"{stages} (or {stages * virtual}, one per virtual stage)"
            raise ValueError(
                f"hetero_layers={layers} has {len(layers)} entries but the meshes have {counts} pipeline stages in"
                " total; give one layer count per stage, mesh by mesh."
            )
        if any(not isinstance(n, int) or n < 1 for n in layers):
            raise ValueError(f"hetero_layers={layers} must hold positive integers.")


def hetero_virtual_size(schedule: str, virtual: int | None) -> int:
    """Model chunks per stage group: ``virtual``, or when unset (``None``) 2 for the V-shaped schedules and 1 else (a
    heterogeneous job always has at least two pipeline stages)."""
    _check_schedule(schedule)
    if virtual is not None:
        return virtual
    return 2 if SCHEDULE_SPECS[schedule].placement == "v" else 1


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULE_SPECS:
        raise ValueError(f"pipeline_schedule={schedule!r} is unknown; use one of {sorted(SCHEDULE_SPECS)}.")


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
                device_type=mesh.device_type, chunk_layers=chunks[index],
                sequence_parallel=sequence_parallel and mesh.tensor_parallel_size > 1, global_ranks=span,
            )  # fmt: skip
            groups.append(group)
            rank += group.size
            index += 1
    return groups


def _declared_type(reported: str | None, declared: list[str]) -> str | None:
    """The declared type a rank's reported one names: itself, else the longest declared type it contains
    (case-insensitive), else unchanged."""
    if reported is None or reported in declared:
        return reported
    contained = [t for t in declared if t.lower() in str(reported).lower()]
    return max(contained, key=len) if contained else reported


def rank_order_by_type(meshes: list[HeteroMesh], rank_types: list[str | None]) -> list[int]:
    """The global rank at each position of the mesh-ordered world, from every rank's reported device type.

    Ranks fill the meshes in rank order when every rank reports the same type (or none) or no mesh declares a
    ``device_type`` (one type: nothing to match). Otherwise each declared type must be reported by exactly as many
    ranks as the meshes declaring it hold, and the ranks of a type fill its meshes in rank order (stable). A rank
    reports a declared type when it names it or contains it, case-insensitively (the CUDA device name
    ``NVIDIA H100 80GB HBM3`` reports ``H100``; the longest declared type contained wins).
    """
    world = sum(m.size for m in meshes)
    if len(rank_types) != world:
        raise ValueError(f"{len(rank_types)} ranks reported a device type but hetero_meshes describe {world} ranks.")
    declared = [m.device_type for m in meshes]
    if len(set(rank_types)) <= 1 or all(t is None for t in declared):
        return list(range(world))
    if any(t is None for t in declared):
        raise ValueError(
            f"Ranks report different device types but hetero_meshes{[i for i, t in enumerate(declared) if t is None]}"
            " declare none; give every mesh a device_type."
        )
    need: dict[str, int] = {}
    for mesh in meshes:
        need[mesh.device_type] = need.get(mesh.device_type, 0) + mesh.size
    rank_types = [_declared_type(t, list(need)) for t in rank_types]
    have: dict[str, int] = {}
    for t in rank_types:
        have[str(t)] = have.get(str(t), 0) + 1
    if need != have:
        raise ValueError(
            f"The ranks' device types {dict(sorted(have.items()))} (ranks per type; FLAGSCALE_DEVICE_TYPE or the"
            f" accelerator's name) do not match the ranks hetero_meshes declare per device_type"
            f" {dict(sorted(need.items()))}; change the meshes' device_type or sizes."
        )
    queues = {t: [r for r, rt in enumerate(rank_types) if str(rt) == t] for t in need}
    return [queues[m.device_type].pop(0) for m in meshes for _ in range(m.size)]
