"""Heterogeneous planning: per-mesh layouts, the layer split and hetero-DP shares that balance stage times (issue 16
item 5).

Given device groups in rank order (a device type, a count and its :class:`HardwareProfile`), two plan kinds:

- **meshes** (FlagScale's heterogeneous pipeline, ``config/hetero.py``): each group becomes one mesh with its own
  TP x DP (x PP) layout; the decoder blocks are split over the stages so that the slowest stage is as fast as it
  can be. A stage's time per micro-batch is ``layers x block time on its mesh`` (the cost model's block pass at that
  mesh's TP, DP, micro-batch and profile) plus the LM head on the stage of the last model chunk (the last stage,
  or the first under a V placement); the split minimises the maximum by
  bisection on the stage time. The step is the schedule's run paced by the slowest stage (1F1B: ``m + S - 1``
  slots over S stages and m micro-batches; interleaved 1F1B and zero-bubble with v = 2 or 4 model chunks per stage
  group (``VIRTUAL_SIZES``), ZBV and DualPipeV with two: ``(S - 1) / v`` fill-and-drain slots, the zero-bubble
  family's filled with deferred weight gradients, as the homogeneous model prices them), plus ``2 (m v + S - 1)``
  hops of the slowest boundary (activations forward, their gradients back, exposed as the homogeneous model prices
  pipeline hops, over the inter-node links between device types), plus what compute does not hide of the slowest
  stage's data-parallel reduction and ZeRO gathers over its mesh's DP ranks (``cost._data_parallel``, the
  strategy's bucket size), plus the slowest stage's optimizer phase (its parameters over the mesh's ZeRO shards)
  and the training loop, once a step. A stage group's memory holds the live micro-batches its schedule really keeps (``inflight.max_live_microbatches``). The
  schedules of ``SCHEDULES`` and micro-batch sizes 1, 2, 4 are tried, and for each layout the least recompute and
  then the least ZeRO stage that fit in memory.
- **hetero-DP**: every device a data-parallel rank holding the whole model, the global batch shared in proportion to
  each device's forward + backward speed per sample (``hetero_dp_batch_sizes``), balancing the per-rank step times,
  each rank's optimizer phase over its 1/world ZeRO shard and the training loop added once a step; the fastest ZeRO
  stage and recompute policy that fit.

Plans come out as the keyword arguments ``ParallelConfig`` / ``FlagScaleStrategy`` take (``hetero_meshes``,
``hetero_layers`` or ``hetero_dp_batch_sizes``) and are validated by constructing the config.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.schedules import SCHEDULE_SPECS, stage_placement, validate_schedule
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.parallel.hetero_dp.batching import proportional_shares
from lightning_flagscale.parallel.hetero_mesh.runner import schedule_order
from lightning_flagscale.parallel.pipeline_parallel.recompute import RECOMPUTE_MODES
from lightning_flagscale.tune.cost import (
    BF16,
    _block_pass,
    _bubble,
    _bucket_sizes,
    _data_parallel,
    _optimizer_seconds,
    _Pass,
    _rank_params,
    _tokens,
    estimate_step,
)
from lightning_flagscale.tune.hardware import HardwareProfile
from lightning_flagscale.tune.inflight import max_live_microbatches
from lightning_flagscale.tune.memory_model import estimate_memory

__all__ = ["DeviceGroup", "HeteroPlan", "balance_layers", "plan_hetero", "plan_hetero_dp"]


ZERO_STAGES = (1, 2, 3)
"""ZeRO stages the planners try, in order of preference (the least sharding that fits)."""
MICRO_BATCH_SIZES = (1, 2, 4)
"""Micro-batch sizes the mesh planner tries (as the homogeneous search does)."""
RECOMPUTE = RECOMPUTE_MODES
"""Recompute policies the planners try, in order of preference (the least recomputation that fits)."""
SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
"""Pipeline schedules the mesh planner tries."""
VIRTUAL_SIZES = (2, 4)
"""Model chunks per stage group the looped multi-chunk schedules (interleaved 1F1B, zero-bubble) are tried with, as
the homogeneous search tries them (``SearchSpace.virtual_sizes``); ZBV and DualPipeV hold two, 1F1B one."""


def _schedule_chunks(schedules: Sequence[str], virtual_sizes: Sequence[int]) -> list[tuple[str, int]]:
    """(schedule, model chunks per stage group) pairs to plan."""
    out: list[tuple[str, int]] = []
    for name in schedules:
        fixed = SCHEDULE_SPECS[name].stages_per_rank  # 1F1B: 1, the V schedules: 2; None: any
        out.extend((name, v) for v in ((fixed,) if fixed else virtual_sizes))
    return out


def _values(value: Any) -> tuple:
    return (value,) if isinstance(value, int | str) else tuple(value)


def _recompute_values(model: TransformerConfig, recompute: str | Sequence[str]) -> tuple:
    """The policies to try: ``selective_mm`` runs on dense blocks only, so an MoE model tries the others."""
    values = _values(recompute)
    kept = tuple(rc for rc in values if not (rc == "selective_mm" and model.is_moe))
    if not kept:
        raise ValueError(f"recompute={list(values)}: 'selective_mm' runs on dense blocks only; add 'selective' or"
                         " 'full' for an MoE model.")  # fmt: skip
    return kept


@dataclass(frozen=True, kw_only=True)
class DeviceGroup:
    """``count`` devices of one type, consecutive in rank order."""

    device_type: str
    count: int
    profile: HardwareProfile


@dataclass(frozen=True, kw_only=True)
class HeteroPlan:
    """A heterogeneous layout, its predicted stage times and step time."""

    kind: str
    """``meshes`` or ``hetero_dp``."""
    parallel: dict[str, Any]
    """Keyword arguments for ``ParallelConfig`` / ``FlagScaleStrategy``."""
    stage_seconds: list[float]
    """Per micro-batch (meshes) or per step (hetero-DP) time of each stage / rank."""
    step_seconds: float
    memory_bytes: list[float]
    """Predicted peak bytes per stage (meshes) or rank (hetero-DP)."""

    def config(self, world_size: int) -> ParallelConfig:
        return ParallelConfig(**self.parallel).resolve(world_size)

    @property
    def imbalance(self) -> float:
        """Slowest over mean stage time (1 = balanced)."""
        return max(self.stage_seconds) * len(self.stage_seconds) / sum(self.stage_seconds)


def balance_layers(per_layer: Sequence[float], extra: Sequence[float], num_layers: int) -> list[int]:
    """Layers per stage (each >= 1) minimising ``max(l_i * per_layer[i] + extra[i])`` with ``sum(l_i) = num_layers``."""
    n = len(per_layer)
    if num_layers < n:
        raise ValueError(f"num_layers={num_layers} is fewer than the {n} pipeline stages of the plan.")

    def counts(limit: float) -> list[int]:
        return [max(1, int((limit - e) / t)) if limit > e + t else 1 for t, e in zip(per_layer, extra, strict=True)]

    lo, hi = 0.0, max(t * num_layers + e for t, e in zip(per_layer, extra, strict=True))
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(counts(mid)) < num_layers else (lo, mid)
    out = counts(hi)
    while sum(out) > num_layers:  # take surplus from the stage whose time drops the most
        i = max((j for j in range(n) if out[j] > 1), key=lambda j: out[j] * per_layer[j] + extra[j])
        out[i] -= 1
    return out


def _mesh_layouts(group: DeviceGroup, model: TransformerConfig, max_pp: int) -> list[tuple[int, int, int]]:
    """(tp, dp, pp) of a mesh on ``group``: TP inside a node and dividing the heads."""
    out = []
    for tp, pp in itertools.product(range(1, group.count + 1), range(1, max_pp + 1)):
        if group.count % (tp * pp) or tp > group.profile.devices_per_node:
            continue
        if model.num_attention_heads % tp or model.num_key_value_heads % tp or model.intermediate_size % tp:
            continue
        out.append((tp, group.count // (tp * pp), pp))
    return out


def _stage_cost(model, layout, group, samples, seq_len, zero, recompute) -> tuple[_Pass, float, ParallelConfig]:
    """One block's pass (forward, backward, weight-gradient seconds per micro-batch) and the LM head seconds on one
    stage of this mesh, and its homogeneous config."""
    tp, dp, _ = layout
    c = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, zero_stage=zero,
                       micro_batch_size=samples // dp, recompute=recompute).resolve(tp * dp)  # fmt: skip
    block = _block_pass(model, c, seq_len, group.profile, model.is_moe, recompute)
    head = group.profile.gemm_seconds(_tokens(model, c, seq_len), model.vocab_size / tp, model.hidden_size)
    return block, head + sum(group.profile.backward_gemm_seconds(head)), c


def plan_hetero(
    model: TransformerConfig,
    groups: Sequence[DeviceGroup],
    *,
    seq_len: int,
    global_batch: int,
    micro_batch_size: int | Sequence[int] = MICRO_BATCH_SIZES,
    zero_stage: int | Sequence[int] = ZERO_STAGES,
    recompute: str | Sequence[str] = RECOMPUTE,
    schedule: str | Sequence[str] = SCHEDULES,
    max_pp_per_mesh: int = 2,
    virtual_size: int | Sequence[int] = VIRTUAL_SIZES,
    grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> list[HeteroPlan]:
    """Mesh plans (one mesh per device group) that fit in memory, fastest first.

    ``micro_batch_size`` / ``schedule``: one value or the values to try (one plan per mesh layout, size and
    schedule). ``virtual_size``: the model chunks per stage group interleaved 1F1B and zero-bubble are tried with
    (ZBV and DualPipeV hold two). ``zero_stage`` / ``recompute``: one value, or the values to try in order of
    preference; each plan takes the first recompute policy (the least recomputation) and, with it, the first ZeRO
    stage that fit in memory. ``grad_bucket_numel``: the strategy's gradient bucket size (one collective a bucket)."""
    if len(groups) < 1 or sum(g.count for g in groups) < 2:
        raise ValueError("Heterogeneous planning needs at least two devices in the device groups.")
    unknown = sorted(set(_values(schedule)) - set(SCHEDULES))
    if unknown:
        raise ValueError(f"schedule={unknown}: the mesh planner plans {SCHEDULES}.")
    if any(v < 2 for v in _values(virtual_size)):
        raise ValueError(f"virtual_size={virtual_size}: multi-chunk schedules hold at least 2 model chunks a group.")
    chunked = _schedule_chunks(_values(schedule), _values(virtual_size))
    plans = []
    meshes = itertools.product(*(_mesh_layouts(g, model, max_pp_per_mesh) for g in groups))
    for layouts, mbs, (name, v) in itertools.product(list(meshes), _values(micro_batch_size), chunked):
        if sum(pp for _, _, pp in layouts) < 2:
            continue
        samples = mbs * layouts[0][1]  # one micro-batch, as the first mesh's DP splits it
        if any(samples % dp for _, dp, _ in layouts) or global_batch % samples:
            continue
        for rc, zero in itertools.product(_recompute_values(model, recompute), _values(zero_stage)):
            plan = _plan_meshes(
                model, groups, layouts, samples, seq_len, global_batch, zero, rc, name, v, grad_bucket_numel
            )
            if plan is not None:
                plans.append(plan)
                break
    plans.sort(key=lambda p: p.step_seconds)
    return plans


def _plan_meshes(
    model, groups, layouts, samples, seq_len, global_batch, zero, recompute, schedule="1f1b", v=1,
    grad_bucket_numel=DEFAULT_BUCKET_NUMEL,
):  # fmt: skip
    """The plan of these mesh layouts under ``schedule`` with ``v`` model chunks per stage group, or None when it
    cannot run or does not fit."""
    per_layer, passes, extra, configs, stage_groups = [], [], [], [], []
    for g, layout in zip(groups, layouts, strict=True):
        block, _, c = _stage_cost(model, layout, g, samples, seq_len, zero, recompute)
        for _ in range(layout[2]):
            per_layer.append(block.f + block.b)
            passes.append(block)
            extra.append(0.0)
            configs.append(c)
            stage_groups.append(g)
    # the LM head runs with the last global stage: on the last stage group, or under a V placement (ZBV, DualPipeV)
    # on the first, where the V turns back; it costs that group's device (issue 42 item 5)
    head = stage_placement(len(extra) * v - 1, len(extra), schedule)[0]
    mesh = next(i for i, n in enumerate(itertools.accumulate(pp for _, _, pp in layouts)) if head < n)
    extra[head] = _stage_cost(model, layouts[mesh], groups[mesh], samples, seq_len, zero, recompute)[1]
    try:
        layers = balance_layers(per_layer, extra, model.num_layers)
    except ValueError:
        return None
    m = global_batch // samples
    stages = len(layers)
    if not _runs(schedule, stages, v, m):
        return None
    if min(layers) < v:  # every model chunk needs a block
        return None
    live = max_live_microbatches(schedule, stages, v, m)  # (chunk, micro-batch) activation sets per stage group
    memory = []
    for s, (count, c, g) in enumerate(zip(layers, configs, stage_groups, strict=True)):
        in_flight = math.ceil(live[s] / v)  # a chunk holds 1/v of the group's blocks
        mem = estimate_memory(dataclasses.replace(model, num_layers=count), c, seq_len, in_flight)
        if mem > g.profile.memory_bytes:
            return None
        memory.append(mem)
    times = [n * t + e for n, t, e in zip(layers, per_layer, extra, strict=True)]
    slowest = max(range(stages), key=times.__getitem__)
    hop = max(_boundary_seconds(model, seq_len, samples, (configs[a], stage_groups[a]), (configs[b], stage_groups[b]))
              for a, b in _boundaries(stages, v, SCHEDULE_SPECS[schedule].placement == "v"))  # fmt: skip
    # After the last backward every mesh reduces its stages' gradients over its own DP ranks (and ZeRO-3 gathers
    # its parameters during the step): the meshes do this side by side, so the slowest one's exposed time adds.
    # Then each stage's ranks step their own parameters (the optimizer phase, sharded over the mesh's DP ranks by
    # ZeRO) and the training loop runs: the next step starts when the slowest has.
    split = ParallelConfig(pipeline_parallel_size=stages, pipeline_layers=layers)  # the stages' parameters
    reduction = optimizer = 0.0
    for s, (c, g) in enumerate(zip(configs, stage_groups, strict=True)):
        on_mesh = dataclasses.replace(split, tensor_parallel_size=c.tensor_parallel_size)
        dense, expert = _rank_params(model, on_mesh)[s]  # as one TP rank of the stage holds them
        buckets = _bucket_sizes(model, on_mesh, [s], grad_bucket_numel)
        exposed, _ = _data_parallel(model, c, g.profile, dense, expert, last_backward=times[s] * 2 / 3,
                                    compute=m * times[s], buckets=buckets)  # fmt: skip
        reduction = max(reduction, exposed)
        optimizer = max(optimizer, _optimizer_seconds(c, g.profile, dense, expert) + g.profile.step_overhead)
    meshes = [
        dict(tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp, device_type=g.device_type)
        for (tp, dp, pp), g in zip(layouts, groups, strict=True)
    ]
    parallel = dict(hetero_meshes=meshes, hetero_layers=layers, pipeline_schedule=schedule, zero_stage=zero,
                    micro_batch_size=samples // layouts[0][1], recompute=recompute)  # fmt: skip
    if v > 1:
        parallel["virtual_pipeline_parallel_size"] = v
    # the schedule's fill and drain, priced as the homogeneous model prices them, every slot at the slowest stage
    n, one, pace = layers[slowest], passes[slowest], times[slowest]
    pipeline = ParallelConfig(pipeline_parallel_size=stages, pipeline_schedule=schedule,
                              virtual_pipeline_parallel_size=v)  # fmt: skip
    run = m * pace + _bubble(pipeline, _Pass(f=pace - n * one.b, b=n * one.b, w=n * one.w, comm={}), m=m)
    return HeteroPlan(kind="meshes", parallel=parallel, stage_seconds=times,
                      step_seconds=run + 2 * (m * v + stages - 1) * hop + reduction + optimizer,
                      memory_bytes=memory)  # fmt: skip


@functools.cache
def _runs(schedule: str, stages: int, v: int, m: int) -> bool:
    """Can the hetero pipeline runner run ``schedule`` over ``stages`` stage groups with ``v`` chunks each and ``m``
    micro-batches? Its own rules decide (``schedule_order``: looped multi-chunk schedules need ``m`` a multiple of
    the group count, V schedules their minimum of micro-batches), besides the homogeneous ones."""
    try:
        validate_schedule(schedule, stages, v, m)
        for group in range(stages):
            schedule_order(schedule, stages, group, v, m, train=True)
    except ValueError:
        return False
    return True


def _boundaries(stages: int, v: int, v_shaped: bool) -> list[tuple[int, int]]:
    """Stage-group pairs activations cross: in order, and with looped model chunks (interleaved placement) from the
    last group back to the first; a V-shaped placement turns inside the last group and comes back the same way."""
    return [(s, s + 1) for s in range(stages - 1)] + ([(stages - 1, 0)] if v > 1 and not v_shaped else [])


def _boundary_seconds(model: TransformerConfig, seq_len: int, samples: int, send: tuple, recv: tuple) -> float:
    """One micro-batch's activations (or, back, their gradients) across a stage boundary, as
    ``parallel/hetero_mesh/boundary.py`` moves them: every receiving rank gets its data-parallel rows whole (no sequence
    parallelism in these plans: each TP rank holds a replica), the senders' TP replicas share the sends; the busiest
    rank of either direction sets the time. Between device types the pieces cross nodes, at the slower side's
    inter-node P2P; inside a group, over its intra-node links unless the group spans nodes."""
    (cs, gs), (cr, gr) = send, recv
    whole = samples * seq_len * model.hidden_size * BF16
    per_rank = max(whole / cr.dp, whole / cs.dp, whole * cr.tensor_parallel_size / (cs.dp * cs.tensor_parallel_size),
                   whole * cs.tensor_parallel_size / (cr.dp * cr.tensor_parallel_size))  # fmt: skip
    if gs is gr:
        return gs.profile.collective_seconds("p2p", per_rank, 2, inter_node=gs.count > gs.profile.devices_per_node)
    return max(g.profile.collective_seconds("p2p", per_rank, 2, inter_node=True) for g in (gs, gr))


def plan_hetero_dp(
    model: TransformerConfig,
    groups: Sequence[DeviceGroup],
    *,
    seq_len: int,
    global_batch: int,
    micro_batch_size: int = 1,
    zero_stage: int | Sequence[int] = ZERO_STAGES,
    recompute: str | Sequence[str] = RECOMPUTE,
    grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> HeteroPlan:
    """Every device a DP rank; samples per rank in proportion to speed (multiples of ``micro_batch_size``). Each rank
    runs its share as one batch. ``zero_stage`` / ``recompute``: one value, or the values to try; the fastest plan
    that fits in memory is returned, and when none fits the error names the leanest one tried. ``grad_bucket_numel``:
    the strategy's gradient bucket size."""
    world = sum(g.count for g in groups)
    if global_batch % micro_batch_size or global_batch // micro_batch_size < world:
        raise ValueError(
            f"global_batch={global_batch} must give every one of the {world} ranks at least one micro-batch of"
            f" {micro_batch_size}; raise the batch or lower micro_batch_size."
        )
    plans, errors = [], []
    for rc, zero in itertools.product(_recompute_values(model, recompute), _values(zero_stage)):
        try:
            plans.append(_plan_dp(model, groups, seq_len, global_batch, micro_batch_size, zero, rc, grad_bucket_numel))
        except _TooBig as err:
            errors.append(err)
    if not plans:
        lean = min(errors, key=lambda e: e.excess)
        tried = f"zero_stage {list(_values(zero_stage))} x recompute {list(_recompute_values(model, recompute))}"
        raise ValueError(
            f"hetero-DP does not fit with any of {tried}: the leanest (zero_stage={lean.zero},"
            f" recompute={lean.recompute!r}) needs {lean.need / 1e9:.1f} GB on rank {lean.rank} ({lean.device})"
            f" against {lean.budget / 1e9:.1f} GB (memory constraint); lower the global batch or the sequence length,"
            " or use hetero meshes."
        )
    return min(plans, key=lambda p: p.step_seconds)


@dataclass(frozen=True)
class _TooBig(Exception):
    rank: int
    device: str
    need: float
    budget: float
    zero: int
    recompute: str

    @property
    def excess(self) -> float:
        return self.need / self.budget


def _plan_dp(
    model, groups, seq_len, global_batch, micro_batch_size, zero_stage, recompute, grad_bucket_numel
) -> HeteroPlan:
    world = sum(g.count for g in groups)
    one = ParallelConfig(zero_stage=zero_stage, micro_batch_size=micro_batch_size, recompute=recompute).resolve(1)
    c = ParallelConfig(zero_stage=zero_stage, micro_batch_size=micro_batch_size, recompute=recompute).resolve(world)

    def per_sample(g: DeviceGroup) -> float:  # forward + backward of one sample (a micro-batch's share)
        cost = estimate_step(model, one, seq_len, micro_batch_size, g.profile)
        return (cost.step_seconds - cost.optimizer_wall_seconds - cost.loop_seconds) / micro_batch_size

    # once a step, whatever the share: each rank's optimizer phase over its ZeRO shard, and the training loop
    dense, expert = _rank_params(model, c)[0]
    once = {g.device_type: _optimizer_seconds(c, g.profile, dense, expert) + g.profile.step_overhead for g in groups}
    sample = {g.device_type: per_sample(g) for g in groups}
    ranks = [g for g in groups for _ in range(g.count)]
    speed = [1 / sample[g.device_type] for g in ranks]
    share = proportional_shares(speed, global_batch // micro_batch_size)
    sizes = [s * micro_batch_size for s in share]
    times = [b * sample[g.device_type] + once[g.device_type] for b, g in zip(sizes, ranks, strict=True)]
    memory = [estimate_memory(model, c, seq_len, b // micro_batch_size) for b in sizes]
    over = [i for i, (mem, g) in enumerate(zip(memory, ranks, strict=True)) if mem > g.profile.memory_bytes]
    if over:
        worst = max(over, key=lambda i: memory[i] / ranks[i].profile.memory_bytes)
        raise _TooBig(worst, ranks[worst].device_type, memory[worst], ranks[worst].profile.memory_bytes, zero_stage,
                      recompute)  # fmt: skip
    # the gradient reduction over all ranks, exposed as on the slowest link of the groups
    slowest = min((g.profile for g in groups), key=lambda p: p.links["all_reduce"]["inter"][0].bus_bandwidth)
    reduce = estimate_step(
        model, c, seq_len, world * micro_batch_size, slowest, grad_bucket_numel=grad_bucket_numel
    ).comm.get("dp", 0.0)
    parallel = dict(hetero_dp_batch_sizes=sizes, zero_stage=zero_stage, micro_batch_size=micro_batch_size,
                    recompute=recompute)  # fmt: skip
    return HeteroPlan(kind="hetero_dp", parallel=parallel, stage_seconds=times, step_seconds=max(times) + reduce,
                      memory_bytes=memory)  # fmt: skip
