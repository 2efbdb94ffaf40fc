"""Re-running the same command after a crash continues: ``FlagScaleStrategy(resume="auto")``, async saves.

A 2-process run (main recipe module, ZeRO-1, ``async_checkpoint=True``, ``ModelCheckpoint(save_top_k=1)`` every 3
steps, no ``last``) is SIGKILLed while its step-6 checkpoint is being finalised, after retention asked to delete the
step-3 one. The step-3 checkpoint must still be there (deleted only once step 6 completes). The same command run
again picks it (skipping a planted incomplete checkpoint with a warning), removes the interrupted ``*.tmp-*`` save,
and its steps 4.. equal the killed run's to the last bit.
"""

from __future__ import annotations

import json

import pytest

from tests.strategies._kill import launch

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

SPEC = dict(
    layout=dict(zero_stage=1), max_steps=12, every_n_steps=3, save_last=False, save_top_k=1, resume="auto"
)  # fmt: skip
SPEC["async"] = True


def _runs(out) -> list[list[dict]]:
    """The rows of each run, split where the step counter goes back."""
    runs: list[list[dict]] = [[]]
    for line in (out / "losses.jsonl").read_text().splitlines():
        row = json.loads(line)
        if runs[-1] and row["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(row)
    return runs


def test_async_crash_keeps_previous_checkpoint_and_rerun_resumes_bit_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = launch({**SPEC, "out": str(tmp_path), "kill_event": ["meta_written", "step=6"]})
    assert proc.returncode == -9, proc.stderr[-3000:]
    names = sorted(p.name for p in ckpt.iterdir())
    assert "epoch=0-step=3.ckpt" in names and any(".tmp-" in n for n in names), names
    assert (ckpt / "epoch=0-step=3.ckpt" / "COMPLETE").is_file()
    planted = ckpt / "epoch=9-step=99.ckpt"  # newer but incomplete: must be skipped, never chosen
    planted.mkdir()
    (planted / ".metadata").write_bytes(b"")

    rerun = launch({**SPEC, "out": str(tmp_path)})
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    log = rerun.stdout + rerun.stderr
    assert "resuming from" in log and "epoch=0-step=3.ckpt" in log, log[-3000:]
    assert "Skipping" in log and "epoch=9-step=99.ckpt" in log and "interrupted" in log, log[-3000:]
    assert not [p for p in ckpt.iterdir() if ".tmp-" in p.name]

    killed, resumed = _runs(tmp_path)
    assert [r["step"] for r in resumed] == list(range(4, 13))
    overlap = [r for r in killed if r["step"] >= 4]
    assert overlap, killed
    for before, after in zip(overlap, resumed):
        assert before == after, (before, after)
