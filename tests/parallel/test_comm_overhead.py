"""Accounting the strategy comparison (``bench/compare_strategies.py``) relies on, beyond ``test_comm.py``.

- the C++ ``Reducer`` of torch DDP (what Lightning's ``DDPStrategy`` wraps) and FSDP1 (``FSDPStrategy``) issue their
  collectives outside Python, yet ``CommTracker`` must see every byte of them, matching ``comm_theory_bytes``;
- no dispatch mode stays on the stack once the window closes (the zero-overhead path), and nothing is counted then.

The formulas themselves and the model-parallel parameter count are tested in ``test_memory.py``, traffic classes
in ``test_comm.py``.

Never timing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_flagscale.accounting.comm import CommTracker
from lightning_flagscale.accounting.state_bytes import comm_theory_bytes


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
        assert r["wire"] == comm_theory_bytes(psi_bytes, 2, stage=0).total
        assert r["other"] == r["wire"]  # nothing else moved


def test_fsdp1_full_shard_matches_zero3_theory(launcher):
    psi_bytes = 192 * 4
    for r in launcher(2, _fsdp1_full_shard):
        assert r["all_gather"] == 2 * psi_bytes / 2
        assert r["reduce_scatter"] == psi_bytes / 2
        assert r["all_reduce"] == 0
        assert r["all_gather"] + r["reduce_scatter"] == comm_theory_bytes(psi_bytes, 2, stage=3).total


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
