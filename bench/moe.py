"""MoE micro-benchmarks (measured, not asserted): expert GEMM paths and all-to-all traffic.

    python bench/moe.py [--tokens 4096] [--hidden 256] [--inter 512] [--experts 8 16] [--world 2]

1. Expert compute, forward + backward, same run: grouped GEMM (``torch._grouped_mm``), the sorted-segment
   fallback and the capacity path's single batched GEMM (``torch.bmm``), each against a per-expert Python loop
   that masks and gathers the tokens of every expert (the Hugging Face reference implementation).
   Target: grouped/batched >= 2x the loop with 8+ experts.
2. All-to-all bytes per step of the EP dispatcher on ``--world`` gloo processes against theory
   ``tokens x top-k x hidden x bytes x 2 directions x (ep - 1) / ep`` (near-uniform router). Target: within 2%.
3. The same on a skewed router, with and without hot-expert replication: dispatch bytes saved, and the
   replica-weight bytes paid instead.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _procs import collect, context  # bench/ is sys.path[0]

from lightning_flagscale.moe.experts import GroupedExperts


def _timeit(fn, repeat: int = 5) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def _loop_experts(x: torch.Tensor, idx: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """HF-style reference: for every expert, find its tokens by mask, gather, compute, scatter-add."""
    out = torch.zeros_like(x)
    flat = idx.reshape(-1)
    tok = torch.arange(flat.numel()) // idx.shape[1]
    for e in range(w1.shape[0]):
        rows = tok[flat == e]
        gate, up = F.linear(x[rows], w1[e]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, w2[e]))
    return out


def bench_gemm(tokens: int, hidden: int, inter: int, experts: int, top_k: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden)
    idx = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    mod = GroupedExperts(experts, hidden, inter)
    torch.nn.init.normal_(mod.gate_up_proj, std=0.02)
    torch.nn.init.normal_(mod.down_proj, std=0.02)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    x_sorted = x[order // top_k]
    cap = math.ceil(tokens * top_k / experts)
    x_batched = torch.randn(experts * cap, hidden)

    def run(fn):
        def step():
            mod.zero_grad(set_to_none=True)
            fn().sum().backward()

        return _timeit(step)

    t_loop = run(lambda: _loop_experts(x, idx, mod.gate_up_proj, mod.down_proj))
    mod.use_grouped_mm = True
    t_grouped = run(lambda: mod(x_sorted, counts))
    mod.use_grouped_mm = False
    t_segment = run(lambda: mod(x_sorted, counts))
    t_bmm = run(lambda: mod(x_batched, [cap] * experts, batched=True))
    print(
        f"E={experts:3d} T={tokens} k={top_k} H={hidden} I={inter}  fwd+bwd ms: loop {t_loop * 1e3:7.1f} | "
        f"grouped_mm {t_grouped * 1e3:7.1f} ({t_loop / t_grouped:4.1f}x) | segments {t_segment * 1e3:7.1f} "
        f"({t_loop / t_segment:4.1f}x) | bmm {t_bmm * 1e3:7.1f} ({t_loop / t_bmm:4.1f}x)"
    )


def _a2a_worker(rank: int, world: int, port: int, tokens: int, hidden: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.moe import build_moe
    from lightning_flagscale.parallel.expert_parallel.apply import apply_ep

    cfg = TransformerConfig.from_preset("mixtral-tiny", hidden_size=hidden, num_experts=8, moe_intermediate_size=64)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    results = {}
    for label, skew, replicate in (("uniform", 0.0, ()), ("skewed", 3.0, ()), ("skewed+replicas", 3.0, (0, 1))):
        torch.manual_seed(0)
        layer = build_moe(cfg, 0)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(hidden))
        x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():  # skew: experts 0 and 1 align with a shared input direction
            direction = torch.ones(hidden) / math.sqrt(hidden)
            layer.gate.weight[:2] += skew * direction
            x += direction
        apply_ep(layer, mesh)
        layer.replicated_experts = replicate
        layer(x).sum().backward()
        results[label] = (layer.a2a_bytes, layer.dispatcher.replica_bytes, float(layer.imbalance))
    queue.put((rank, results))
    dist.destroy_process_group()


def bench_a2a(world: int, tokens: int, hidden: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_a2a_worker, args=(r, world, port, tokens, hidden, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(collect(procs, queue, world, name="all-to-all"))
    theory = world * tokens * 2 * hidden * 4 * 2 * (world - 1) / world  # fp32, top-2, dispatch + combine
    for label in ("uniform", "skewed", "skewed+replicas"):
        measured = sum(per_rank[r][label][0] for r in range(world))
        replica = per_rank[0][label][1]
        print(
            f"EP={world} {label:16s} imbalance {per_rank[0][label][2]:5.2f}  a2a bytes/step {measured / 1e6:8.3f} MB"
            f"  vs uniform theory {theory / 1e6:8.3f} MB ({100 * (measured / theory - 1):+6.2f}%)"
            + (f"  replica weights all-reduced {replica / 1e6:.3f} MB/rank (x2 with the grad sum)" if replica else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--a2a-tokens", type=int, default=8192)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, _grouped_mm: {hasattr(torch, '_grouped_mm')}")
    for e in args.experts:
        bench_gemm(args.tokens, args.hidden, args.inter, e, args.top_k)
    bench_a2a(args.world, args.a2a_tokens, args.hidden)


if __name__ == "__main__":
    main()
