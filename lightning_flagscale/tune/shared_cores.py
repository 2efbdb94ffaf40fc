"""Ranks that share a node's cores: the time a pipeline schedule and an optimizer phase take when more ranks than
compute units run at once (CPU processes on a few cores; ``HardwareProfile.compute_units_per_node``).

The node is a fluid processor-sharing machine: at every moment the ranks that have work share the units equally,
each at most one unit (``rate = min(1, units / running)``); a rank waiting on a peer (a pipeline receive) or done
computes nothing and lends its unit to the others. A pipeline rank runs its actions in the order the schedule
gives (``tune.inflight.schedule_actions``, the lists torch executes); an action starts once the rank is free and
its input has arrived: a forward after the previous stage's forward of that micro-batch, a full or input-gradient
backward after the next stage's backward of it, each plus one ``hop`` when the stages sit on different ranks. The
two closed forms this replaces are its limits: with a unit per rank it is the schedule's critical path (fill, steady
state, drain); with every rank always busy it is the node's summed work over its units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["pipeline_seconds", "processor_sharing_seconds"]

_EPS = 1e-12


def processor_sharing_seconds(works: Sequence[float], units: float) -> float:
    """Time until every job of ``works`` (seconds on one unit each, all started together) is done."""
    left = sorted(w for w in works if w > 0)
    t = done = 0.0
    for i, w in enumerate(left):
        running = len(left) - i
        t += (w - done) / min(1.0, units / running)
        done = w
    return t


def pipeline_seconds(
    actions: Sequence[Sequence[tuple[str, int, int]]],
    stage_times: Mapping[int, tuple[float, float, float]],
    hop: float,
    units: float,
) -> float:
    """Makespan of one schedule run: ``actions[r]`` are rank ``r``'s ``(kind, stage, micro-batch)`` in order (kind
    F, B, I or W), ``stage_times[stage]`` its ``(f, b, w)`` per micro-batch (``I`` takes ``b - w``), ``hop`` the
    transfer between ranks, ``units`` the compute units the ranks share."""
    if units <= 0:
        raise ValueError(f"units={units}: the ranks need at least part of a compute unit.")
    owner = {stage: r for r, acts in enumerate(actions) for _, stage, _ in acts}
    last = max(owner)

    def work(kind: str, stage: int) -> float:
        f, b, w = stage_times[stage]
        return {"F": f, "B": b, "I": b - w, "W": w}[kind]

    def ready(kind: str, stage: int, mb: int) -> float | None:
        """When this action's input is on its rank (None: its producer has not finished)."""
        if kind == "F" and stage > 0:
            src = ("F", stage - 1, mb)
        elif kind in ("B", "I") and stage < last:
            src = ("B", stage + 1, mb)
        else:
            return 0.0
        if src not in finished:
            return None
        return finished[src] + (hop if owner[src[1]] != owner[stage] else 0.0)

    finished: dict[tuple[str, int, int], float] = {}  # ("F" | "B", stage, mb) -> time; "B" = input gradient out
    nxt = [0] * len(actions)
    left: list[float | None] = [None] * len(actions)  # work left of the running action
    t = 0.0
    while True:
        waits = []
        for r, acts in enumerate(actions):
            if left[r] is None and nxt[r] < len(acts):
                at = ready(*acts[nxt[r]])
                if at is not None and at <= t + _EPS:
                    left[r] = work(*acts[nxt[r]][:2])
                elif at is not None:
                    waits.append(at)
        running = [r for r in range(len(actions)) if left[r] is not None]
        if not running:
            if all(nxt[r] == len(acts) for r, acts in enumerate(actions)):
                return t
            if not waits:
                stuck = {r: acts[nxt[r]] for r, acts in enumerate(actions) if nxt[r] < len(acts)}
                raise ValueError(f"pipeline actions deadlock: ranks wait on inputs nobody produces: {stuck}")
        rate = min(1.0, units / len(running)) if running else 0.0
        dt = min([left[r] / rate for r in running] + [at - t for at in waits])
        t += dt
        for r in running:
            left[r] -= rate * dt
            if left[r] <= _EPS:
                kind, stage, mb = actions[r][nxt[r]]
                if kind in ("F", "B", "I"):
                    finished[("F" if kind == "F" else "B", stage, mb)] = t
                left[r] = None
                nxt[r] += 1
