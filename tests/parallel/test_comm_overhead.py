"""Accounting the strategy comparison (``lightning-flagscale bench``) relies on, beyond ``test_comm.py``.

- the C++ ``Reducer`` of torch DDP (what Lightning's ``DDPStrategy`` wraps) and FSDP1 (``FSDPStrategy``) issue their
  collectives outside Python, yet ``CommTracker`` must see every byte of them;
- no dispatch mode stays on the stack once the window closes (the zero-overhead path), and nothing is counted then;
- the bench's own bookkeeping: traffic classes from group descriptions, the model-parallel parameter count of
  DTensor parameters, and the theory it compares against.

Never timing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_flagscale.bench_cli import RunSpec, _dp_comm_theory, _mp_local_numel, _state_theory, _traffic_class
from lightning_flagscale.parallel.comm import CommTracker


def _ddp_reducer() -> dict:
    """torch DDP on 2 ranks, one bucket holding every gradient: one all_reduce of 4Ψ bytes, 2·4Ψ(N-1)/N on the wire."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # Ψ = 144 + 68 = 212
    ddp = DistributedDataParallel(model, bucket_cap_mb=100)
    x = torch.randn(3, 8) + dist.get_rank()
    for _ in range(2):  # the second iteration rebuilds the buckets (a small broadcast): count the third
        ddp(x).sum().backward()
        model.zero_grad()
    with CommTracker() as comm:
        ddp(x).sum().backward()
    s = comm.stats("all_reduce")
    return {"calls": s.calls, "payload": s.payload_bytes, "wire": s.wire_bytes, "other": comm.total_wire_bytes()}


def _fsdp1_full_shard() -> dict:
    """FSDP1 FULL_SHARD, one unit per Linear (the root holds none: FSDP1 keeps the root's parameters gathered from
    forward to backward): all-gather in forward and in backward, one reduce-scatter per unit: 3·4Ψ(N-1)/N."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))  # Ψ = 192, even over 2 ranks
    fsdp = FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    x = torch.randn(3, 8) + dist.get_rank()
    with CommTracker() as comm:
        fsdp(x).sum().backward()
    return {op: comm.stats(op).wire_bytes for op in ("all_gather", "reduce_scatter", "all_reduce")}


def test_ddp_reducer_all_reduce_is_counted(launcher):
    psi_bytes = 212 * 4
    for r in launcher(2, _ddp_reducer):
        assert r["calls"] == 1
        assert r["payload"] == psi_bytes
        assert r["wire"] == pytest.approx(2 * psi_bytes * (2 - 1) / 2, rel=0, abs=0)
        assert r["other"] == r["wire"]  # nothing else moved


def test_fsdp1_full_shard_matches_zero3_theory(launcher):
    psi_bytes = 192 * 4
    for r in launcher(2, _fsdp1_full_shard):
        assert r["all_gather"] == 2 * psi_bytes / 2
        assert r["reduce_scatter"] == psi_bytes / 2
        assert r["all_reduce"] == 0
        assert r["all_gather"] + r["reduce_scatter"] == _dp_comm_theory(RunSpec(name="z3", family="x", kind="x",
                                                                                zero_stage=3), 192, 2)  # fmt: skip


def _disabled_path() -> dict:
    t = torch.ones(4)
    with CommTracker() as comm:
        inside = _get_current_dispatch_mode() is not None
        dist.all_reduce(t)
    after_mode = _get_current_dispatch_mode()
    dist.all_reduce(t)  # outside the window: not counted, no mode to go through
    return {"inside": inside, "after_none": after_mode is None, "calls": comm.stats("all_reduce").calls}


def test_no_mode_and_no_counting_outside_the_window(launcher):
    for r in launcher(2, _disabled_path):
        assert r == {"inside": True, "after_none": True, "calls": 1}


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
    return {"ours": _mp_local_numel(model), "lightning": _mp_local_numel(model2)}


def test_model_parallel_numel_of_dtensors(launcher):
    for r in launcher(4, _tp_dp_local_numel):
        assert r == {"ours": 48 // 2 + 8 + 5, "lightning": 48 // 2}


def test_traffic_classes():
    assert _traffic_class("mesh_tp", "all_reduce") == "tp"
    assert _traffic_class("mesh_tensor_parallel", "all_gather") == "tp"
    assert _traffic_class("mesh_pp", "send") == "pp"
    assert _traffic_class("default_pg", "recv") == "pp"  # P2P is pipeline traffic on any group
    assert _traffic_class("mesh_dp_cp", "reduce_scatter") == "dp"
    assert _traffic_class("mesh_data_parallel", "all_gather") == "dp"
    assert _traffic_class("default_pg", "all_reduce") == "dp"


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, (16 * 100, 16 * 100)), (1, (4 * 100 + 16 * 100 / 4, 8 * 100 + 8 * 100 / 4)), (3, (400, 400))],
)
def test_state_and_comm_theory(stage, expected):
    spec = RunSpec(name="x", family="flagscale", kind="flagscale", zero_stage=stage)
    assert _state_theory(spec, 100, 4) == expected
    assert _dp_comm_theory(spec, 100, 4) == (3 if stage == 3 else 2) * 400 * 3 / 4
