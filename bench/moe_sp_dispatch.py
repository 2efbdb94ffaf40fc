"""MoE under TP + sequence parallelism: what each rank dispatches (counted with ``CommTracker``, not timed).

    python bench/moe_sp_dispatch.py [--world 2] [--tp 2] [--ep 2] [--batch 2] [--seq 256] [--micro-batches 1]
                                    [--out FILE.md]

One MoE layer (a ``qwen2-moe-tiny``-shaped block: 8 experts, top-2, a gated shared expert) with its experts sharded
over ``--ep`` ranks, on ``--world`` gloo ranks laid out as Megatron folds them: TP the fastest rank dim, DP = world /
TP, the EP groups contiguous blocks of ``--ep`` ranks (``parallel/mesh.py``). Each data-parallel rank feeds its own
[batch, seq, hidden] micro-batches; each TP rank holds its sequence chunk, as under sequence parallelism. One optimizer
step of ``--micro-batches`` forward + backward passes, then the step's data-parallel gradient reduction (DDP buckets
over the strategy's groups, ``reduction_groups``), run three ways in the same processes on the same weights and data:

- ``whole sequence`` (the code before commit d368c91): all-gather the sequence over TP, route and dispatch all of it
  on every TP rank, keep this rank's chunk of the output;
- ``own chunk, summed at use`` (``MoELayer.forward`` under SP with ETP = 1, a layer used on its own): route and
  dispatch only this rank's chunk; the router's, the shared expert's and its gate's gradients are summed over TP in
  every micro-batch's backward (one all-reduce each);
- ``own chunk, summed at step`` (the strategy's path: ``tag_chunk_routed_params``): the same routing; those
  gradients are summed over TP by the step's reduction, their DDP bucket reduced over dp x cp x tp instead of dp x cp.

Per rank and step: wire bytes of the EP all-to-alls (dispatch + combine, forward and backward) and of the TP group
during the micro-batches, the TP all-reduces issued there, the wire bytes of the step's gradient reduction, the rows
this rank's experts received in the last forward; the outputs and the reduced router gradient of each own-chunk mode
are compared with the whole-sequence mode (relative difference of the norms; they must agree up to fp32 summation
order). Wire bytes follow ``CommTracker``'s ring model.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from _procs import collect, context, free_port  # bench/ is sys.path[0]

MODES = ("whole sequence", "own chunk, summed at use", "own chunk, summed at step")


def _layer(hidden: int):
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.moe import build_moe

    cfg = TransformerConfig.from_preset(
        "qwen2-moe-tiny", hidden_size=hidden, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, moe_aux_loss_coeff=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = build_moe(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=1.0 / math.sqrt(hidden))
    layer.token_group = None  # no aux loss here: only the dispatch is counted
    return layer


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.accounting.comm import CommTracker
    from lightning_flagscale.config import ParallelConfig
    from lightning_flagscale.distributed.sequence_parallel import gather_sequence, scatter_sequence
    from lightning_flagscale.parallel.data_parallel.optimizer import DistributedOptimizer, reduction_groups
    from lightning_flagscale.parallel.expert_parallel.apply import (
        apply_ep,
        tag_chunk_routed_params,
        tag_expert_params,
    )
    from lightning_flagscale.parallel.mesh import build_meshes

    tp, ep = args.tp, args.ep
    tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    tp_group, dp_rank, tp_rank = tp_groups[rank // tp], rank // tp, rank % tp
    ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    ep_group = ep_mesh["ep"].get_group()
    # The step's reduction over the strategy's groups (the same rank layout; their own process groups, so the bytes
    # of the micro-batches' TP and EP groups above stay apart from the step's)
    parallel = ParallelConfig(tensor_parallel_size=tp, expert_parallel_size=ep, sequence_parallel=True).resolve(world)
    groups, divisors = reduction_groups(build_meshes(parallel, "cpu"), parallel)
    g = torch.Generator().manual_seed(dp_rank)
    xs = torch.randn(args.micro_batches, args.batch, args.seq, args.hidden, generator=g)
    grads_out = torch.randn(xs.shape, generator=g)
    chunk = lambda t: t.chunk(tp, dim=1)[tp_rank]  # noqa: E731
    results, compared = {}, {}
    for mode in MODES:
        layer = apply_ep(_layer(args.hidden), ep_mesh["ep"])
        tag_expert_params(layer)
        if mode != MODES[0]:
            layer.sequence_parallel_group = tp_group
        if mode == MODES[2]:
            tag_chunk_routed_params(layer)
        # DDP, reduced in `reduce_grads` only (no overlap): the micro-batches' and the step's bytes are counted apart
        dopt = DistributedOptimizer(
            torch.optim.SGD(layer.parameters(), lr=0.1), layer, groups, stage=0, master_weights=False,
            divisors=divisors, overlap=False,
        )  # fmt: skip
        comm, step = CommTracker(), CommTracker()
        outs = []
        for x, grad_out in zip(xs, grads_out):
            inp = chunk(x).clone().requires_grad_()
            with comm:
                if mode == MODES[0]:
                    out = scatter_sequence(layer(gather_sequence(inp, tp_group)), tp_group)
                else:
                    out = layer(inp)
                (out * chunk(grad_out)).sum().backward()
            outs.append(out.detach())
        with step:
            dopt.reduce_grads()
        ep_rank = dist.get_rank(ep_group)
        results[mode] = dict(
            a2a=comm.stats("all_to_all", ep_group).wire_bytes,
            tp=comm.total_wire_bytes(tp_group),
            tp_all_reduces=comm.stats("all_reduce", tp_group).calls,
            step=step.total_wire_bytes(),
            ep_total=comm.total_wire_bytes(ep_group),
            rows=float(layer.tokens_per_ep_rank[ep_rank]),
        )
        # Compared here: a rank puts only plain values on the queue (bench/_procs.py says why)
        compared[mode] = (torch.cat(outs), layer.gate.weight.grad.detach().clone())
        dopt.close()
    whole_out, whole_grad = compared[MODES[0]]
    same = {m: dict(out=_rel(compared[m][0], whole_out), router_grad=_rel(compared[m][1], whole_grad)) for m in MODES}
    queue.put((rank, results, same))
    dist.destroy_process_group()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=1, help="forward + backward passes per optimizer step")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.world % args.tp or args.world % args.ep or args.seq % args.tp or args.micro_batches < 1:
        raise SystemExit("--tp and --ep must divide --world, --tp must divide --seq, --micro-batches >= 1")
    port = free_port()
    ctx = context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    collected = collect(procs, queue, args.world, name="moe_sp_dispatch")
    per_rank = {rank: res for rank, res, _ in collected}
    same = {rank: s for rank, _, s in collected}
    dp = args.world // args.tp
    tokens = args.batch * args.seq
    n = args.micro_batches
    lines = [
        f"TP {args.tp} + SP x EP {args.ep} x DP {dp} on {args.world} ranks; per data-parallel rank and micro-batch"
        f" {args.batch} x {args.seq} tokens, hidden {args.hidden}, 8 experts, top-2, fp32; one step of {n}"
        f" micro-batch{'es' if n > 1 else ''} (forward + backward) and its DDP gradient reduction per mode.",
        "",
        "| rank | mode | EP all-to-all wire bytes | other EP-group bytes | TP-group wire bytes | TP all-reduces |"
        " step's gradient reduction wire bytes | expert rows received (last fwd) | output: rel. diff. to whole |"
        " reduced router gradient: rel. diff. to whole |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for rank in range(args.world):
        res = per_rank[rank]
        for mode in MODES:
            r, c = res[mode], same[rank][mode]
            lines.append(
                f"| {rank} | {mode} | {r['a2a']:,.0f} | {r['ep_total'] - r['a2a']:,.0f} | {r['tp']:,.0f} |"
                f" {r['tp_all_reduces']} | {r['step']:,.0f} | {r['rows']:,.0f} | {c['out']:.1e} |"
                f" {c['router_grad']:.1e} |"
            )
    whole, own = MODES[:2]
    ratio_a2a = [per_rank[r][whole]["a2a"] / max(per_rank[r][own]["a2a"], 1) for r in range(args.world)]
    ratio_rows = [per_rank[r][whole]["rows"] / max(per_rank[r][own]["rows"], 1) for r in range(args.world)]
    tp_bytes = {m: sorted({per_rank[r][m]["tp"] + per_rank[r][m]["step"] for r in range(args.world)}) for m in MODES}
    lines += [
        "",
        f"whole / own chunk, per rank: all-to-all bytes {min(ratio_a2a):.2f}-{max(ratio_a2a):.2f}x, expert rows"
        f" {min(ratio_rows):.2f}-{max(ratio_rows):.2f}x (TP = {args.tp}); the rows every EP group's experts get per"
        f" forward: {tokens} tokens x top-2 x the data ranks in the group, once (own chunk) or TP times (whole)."
        f" TP-group plus step-reduction bytes per rank and step: "
        + ", ".join(f"{m} {'/'.join(f'{b:,.0f}' for b in tp_bytes[m])}" for m in MODES)
        + ".",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
