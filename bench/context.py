"""Context-parallel attention benchmark (measured, not asserted): per-rank memory and communication vs theory.

    python bench/context.py [--seqs 256 512 1024] [--cps 1 2 4] [--heads 8] [--kv-heads 4] [--head-dim 32]
                            [--q-block 128] [--modes ring ulysses]
    torchrun --nproc-per-node 4 bench/context.py ...     # one world; cp = world size only

For each mode, cp and sequence length N, one attention layer (forward + backward, fp32, batch 1) runs on cp gloo
processes (spawned here unless launched by torchrun):

1. Peak attention memory per rank: ``torch.distributed._tools.mem_tracker.MemTracker`` peak of every tensor
   the layer's forward and backward allocate or touch (so its local q/k/v and output gradient are included),
   next to cp=1. Target on long sequences: cp=4 at most 0.3x cp=1.
2. Communication per rank per layer, measured with ``lightning_flagscale.accounting.comm.CommTracker``:
   ring = bytes sent by P2P; theory: forward ``(cp-1)`` K/V blocks (the K/V of the whole sequence but one's own
   pass every rank), backward ``(cp-1)`` K/V blocks + ``cp`` fp32 dK/dV blocks (they go full circle).
   Ulysses = all-to-all bytes leaving the rank; theory: q, k, v and out each move ``(P-1)/P`` of their local
   ``N/P x heads x D`` slice forward (``4 N h / P`` for MHA) and the same again backward. Target: within 5%.
3. Longest trainable sequence within a memory budget (default: the cp=1 peak at the longest ``--seqs``): the
   measured peaks are extrapolated linearly per (mode, cp) (memory is linear in N with a tiled kernel), and
   the estimate is refined by measured runs (secant steps); the longest measured length within budget is reported. Target: cp=4 at least 3.5x cp=1.

The pure-torch kernel is run with query tiles of ``--q-block`` rows, so its scores take ``q_block x N_k`` per head
like a fused GPU kernel instead of ``N_q x N_k``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _procs import context, start_method  # bench/ is sys.path[0]

from lightning_flagscale.accounting.comm import CommTracker
from lightning_flagscale.parallel.context_parallel.attention import HybridAttention, load_balanced_indices
from lightning_flagscale.parallel.context_parallel.kernels import TorchBlockKernel

F32 = 4


def _layer(mode: str, group: dist.ProcessGroup | None, q_block: int) -> HybridAttention:
    kernel = TorchBlockKernel(q_block=q_block)
    if mode == "ring":
        return HybridAttention(group, None, kernel=kernel)
    return HybridAttention(None, group, kernel=kernel)


def _inputs(n: int, heads: int, kv_heads: int, d: int, cp: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    idx = load_balanced_indices(n, cp, rank)
    full = [torch.randn(1, n, h, d, generator=g) for h in (heads, kv_heads, kv_heads)]
    return [t[:, idx].clone().requires_grad_() for t in full]


def _step(layer: HybridAttention, qkv: list[torch.Tensor], dout: torch.Tensor) -> None:
    out = layer(*qkv, causal=True)
    out.backward(dout)


def measure(mode: str, n: int, args: argparse.Namespace, group: dist.ProcessGroup | None) -> dict[str, float]:
    """Peak memory and fwd/bwd comm bytes of one layer on this rank."""
    cp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    layer = _layer(mode, group, args.q_block)
    qkv = _inputs(n, args.heads, args.kv_heads, args.head_dim, cp, rank)
    dout = torch.ones_like(qkv[0])  # incoming gradient of the output (MemTracker counts it once it is used)
    mem = MemTracker()
    with mem:
        _step(layer, qkv, dout)
    peak = mem.get_tracker_snapshot("peak")
    peak_bytes = sum(dev.get("Total", 0) for dev in peak.values()) if isinstance(peak, dict) else 0
    qkv = _inputs(n, args.heads, args.kv_heads, args.head_dim, cp, rank)
    with CommTracker() as fwd:
        out = layer(*qkv, causal=True)
    with CommTracker() as bwd:
        out.backward(torch.ones_like(out))
    op = "send" if mode == "ring" else "all_to_all"
    field = "payload_bytes" if mode == "ring" else "wire_bytes"
    return {
        "peak": float(peak_bytes),
        "fwd": float(getattr(fwd.stats(op), field)),
        "bwd": float(getattr(bwd.stats(op), field)),
    }


def theory(mode: str, n: int, cp: int, args: argparse.Namespace) -> tuple[float, float]:
    """Bytes per rank per layer (forward, backward), fp32 activations, batch 1."""
    d, hq, hkv = args.head_dim, args.heads, args.kv_heads
    if cp == 1:
        return 0.0, 0.0
    if mode == "ring":
        kv_block = 2 * (n // cp) * hkv * d * F32
        return (cp - 1) * kv_block, (cp - 1) * kv_block + cp * kv_block  # dK/dV accumulators are fp32
    hkv_eff = max(hkv, cp)  # KV heads replicated up to the degree when fewer
    per_pass = (2 * hq + 2 * hkv_eff) * (n // cp) * d * F32 * (cp - 1) / cp
    return per_pass, per_pass


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = run_world(args)
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def run_world(args: argparse.Namespace, seqs: list[int] | None = None) -> dict[tuple[str, int], dict[str, float]]:
    """Every rank measures every (mode, N); returns the max over ranks of each number (on every rank)."""
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    results: dict[tuple[str, int], dict[str, float]] = {}
    for mode in args.modes:
        for n in seqs or args.seqs:
            r = measure(mode, n, args, group)
            t = torch.tensor([r["peak"], r["fwd"], r["bwd"]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[(mode, n)] = dict(zip(("peak", "fwd", "bwd"), t.tolist()))
    return results


def _spawn(cp: int, args: argparse.Namespace, seqs: list[int] | None = None) -> dict:
    ctx = context()
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sub = argparse.Namespace(**vars(args))
    if seqs is not None:
        sub.seqs = seqs
    mp.start_processes(_worker, args=(cp, port, sub, queue), nprocs=cp, start_method=start_method(), join=True)
    return queue.get()


def _fit_length(points: list[tuple[int, float]], budget: float, multiple: int) -> int:
    """Largest N (a multiple of ``multiple``) with a + b N <= budget on the line through the two measured points
    whose peaks are closest to the budget (a secant step).

    With a tiled kernel every term of the attention memory is linear in N once the local length exceeds the tile,
    so the line is a good local model; the caller checks each estimate with a measured run.
    """
    (n0, p0), (n1, p1) = sorted(sorted(points, key=lambda p: abs(p[1] - budget))[:2])
    slope = (p1 - p0) / (n1 - n0)
    n = n1 + (budget - p1) / slope if slope > 0 else n1
    return max(multiple, int(n) // multiple * multiple)


def _mib(x: float) -> str:
    return f"{x / 2**20:9.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--q-block", type=int, default=128)
    parser.add_argument("--budget-mib", type=float, default=None)
    args = parser.parse_args()
    if len(args.seqs) < 2:  # the longest-sequence fit below needs two measured lengths
        parser.error("--seqs needs at least two lengths")

    if "WORLD_SIZE" in os.environ:  # torchrun: one world, cp = world size
        dist.init_process_group("gloo")
        res = run_world(args)
        if dist.get_rank() == 0:
            cp = dist.get_world_size()
            for (mode, n), r in res.items():
                tf, tb = theory(mode, n, cp, args)
                print(f"{mode:8s} cp={cp} N={n:6d} peak={_mib(r['peak'])} MiB  fwd={r['fwd']:.0f} B (theory {tf:.0f})"
                      f"  bwd={r['bwd']:.0f} B (theory {tb:.0f})")  # fmt: skip
        dist.destroy_process_group()
        return

    results = {cp: _spawn(cp, args) for cp in args.cps}
    print(f"\nOne attention layer, fwd+bwd, fp32, B=1, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim},"
          f" q_block={args.q_block}. Bytes and memory per rank (max over ranks).")  # fmt: skip
    header = f"{'mode':8s} {'cp':>3s} {'N':>6s} {'peak MiB':>9s} {'vs cp1':>7s} {'fwd MiB':>9s} {'theory':>9s}"
    header += f" {'bwd MiB':>9s} {'theory':>9s} {'comm/theory':>11s}"
    print(header)
    for mode in args.modes:
        for cp in args.cps:
            for n in args.seqs:
                r, base = results[cp][(mode, n)], results[args.cps[0]][(mode, n)]
                tf, tb = theory(mode, n, cp, args)
                ratio = (r["fwd"] + r["bwd"]) / (tf + tb) if tf + tb else float("nan")
                print(f"{mode:8s} {cp:3d} {n:6d} {_mib(r['peak'])} {r['peak'] / base['peak']:7.3f} {_mib(r['fwd'])}"
                      f" {_mib(tf)} {_mib(r['bwd'])} {_mib(tb)} {ratio:11.4f}")  # fmt: skip

    # Longest trainable sequence within a memory budget.
    longest = max(args.seqs)
    for mode in args.modes:
        budget = args.budget_mib * 2**20 if args.budget_mib else results[args.cps[0]][(mode, longest)]["peak"]
        print(f"\n{mode}: longest sequence within {budget / 2**20:.2f} MiB per rank (linear fit, then measured)")
        base_len = None
        for cp in args.cps:
            points = [(n, results[cp][(mode, n)]["peak"]) for n in args.seqs]
            best, best_peak = 0, 0.0
            for _ in range(4):  # secant refinement on measured runs: the fit is only an estimate
                n_try = _fit_length(points, budget, 2 * cp)
                if n_try in (n for n, _ in points):
                    break
                sub = argparse.Namespace(**{**vars(args), "modes": [mode]})
                peak = _spawn(cp, sub, seqs=[n_try])[(mode, n_try)]["peak"]
                points.append((n_try, peak))
                if peak <= budget and n_try > best:
                    best, best_peak = n_try, peak
            if best == 0:  # every try was over budget: the longest measured length that fits
                best, best_peak = max(((n, p) for n, p in points if p <= budget), default=(0, 0.0))
            n_fit, check = best, {"peak": best_peak}
            base_len = base_len or n_fit
            print(f"  cp={cp}: N={n_fit:7d} ({n_fit / base_len:5.2f}x cp={args.cps[0]}), measured peak"
                  f" {_mib(check['peak'])} MiB ({check['peak'] / budget:.3f} of budget)")  # fmt: skip


if __name__ == "__main__":
    main()
