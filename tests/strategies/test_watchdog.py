"""A rank that stops responding or dies, or a SIGTERM during a hang: every rank exits promptly, naming the culprit.

Each case launches ``_hang_run`` (2 processes, Lightning's launcher) with a short ``watchdog_timeout``; without the
watchdog the surviving rank would wait for the process group's 30-minute timeout. No elapsed time is asserted: what
ended the run is read from the ranks' messages (the watchdog's hang diagnosis, the SIGTERM path and not the hang
timeout); ``_finish``'s limit only keeps a broken run from blocking the suite.

The three runs mostly wait (for the hang timeout, a dead peer, the SIGTERM grace), so the selected ones start together
when the first test runs (``runs``), each driven to its end on a thread of its own; each test asserts on its own run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._background import background, selected

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def _start(mode: str, timeout: float, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.strategies._hang_run", mode, str(timeout), str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, limit: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=limit)  # waits for every rank: they share the pipes
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the ranks did not exit in time") from None
    return proc.returncode, err


def _wait_for_step(out: Path, rank: int, step: int, limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if out.exists() and f"{rank} {step}" in out.read_text().split("\n"):
            return
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never reached step {step}")


def _hang(out: Path) -> tuple[int, str]:
    proc = _start("hang", 6.0, out)
    _wait_for_step(out, 1, 2)
    return _finish(proc, 300)


def _die(out: Path) -> tuple[int, str]:
    proc = _start("die", 6.0, out)
    return _finish(proc, 180)


def _sigterm(out: Path) -> tuple[int, str]:
    proc = _start("hang", 120.0, out)  # the hang timeout is far away: only SIGTERM can end this run quickly
    _wait_for_step(out, 1, 2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)
    return _finish(proc, 300)


RUNS = {
    "test_hung_rank_makes_every_rank_exit_naming_the_phase": _hang,
    "test_dead_rank_is_named": _die,
    "test_sigterm_during_a_hang_is_honoured": _sigterm,
}


@pytest.fixture(scope="module")
def runs(request, launcher, tmp_path_factory):
    """test name -> its run's ``(exit code, stderr)``, awaited: the selected tests' runs, all started at once."""
    launcher.close()  # own processes (as the marker does for each test): no idle shared workers on the cores
    wanted = [test for test in RUNS if selected(request, test)]
    with background(workers=len(RUNS)) as jobs:
        for test in wanted:
            jobs.submit(test, RUNS[test], tmp_path_factory.mktemp("watchdog") / "steps")
        yield jobs


def test_hung_rank_makes_every_rank_exit_naming_the_phase(runs):
    code, err = runs.result("test_hung_rank_makes_every_rank_exit_naming_the_phase")
    assert code != 0, err[-3000:]
    # Whichever watchdog fires first names the hang and the phases of both ranks (rank 1 is stuck "between steps",
    # in the callback; rank 0 in the next collective); the other rank then exits too, naming what it saw.
    hung = [line for line in err.splitlines() if "[FlagScale watchdog" in line and "hung for" in line]
    assert hung and "between steps" in hung[0] and "rank 1" in hung[0], err[-3000:]
    for rank in (0, 1):
        assert f"[FlagScale watchdog, rank {rank}]" in err, err[-3000:]


def test_dead_rank_is_named(runs):
    code, err = runs.result("test_dead_rank_is_named")
    assert code != 0, err[-3000:]
    # Named by the watchdog's diagnosis of the failed collective, or by Lightning's child-process observer on the
    # launching rank (whichever comes first; both name rank 1).
    named = ("rank(s) [1] stopped responding", "rank 1 stopped responding", "[rank: 1] Child process")
    assert any(text in err for text in named), err[-3000:]


def test_sigterm_during_a_hang_is_honoured(runs):
    code, err = runs.result("test_sigterm_during_a_hang_is_honoured")
    assert code != 0, err[-3000:]
    # The SIGTERM path ended it, not the hang timeout (120 s; the rank sleeps for an hour).
    assert "SIGTERM received" in err and "hung for" not in err, err[-3000:]
