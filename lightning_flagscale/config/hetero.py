"""Heterogeneous process meshes: the typed layout and its checks (pure; no process group, no torch).

A job spans several process meshes in rank order, each homogeneous with its own tensor / data / pipeline / expert
parallel sizes and device type, chained as pipeline stages with their own layer counts (FlagScale's second
generation of heterogeneous training, SEEDS.md section 3), in the order listed or in the one the planner chooses
(``hetero_mesh_order="speed"``, ``config/layer_split.py::speed_mesh_order``). Every pipeline stage of every mesh becomes a *stage group*:
the ranks of one stage of one mesh, laid out ``("dp", "cp", "tp")`` with tp fastest, like a homogeneous stage.
Context parallelism must be equal on every mesh (a token then lives on the same CP rank on both sides of a
boundary); sequence parallelism applies on the meshes with TP > 1; with ``virtual_pipeline_parallel_size=v``
(interleaved 1F1B, ``zero_bubble``) every stage group holds ``v`` model chunks, placed in a loop (global stage
``k G + g`` is chunk ``k`` of group ``g``). The V-shaped schedules (``zbv``, ``dualpipev``) hold two chunks per group
placed in a V: stage ``g`` down the groups, then stage ``2G - 1 - g`` back up, so the first group holds the first and
the last stage (``config/schedules.py::stage_placement``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_flagscale.config.schedules import SCHEDULE_SPECS

__all__ = [
    "MESH_KEYS",
    "HeteroMesh",
    "StageGroup",
    "check_hetero_batch_sizes",
    "hetero_micro_batch_sizes",
    "hetero_virtual_size",
    "parse_hetero_meshes",
]  # fmt: skip

MESH_KEYS = (
    "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size", "context_parallel_size",
    "expert_parallel_size", "expert_tensor_parallel_size", "device_type",
)  # fmt: skip


@dataclass(frozen=True)
class HeteroMesh:
    """One homogeneous process mesh of a heterogeneous job."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    """Each expert's FFN split over this many of the mesh's ranks (``ParallelSizes.expert_tensor_parallel_size``)."""
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
    """Index in ``hetero_meshes`` (as listed) of the mesh it belongs to; ``hetero_mesh_order="speed"`` may run the
    meshes in another order, so it need not grow with ``index``."""
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
    expert_tensor_parallel_size: int = 1
    """Expert tensor parallelism inside the group (folded with EP over its ranks)."""

    def __post_init__(self) -> None:
        if not self.chunk_layers:
            object.__setattr__(self, "chunk_layers", (self.num_layers,))

    global_ranks: tuple[int, ...] = ()
    """The group's global ranks in its (dp, cp, tp) order when they are not ``first_rank ...`` (see
    ``rank_order_by_type``); empty = contiguous."""
    warmup: int | None = None
    """1F1B warm-up forwards of this group when not the standard ``G - index - 1`` (``hetero_warmup="speed"``,
    ``config/layer_split.py::speed_warmup``); ``None``: the standard."""

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


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULE_SPECS:
        raise ValueError(f"pipeline_schedule={schedule!r} is unknown; use one of {sorted(SCHEDULE_SPECS)}.")


def check_hetero_batch_sizes(
    batch_sizes: Sequence[int], dp: int, *, micro_batch_size: int = 1, pipeline: bool = False
) -> None:
    """Raise a ``ValueError`` naming the fix when the per-rank batch sizes do not describe ``dp`` ranks."""
    if len(batch_sizes) != dp:
        raise ValueError(
            f"hetero_dp_batch_sizes has {len(batch_sizes)} entries but there are {dp} data-parallel ranks; give one"
            " batch size per data-parallel rank."
        )
    if any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"hetero_dp_batch_sizes={list(batch_sizes)} must hold positive integers.")
    if pipeline:
        hetero_micro_batch_sizes(batch_sizes, micro_batch_size)


def hetero_virtual_size(schedule: str, virtual: int | None) -> int:
    """Model chunks per stage group: ``virtual``, or when unset (``None``) 2 for the V-shaped schedules and 1 else (a
    heterogeneous job always has at least two pipeline stages)."""
    _check_schedule(schedule)
    if virtual is not None:
        return virtual
    return 2 if SCHEDULE_SPECS[schedule].placement == "v" else 1


def hetero_micro_batch_sizes(batch_sizes: Sequence[int], micro_batch_size: int) -> list[int]:
    """Per-rank micro-batch sizes under pipeline parallelism: every rank runs the same number of micro-batches.

    Pipeline schedules and the collectives inside them (expert all-to-all, the data-parallel reduction after the
    last micro-batch) need every data-parallel rank to run the same number of micro-batches, so ``micro_batch_size``
    applies to the smallest share and the other ranks take proportionally larger micro-batches (FlagScale rescales
    the micro-batch size per mesh in the same way).
    """
    smallest = min(batch_sizes)
    if smallest % micro_batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must divide the smallest hetero_dp_batch_sizes entry ({smallest}):"
            " under pipeline parallelism it is the micro-batch size of the rank with the smallest share."
        )
    n = smallest // micro_batch_size
    uneven = [b for b in batch_sizes if b % n]
    if uneven:
        raise ValueError(
            f"hetero_dp_batch_sizes={list(batch_sizes)} with micro_batch_size={micro_batch_size} gives {n} micro-batches"
            f" per step, which do not split the shares {uneven} evenly; make every share a multiple of {n}."
        )
    return [b // n for b in batch_sizes]
