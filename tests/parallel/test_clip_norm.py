"""``parallel.data.clip_grad_norm_`` in one process: the global norm over tensors of mixed dtypes, without the fp64
copy of every gradient it used to make."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.parallel.data_parallel.optimizer import clip_grad_norm_


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in (((300, 17), torch.float32), ((4096,), torch.float32), ((64, 33), torch.bfloat16)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * 3).to(dtype)
        out.append(p)
    return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_global_norm_and_clip_match_an_fp64_reference(norm_type):
    params = _params(0)
    grads = [p.grad.double() for p in params]  # what the norm must equal: the exact fp64 norm of the gradients
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]), norm_type)
    total = clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(want.item(), rel=1e-6)
    coef = 1.0 / (want.item() + 1e-6)  # every gradient scaled by max_norm / norm, in its own dtype
    for p, g in zip(params, grads, strict=True):
        tol = 1e-2 if p.grad.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(p.grad.double(), g * coef, rtol=tol, atol=tol * coef * g.abs().max().item())


def test_no_clip_below_the_threshold():
    params = _params(1)
    before = [p.grad.clone() for p in params]
    total = clip_grad_norm_(params, max_norm=1e9)
    assert total.item() > 0 and all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
