"""Precision parity (issue 10): the mixed-precision layouts train like the fp32 run within stated tolerances, with
plain SGD and ragged labels so that a gradient of the wrong scale fails (the gradient norms are compared too).

Tolerances follow each format's unit roundoff u (bf16: 2^-8 = 3.9e-3, fp16: 2^-11 = 4.9e-4): parameters (what the
module holds after fit: the fp32 masters under the mixed layouts, the bf16 weights under bf16-true) within ~1.3u of
the fp32 run after 3 steps, gradient norms within a few u, losses within 1e-3."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.precision.flagscale import check_precision_layout
from tests.strategies._lm import GRAD_NORMS, assert_rel_close, reference_run, tiny_config, trainer_run

STEPS = 3
TOLERANCE = {  # precision -> (parameters, gradient norms)
    "bf16-mixed": (5e-3, 1e-2),
    "bf16-true": (5e-3, 1e-2),
    "16-mixed": (1e-3, 2e-3),
}


def _check(results, reference, precision: str, *, norms: bool = True) -> None:
    ref_losses, ref_params = reference
    params_tol, norm_tol = TOLERANCE[precision]
    for losses, params in results:
        assert all(abs(a - b) <= 1e-3 for a, b in zip(losses, ref_losses)), (precision, losses, ref_losses)
        if norms:
            assert_rel_close(params[GRAD_NORMS], ref_params[GRAD_NORMS], norm_tol, f"{precision} gradient norms")
        for name, want in ref_params.items():
            if name != GRAD_NORMS:
                assert_rel_close(params[name], want, params_tol, f"{precision} {name}")


@pytest.mark.parametrize("precision", list(TOLERANCE))
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_mixed_precision_trains_like_fp32(launcher, precision, zero_stage):
    reference = reference_run(tiny_config(), STEPS, clip=1.0)
    results = launcher(2, trainer_run, dict(zero_stage=zero_stage), tiny_config(), STEPS, clip=1.0, precision=precision)
    _check(results, reference, precision)


def _fp16_run_with_overflow(zero_stage: int):
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[3] = float("inf")
        return grad

    class InjectInf(Callback):
        handle = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1 and dist.get_rank() == 0:
                self.handle = pl_module.model.layers["1"].mlp.up_proj.weight.register_hook(poison)

        def on_after_backward(self, trainer, pl_module):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    return trainer_run(
        dict(zero_stage=zero_stage), tiny_config(), STEPS, clip=1.0, precision="16-mixed", callbacks=[InjectInf()]
    )


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_fp16_dynamic_loss_scale_with_a_skipped_overflow_step_matches_fp32(launcher, zero_stage):
    """Step 1 overflows on one rank: every rank skips it, and the weights equal an fp32 run that skips step 1."""
    reference = reference_run(tiny_config(), STEPS, clip=1.0, skip_steps=(1,))
    _check(launcher(2, _fp16_run_with_overflow, zero_stage), reference, "16-mixed", norms=False)


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2), dict(zero_stage=3)])
def test_fp8_is_refused_for_layouts_it_does_not_support_yet(kwargs):
    with pytest.raises(ValueError, match="precision='fp8' with"):
        check_precision_layout("fp8", ParallelConfig(**kwargs).resolve(2))
    check_precision_layout("bf16-mixed", ParallelConfig(**kwargs).resolve(2))  # other precisions pass
    check_precision_layout("fp8", ParallelConfig(zero_stage=1).resolve(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_trains_with_transformer_engine_on_a_gpu():
    pytest.importorskip("transformer_engine")
    from lightning_flagscale import FlagScalePrecision

    losses, _ = trainer_run(dict(zero_stage=1), tiny_config(hidden_size=64, intermediate_size=128), 3, clip=1.0,
                            precision=FlagScalePrecision("fp8").precision)  # fmt: skip
    assert losses[-1] < losses[0]


def test_fp8_through_torchao_trains_like_bf16(launcher):
    """Issue 37 item 6 on CPU: fp8 GEMMs (torchao's Float8Linear: e4m3 forward, e5m2 gradients, dynamic per-tensor
    scales; the same quantisation ``torch._scaled_mm`` runs on an H100) under DP 2 with ZeRO-1 and fp32 masters stay
    within 0.5% of the bf16 run's loss at every one of 12 steps (0.03% measured; the issue's bar is 2% over 100 steps
    of the 1B shape, `bench/gpu.py`'s ``fp8-loss`` row), differ from it (fp8 ran), and the loss falls."""
    steps = 12
    bf16 = launcher.shared(2, trainer_run, dict(zero_stage=1), tiny_config(), steps, clip=1.0, precision="bf16-mixed")
    fp8 = launcher.shared(2, trainer_run, dict(zero_stage=1), tiny_config(), steps, clip=1.0, precision="fp8")
    (ref, _), (got, _) = bf16[0], fp8[0]
    gaps = [abs(g - r) / r for g, r in zip(got, ref)]
    assert max(gaps) < 0.005, [f"{x:.2%}" for x in gaps]
    assert max(gaps) > 0, "fp8 ran exactly as bf16: the float8 linears were not used"
    assert got[-1] < got[0] - 0.2 and ref[-1] < ref[0] - 0.2, (got, ref)
