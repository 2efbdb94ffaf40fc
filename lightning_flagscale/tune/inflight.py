"""Micro-batches whose activations a pipeline rank holds at once, read off the schedules torch really runs.

The multi-stage schedules (interleaved 1F1B, zero-bubble, ZBV, DualPipeV) execute ``schedule.pipeline_order``, the
per-rank action list torch computes in the schedule's constructor; we build that very list (stages are stand-ins
that carry only the sizes the constructor reads: no process group, no module) and walk it. A forward (``F``) makes
a micro-batch's activations of that stage alive; a full backward (``B``) frees them; under the zero-bubble family
the input-gradient pass (``I``) keeps the graph (torch's ``stage_backward_input`` retains it for the weight pass)
and the weight-gradient pass (``W``) frees it. The single-stage schedules run their own loops
(``torch.distributed.pipelining.schedules``): GPipe runs every forward before any backward; 1F1B's rank ``r``
warms up with ``min(m, p - r)`` forwards and then alternates one backward, one forward ("1B1F").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, lru_cache
from types import SimpleNamespace
from typing import Literal

from lightning_flagscale.config.schedules import SCHEDULE_SPECS, validate_schedule
from lightning_flagscale.parallel.pipeline_parallel.orders import dualpipev_order, torch_v_order, zbv_order
from lightning_flagscale.parallel.pipeline_parallel.plan import stage_ids_for_rank

__all__ = [
    "live_activation_peak",
    "max_live_microbatches",
    "overlapped_pairs",
    "runner_v_order",
    "schedule_actions",
    "schedule_live_peak",
]


@lru_cache(maxsize=256)
def schedule_actions(
    schedule: str, p: int, v: int, m: int, costs: tuple[float, float, float] | None = None, cap: int | None = None
) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per pipeline rank, the compute actions ``(kind, stage, microbatch)`` in execution order; kind is F, B, I or W
    (a DualPipeV overlapped F+B is its forward then its backward). ``costs`` / ``cap``
    (``ParallelConfig.pipeline_chunk_costs`` / ``pipeline_max_activations``, ZB-V and DualPipeV): the order generated
    for them, which the runner runs instead of torch's (:func:`runner_v_order`)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    validate_schedule(schedule, p, v, m)
    spec = SCHEDULE_SPECS[schedule]
    if costs is not None or cap is not None:
        return tuple(_kinds(acts) for acts in runner_v_order(schedule, p, m, costs, cap).values())
    if spec.stages_per_rank == 1:
        return tuple(_single_stage_actions(schedule, p, r, m) for r in range(p))
    n = p * v
    # The constructor computes every rank's order (``pipeline_order[r]`` for all r), whichever rank builds it: one
    # schedule, built for rank 0's stages, gives them all.
    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=n, stage_index=s, is_first=s == 0,
                              is_last=s == n - 1, submod=None) for s in stage_ids_for_rank(0, p, n, spec.placement)]  # fmt: skip
    sched = _order_only(getattr(torch_schedules, spec.torch_class))(stages, m, loss_fn=lambda out, target: out)
    return tuple(_kinds(sched.pipeline_order[rank]) for rank in range(p))


def _kinds(order) -> tuple[tuple[str, int, int], ...]:
    """One rank's torch actions as ``(kind, stage, microbatch)``, an overlapped pair as its two halves."""
    actions = []
    for action in order:
        if action is None:
            continue
        for sub in action.sub_actions or (action,):
            kind = str(sub.computation_type)
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(
                kind.rsplit(".", 1)[-1], kind
            )
            actions.append((kind, sub.stage_index, sub.microbatch_index))
    return tuple(actions)


@lru_cache(maxsize=64)
def runner_v_order(
    schedule: str, p: int, m: int, costs: tuple[float, float, float] | None = None, cap: int | None = None
) -> dict[int, tuple]:
    """Per pipeline rank, the compute actions (torch ``_Action``s, DualPipeV's pairs as ``OVERLAP_F_B``) that the
    pipeline runner runs for ``"zbv"`` or ``"dualpipev"`` over ``p`` ranks and ``m`` micro-batches, as
    ``PipelineRunner._schedule`` chooses: torch's own order, or, when ``costs`` (a chunk's forward, input-gradient and
    weight-gradient cost: ``ParallelConfig.pipeline_chunk_costs``) or ``cap`` (``pipeline_max_activations``) is set,
    the order ``orders.zbv_order`` / ``orders.dualpipev_order`` generates for them (``costs`` None: equal costs).
    Cached: a search asks for the same few (p, m) many times; the result must not be changed."""
    if schedule not in ("zbv", "dualpipev"):
        raise ValueError(f"schedule={schedule!r}: only 'zbv' and 'dualpipev' run an order built here.")
    if costs is None and cap is None:
        return {r: tuple(a for a in acts if a is not None) for r, acts in torch_v_order(schedule, p, m).items()}
    generate = {"zbv": zbv_order, "dualpipev": dualpipev_order}[schedule]
    return {r: tuple(acts) for r, acts in generate(p, m, costs or (1.0, 1.0, 1.0), cap).items()}


@cache
def overlapped_pairs(schedule: str, p: int, m: int) -> tuple[int, ...]:
    """Per pipeline rank, how many forward-backward pairs of one schedule run over ``m`` micro-batches are fused into
    one overlapped action (torch's ``OVERLAP_F_B``: DualPipeV's steady state, a forward chunk beside a backward
    chunk of another micro-batch); 0 for schedules without them."""
    from torch.distributed.pipelining import schedules as torch_schedules

    spec = SCHEDULE_SPECS[schedule]
    if spec.stages_per_rank == 1 or schedule != "dualpipev":
        return (0,) * p
    validate_schedule(schedule, p, 2, m)
    n = 2 * p
    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=n, stage_index=s, is_first=s == 0,
                              is_last=s == n - 1, submod=None)
              for s in stage_ids_for_rank(0, p, n, spec.placement)]  # fmt: skip
    sched = _order_only(getattr(torch_schedules, spec.torch_class))(stages, m, loss_fn=lambda out, target: out)
    return tuple(
        sum(1 for a in sched.pipeline_order[r] if a is not None and str(a.computation_type).endswith("OVERLAP_F_B"))
        for r in range(p)
    )


@cache
def _order_only(cls: type) -> type:
    """``cls`` without the lowering of its compute actions to a runtime schedule with communication actions, which
    its constructor runs after computing ``pipeline_order`` (into a separate ``pipeline_order_with_comms``): only the
    order is read here, and the lowering took most of a search's time."""
    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": lambda self, *args, **kwargs: None})


def _single_stage_actions(schedule: str, p: int, rank: int, m: int) -> tuple[tuple[str, int, int], ...]:
    if schedule == "gpipe":
        return tuple([("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)])
    warmup = min(m, p - rank)
    actions = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):  # torch runs "1B1F": the backward first, then the next forward
        actions += [("B", rank, i), ("F", rank, warmup + i)]
    actions += [("B", rank, i) for i in range(m - warmup, m)]
    return tuple(actions)


def live_activation_peak(actions: Sequence[tuple[str, int, int]], weight: dict[int, float]) -> tuple[float, int]:
    """Walk one rank's actions: (largest sum of ``weight[stage]`` over live (stage, micro-batch) pairs, the number
    of pairs alive at that moment; the first such moment). Freed at ``B`` or ``W``."""
    return _weigh(*_live_counts(tuple(actions)), weight)


def schedule_live_peak(
    schedule: str,
    p: int,
    v: int,
    m: int,
    rank: int,
    weight: dict[int, float],
    costs: tuple[float, float, float] | Literal["auto"] | None = None,
    cap: int | None = None,
) -> tuple[float, int]:
    """:func:`live_activation_peak` of rank ``rank`` of ``schedule_actions(schedule, p, v, m, costs, cap)``, its walk
    cached by those arguments (a search weighs the same few schedules ~10^5 times; hashing their action lists was most
    of it). ``costs="auto"``: the order is generated for costs measured in training, unknown here; it never holds more
    than its cap (``cap``, or 2p for ZB-V and torch's 2p + 1 for DualPipeV), priced at the rank's heaviest stage."""
    if costs == "auto":
        if cap is None:
            cap = 2 * p if schedule == "zbv" else max(max_live_microbatches(schedule, p, v, m))
        top = max(weight.get(s, 0.0) for s in stage_ids_for_rank(rank, p, p * v, SCHEDULE_SPECS[schedule].placement))
        return top * cap, cap
    return _weigh(*_schedule_live_counts(schedule, p, v, m, costs, cap)[rank], weight)


@lru_cache(maxsize=1024)
def _schedule_live_counts(
    schedule: str, p: int, v: int, m: int, costs: tuple[float, float, float] | None, cap: int | None
) -> tuple:
    return tuple(_live_counts(actions) for actions in schedule_actions(schedule, p, v, m, costs, cap))


def _weigh(stages: tuple[int, ...], counts: tuple[tuple[int, ...], ...], weight: dict[int, float]) -> tuple[float, int]:
    if len(stages) == 1:  # one stage: the most micro-batches alive is the peak (equal weights)
        most = counts[0][0]
        w = weight.get(stages[0], 0.0)
        return (w * most, most) if w * most > 0.0 else (0.0, 0)
    peak, live = 0.0, 0
    for vector in counts:  # the peak is at a forward; each distinct state once, in order of first occurrence
        total = sum(weight.get(s, 0.0) * n for s, n in zip(stages, vector, strict=True))
        if total > peak:
            peak, live = total, sum(vector)
    return peak, live


@lru_cache(maxsize=4096)
def _live_counts(actions: tuple[tuple[str, int, int], ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(the stages of ``actions``, the distinct per-stage counts of live micro-batches right after each forward, in
    order of first occurrence): what :func:`live_activation_peak` needs of a walk, whatever the weights (a search
    weighs the same schedule thousands of times)."""
    stages = tuple(sorted({s for _, s, _ in actions}))
    index = {s: i for i, s in enumerate(stages)}
    live: set[tuple[int, int]] = set()
    count = [0] * len(stages)
    seen: dict[tuple[int, ...], None] = {}
    for kind, stage, mb in actions:
        if kind == "F":
            live.add((stage, mb))
            count[index[stage]] += 1
            seen.setdefault(tuple(count))
        elif kind in ("B", "W") and (stage, mb) in live:
            live.discard((stage, mb))
            count[index[stage]] -= 1
    if len(stages) == 1:  # only the most live micro-batches matter (:func:`_weigh`)
        return stages, ((max(vector[0] for vector in seen),),)
    return stages, tuple(seen)


def max_live_microbatches(schedule: str, p: int, v: int, m: int) -> list[int]:
    """Per pipeline rank, the most (stage, micro-batch) activation sets alive at once (every stage weighing 1)."""
    out = []
    for actions in schedule_actions(schedule, p, v, m):
        stages = {s for _, s, _ in actions}
        out.append(live_activation_peak(actions, dict.fromkeys(stages, 1.0))[1])
    return out
