"""CommTracker: exact call and byte counts of c10d, functional/DTensor, FSDP2 and P2P communication."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_flagscale.accounting.comm import CommTracker, format_table, gather_summaries, merge_summaries
from lightning_flagscale.accounting.state_bytes import comm_theory_bytes

F32 = 4  # bytes per float32 element


def _ops(tracker: CommTracker) -> dict[str, dict]:
    """The ops of the single group the tracker saw."""
    summary = tracker.summary()
    assert len(summary) == 1, summary
    return next(iter(summary.values()))["ops"]


# ---- rank tasks -----------------------------------------------------------------------------------------------------


def _c10d_collectives() -> dict:
    rank = dist.get_rank()
    t = torch.ones(6)
    dist.all_reduce(t)  # outside the window: must not be counted
    with CommTracker() as comm:
        dist.all_reduce(torch.ones(6))
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank)))
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8))
        work = dist.broadcast(torch.ones(3), src=0, async_op=True)  # counted at issue, waited outside
        # Uneven all_to_all of rows of 2 floats: rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 to
        # rank 0 and 1 to itself.
        in_splits, out_splits = ([1, 3], [1, 2]) if rank == 0 else ([2, 1], [3, 1])
        out_a2a = torch.empty(sum(out_splits), 2)
        inp_a2a = torch.arange(sum(in_splits) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
        dist.all_to_all_single(out_a2a, inp_a2a, out_splits, in_splits)
        if rank == 0:
            dist.send(torch.ones(5), dst=1)
        else:
            dist.recv(torch.empty(5), src=0)
        p2p = [dist.P2POp(dist.isend, torch.ones(7), 1 - rank), dist.P2POp(dist.irecv, torch.empty(7), 1 - rank)]
        reqs = dist.batch_isend_irecv(p2p)
        dist.barrier()
    work.wait()
    for req in reqs:
        req.wait()
    dist.all_reduce(t)  # after the window: not counted either
    assert out.tolist() == [0.0] * 4 + [1.0] * 4
    return {"summary": comm.summary(), "table": comm.table(), "total": comm.total_wire_bytes()}


def _list_and_rooted_collectives() -> dict:
    rank = dist.get_rank()
    with CommTracker() as comm:
        dist.all_gather([torch.empty(3), torch.empty(3)], torch.ones(3))
        dist.reduce_scatter_single(torch.empty(2), torch.ones(4))
        dist.all_to_all([torch.empty(2), torch.empty(2)], [torch.ones(2), torch.ones(2)])
        dist.gather(torch.ones(5), [torch.empty(5), torch.empty(5)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty(6), [torch.ones(6), torch.ones(6)] if rank == 0 else None, src=0)
        dist.reduce(torch.ones(7), dst=1)
        dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
    return _ops(comm)


def _pipeline_1f1b() -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(3, 3), rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: out.sum())
    x, target = torch.randn(8, 3), torch.zeros(8, 3)
    summaries = []
    for _ in range(2):  # the first step also exchanges shape metadata; the second only activations and grads
        with CommTracker() as comm:
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=target, losses=[])
        summaries.append(_ops(comm))
    return summaries[1]


def _dtensor_redistribute() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    full = torch.arange(12, dtype=torch.float32).view(4, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])  # a scatter, outside the window
    partial = DTensor.from_local(torch.ones(5), mesh, [Partial()])
    with CommTracker() as comm:
        gathered = sharded.redistribute(mesh, [Replicate()]).to_local()
        reduced = partial.redistribute(mesh, [Replicate()]).to_local()
    assert torch.equal(gathered, full) and torch.equal(reduced, torch.full((5,), 2.0))
    return comm.summary()


def _fsdp2_linear() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 4, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh)  # reshard after forward: ZeRO-3, params gathered again in backward
    fully_shard(model, mesh=mesh)
    x = torch.randn(3, 4)
    with CommTracker() as comm:
        model(x).sum().backward()
    return {"summary": comm.summary(), "dp": comm.total_wire_bytes(mesh.get_group("dp"))}


def _mesh_groups_world4() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "tp", "cp"))
    dp, tp, cp = (mesh.get_group(d) for d in ("dp", "tp", "cp"))
    with CommTracker() as comm:
        dist.all_reduce(torch.ones(10), group=tp)  # 40 B
        dist.all_gather_into_tensor(torch.empty(6), torch.ones(3), group=dp)  # shard 12 B, output 24 B
        dist.all_reduce(torch.ones(8), group=cp)  # group of size 1: no wire bytes
        # Uneven all_to_all over the world: rank r sends r+1 rows of one float to every rank (itself included).
        rank = dist.get_rank()
        dist.all_to_all_single(torch.empty(sum(range(1, 5))), torch.ones(4 * (rank + 1)), [1, 2, 3, 4], [rank + 1] * 4)
    local = comm.summary()
    merged = merge_summaries(gather_summaries(comm))  # outside the window
    return {
        "local": local,
        "merged": merged,
        "tp": comm.total_wire_bytes(tp),
        "cp": comm.total_wire_bytes(cp),
        "dp_by_desc": comm.total_wire_bytes("mesh_dp"),
        "dp_ranks": dist.get_process_group_ranks(dp),
        "tp_ranks": dist.get_process_group_ranks(tp),
        "table": format_table(merged),
    }


def _nested_and_reentered() -> list[float]:
    comm = CommTracker()
    with comm:
        dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))
    # Re-entering accumulates; nested trackers both count.
    with comm, CommTracker() as inner:
        dist.all_reduce(torch.ones(2))
    totals = [comm.total_wire_bytes(), inner.total_wire_bytes()]
    comm.reset()
    return [*totals, comm.total_wire_bytes()]


# ---- tests ----------------------------------------------------------------------------------------------------------


def test_c10d_collectives_and_p2p_exact_bytes(launcher):
    results = launcher(2, _c10d_collectives)
    for rank, res in enumerate(results):
        (group,) = res["summary"].values()
        assert group["ranks"] == [0, 1] and group["size"] == 2
        ops = group["ops"]
        assert ops["all_reduce"] == {"calls": 1, "payload_bytes": 6 * F32, "wire_bytes": 6 * F32}  # 2(N-1)/N = 1
        assert ops["all_gather"] == {"calls": 1, "payload_bytes": 4 * F32, "wire_bytes": 4 * F32}
        assert ops["reduce_scatter"] == {"calls": 1, "payload_bytes": 8 * F32, "wire_bytes": 4 * F32}
        assert ops["broadcast"] == {"calls": 1, "payload_bytes": 3 * F32, "wire_bytes": 3 * F32}
        rows_in, rows_off = (4, 3) if rank == 0 else (3, 2)
        assert ops["all_to_all"] == {"calls": 1, "payload_bytes": rows_in * 2 * F32, "wire_bytes": rows_off * 2 * F32}
        # Rank 0 sends 5 + 7 floats and receives 7; rank 1 the reverse.
        one = {"calls": 1, "payload_bytes": 7 * F32, "wire_bytes": 7 * F32}
        two = {"calls": 2, "payload_bytes": 12 * F32, "wire_bytes": 12 * F32}
        assert (ops["send"], ops["recv"]) == ((two, one) if rank == 0 else (one, two))
        assert ops["barrier"] == {"calls": 1, "payload_bytes": 0, "wire_bytes": 0.0}
        assert len(ops) == 8  # nothing else, and nothing from outside the window
        expected_total = (6 + 4 + 4 + 3 + 12 + 7 + rows_off * 2) * F32
        assert res["total"] == expected_total
        assert "all_to_all" in res["table"] and "total wire" in res["table"]


def test_list_rooted_and_coalesced_collectives(launcher):
    for rank, ops in enumerate(launcher(2, _list_and_rooted_collectives)):
        assert ops["all_gather"] == {"calls": 1, "payload_bytes": 3 * F32, "wire_bytes": 3 * F32}
        assert ops["reduce_scatter"] == {"calls": 1, "payload_bytes": 4 * F32, "wire_bytes": 2 * F32}
        assert ops["all_to_all"] == {"calls": 1, "payload_bytes": 4 * F32, "wire_bytes": 2 * F32}
        # gather: the root receives the other rank's 5 floats, the other rank sends its 5.
        assert ops["gather"] == {"calls": 1, "payload_bytes": 5 * F32, "wire_bytes": 5 * F32}
        # scatter: the root hands over 2 x 6 floats and sends one slot; the other rank receives 6.
        assert ops["scatter"] == {"calls": 1, "payload_bytes": (12 if rank == 0 else 6) * F32, "wire_bytes": 6 * F32}
        assert ops["reduce"] == {"calls": 1, "payload_bytes": 7 * F32, "wire_bytes": 7 * F32}
        assert ops["all_reduce"] == {"calls": 1, "payload_bytes": 5 * F32, "wire_bytes": 5 * F32}
        assert len(ops) == 7


def test_pipeline_schedule_p2p(launcher):
    # 4 micro-batches of 2 x 3 floats: stage 0 sends activations and receives grads, stage 1 the reverse.
    micro = {"calls": 4, "payload_bytes": 4 * 2 * 3 * F32, "wire_bytes": 4 * 2 * 3 * F32}
    for ops in launcher(2, _pipeline_1f1b):
        assert ops == {"recv": micro, "send": micro}


def test_dtensor_redistribution_counts_functional_collectives(launcher):
    for summary in launcher(2, _dtensor_redistribute):
        (group,) = summary.values()
        assert group["ops"] == {
            # Shard(0) -> Replicate: all-gather of the 2x3 local shard into 4x3.
            "all_gather": {"calls": 1, "payload_bytes": 6 * F32, "wire_bytes": 6 * F32},
            # Partial -> Replicate: all-reduce of 5 floats.
            "all_reduce": {"calls": 1, "payload_bytes": 5 * F32, "wire_bytes": 5 * F32},
        }


def test_fsdp2_forward_backward_matches_zero3_theory(launcher):
    num_param_bytes = (4 * 6 + 6 * 4) * F32  # Ψ in bytes
    theory = comm_theory_bytes(num_param_bytes, dp=2, stage=3)
    for res in launcher(2, _fsdp2_linear):
        (group,) = res["summary"].values()
        ops = group["ops"]
        # Each layer's params gathered in forward and again in backward, grads reduce-scattered once per layer.
        assert ops["all_gather"]["calls"] == 4 and ops["reduce_scatter"]["calls"] == 2
        assert ops["all_gather"]["payload_bytes"] == num_param_bytes  # 2 x (half of each layer)
        assert ops["reduce_scatter"]["payload_bytes"] == num_param_bytes
        assert set(ops) == {"all_gather", "reduce_scatter"}
        assert {op: ops[op]["wire_bytes"] for op in ops} == theory.by_op
        assert res["dp"] == theory.total == 3 * num_param_bytes / 2


def test_mesh_groups_size_one_and_merge_world4(launcher):
    results = launcher(4, _mesh_groups_world4)
    for rank, res in enumerate(results):
        local = res["local"]
        by_desc = {g["desc"]: g for g in local.values()}
        tp, dp, cp, world = by_desc["mesh_tp"], by_desc["mesh_dp"], by_desc["mesh_cp"], by_desc["default_pg"]
        assert tp["ranks"] == res["tp_ranks"] and dp["ranks"] == res["dp_ranks"] and cp["ranks"] == [rank]
        assert tp["ops"] == {"all_reduce": {"calls": 1, "payload_bytes": 40, "wire_bytes": 40.0}}
        assert dp["ops"] == {"all_gather": {"calls": 1, "payload_bytes": 12, "wire_bytes": 12.0}}
        assert cp["ops"] == {"all_reduce": {"calls": 1, "payload_bytes": 32, "wire_bytes": 0.0}}
        sent_off_rank = 3 * (rank + 1) * F32
        assert world["ops"]["all_to_all"] == {
            "calls": 1,
            "payload_bytes": 4 * (rank + 1) * F32,
            "wire_bytes": sent_off_rank,
        }
        assert res["tp"] == 40.0 and res["cp"] == 0.0 and res["dp_by_desc"] == 12.0
    merged = results[0]["merged"]
    assert all(r["merged"] == merged for r in results)
    (world,) = [g for g in merged.values() if g["desc"] == "default_pg"]
    assert world["reporting"] == 4
    a2a = world["ops"]["all_to_all"]
    assert a2a["calls"] == 4 and a2a["wire_bytes"] == sum(3 * (r + 1) * F32 for r in range(4))
    assert a2a["max_rank_wire_bytes"] == 3 * 4 * F32
    tp_groups = [g for g in merged.values() if g["desc"] == "mesh_tp"]
    assert sorted(g["ranks"] for g in tp_groups) == [[0, 1], [2, 3]]
    assert all(g["reporting"] == 2 and g["ops"]["all_reduce"]["calls"] == 2 for g in tp_groups)
    assert "mesh_tp" in results[0]["table"]


def test_reentry_nesting_and_reset(launcher):
    for outer, inner, after_reset in launcher(2, _nested_and_reentered):
        assert outer == (4 + 2) * F32 and inner == 2 * F32 and after_reset == 0.0


def test_no_group_needed_outside_window():
    # Entering and leaving a tracker without any communication needs no process group.
    with CommTracker() as comm:
        torch.ones(3).sum()
    assert comm.summary() == {} and comm.total_wire_bytes() == 0.0
    assert format_table(comm.summary()) == "(no communication)"


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_comm_theory(dp):
    psi = 1024
    assert comm_theory_bytes(psi, dp, 0).total == 2 * psi * (dp - 1) / dp
    assert comm_theory_bytes(psi, dp, 1).total == comm_theory_bytes(psi, dp, 2).total == 2 * psi * (dp - 1) / dp
    assert comm_theory_bytes(psi, dp, 3).total == 3 * psi * (dp - 1) / dp
    # bf16 parameters with an fp32 gradient reduction: the reduce side doubles, the gather side does not.
    mixed = comm_theory_bytes(psi, dp, 1, grad_bytes=2 * psi).by_op
    assert mixed == {"reduce_scatter": 2 * psi * (dp - 1) / dp, "all_gather": psi * (dp - 1) / dp}


def test_traffic_classes():
    from lightning_flagscale.accounting.comm import traffic_class

    assert traffic_class("mesh_tp", "all_reduce") == "tp"
    assert traffic_class("mesh_tensor_parallel", "all_gather") == "tp"
    assert traffic_class("mesh_pp", "send") == "pp"
    assert traffic_class("default_pg", "recv") == "pp"  # P2P is pipeline traffic on any group
    assert traffic_class("mesh_dp_cp", "reduce_scatter") == "dp"
    assert traffic_class("mesh_data_parallel", "all_gather") == "dp"
    assert traffic_class("default_pg", "all_reduce") == "dp"
