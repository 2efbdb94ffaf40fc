"""Fault injection: SIGKILL inside a forward, a backward and an optimizer step, resume, and compare with the
uninterrupted run to the last bit.

Every rank kills itself at the chosen point (``_resume_run._fault``: a forward hook, a gradient hook during backward,
``on_before_optimizer_step`` after the gradient reduction) of a real 2-process run of the main recipe's module (fp32,
AdamW, warmup + cosine, clipping, ``LMDataModule``, ZeRO-1, a ``ModelCheckpoint`` every 2 steps), then the run is
resumed from ``last.ckpt``. Two chains, each against its own uninterrupted run:

- hetero data parallelism (``hetero_dp_batch_sizes=[3, 1]``: the hetero batch samplers' position) with 2-step
  gradient accumulation: killed in step 3's optimizer step; resumed from step 2 and killed in the forward of
  micro-batch 2 of step 3's window (micro-batch 1's backward is done, its gradients sit unreduced in the buckets):
  the resume must restart that window from its first micro-batch, and ``last.ckpt`` must still be the end of step 2
  (Lightning's ModelCheckpoint used to save step 2 again after micro-batch 1, mid-window); resumed to step 9, across
  the epoch boundary (6 steps per epoch). Every resumed step's LR is compared too: before the fix the first resumed
  step ran at the LR the scheduler set when built (warmup step 0), as the optimizer's param groups were not restored.
- MoE under expert parallelism (``mixtral-tiny``, ``expert_parallel_size=2``, aux-loss-free router biases updated
  every step, one hot expert replicated): killed in the backward of step 4; resumed to step 6. The router biases
  (buffers) and the replicated-expert choice (kept in ``meta.pt``) must be restored for the losses to match.

A launch is mostly one rank importing torch and Lightning while the other waits, so the selected tests' chains and
their uninterrupted runs all start together when the first test runs (``runs``), each test asserting on its own.
"""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.checkpoint import read_meta
from tests._background import background, selected
from tests.strategies._kill import final_weights, launch_killed, launch_ok, losses

pytestmark = pytest.mark.own_processes  # starts its own jobs (see tests/conftest.py)

HETERO = dict(layout=dict(zero_stage=1, hetero_dp_batch_sizes=[3, 1]), accumulate=2, max_steps=9, every_n_steps=2)
MOE = dict(
    layout=dict(zero_stage=1, expert_parallel_size=2), preset="mixtral-tiny", max_steps=6, every_n_steps=2,
    config=dict(moe_router_bias_update_rate=0.01, moe_hot_expert_replicas=1, moe_hot_expert_enable_imbalance=1.0,
                moe_hot_expert_disable_imbalance=1.0),
)  # fmt: skip


def _assert_same_run(got_dir, want_dir, steps: int) -> None:
    got, want = losses(got_dir), losses(want_dir)
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step] == want[step], (step, got[step], want[step])
    weights, ref = final_weights(got_dir), final_weights(want_dir)
    assert weights.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(weights[name], value), name


def _hetero_chain(out) -> None:
    last = str(out / "ckpt" / "last.ckpt")
    launch_killed({**HETERO, "out": str(out), "fault": ["optimizer", 3, 0]})
    assert sorted(losses(out)) == [1, 2]
    launch_killed({**HETERO, "out": str(out), "fault": ["forward", 3, 1], "ckpt_path": last})
    assert read_meta(last)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 4
    launch_ok({**HETERO, "out": str(out), "ckpt_path": last})


def _moe_chain(out) -> None:
    launch_killed({**MOE, "out": str(out), "fault": ["backward", 4, 0]})
    assert sorted(losses(out)) == [1, 2, 3]
    launch_ok({**MOE, "out": str(out), "ckpt_path": str(out / "ckpt" / "last.ckpt")})


# test -> (the spec of its uninterrupted run, its kill/resume chain)
CHAINS = {
    "test_kills_in_optimizer_step_and_in_forward_mid_accumulation_under_hetero_dp": (HETERO, _hetero_chain),
    "test_kill_in_backward_under_expert_parallelism": (MOE, _moe_chain),
}


@pytest.fixture(scope="module")
def runs(request, launcher, tmp_path_factory):
    """test name -> (uninterrupted run's folder, chain's folder, the jobs): every selected chain and uninterrupted
    run started at once."""
    launcher.close()  # own processes (as the marker does for each test): no idle shared workers on the cores
    wanted = [test for test in CHAINS if selected(request, test)]
    with background(workers=2 * len(wanted)) as jobs:
        folders = {}
        for test in wanted:
            spec, chain = CHAINS[test]
            folder = tmp_path_factory.mktemp("fault")
            folders[test] = (folder / "ref", folder / "run", jobs)
            jobs.submit((test, "ref"), launch_ok, {**spec, "out": str(folder / "ref")})
            jobs.submit((test, "chain"), chain, folder / "run")
        yield folders


def _check(runs, test: str, steps: int) -> None:
    ref, out, jobs = runs[test]
    jobs.result((test, "chain"))  # its own assertions between the launches
    jobs.result((test, "ref"))
    _assert_same_run(out, ref, steps)


def test_kills_in_optimizer_step_and_in_forward_mid_accumulation_under_hetero_dp(runs):
    _check(runs, "test_kills_in_optimizer_step_and_in_forward_mid_accumulation_under_hetero_dp", 9)


def test_kill_in_backward_under_expert_parallelism(runs):
    _check(runs, "test_kill_in_backward_under_expert_parallelism", 6)
