"""``lightning-flagscale tune``."""

from __future__ import annotations

import argparse

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.tune.hardware import Hardware
from lightning_flagscale.tune.search import search

__all__ = ["tune_main"]


def tune_main(argv: list[str]) -> None:
    """``lightning-flagscale tune``: print the best layouts for a model on a cluster."""
    parser = argparse.ArgumentParser(
        prog="lightning-flagscale tune", description="best parallel layouts for a model on a cluster"
    )
    parser.add_argument("--preset", default="llama3-8b", help="TransformerConfig preset name")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    parser.add_argument("--memory-gb", type=float, default=80.0)
    parser.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per device")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=10)
    args = parser.parse_args(argv)
    model = TransformerConfig.from_preset(args.preset)
    hw = Hardware(memory_bytes=args.memory_gb * 1e9, flops=args.tflops * 1e12, devices_per_node=args.devices_per_node)
    best, considered = search(
        model, args.devices, seq_len=args.seq_len, global_batch=args.global_batch, hardware=hw, top_k=args.top_k
    )
    print(
        f"{args.preset}: {model.num_params() / 1e9:.2f}B parameters, {args.devices} devices, {considered} valid layouts"
    )
    if not best:
        print("No layout fits in memory: add devices, shorten sequences or lower the global batch.")
        return
    print(f"{'layout':<48} {'memory/rank':>12} {'step':>9} {'tokens/s':>12}")
    for cand in best:
        print(f"{cand.describe():<48} {cand.memory_bytes / 1e9:10.1f}GB {cand.step_seconds:8.2f}s"
              f" {cand.tokens_per_second:12.0f}")  # fmt: skip
