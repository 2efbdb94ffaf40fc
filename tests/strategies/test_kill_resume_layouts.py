"""SIGKILL and resume across layouts: ZeRO-3 -> PP=2 -> ZeRO-3, against one uninterrupted single-process run.

The runner of ``test_fault_injection.py`` (``_resume_run``: main recipe module, warmup + cosine, clipping,
``LMDataModule``, fp32, here a checkpoint every 3 steps). A ZeRO-3 run (DP=2) is killed after step 8; its step-6
checkpoint resumes under PP=2 (DP=1, twice the per-rank batch: the same global batch), which is killed after step 13;
its step-12 checkpoint resumes under ZeRO-3 to step 16. Both layouts save and load; every step's LR must equal the
oracle's exactly and every loss and the final weights within 1e-5 (the layouts sum in other orders). The oracle trains
beside the chain's first run (``background``: a launch is mostly one process importing at a time).
"""

from __future__ import annotations

import pytest
import torch

from tests._background import background
from tests.strategies._kill import final_weights, launch_killed, launch_ok, losses
from tests.strategies._lm import assert_rel_close

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

COMMON = dict(max_steps=16, every_n_steps=3)
ZERO3 = dict(layout=dict(zero_stage=3), batch_size=2)
PP2 = dict(layout=dict(pipeline_parallel_size=2), batch_size=4)


def test_sigkill_and_resume_across_zero3_and_pp2_matches_one_process(tmp_path):
    ref_dir, out = tmp_path / "ref", tmp_path / "run"
    with background(workers=1) as jobs:
        jobs.submit("ref", launch_ok, {**COMMON, "out": str(ref_dir), "devices": 1, "layout": {}, "batch_size": 4})
        ckpt = str(out / "ckpt" / "last.ckpt")
        launch_killed({**COMMON, **ZERO3, "out": str(out), "kill_at": 8})
        launch_killed({**COMMON, **PP2, "out": str(out), "kill_at": 13, "ckpt_path": ckpt})
        launch_ok({**COMMON, **ZERO3, "out": str(out), "ckpt_path": ckpt})
        jobs.result("ref")
    ref, got = losses(ref_dir), losses(out)
    assert sorted(got) == sorted(ref) == list(range(1, 17))
    for step, want in ref.items():
        assert got[step]["lr"] == want["lr"], (step, got[step], want)
        assert abs(got[step]["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (step, got[step], want)
    ref_weights, weights = final_weights(ref_dir), final_weights(out)
    assert weights.keys() == ref_weights.keys()
    for name, want in ref_weights.items():
        assert_rel_close(weights[name], want, 1e-5, name)
    assert torch.isfinite(torch.tensor([row["loss"] for row in got.values()])).all()
