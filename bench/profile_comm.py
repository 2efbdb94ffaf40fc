"""Overlap of communication with compute in one profiled training step (``torch.profiler`` CPU trace).

gloo runs every collective on its own worker threads, where the trace shows it as ``gloo:<op>`` events; the
training thread shows ``aten::`` ops (forward, backward, optimizer) and ``autograd::engine::evaluate_function``
nodes. From one step's trace:

- ``comm_ms``: time during which at least one collective was running;
- ``exposed_comm_ms``: the part of it during which the training thread ran no ``aten::`` op, i.e. waited for the
  network (a blocking collective, ``Work.wait()``, DDP's end-of-backward wait, the ZeRO all-gather);
- ``comm_before_backward_end``: collectives that started before the last backward node of the step finished,
  out of ``comm_ops`` (overlap needs them to start while backward still computes).
"""

from __future__ import annotations

from typing import Any

__all__ = ["comm_overlap"]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union ``a`` outside the union ``b`` (both sorted, disjoint)."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        total += max(0.0, end - cursor)
    return total


def comm_overlap(events: Any) -> dict[str, float]:
    """Summary of one profiled step (``profiler.events()``); times in milliseconds."""
    events = list(events)
    threads: dict[Any, int] = {}
    for e in events:
        if e.name.startswith("aten::"):
            threads[e.thread] = threads.get(e.thread, 0) + 1
    main = max(threads, key=threads.get) if threads else None
    compute = _union([(e.time_range.start, e.time_range.end) for e in events
                      if e.thread == main and e.name.startswith("aten::")])  # fmt: skip
    comm_events = [e for e in events if e.name.startswith("gloo:")]
    comm = _union([(e.time_range.start, e.time_range.end) for e in comm_events])
    backward = [e.time_range.end for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    backward_end = max(backward) if backward else float("inf")
    return {
        "comm_ms": _length(comm) / 1e3,
        "exposed_comm_ms": _minus(comm, compute) / 1e3,
        "comm_ops": len(comm_events),
        "comm_before_backward_end": sum(1 for e in comm_events if e.time_range.start < backward_end),
        "step_ms": (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3,
    }
