"""Pipeline planning (pure, no process group): which units each stage runs, and the stage modules cut from a model.

* **Stage planning** from the model protocol's ``pipeline_units()``: even split, explicit ``pipeline_layers``, or
  cost balancing that counts the embedding and LM head (and a vision tower); **empty-layer padding** (61 layers,
  p=8, v=2 -> 64 slots): placeholder slots exist only in the plan, so they cost nothing and hold no weights.
* **Stage modules** cut from one (meta) model by removing what a stage does not run, keeping every FQN, so a
  checkpoint written with PP=2 loads with PP=1 or PP=4; units may have any names (blocks in ``nn.ModuleDict``s).

The runner that executes the stages is in ``pipeline.py``; heterogeneous meshes use the same plan
(``hetero_mesh.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_flagscale.config.layer_split import even_layer_counts
from lightning_flagscale.models.protocol import PipelineUnitCosts

__all__ = [
    "StagePlan",
    "build_stage_module",
    "check_units_cover_parameters",
    "is_layer_unit",
    "pipeline_unit_costs",
    "plan_stages",
    "stage_ids_for_rank",
    "tied_parameters",
    "unit_param_costs",
]


# --------------------------------------------------------------------------------------------------------------------
# Stage planning (pure, no process group)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """Which pipeline units each global stage runs, and how many placeholder (padding) layers it has."""

    units: tuple[tuple[str, ...], ...]
    """Per global stage, the units from ``pipeline_units()`` it runs, in execution order."""
    padding: tuple[int, ...]
    """Per global stage, placeholder layer slots: nothing is built for them, they only shape the split."""

    @property
    def num_stages(self) -> int:
        return len(self.units)

    def layers(self, stage: int) -> list[str]:
        """Decoder-layer keys (``"0"``, ``"1"``, ...) of ``stage``."""
        return [u.rpartition(".")[2] for u in self.units[stage] if is_layer_unit(u)]

    def num_layers(self) -> list[int]:
        return [len(self.layers(s)) for s in range(self.num_stages)]


def is_layer_unit(unit: str) -> bool:
    """A repeated block (``layers.3``, ``encoder.blocks.0``): an entry of a ``ModuleDict`` keyed by its index.

    Even splits and ``pipeline_layers`` count these; every other unit (embedding, norm, head, a bridge between two
    towers) travels with its neighbours: before the first block to the first stage, after the last block to the last
    stage, in between with the block before it.
    """
    parent, _, last = unit.rpartition(".")
    return bool(parent) and last.isdigit()


def _layer_positions(units: Sequence[str]) -> list[int]:
    idx = [i for i, u in enumerate(units) if is_layer_unit(u)]
    if not idx:
        raise ValueError(
            f"pipeline_units() has no repeated blocks ('<container>.<index>', e.g. 'layers.0'): {list(units)}."
        )
    return idx


def _assemble(units: Sequence[str], counts: Sequence[int]) -> list[tuple[str, ...]]:
    """Stages from per-stage block counts: other units join the block before them (or the first stage)."""
    layer_idx = _layer_positions(units)
    stage_of_layer = [s for s, n in enumerate(counts) for _ in range(n)]
    out: list[list[str]] = [[] for _ in counts]
    current, k = 0, 0
    for i, unit in enumerate(units):
        if is_layer_unit(unit):
            current = stage_of_layer[k]
            k += 1
        elif i > layer_idx[-1]:
            current = len(counts) - 1
        out[current].append(unit)
    return [tuple(stage) for stage in out]


def _balanced_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of ``costs`` into ``parts`` non-empty runs minimising the largest run; returns run lengths."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-run cost splitting the first i units into k runs; cut[k][i]: start of the last run.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    lengths, i = [], n
    for k in range(parts, 0, -1):
        lengths.append(i - cut[k][i])
        i = cut[k][i]
    return lengths[::-1]


def plan_stages(
    units: Sequence[str],
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    *,
    pipeline_layers: Sequence[int] | None = None,
    balance: str = "even",
    unit_costs: Mapping[str, float] | None = None,
) -> StagePlan:
    """Cut ``units`` (from ``model.pipeline_units()``) into ``pp x vpp`` contiguous stages.

    ``pipeline_layers`` fixes the decoder layers per stage; otherwise ``balance="even"`` gives every stage the same
    number of layer slots (padding with placeholders when needed) and ``balance="cost"`` minimises the largest
    stage cost from ``unit_costs`` (e.g. :func:`pipeline_unit_costs`), counting embedding, final norm and LM head.
    Units before the first layer always go to stage 0 and units after the last to the last stage, except under
    ``"cost"``, where the units before the first layer (together: the embedding, and e.g. a vision tower) or the
    head may get a stage of its own.
    """
    stages = pipeline_parallel_size * virtual_pipeline_parallel_size
    if stages > len(units):
        raise ValueError(
            f"pipeline_parallel_size x virtual_pipeline_parallel_size = {stages} stages exceed the {len(units)} "
            f"pipeline units of the model ({', '.join(units)}); lower the pipeline size."
        )
    num_layers = len(_layer_positions(units))
    if pipeline_layers is not None:
        counts, padding = list(pipeline_layers), [0] * stages
        if len(counts) != stages:
            raise ValueError(f"pipeline_layers={counts} needs one entry per stage ({stages} stages).")
        if sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(f"pipeline_layers={counts} must be >= 0 and sum to the {num_layers} model blocks.")
    elif balance == "even":
        counts, padding = even_layer_counts(num_layers, pipeline_parallel_size, virtual_pipeline_parallel_size)
    elif balance == "cost":
        if unit_costs is None:
            raise ValueError("balance='cost' needs unit_costs (e.g. unit_param_costs(model)).")
        # Units before the first block consume the raw inputs, which only the first stage is fed: they are one item.
        lead = _layer_positions(units)[0]
        items = [tuple(units[:lead])] * bool(lead) + [(u,) for u in units[lead:]]
        if stages > len(items):
            raise ValueError(
                f"{stages} stages exceed the {len(items)} pipeline items {items}; lower the pipeline size."
            )
        lengths = _balanced_partition([sum(float(unit_costs[u]) for u in item) for item in items], stages)
        out, start = [], 0
        for n in lengths:
            out.append(tuple(u for item in items[start : start + n] for u in item))
            start += n
        return StagePlan(units=tuple(out), padding=(0,) * stages)
    else:
        raise ValueError(f"balance={balance!r} is unknown; use 'even' or 'cost'.")
    out = _assemble(units, counts)
    for s, stage_units in enumerate(out):
        if not stage_units:
            raise ValueError(f"Stage {s} would run nothing (blocks per stage {counts}); give every stage a block.")
    return StagePlan(units=tuple(out), padding=tuple(padding))


def unit_param_costs(model: nn.Module, units: Sequence[str] | None = None) -> dict[str, float]:
    """Parameter count of each pipeline unit, a FLOP proxy (2 x params x tokens for every linear/embedding).

    A tied LM head counts its (shared) weight again: it costs a full matmul even though it owns no new storage.
    """
    units = list(units if units is not None else model.pipeline_units())
    return {
        u: float(sum(p.numel() for _, p in model.get_submodule(u).named_parameters(remove_duplicate=False)))
        for u in units
    }


def pipeline_unit_costs(model: nn.Module, units: Sequence[str] | None = None) -> dict[str, float]:
    """The costs ``balance="cost"`` splits by: the model's own ``pipeline_unit_costs()`` (model protocol), else
    :func:`unit_param_costs`."""
    units = list(units if units is not None else model.pipeline_units())
    costs = model.pipeline_unit_costs() if isinstance(model, PipelineUnitCosts) else unit_param_costs(model, units)
    missing = [u for u in units if u not in costs]
    if missing:
        raise ValueError(f"{type(model).__name__}.pipeline_unit_costs() gives no cost for the units {missing}.")
    return {u: float(costs[u]) for u in units}


def stage_ids_for_rank(rank: int, pipeline_parallel_size: int, num_stages: int, style: str = "loop") -> list[int]:
    """Global stage indices held by pipeline rank ``rank``: looped (r, r+p, ...) or V-shaped (r, 2p-1-r)."""
    p = pipeline_parallel_size
    if style == "v":
        if num_stages != 2 * p:
            raise ValueError(f"V-shaped placement needs exactly 2 stages per rank ({2 * p}), got {num_stages}.")
        return [rank, 2 * p - 1 - rank]
    return list(range(rank, num_stages, p))


# --------------------------------------------------------------------------------------------------------------------
# Stage modules
# --------------------------------------------------------------------------------------------------------------------


def build_stage_module(model: nn.Module, units: Sequence[str]) -> nn.Module:
    """A copy of ``model`` that runs only ``units``: other units removed, every kept FQN unchanged.

    A dropped unit inside a ``ModuleDict`` is deleted from it; any other dropped unit is set to ``None`` (the model's
    forward skips absent parts, as the model protocol requires). Kept parameters keep their names (e.g.
    ``layers.7.mlp.up_proj.weight``), so the state dicts of all stages together are exactly the full model's and
    checkpoints reshard across pipeline sizes. Works on meta models; only the kept parts are copied.
    """
    keep = set(units)
    all_units = list(model.pipeline_units())
    unknown = keep - set(all_units)
    if unknown:
        raise ValueError(f"Units {sorted(unknown)} are not in the model's pipeline_units().")
    saved: dict[int, tuple[nn.Module, dict[str, nn.Module | None]]] = {}
    try:
        for unit in all_units:
            if unit in keep:
                continue
            parent_name, _, name = unit.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if isinstance(parent, nn.ModuleList):
                raise ValueError(
                    f"Pipeline unit {unit!r} lives in an nn.ModuleList, whose indices would shift when a stage drops"
                    " blocks; keep blocks in an nn.ModuleDict keyed by their index."
                )
            # Strip what the stage does not run so deepcopy never touches it; restore the exact order afterwards.
            saved.setdefault(id(parent), (parent, dict(parent._modules)))
            if isinstance(parent, nn.ModuleDict):
                del parent[name]
            else:
                setattr(parent, name, None)
        stage = copy.deepcopy(model)
    finally:
        for parent, modules in saved.values():
            parent._modules.clear()
            parent._modules.update(modules)
    return stage


def check_units_cover_parameters(model: nn.Module, units: Sequence[str]) -> None:
    """Every parameter must belong to a pipeline unit, or a stage split would silently lose it."""
    covered = {id(p) for u in units for p in model.get_submodule(u).parameters()}
    missing = [name for name, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(
            f"{type(model).__name__}.pipeline_units() leaves parameters outside every unit: {missing[:5]}; list the"
            " modules that hold them as units."
        )


def tied_parameters(model: nn.Module, units: Sequence[str]) -> tuple[str, str] | None:
    """FQNs of one Parameter shared by two units (a tied embedding and LM head), or None.

    Only a weight shared by the first and the last unit's stages can be kept in sync (their gradients are summed
    across the two stages); other sharing patterns are rejected when the stages are built.
    """
    owners: dict[int, list[str]] = {}
    for unit in units:
        for name, p in model.get_submodule(unit).named_parameters(remove_duplicate=False):
            fqn = f"{unit}.{name}"
            if fqn not in owners.setdefault(id(p), []):
                owners[id(p)].append(fqn)
    shared = [names for names in owners.values() if len(names) > 1]
    if not shared:
        return None
    if len(shared) > 1 or len(shared[0]) != 2:
        raise ValueError(f"Pipeline parallelism supports one weight tied between two units; found {shared}.")
    return shared[0][0], shared[0][1]
