"""Loud failures on non-finite values: ``nan_policy`` raise / skip_step / rollback, and ``skip_spiky_loss``.

NaN is injected into one parameter's gradient on rank 1 only (by a gradient hook, so before the bucketed reduction
sees it), under DP=2 with ZeRO-1 (each rank checks its own gradient shard, the flags are gathered) and with plain DDP
(the reduced gradients are the same on every rank: each rank's own check decides, no collective), with plain SGD;
every rank must take the same decision. A NaN *loss* with finite gradients on one rank is found through the loss
exchange that runs under backward.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_flagscale.strategies._resilience import StepGuard
from tests._launcher import WorkerError
from tests.strategies._lm import tiny_config, trainer_run

LAYOUT = dict(zero_stage=1)
LAYOUTS = [pytest.param(dict(zero_stage=1), id="zero1-sharded-grads"), pytest.param(dict(zero_stage=0), id="ddp")]


def _nan_run(
    policy: str,
    steps: int,
    nan_step: int,
    save_at: int | None = None,
    ckpt_dir: str | None = None,
    layout: dict | None = None,
):
    import lightning as L
    import torch.distributed as dist

    class InjectNaN(L.Callback):
        # A tensor hook, not `param.grad` after backward: the bucketed reduction moves gradients out of `.grad` as
        # soon as they are accumulated, so the NaN has to enter through autograd.
        handle = None

        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step == nan_step and dist.get_rank() == 1:
                param = next(p for p in pl_module.parameters() if p.requires_grad)
                self.handle = param.register_hook(lambda grad: torch.full_like(grad, math.nan))

        def on_after_backward(self, trainer, pl_module):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if save_at is not None and trainer.global_step == save_at:
                trainer.save_checkpoint(f"{ckpt_dir}/step{save_at}.ckpt")

    return trainer_run({**(layout or LAYOUT), "nan_policy": policy}, tiny_config(), steps, callbacks=[InjectNaN()])


def _nan_loss_run(nan_step: int, accumulate: int):
    """A NaN added to rank 1's loss as a constant (its gradients stay finite) on the first micro-batch of step
    ``nan_step``'s window, under DDP."""
    import lightning as L
    import torch.distributed as dist

    class NaNLoss(L.Callback):
        def on_train_start(self, trainer, pl_module):
            step = pl_module.training_step

            def training_step(batch, batch_idx):
                loss = step(batch, batch_idx)
                first = batch_idx % trainer.accumulate_grad_batches == 0
                if trainer.global_step == nan_step and first and dist.get_rank() == 1:
                    loss = loss + math.nan  # d(loss + c)/d(loss) = 1: finite gradients, a NaN loss
                return loss

            pl_module.training_step = training_step

    return trainer_run(
        {"zero_stage": 0, "nan_policy": "raise"}, tiny_config(), 3, callbacks=[NaNLoss()], accumulate=accumulate
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_raise_names_the_step(launcher, layout):
    with pytest.raises(WorkerError, match=r"FloatingPointError: Step 1: non-finite gradients on rank\(s\) \[0, 1\]"):
        launcher(2, _nan_run, "raise", 3, 1, None, None, layout)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_nan_loss_with_finite_gradients_is_named(launcher, accumulate):
    # The window's loss is exchanged asynchronously once its last micro-batch's loss is known; with accumulation the
    # NaN came in the window's first micro-batch and must still be counted.
    with pytest.raises(WorkerError, match=r"Step 1: non-finite loss on rank\(s\) \[1\] \(global loss nan\)"):
        launcher(2, _nan_loss_run, 1, accumulate)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skip_step_drops_the_step_on_every_rank(launcher, layout):
    skipped = launcher(2, _nan_run, "skip_step", 3, 2, None, None, layout)  # the last of 3 steps is skipped
    _, want = launcher(2, trainer_run, layout, tiny_config(), 2)[0]  # the same run stopped after 2 steps
    for losses, params in skipped:
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
        for name, value in want.items():
            assert torch.equal(params[name], value), name


def test_rollback_restores_the_newest_checkpoint(launcher, tmp_path):
    # A checkpoint after step 1; the NaN comes at step 3: weights and optimizer go back to step 1's.
    rolled = launcher(2, _nan_run, "rollback", 3, 2, 1, str(tmp_path))
    _, want = launcher(2, trainer_run, LAYOUT, tiny_config(), 1)[0]
    for _, params in rolled:
        for name, value in want.items():
            assert torch.equal(params[name], value), name


def test_spiky_loss_is_skipped_and_nan_loss_is_named():
    guard = StepGuard("raise", spike_threshold=0.5, spike_window=3)

    def step(loss: float):
        guard.observe(torch.tensor(loss))
        return guard.decide([], step=7, accumulate=1, device=torch.device("cpu"))

    assert [step(x).action for x in (2.0, 2.1, 1.9, 2.0)] == ["step"] * 4
    spike = step(3.5)  # > 1.5 x mean(2.1, 1.9, 2.0)
    assert spike.action == "skip" and "spike" in spike.message and guard.skipped_steps == 1
    assert step(2.2).action == "step"  # the spike did not enter the running mean
    with pytest.raises(FloatingPointError, match=r"Step 7: non-finite loss on rank\(s\) \[0\]"):
        step(math.nan)
    # launched early (as the strategy does once a window's last loss is known): decide uses that window
    guard.observe(torch.tensor(1.0))
    guard.observe(torch.tensor(3.0))
    guard.launch(accumulate=2, device=torch.device("cpu"))
    guard.observe(torch.tensor(100.0))  # the next window's: not part of this decision
    verdict = guard.decide([], step=8, accumulate=2, device=torch.device("cpu"))
    assert verdict.action == "step" and verdict.loss == 2.0
    assert StepGuard("skip_step", None).__class__ is StepGuard
    with pytest.raises(ValueError, match="nan_policy='ignore' is unknown"):
        StepGuard("ignore", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_check_finds_any_nan_or_inf_and_no_false_alarm(dtype):
    """One fp32-accumulated sum per gradient: any NaN / inf (also +inf and -inf in two tensors, whose sums cancel to
    NaN) is found; large finite fp16 gradients, whose fp16 sum would overflow, are not flagged."""
    from lightning_flagscale.parallel.data_parallel.optimizer import grads_finite

    def params(*values):
        out = []
        for v in values:
            p = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
            p.grad = torch.full((1000,), 1.0, dtype=dtype)
            if v is not None:
                p.grad[17] = v
            out.append(p)
        return out

    large = params(None)
    large[0].grad.fill_(60000.0)  # finite; its sum, 6e7, overflows fp16 but not the fp32 accumulator
    assert bool(grads_finite(large))
    assert bool(grads_finite([torch.nn.Parameter(torch.zeros(3))]))  # no gradient: nothing to flag
    for bad in ([math.nan, None], [None, math.inf], [math.inf, -math.inf]):
        assert not bool(grads_finite(params(*bad))), bad
    guard = StepGuard("raise", None)
    guard.observe(torch.tensor(1.0))
    with pytest.raises(FloatingPointError, match=r"non-finite gradients on rank\(s\) \[0\]"):
        guard.decide(params(None, math.nan), step=3, accumulate=1, device=torch.device("cpu"))
