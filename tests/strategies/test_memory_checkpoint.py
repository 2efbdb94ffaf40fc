"""In-memory (flash) checkpoints: SIGKILL a real 2-process run after a snapshot newer than its last disk checkpoint,
restart, and the run continues from the snapshot, bit-exact with an uninterrupted run.

The run is the main recipe's module (AdamW, warmup then cosine decay, clipping, ``LMDataModule``), fp32, ZeRO-1 and
ZeRO-3 on 2 processes, ``ModelCheckpoint`` every 4 steps and ``MemoryCheckpoint`` every step (files in ``/dev/shm``). Every rank
SIGKILLs itself once its step-7 snapshot is written; the disk holds step 4. Rank 1's step-7 snapshot is then deleted
(as if the crash had interrupted its write): the ranks must agree on step 6, the newest step both hold, and say so.
The choice between memory and disk is unit-tested in ``tests/checkpoint/test_memory.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_flagscale.checkpoint.memory import default_snapshot_root, snapshot_folder
from tests.strategies._kill import final_weights, launch, launch_ok, losses

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

SPEC = dict(max_steps=12, every_n_steps=4, memory_every=1)
# ZeRO-1: our optimizer's local shards (main weights + states) as they are; ZeRO-3: FSDP2 DTensor shards through DCP's
# state-dict setters.
LAYOUTS = {"zero1": dict(zero_stage=1), "zero3": dict(zero_stage=3)}


def _rank_folder(out: Path, rank: int) -> Path:
    return snapshot_folder(default_snapshot_root(), str((out / "ckpt").resolve()), rank)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sigkill_after_memory_snapshot_resumes_from_memory_bit_exact(tmp_path, layout):
    spec = {**SPEC, "layout": LAYOUTS[layout]}
    ref, out = tmp_path / "ref", tmp_path / "run"
    launch_ok({**spec, "out": str(ref)})
    assert not _rank_folder(ref, 0).parent.exists(), "snapshots must be removed when fit ends"

    killed = launch({**spec, "out": str(out), "kill_after_snapshot": 7, "resume": "auto"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("epoch")) == ["epoch=0-step=4.ckpt"]
    rank1 = sorted(_rank_folder(out, 1).glob("step-*.pt"))
    assert [p.name[:14] for p in rank1] == ["step-000000006", "step-000000007"], rank1
    rank1[-1].unlink()  # rank 1's newest snapshot is lost: step 6 is the newest both ranks hold

    resumed = launch({**spec, "out": str(out), "resume": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    log = resumed.stdout + resumed.stderr
    assert "in-memory snapshot of step 6" in log and "rank(s) [1]" in log, log[-3000:]
    assert not _rank_folder(out, 0).parent.exists()

    want, got = losses(ref), losses(out)
    assert sorted(got) == list(range(1, 13))
    # Steps 1-6 ran from a fresh start through `resume="auto"` (nothing to resume yet), 7-12 from the snapshot: same LR,
    # same batch, same loss as the uninterrupted run, to the last bit.
    for step in range(1, 13):
        assert got[step]["lr"] == want[step]["lr"], (step, got[step], want[step])
        assert got[step]["loss"] == want[step]["loss"], (step, got[step], want[step])
    ref_weights, weights = final_weights(ref), final_weights(out)
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        assert torch.equal(weights[name], value), name
