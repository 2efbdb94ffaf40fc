"""SIGKILL a real 2-process run mid-epoch, resume from its last periodic checkpoint: bit-exact with no kill.

The run is the main recipe's module (AdamW, warmup then cosine decay, gradient clipping, ``LMDataModule``), fp32,
TP=1 x DP=2 with ZeRO-1, launched by Lightning's own launcher, with a ``ModelCheckpoint`` every 3 steps. Every rank
SIGKILLs itself after step 8 (the last checkpoint is step 6, mid-epoch: 12 steps per epoch), and the resumed run goes
on across the epoch boundary to step 16. Before the fix the first resumed step ran at the LR the scheduler set when
built (warmup step 0): the optimizer's param groups were not restored.
"""

from __future__ import annotations

import pytest
import torch

from tests.strategies._kill import final_weights, launch_killed, launch_ok, losses

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

SPEC = dict(layout=dict(zero_stage=1), max_steps=16, every_n_steps=3)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    launch_ok({**SPEC, "out": str(out)})
    return losses(out), final_weights(out)


def test_sigkill_mid_epoch_then_resume_is_bit_exact(uninterrupted, tmp_path):
    ref_losses, ref_weights = uninterrupted
    launch_killed({**SPEC, "out": str(tmp_path), "kill_at": 8})
    assert sorted(losses(tmp_path)) == list(range(1, 9))
    launch_ok({**SPEC, "out": str(tmp_path), "ckpt_path": str(tmp_path / "ckpt" / "last.ckpt")})
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 17))
    for step in range(7, 17):  # the resumed steps: same LR, same batch, same loss, to the last bit
        assert got[step]["lr"] == ref_losses[step]["lr"], (step, got[step], ref_losses[step])
        assert got[step]["loss"] == ref_losses[step]["loss"], (step, got[step], ref_losses[step])
    weights = final_weights(tmp_path)
    assert weights.keys() == ref_weights.keys()
    for name, want in ref_weights.items():
        assert torch.equal(weights[name], want), name
