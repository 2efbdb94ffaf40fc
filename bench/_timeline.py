"""Per-rank timelines drawn as lanes of bars, shared by ``bench/pipeline.py`` and ``bench/hetero.py`` (issue 42 items
4 and 5): compute as full-height bars labelled with their micro-batch, communication as a thin bar at the bottom of
the lane, idle as the grey background the bars leave uncovered. Plotting only; callers import matplotlib."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd19e", "W": "#dd8452", "S": "#8172b2", "R": "#c44e52"}
IDLE = "#eeeeee"
LABELS = {
    "F": "F forward", "B": "B full backward", "I": "I input grad", "W": "W weight grad", "S": "send (post + wait)",
    "R": "receive (post + wait)",
}  # fmt: skip
"""Legend text of each event kind."""

Event = tuple[str, str, float, float]
"""(kind, text written on the bar, start s, end s), times from the panel's origin."""


def draw_lanes(
    ax: Any, lanes: Sequence[Sequence[Event]], span: float, names: Sequence[str], compute: set[str], xmax: float
) -> None:
    """One panel: lane ``i`` (top to bottom) draws ``lanes[i]`` over ``span`` seconds; x in ms up to ``xmax``."""
    n = len(lanes)
    for i, events in enumerate(lanes):
        y = n - 1 - i
        ax.broken_barh([(0, span * 1e3)], (y - 0.4, 0.8), facecolors=IDLE)  # idle unless covered
        for kind in dict.fromkeys(e[0] for e in events):  # one collection per kind and lane: fast to draw
            bars = [(t0 * 1e3, (t1 - t0) * 1e3) for k, _, t0, t1 in events if k == kind]
            if kind in compute:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="black", linewidth=0.2)
            else:  # communication: a thin bar at the bottom of the lane
                bars = [(left, max(width, xmax / 2000)) for left, width in bars]
                ax.broken_barh(bars, (y - 0.4, 0.2), facecolors=COLORS[kind])
        for kind, text, t0, t1 in events:
            if kind in compute and text and (t1 - t0) * 1e3 > xmax / 60:
                ax.text((t0 + t1) / 2 * 1e3, y, text, ha="center", va="center", fontsize=4)
    ax.set_xlim(0, xmax)
    ax.set_yticks(range(n), list(names)[::-1], fontsize=7)
    ax.tick_params(axis="x", labelsize=7)


def legend(kinds: Sequence[str]) -> list[Any]:
    """Legend patches of ``kinds`` and idle."""
    from matplotlib.patches import Patch  # the callers import matplotlib lazily (optional dependency)

    return [Patch(color=COLORS[k], label=LABELS[k]) for k in kinds] + [Patch(color=IDLE, label="idle")]
