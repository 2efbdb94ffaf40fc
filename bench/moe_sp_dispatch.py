"""MoE under TP + sequence parallelism: what each rank dispatches (counted with ``CommTracker``, not timed).

    python bench/moe_sp_dispatch.py [--world 2] [--tp 2] [--ep 2] [--batch 2] [--seq 256] [--out FILE.md]

One MoE layer (a ``qwen2-moe-tiny``-shaped block: 8 experts, top-2, a gated shared expert) with its experts sharded
over ``--ep`` ranks, on ``--world`` gloo ranks laid out as Megatron folds them: TP the fastest rank dim, DP = world /
TP, the EP groups contiguous blocks of ``--ep`` ranks (``parallel/mesh.py``). Each data-parallel rank feeds its own
[batch, seq, hidden] micro-batch; each TP rank holds its sequence chunk, as under sequence parallelism. Two ways to
run the block, forward + backward, in the same processes on the same weights and data:

- ``whole sequence`` (the code before this change): all-gather the sequence over TP, route and dispatch all of it on
  every TP rank, keep this rank's chunk of the output;
- ``own chunk`` (``MoELayer.forward`` under SP with ETP = 1): route and dispatch only this rank's chunk; the router's
  and the shared expert's gradients are summed over TP (one all-reduce each).

Per rank: wire bytes of the EP all-to-alls (dispatch + combine, forward and backward) and of the TP group, the rows
this rank's experts received in the forward, and the expert GEMM rows (forward); the outputs and the router gradient
of the two runs are compared (relative difference of the norms; they must agree up to fp32 summation order). Wire bytes follow ``CommTracker``'s ring model.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from _procs import collect, context, free_port  # bench/ is sys.path[0]

MODES = ("whole sequence", "own chunk")


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
    from lightning_flagscale.distributed.sequence_parallel import gather_sequence, scatter_sequence
    from lightning_flagscale.parallel.expert_parallel.apply import apply_ep

    tp, ep = args.tp, args.ep
    tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    tp_group, dp_rank, tp_rank = tp_groups[rank // tp], rank // tp, rank % tp
    ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    ep_group = ep_mesh["ep"].get_group()
    g = torch.Generator().manual_seed(dp_rank)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    grad_out = torch.randn(x.shape, generator=g)
    chunk = lambda t: t.chunk(tp, dim=1)[tp_rank]  # noqa: E731
    results = {}
    for mode in MODES:
        layer = apply_ep(_layer(args.hidden), ep_mesh["ep"])
        inp = chunk(x).clone().requires_grad_()
        comm = CommTracker()
        with comm:
            if mode == "whole sequence":
                out = scatter_sequence(layer(gather_sequence(inp, tp_group)), tp_group)
            else:
                layer.sequence_parallel_group = tp_group
                out = layer(inp)
            (out * chunk(grad_out)).sum().backward()
        ep_rank = dist.get_rank(ep_group)
        results[mode] = dict(
            a2a=comm.stats("all_to_all", ep_group).wire_bytes,
            tp=comm.total_wire_bytes(tp_group),
            ep_total=comm.total_wire_bytes(ep_group),
            rows=float(layer.tokens_per_ep_rank[ep_rank]),
            layer_a2a=layer.a2a_bytes,
            out=out.detach(),
            router_grad=layer.gate.weight.grad.detach().clone(),
        )
    # Compared here: a tensor put on the queue travels as a shared-memory handle that the parent can only open while
    # this process is alive, and a fast rank can exit before the parent unpickles its result (EOFError).
    whole, own = (results[m] for m in MODES)
    same = dict(
        out=_rel(whole.pop("out"), own.pop("out")), router_grad=_rel(whole.pop("router_grad"), own.pop("router_grad"))
    )
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
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.world % args.tp or args.world % args.ep or args.seq % args.tp:
        raise SystemExit("--tp and --ep must divide --world, --tp must divide --seq")
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
    lines = [
        f"TP {args.tp} + SP x EP {args.ep} x DP {dp} on {args.world} ranks; per data-parallel rank {args.batch} x"
        f" {args.seq} tokens, hidden {args.hidden}, 8 experts, top-2, fp32; one forward + backward per mode.",
        "",
        "| rank | mode | EP all-to-all wire bytes | other EP-group bytes | TP-group wire bytes | expert rows received"
        " (fwd) | output: rel. diff. to other mode | router gradient: rel. diff. |",
        "|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for rank in range(args.world):
        res = per_rank[rank]
        same_out, same_grad = f"{same[rank]['out']:.1e}", f"{same[rank]['router_grad']:.1e}"
        for mode in MODES:
            r = res[mode]
            lines.append(
                f"| {rank} | {mode} | {r['a2a']:,.0f} | {r['ep_total'] - r['a2a']:,.0f} | {r['tp']:,.0f} |"
                f" {r['rows']:,.0f} | {same_out} | {same_grad} |"
            )
    ratio_a2a = [per_rank[r][MODES[0]]["a2a"] / max(per_rank[r][MODES[1]]["a2a"], 1) for r in range(args.world)]
    ratio_rows = [per_rank[r][MODES[0]]["rows"] / max(per_rank[r][MODES[1]]["rows"], 1) for r in range(args.world)]
    lines += [
        "",
        f"whole / own chunk, per rank: all-to-all bytes {min(ratio_a2a):.2f}-{max(ratio_a2a):.2f}x, expert rows"
        f" {min(ratio_rows):.2f}-{max(ratio_rows):.2f}x (TP = {args.tp}); the rows every EP group's experts get per"
        f" forward: {tokens} tokens x top-2 x the data ranks in the group, once (own chunk) or TP times (whole).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
