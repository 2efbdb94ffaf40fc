"""Ranks of the calibration worlds that ``tests/test_tune_run.py`` spawns to test ``tune.calibrate._run_world``.

A spawned rank imports the module its function lives in. Here that is this module (standard library only) and not the
test module, whose imports (the tuner, hence Lightning) cost about 4 s of CPU per rank: with them a world spent most of
its time importing, and the "hung" rank of a 3-second timeout was killed before it had reached its hang.
"""

from __future__ import annotations

import os
import time


def world_rank(rank: int, mode: str, results, reported=None) -> None:
    """A calibration world's rank: rank 1 hangs, fails or aborts (before rank 0 reports, or after: ``reported`` is set
    once it has), rank 0 reports."""
    if rank == 1 and mode == "hang":
        time.sleep(3600)
    if rank == 1 and mode == "fail":
        raise RuntimeError("rank 1 broke")
    if rank == 1 and mode == "abort_after":
        reported.wait(120)
        os.abort()
    if rank == 1 and mode == "abort_before":
        os.abort()
    if rank == 0 and mode == "abort_before":
        time.sleep(3600)
    if rank == 0:
        results.put(("done", mode))
        if reported is not None:
            reported.set()
