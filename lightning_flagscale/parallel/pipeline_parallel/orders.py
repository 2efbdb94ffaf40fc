"""Action orders of V-shaped schedules, generated for given forward / input-gradient / weight-gradient costs.

torch's ``ScheduleZBVZeroBubble`` builds one fixed ZB-V order. It is optimal when a chunk's F, I and W cost the same,
but not otherwise: with I = 2F = 2W (a backward that costs twice the forward, the usual case) every rank idles
(p-1)(F+I-W) per step instead of the (p-1)F that no V schedule can beat (issue 42 item 2). The ZB paper
(arXiv 2401.10241, section 3 and 6) builds its schedules greedily from the measured F, B, W costs instead; this file
does the same for the V placement: list scheduling that, on each rank and at each moment, runs the ready input
gradient, else the next forward (while the rank holds fewer activations than 1F1B would), else a deferred weight
gradient, trying a few tie-break rules and keeping the order with the shortest simulated makespan.

DualPipeV's order is built around its forward-backward pairs (one chunk's forward beside the other chunk's backward,
what lets a model overlap one's communication with the other's compute), and torch's pairs run a full backward: each
pair waits for the whole backward's input, and the weight gradients that could fill those waits are not free to move.
:func:`dualpipev_order` keeps torch's forwards, pairs and backwards in torch's sequence, runs each backward as its
input gradient only (a pair becomes forward + input gradient), and places every weight gradient greedily where the
rank would otherwise wait, under an activation cap (issue 42 item 2: 7.1% -> 5.2% per-rank idle at p = 4, m = 8,
I = 2F = 2W at torch's own memory; 2.7% with 3p activations).

Costs follow torch's ``PipelineStage``: the first stage has no input to differentiate, so its I does nothing and its
W runs the whole backward (``I + W``).

:func:`simulate` replays any per-rank order (torch's or ours) with given costs and free communication; it is the
check that an order respects every dependency (a rank blocked forever raises) and the source of the bubble the tests
compare with theory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from types import SimpleNamespace

from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _Action,
    _ComputationType,
)

__all__ = [
    "SimResult",
    "action_cost",
    "dualpipev_order",
    "simulate",
    "torch_v_order",
    "v_lower_bound",
    "zbv_order",
]

_F, _I, _W, _B, _FB = (
    _ComputationType.FORWARD,
    _ComputationType.BACKWARD_INPUT,
    _ComputationType.BACKWARD_WEIGHT,
    _ComputationType.FULL_BACKWARD,
    _ComputationType.OVERLAP_F_B,
)
Costs = tuple[float, float, float]
"""Cost of one stage's forward, input gradient and weight gradient for one micro-batch (any unit)."""


def action_cost(action: _Action, costs: Costs) -> float:
    """Cost of one compute action under torch's stage semantics (the first stage's backward all runs in W)."""
    f, i, w = costs
    kind, first = action.computation_type, action.stage_index == 0
    if kind == _F:
        return f
    if kind == _I:
        return 0.0 if first else i
    if kind == _W:
        return i + w if first else w
    if kind == _B:
        return i + w
    return 0.0


@dataclass(frozen=True)
class SimResult:
    """Replay of an order: per rank the (action, start, end) of every compute action, and the common makespan."""

    timeline: dict[int, list[tuple[_Action, float, float]]]
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.timeline[rank])

    @property
    def bubble(self) -> float:
        """Idle share of ``ranks x makespan`` (every rank starts together and the step ends with the last rank)."""
        idle = sum(self.makespan - self.busy(r) for r in self.timeline)
        return idle / (len(self.timeline) * self.makespan) if self.makespan else 0.0

    def own_span_bubble(self, rank: int) -> float:
        """Idle share of ``rank``'s own span, from its first action's start to its last action's end: the count of
        the ZB paper (ZB-V at F = I = W: 0) and of DeepSeek's DualPipe, where a later rank's wait for its first input
        and an earlier rank's early finish are not bubble."""
        actions = self.timeline[rank]
        span = actions[-1][2] - actions[0][1] if actions else 0.0
        return (span - self.busy(rank)) / span if span else 0.0

    @property
    def own_bubble(self) -> float:
        """:meth:`own_span_bubble` averaged over ranks."""
        return sum(self.own_span_bubble(r) for r in self.timeline) / len(self.timeline) if self.timeline else 0.0


def _compute_actions(actions: Sequence[_Action | None]) -> list[_Action]:
    flat = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]
    return [a for a in flat if a.computation_type in (_F, _I, _W, _B)]


def simulate(
    order: Mapping[int, Sequence[_Action | None]],
    num_stages: int,
    costs: Costs | Callable[[_Action], float],
) -> SimResult:
    """Run every rank's actions in their order, each as soon as its inputs exist (free communication and host).

    F of stage s needs F of s-1; I or B of s needs F of s and the input gradient of s+1; W needs I. Raises
    ``ValueError`` when no rank can move (an order that would hang) or an action repeats or is missing.
    """
    cost = costs if callable(costs) else (lambda a: action_cost(a, costs))
    queues = {r: _compute_actions(acts) for r, acts in order.items()}
    seen: set[tuple[str, int, int]] = set()
    for r, q in queues.items():
        for a in q:
            key = (a.computation_type.value, a.stage_index, a.microbatch_index)
            if key in seen:
                raise ValueError(f"rank {r} repeats {a}")
            seen.add(key)
    done: dict[tuple[str, int, int], float] = {}  # (F | G, stage, mb) -> finish; G: input gradient of the stage
    clock = dict.fromkeys(queues, 0.0)
    pos = dict.fromkeys(queues, 0)
    timeline: dict[int, list[tuple[_Action, float, float]]] = {r: [] for r in queues}
    moved = True
    while moved:
        moved = False
        for r, q in queues.items():
            while pos[r] < len(q):
                a = q[pos[r]]
                s, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
                if kind == _F:
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif kind in (_I, _B):
                    deps = [("F", s, mb)] + ([("G", s + 1, mb)] if s < num_stages - 1 else [])
                else:
                    deps = [("G", s, mb)]
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + cost(a)
                done[("F" if kind == _F else "G" if kind != _W else "W", s, mb)] = clock[r]
                timeline[r].append((a, start, clock[r]))
                pos[r] += 1
                moved = True
    stuck = {r: queues[r][pos[r]] for r in queues if pos[r] < len(queues[r])}
    if stuck:
        raise ValueError(f"the order cannot run: every rank waits ({stuck})")
    return SimResult(timeline=timeline, makespan=max(clock.values(), default=0.0))


def torch_v_order(name: str, p: int, m: int) -> dict[int, list[_Action | None]]:
    """torch's own compute order of ``"zbv"`` or ``"dualpipev"`` at p ranks and m micro-batches, without stages.

    Calls the schedule class's per-rank generator on a namespace holding the attributes it reads (torch 2.13); the
    tests compare it with the order a real schedule object holds."""
    cls = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[name]
    ns = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p, _num_stages=2 * p)
    return {r: cls._calculate_single_rank_operations(ns, r) for r in range(p)}


def _peak_activations(order: Mapping[int, Sequence[_Action]]) -> int:
    """Most activations any rank holds: forwards whose weight gradient (or full backward) has not run yet."""
    peak = 0
    for actions in order.values():
        held = 0
        for a in _compute_actions(actions):
            held += 1 if a.computation_type == _F else -1 if a.computation_type in (_W, _B) else 0
            peak = max(peak, held)
    return peak


def v_lower_bound(p: int, m: int, costs: Costs) -> float:
    """Smallest bubble of any V schedule with a common start and end: the last rank cannot start before the p-1
    forwards ahead of it, and every rank carries the same 2m(F+I+W), so each idles at least (p-1)F."""
    f, i, w = costs
    idle = (p - 1) * f
    return idle / (idle + 2 * m * (f + i + w))


def _greedy(p: int, m: int, costs: Costs, cap: int, i_first: bool, i_deep: bool, f_deep: bool) -> dict[int, list]:
    """One list-scheduling pass; ``cap``: activations a rank may hold (forwards whose W has not run)."""
    stages = {r: (r, 2 * p - 1 - r) for r in range(p)}
    n = 2 * p
    next_f, next_b = [0] * n, [0] * n
    pending_w: dict[int, deque[tuple[int, int]]] = {r: deque() for r in range(p)}
    held = [0] * p
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    order: dict[int, list[_Action]] = {r: [] for r in range(p)}
    total = 3 * n * m

    def ready(key: tuple[str, int, int], t: float) -> bool:
        return key in done and done[key] <= t

    scheduled = 0
    blocked: set[int] = set()
    while scheduled < total:
        waiting = [x for x in range(p) if free[x] < float("inf") and x not in blocked]
        if not waiting:
            raise RuntimeError(f"no V order with cap={cap}: every rank waits")
        r = min(waiting, key=lambda x: (free[x], x))
        t = free[r]
        inputs, forwards = [], []
        for s in stages[r]:
            mb = next_b[s]
            if mb < next_f[s] and ready(("F", s, mb), t) and (s == n - 1 or ready(("G", s + 1, mb), t)):
                inputs.append(_Action(s, _I, mb))
            mb = next_f[s]
            # a first-chunk forward leaves one activation free for the second chunk, whose forward leads to the
            # backwards that free memory (without it, ranks full of first-chunk activations wait on each other)
            room = cap - (1 if s < p and next_f[n - 1 - s] < m else 0)
            if mb < m and held[r] < room and (s == 0 or ready(("F", s - 1, mb), t)):
                forwards.append(_Action(s, _F, mb))
        # deep: the stage nearer the loss (the second chunk, stage 2p-1-r) first
        inputs.sort(key=lambda a: (a.microbatch_index, -a.stage_index if i_deep else a.stage_index))
        forwards.sort(key=lambda a: (a.microbatch_index, -a.stage_index if f_deep else a.stage_index))
        choice = (inputs + forwards) if i_first else (forwards + inputs)
        if choice:
            a = choice[0]
        elif pending_w[r]:
            s, mb = pending_w[r].popleft()
            a = _Action(s, _W, mb)
        else:  # nothing to run now: wait until the next action of another rank finishes
            later = [v for v in done.values() if v > t]
            if later:
                free[r] = min(later)
            else:  # nothing in flight: another rank free at this moment must move first
                blocked.add(r)
            continue
        blocked.clear()
        end = t + action_cost(a, costs)
        s, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
        if kind == _F:
            next_f[s] += 1
            held[r] += 1
            done[("F", s, mb)] = end
        elif kind == _I:
            next_b[s] += 1
            pending_w[r].append((s, mb))
            done[("G", s, mb)] = end
        else:
            held[r] -= 1
        order[r].append(a)
        free[r] = end if len(order[r]) < 6 * m else float("inf")  # a rank runs F, I and W of 2m chunk passes
        scheduled += 1
    return order


def zbv_order(p: int, m: int, costs: Costs = (1.0, 1.0, 1.0), cap: int | None = None) -> dict[int, list[_Action]]:
    """A ZB-V order (rank r holds stages r and 2p-1-r) for ``m`` micro-batches, greedy for the given chunk costs.

    ``cap``: activations a rank may hold at once (forwards whose weight gradient has not run), default 2p, what a
    1F1B rank holds (p micro-batches of a stage twice the size of a V chunk). Among a few tie-break rules the order
    with the shortest simulated makespan wins, torch's own order included (it wins at some ratios under a tight cap);
    every order is checked by :func:`simulate`.
    """
    if p < 1 or m < 1:
        raise ValueError(f"zbv_order needs p >= 1 and m >= 1, got p={p}, m={m}.")
    cap = 2 * p if cap is None else cap
    best: tuple[float, dict[int, list[_Action]]] | None = None
    # torch's fixed order competes too (it wins at some cost ratios under a tight cap)
    theirs = {r: [a for a in acts if a is not None] for r, acts in torch_v_order("zbv", p, m).items()}
    if _peak_activations(theirs) <= cap:
        best = (simulate(theirs, 2 * p, costs).makespan, theirs)
    for i_first, i_deep, f_deep in product((True, False), repeat=3):
        try:
            order = _greedy(p, m, costs, cap, i_first, i_deep, f_deep)
        except RuntimeError:  # this tie-break rule fills a rank with forwards it cannot finish under the cap
            continue
        span = simulate(order, 2 * p, costs).makespan
        if best is None or span < best[0] - 1e-9:
            best = (span, order)
    if best is None:
        raise ValueError(
            f"no ZB-V order for p={p}, m={m} holds at most cap={cap} activations per rank; raise cap"
            " (ParallelConfig.pipeline_max_activations)."
        )
    return best[1]


def _v_units(name: str, p: int, m: int) -> dict[int, list[tuple[_Action, ...]]]:
    """torch's DualPipeV order as units in its sequence, every backward an input gradient: ``(F,)``, ``(I,)`` or a
    pair ``(F, I)``; weight gradients left out (:func:`_place_weights` places them)."""
    units: dict[int, list[tuple[_Action, ...]]] = {}
    for r, actions in torch_v_order(name, p, m).items():
        seq: list[tuple[_Action, ...]] = []
        for a in actions:
            if a is None or a.computation_type == _W:
                continue
            subs = a.sub_actions or (a,)
            seq.append(
                tuple(_Action(s.stage_index, _I, s.microbatch_index) if s.computation_type == _B else s for s in subs)
            )
        units[r] = seq
    return units


def _place_weights(
    units: Mapping[int, Sequence[tuple[_Action, ...]]], p: int, costs: Costs, cap: int, fill: str, lifo: bool
) -> dict[int, list[_Action]]:
    """Run every rank's units in their sequence (free communication), inserting its pending weight gradients (those
    of input gradients it has run): when the next unit would exceed ``cap`` activations, when no unit is left, and
    when the next unit must wait: ``fill="unknown"`` while its inputs are not yet computed anywhere, ``"any"`` also
    while they are still on their way, ``"fit"`` only when a whole weight gradient fits before they arrive.
    ``lifo``: the latest input gradient's weight first (its activations are the freshest)."""
    n = 2 * p
    done: dict[tuple[str, int, int], float] = {}
    free, pos, held = [0.0] * p, [0] * p, [0] * p
    pending: dict[int, deque[tuple[int, int]]] = {r: deque() for r in range(p)}
    order: dict[int, list[_Action]] = {r: [] for r in range(p)}
    blocked: set[int] = set()

    def needs(a: _Action) -> list[tuple[str, int, int]]:
        s, mb = a.stage_index, a.microbatch_index
        if a.computation_type == _F:
            return [("F", s - 1, mb)] if s > 0 else []
        return [("F", s, mb)] + ([("G", s + 1, mb)] if s < n - 1 else [])

    while True:
        live = [r for r in range(p) if (pos[r] < len(units[r]) or pending[r]) and r not in blocked]
        if not live:
            if any(pos[r] < len(units[r]) or pending[r] for r in range(p)):
                raise RuntimeError("the DualPipeV order cannot run: every rank waits")
            return order
        r = min(live, key=lambda x: (free[x], x))
        t = free[r]
        unit = units[r][pos[r]] if pos[r] < len(units[r]) else None
        ready_at = None
        if unit is not None:
            deps = [d for a in unit for d in needs(a)]  # a pair's halves never feed each other
            if all(d in done for d in deps):
                ready_at = max((done[d] for d in deps), default=0.0)
        forwards = sum(a.computation_type == _F for a in unit) if unit else 0
        if pending[r]:
            s, mb = pending[r][-1] if lifo else pending[r][0]
            w = action_cost(_Action(s, _W, mb), costs)
            run_w = (
                unit is None
                or held[r] + forwards > cap
                or ready_at is None
                or (fill == "any" and ready_at > t)
                or (fill == "fit" and ready_at >= t + w)
            )
            if run_w:
                (pending[r].pop if lifo else pending[r].popleft)()
                order[r].append(_Action(s, _W, mb))
                free[r], held[r] = t + w, held[r] - 1
                blocked.clear()
                continue
        if ready_at is None:  # wait for the next action of another rank to finish
            later = [v for v in done.values() if v > t]
            if later:
                free[r] = min(later)
            else:
                blocked.add(r)
            continue
        t = max(t, ready_at)
        for a in unit:
            t += action_cost(a, costs)
            if a.computation_type == _F:
                done[("F", a.stage_index, a.microbatch_index)] = t
                held[r] += 1
            else:
                done[("G", a.stage_index, a.microbatch_index)] = t
                pending[r].append((a.stage_index, a.microbatch_index))
        order[r].append(_Action(unit[0].stage_index, _FB, None, sub_actions=unit) if len(unit) > 1 else unit[0])
        free[r], pos[r] = t, pos[r] + 1
        blocked.clear()


def dualpipev_order(p: int, m: int, costs: Costs = (1.0, 1.0, 1.0), cap: int | None = None) -> dict[int, list[_Action]]:
    """A DualPipeV order (rank r holds stages r and 2p-1-r) for ``m`` micro-batches, its weight gradients placed for
    the given chunk costs.

    torch's forwards, forward-backward pairs (``OVERLAP_F_B``) and backwards stay in torch's sequence; each backward
    runs as its input gradient, and the weight gradients go where the rank would wait (a few placement rules tried,
    the order with the shortest simulated makespan, then the shortest per-rank spans, kept; torch's own order wins
    ties). ``cap``: activations a rank may hold (forwards whose weight gradient has not run), default what torch's
    order holds (2p + 1); more lets weight gradients wait longer for a gap. Every order is checked by
    :func:`simulate`.
    """
    if p < 1 or m < 1:
        raise ValueError(f"dualpipev_order needs p >= 1 and m >= 1, got p={p}, m={m}.")
    theirs = {r: [a for a in acts if a is not None] for r, acts in torch_v_order("dualpipev", p, m).items()}
    cap = _peak_activations(theirs) if cap is None else cap

    def rank_key(order: Mapping[int, Sequence[_Action]]) -> tuple[float, float]:
        sim = simulate(order, 2 * p, costs)
        return round(sim.makespan, 9), round(sum(tl[-1][2] - tl[0][1] for tl in sim.timeline.values()), 9)

    best = (rank_key(theirs), theirs) if _peak_activations(theirs) <= cap else None
    units = _v_units("dualpipev", p, m)
    for fill, lifo in product(("unknown", "any", "fit"), (True, False)):
        order = _place_weights(units, p, costs, cap, fill, lifo)
        if _peak_activations(order) > cap:  # torch's forwards ahead of its first backward need more
            continue
        key = rank_key(order)
        if best is None or key < best[0]:
            best = (key, order)
    if best is None:
        need = next(
            c for c in range(cap + 1, _peak_activations(theirs) + 1)
            if _peak_activations(_place_weights(units, p, costs, c, "unknown", True)) <= c
        )  # fmt: skip
        raise ValueError(
            f"no DualPipeV order for p={p}, m={m} holds at most cap={cap} activations per rank (its forwards ahead of"
            f" a rank's first backward need {need}); raise ParallelConfig.pipeline_max_activations."
        )
    return best[1]
