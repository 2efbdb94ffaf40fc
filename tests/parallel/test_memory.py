"""state_bytes on tiny models + AdamW (plain, tied, bf16 master copies, FSDP2 shards), the model-parallel parameter
count, and the one copy of each formula (ZeRO paper, this package's layout, data-parallel traffic) that ``tune``,
``bench/`` and the tests share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_flagscale.accounting.state_bytes import (
    StateBytes,
    comm_theory_bytes,
    current_rss_bytes,
    expected_state_bytes,
    model_parallel_numel,
    peak_rss_bytes,
    state_bytes,
    zero_theory_bytes,
)

F32, BF16 = 4, 2


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).float().sum().backward()
    opt.step()


def test_linear_adamw_exact():
    model = nn.Linear(4, 3)  # 15 parameters
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert state_bytes(model, [opt]) == StateBytes(params=15 * F32, grads=0, master_params=0, optimizer_states=0)
    _step(model, opt, torch.randn(2, 4))
    sb = state_bytes(model, [opt])
    # Adam: exp_avg + exp_avg_sq per parameter, plus one fp32 scalar ``step`` per parameter tensor.
    assert sb == StateBytes(params=15 * F32, grads=15 * F32, master_params=0, optimizer_states=2 * 15 * F32 + 2 * F32)
    assert sb.total == 60 + 60 + 128 and sb.optimizer == 128


def test_tied_weights_and_views_counted_once():
    emb = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = emb.weight  # tied: one storage
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert state_bytes(model).params == 8 * 4 * F32
    # Parameters viewing one flat buffer (a flat-parameter layout): the buffer is counted once, whole.
    flat = torch.zeros(10)
    views = nn.ParameterList([nn.Parameter(flat[:6]), nn.Parameter(flat[6:])])
    assert state_bytes(views).params == 10 * F32


def test_bf16_model_with_fp32_master_copies():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=0.1)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    for m in master:
        m.grad = None  # the fp32 grad copy is transient in a bf16-master layout
    sb = state_bytes(model, [opt])
    assert sb == StateBytes(
        params=15 * BF16, grads=15 * BF16, master_params=15 * F32, optimizer_states=2 * 15 * F32 + 2 * F32
    )
    # The layout the ZeRO paper calls 2 + 2 + K(=12) bytes per parameter (plus Adam's step counters).
    assert sb.total - 2 * F32 == zero_theory_bytes(15, dp=1, stage=0, layout="bf16-master").total


def _fsdp2_adamw_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Linear(4, 6)  # 30 parameters, 15 per rank
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, torch.randn(3, 4))
    return vars(state_bytes(model, [opt]))


def test_fsdp2_local_shards(launcher):
    for sb in launcher(2, _fsdp2_adamw_state):
        assert sb == {"params": 15 * F32, "grads": 15 * F32, "master_params": 0, "optimizer_states": 30 * F32 + 8}


def test_rss():
    current = current_rss_bytes()
    assert 10 * 2**20 < current <= peak_rss_bytes()


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, (2, 2, 12)), (1, (2, 2, 12 / 4)), (2, (2, 2 / 4, 12 / 4)), (3, (2 / 4, 2 / 4, 12 / 4))],
)
def test_zero_theory_bf16_master(stage, expected):
    psi, n = 1000, 4
    theory = zero_theory_bytes(psi, dp=n, stage=stage, layout="bf16-master")
    assert (theory.params, theory.grads, theory.optimizer) == tuple(psi * e for e in expected)
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    assert theory.total == paper[stage]


def test_zero_theory_fp32_and_validation():
    assert zero_theory_bytes(10, dp=2, stage=0, layout="fp32").total == 160
    assert vars(zero_theory_bytes(10, dp=2, stage=2, layout="fp32")) == {"params": 40, "grads": 20, "optimizer": 40}
    with pytest.raises(ValueError, match="layout"):
        zero_theory_bytes(10, dp=2, stage=1, layout="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stage"):
        zero_theory_bytes(10, dp=2, stage=4)  # type: ignore[arg-type]


def _tp_dp_local_numel() -> dict:
    """2 x 2 mesh: a weight sharded over tp and dp counts Ψ/tp (its model-parallel part), a tp-replicated bias Ψ."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1), Shard(0)]))
    model.b = nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0), Replicate()]))
    model.plain = nn.Parameter(torch.zeros(5))
    lightning_names = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model2 = nn.Module()
    model2.w = nn.Parameter(distribute_tensor(torch.zeros(8, 6), lightning_names, [Shard(1), Shard(0)]))
    return {"ours": model_parallel_numel(model), "lightning": model_parallel_numel(model2)}


def test_model_parallel_numel_of_dtensors(launcher):
    for r in launcher(4, _tp_dp_local_numel):
        assert r == {"ours": 48 // 2 + 8 + 5, "lightning": 48 // 2}


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (0, (16 * 100, 16 * 100)),
        (1, (8 * 100 + 12 * 100 / 4, 8 * 100 + 8 * 100 / 4)),
        (2, (4 * 100 + 16 * 100 / 4, 4 * 100 + 12 * 100 / 4)),
        (3, (400, 400)),
    ],
)
def test_fp32_state_theory_ours_and_paper(stage, expected):
    """fp32 Adam: ZeRO-1 keeps the full fp32 gradient buckets like the paper's ZeRO-1 and adds an fp32 main slice
    (8Ψ + 12Ψ/N); ZeRO-2 frees them (4Ψ + 16Ψ/N, the paper's 4Ψ + 12Ψ/N plus that slice)."""
    ours = expected_state_bytes(100, 4, stage, "32-true").total
    paper = zero_theory_bytes(100, 4, stage, layout="fp32").total
    assert (ours, paper) == expected


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp_comm_theory_fp32(stage):
    assert comm_theory_bytes(4 * 100, 4, stage).total == (3 if stage == 3 else 2) * 400 * 3 / 4


@pytest.mark.parametrize(
    ("precision", "stage", "expected"),
    [
        ("32-true", 0, (4, 4, 0, 8)),
        ("32-true", 2, (4, 4 / 4, 4 / 4, 8 / 4)),
        ("32-true", 3, (4 / 4, 4 / 4, 0, 8 / 4)),
        ("bf16-mixed", 0, (2, 4, 4, 8)),
        ("32-true", 1, (4, 4, 4 / 4, 8 / 4)),
        ("bf16-mixed", 1, (2, 4, 4 / 4, 8 / 4)),
        ("bf16-mixed", 2, (2, 4 / 4, 4 / 4, 8 / 4)),
        ("bf16-mixed", 3, (4 / 4, 4 / 4, 0, 8 / 4)),
    ],
)
def test_expected_state_bytes_at_the_optimizer_step(precision, stage, expected):
    """Per category, bytes per parameter of this package's layout (the README's "Mixed precision layout")."""
    got = expected_state_bytes(1000, 4, stage, precision)
    assert (got.params, got.grads, got.master_params, got.optimizer_states) == tuple(1000 * e for e in expected)


def test_backward_peak_of_the_gradient_buckets():
    """Hooks move gradients into fp32 buckets as backward produces them: stages 0-1 hold the full fp32 buckets
    throughout, ZeRO-2 its fp32 shard plus at most two buckets in flight (issue 15; issue 16 had the tuner assume
    ZeRO-2 saved gradient memory at the peak while the code held full gradients)."""
    for stage in (0, 1):
        assert expected_state_bytes(1000, 4, stage, "bf16-mixed", when="backward_peak").grads == 4 * 1000
    peak = expected_state_bytes(1000, 4, 2, "bf16-mixed", when="backward_peak", bucket_numel=100)
    assert peak.grads == 4 * 1000 / 4 + 4 * 2 * 100
    small_model = expected_state_bytes(1000, 4, 2, "bf16-mixed", when="backward_peak", bucket_numel=10_000)
    assert small_model.grads == 4 * 1000 / 4 + 4 * 1000  # one bucket holds the whole model
    assert expected_state_bytes(1000, 4, 2, "bf16-mixed").grads == 4 * 1000 / 4
    assert expected_state_bytes(1000, 4, 3, "bf16-mixed", when="backward_peak").grads == 4 * 1000 / 4
    with pytest.raises(ValueError, match="precision"):
        expected_state_bytes(10, 2, 1, "fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stage"):
        expected_state_bytes(10, 2, 4)  # type: ignore[arg-type]
