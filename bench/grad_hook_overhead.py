"""Cost of moving gradients into flat buckets from Python hooks, against torch DDP's C++ reducer, in one process.

    python bench/grad_hook_overhead.py [--rounds 3] [--steps 6] [--out bench/results/grad_hook_overhead.md]

One CPU process (gloo, world 1, one thread): the decoder of ``compare_strategies.py`` (23.9M parameters), batch
2 x 128, forward + backward + gradient hand-over per step, three ways: plain autograd (no hooks), this package's
``GradReducer`` (post-accumulate-grad hook per parameter, fp32 buckets of 4M elements, ``finish`` and zeroing as
at an optimizer step) and ``torch.nn.parallel.DistributedDataParallel``. With one rank the collectives are trivial,
so the ratios to plain autograd isolate the bookkeeping and copies. Configurations interleave over ``--rounds``;
each round reports the median step of ``--steps`` timed steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lightning_flagscale

from compare_strategies import model_settings  # bench/ is sys.path[0]

MODEL = model_settings(quick=False)["model"]  # the decoder of the strategy comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="bench/results/grad_hook_overhead.md")
    args = parser.parse_args()

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.models.decoder import CausalLM
    from lightning_flagscale.parallel.data_parallel.grad_buckets import (
        DEFAULT_BUCKET_NUMEL,
        GradBucket,
        GradReducer,
        bucket_runs,
    )

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = TransformerConfig.from_preset("llama-tiny", **MODEL)

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return CausalLM(config, vocab_multiple=64)

    tokens = torch.randint(0, MODEL["vocab_size"], (2, 128))
    plain, ours, ddp = make(), make(), DistributedDataParallel(make())
    params = list(ours.parameters())
    buckets = [GradBucket(run, dist.group.WORLD, stage=0) for _, run in bucket_runs(params[::-1], DEFAULT_BUCKET_NUMEL)]
    reducer = GradReducer(buckets, overlap=True, hooks=True)

    def hand_over() -> None:  # what the strategy does at the optimizer step
        reducer.finish()
        for bucket in buckets:
            bucket.zero_()

    runs = {"plain autograd": (plain, None), "GradReducer (ours)": (ours, hand_over), "torch DDP": (ddp, None)}

    def step(model: torch.nn.Module, after) -> None:
        model(tokens).float().square().mean().backward()
        if after is not None:
            after()
        for p in model.parameters():
            p.grad = None

    times: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(args.rounds):
        for name, (model, after) in runs.items():
            step(model, after)
            samples = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(model, after)
                samples.append(time.perf_counter() - t0)
            times[name].append(statistics.median(samples))
        print(f"round {rnd}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()), flush=True)
    dist.destroy_process_group()

    base = times["plain autograd"]
    lines = [
        "# Gradient hand-over cost: Python bucket hooks vs torch DDP (one process)",
        "",
        f"`python bench/grad_hook_overhead.py --rounds {args.rounds} --steps {args.steps}`; load average at the end:"
        f" {', '.join(f'{x:.1f}' for x in os.getloadavg())}. torch {torch.__version__}.",
        "",
        "| hand-over | step s, median (min-max) over rounds | / plain autograd, per round: median (min-max) |",
        "|---|---|---|",
    ]
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        lines.append(
            f"| {name} | {statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f}) |"
            f" {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
