"""A SIGKILL at any step of a synchronous or asynchronous save leaves a loadable checkpoint (fault injection).

Each case runs ``_save_kill`` (one process, real DCP saves, retention as ``ModelCheckpoint(save_top_k=1,
save_last=True)`` does it) and kills it at one step of the second round; afterwards ``clean_interrupted`` removes
(or restores) what the crash left, and every checkpoint ``list_checkpoints`` returns loads, with the newest one at
step 6 exactly when the kill came after ``step6.ckpt`` was complete. The selected cases' processes (one core each)
run two at a time, started together when the first case runs (``killed``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_flagscale.checkpoint import load_sharded
from lightning_flagscale.checkpoint.recovery import clean_interrupted, find_latest_checkpoint, list_checkpoints
from tests._background import background, selected

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

# (mode, event, whether step6.ckpt is complete when the kill hits, whether the crash leaves something to clean)
CASES = [
    ("sync", "data_written", False, True),
    ("sync", "meta_written", False, True),
    ("sync", "old_moved_aside", True, True),  # replacing last.ckpt: the old copy is aside, the new not yet in place
    ("sync", "renamed", True, False),  # step6.ckpt in place, retention not yet run
    ("async", "async_started", False, True),  # retention asked to delete step3.ckpt while step6 is in flight
    ("async", "meta_written", False, True),
    ("async", "old_moved_aside", True, True),
]


def _run(folder: Path, mode: str, event: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint._save_kill", str(folder), mode, event],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -9, f"expected SIGKILL at {event}, got {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.returncode


@pytest.fixture(scope="module")
def killed(request, launcher, tmp_path_factory):
    """(mode, event) -> (its folder, the jobs): the selected cases' killed runs, two at a time in test order."""
    launcher.close()  # own processes (as the marker does for each test): no idle shared workers on the cores
    cases = [(item.callspec.params["mode"], item.callspec.params["event"])
             for item in selected(request, "test_kill_during_save_leaves_a_loadable_checkpoint")]  # fmt: skip
    with background(workers=2) as jobs:
        folders = {}
        for mode, event in cases:
            folders[mode, event] = tmp_path_factory.mktemp(f"{mode}-{event}")
            jobs.submit((mode, event), _run, folders[mode, event], mode, event)
        yield {case: (folder, jobs) for case, folder in folders.items()}


@pytest.mark.parametrize(("mode", "event", "step6_complete", "leftover"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_kill_during_save_leaves_a_loadable_checkpoint(killed, mode, event, step6_complete, leftover):
    folder, jobs = killed[mode, event]
    jobs.result((mode, event))  # SIGKILLed at that event
    ckpt = folder / "ckpt"
    if not step6_complete:  # retention must not have deleted the previous top-k checkpoint before step 6 completed
        assert (ckpt / "step3.ckpt" / "COMPLETE").is_file(), sorted(p.name for p in ckpt.iterdir())
    if leftover:
        with pytest.warns(UserWarning, match="interrupted"):
            assert clean_interrupted(ckpt) or (ckpt / "last.ckpt").is_dir()
    else:
        assert clean_interrupted(ckpt) == []
    names = sorted(p.name for p in ckpt.iterdir())
    assert not [n for n in names if ".tmp-" in n or ".old-" in n], names
    found = list_checkpoints(ckpt)
    assert found, f"no checkpoint survived: {names}"
    for step, path in found:
        state = {"state_dict": {"w": torch.zeros(64, 64)}}
        load_sharded(path, state)
        assert torch.equal(state["state_dict"]["w"], torch.full((64, 64), float(step))), path
    latest = find_latest_checkpoint(ckpt)
    assert latest is not None and found[-1][0] == (6 if step6_complete else 3), names
    assert (ckpt / "last.ckpt").is_dir(), "last.ckpt must survive (restored if the crash hit its replacement)"
