"""An injected clock for the emulated-slowdown hooks (``parallel/hetero_mesh/ranks.py``), so that tests of the
profiling pass assert exact speeds instead of measured ones."""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Callable, Iterator

TICK = 1e-3
"""Seconds each region the hooks time (a forward, a backward) lasts on :func:`ticking_clock`."""


def ticking_clock(tick: float = TICK) -> Callable[[], float]:
    """A clock that advances ``tick`` at each reading: every region the emulation's hooks time (a forward between
    its two readings, a backward between its two) lasts exactly ``tick``, whatever the machine's load; the emulated
    slowdown then stretches it by exactly its factor (its sleep stays real)."""
    now = [0.0]

    def read() -> float:
        now[0] += tick
        return now[0]

    return read


@contextlib.contextmanager
def emulation_on_ticking_clock(tick: float = TICK) -> Iterator[None]:
    """Within the block, every ``BusyTimer`` created reads :func:`ticking_clock` (restored after: the test pool's
    workers live on)."""
    from lightning_flagscale.parallel.hetero_mesh import ranks

    clock = ticking_clock(tick)
    ranks.time = types.SimpleNamespace(thread_time=clock, perf_counter=clock, sleep=time.sleep)
    try:
        yield
    finally:
        ranks.time = time
