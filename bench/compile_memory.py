"""What a decoder block keeps for backward under ``torch_compile`` with CP, eager vs compiled, on 2 gloo ranks (#37).

    python bench/compile_memory.py [--out bench/results/compile_memory.md] [--smoke]

Per context-parallel mode (ring, Ulysses over 2 ranks) and recompute mode, one bf16 block of the test shape
(``tests/test_tune_compile.py``: h 128, 4/2 heads, FFN 352, 2 x 64 tokens, 32 a rank): the bytes the block's forward
leaves allocated beyond its output (``AllocationPeak.net_bytes``: what it keeps for backward, its input excluded, as
the input exists before the block runs) next to ``tune.activations``' compiled and eager formulas (minus the input,
for the same reason). ``SavedActivations`` cannot count these runs: the ring's exchange breaks the compiled graph, and
a checkpoint that then runs eagerly packs through its own saved-tensor hooks, which hide the tensors from ours.
The single-process counts are ``tests/test_tune_compile.py``'s.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2)
MODES = ("none", "selective", "selective_mm", "full")


def _block_bytes(mesh, cp_mode: str, recompute: str, compiled: bool) -> int:
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.models.decoder import CausalLM
    from lightning_flagscale.parallel.compile import apply_compile
    from lightning_flagscale.parallel.context_parallel.attention import apply_cp, shard_batch_for_cp
    from lightning_flagscale.parallel.pipeline_parallel.recompute import apply_recompute
    from lightning_flagscale.tune.measure import AllocationPeak

    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(**SHAPE, num_layers=1), vocab_multiple=64).to(torch.bfloat16)
    apply_cp(model, mesh, mode=cp_mode)
    apply_recompute(model, recompute)
    if compiled:
        apply_compile(model)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    batch = shard_batch_for_cp({"input_ids": ids}, mesh)
    block = model.layers["0"]
    for _ in range(2):  # the first call compiles
        h = model.embed_tokens(batch["input_ids"])
        cos, sin = model.rotary_emb(batch["position_ids"], torch.bfloat16)
        with AllocationPeak() as alloc:
            out = block(h, cos, sin)
        kept = alloc.net_bytes - out.untyped_storage().nbytes()
        out.float().sum().backward()
        del out, h  # freed here, not inside the next measurement
    return kept


def _rank(rank: int, port: int, queue, smoke: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    rows = []
    for cp_mode in ("ring",) if smoke else ("ring", "ulysses"):
        for recompute in ("none",) if smoke else MODES:
            got = [_block_bytes(mesh, cp_mode, recompute, compiled) for compiled in (False, True)]
            rows.append((cp_mode, recompute, *got))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.tune.activations import layer_activation_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here (default: print it)")
    parser.add_argument("--port", type=int, default=29563, help="rendezvous port of the 2 gloo ranks")
    parser.add_argument("--smoke", action="store_true", help="ring CP without recompute only (what the tests run)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_rank, args=(args.port, queue, args.smoke), nprocs=2)
    rows = queue.get()
    config, tokens = TransformerConfig(**SHAPE, num_layers=1), 64
    block_input = tokens * 2 * SHAPE["hidden_size"]
    lines = [
        "| CP mode | recompute | eager block | compiled block | compiled formula | eager formula |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for cp_mode, recompute, eager, compiled in rows:
        formula = {c: layer_activation_bytes(config, tokens, recompute=recompute, compiled=c)[0] - block_input
                   for c in (True, False)}  # fmt: skip
        lines.append(f"| {cp_mode} | {recompute} | {eager:,} | {compiled:,} | {formula[True]:,.0f} |"
                     f" {formula[False]:,.0f} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
