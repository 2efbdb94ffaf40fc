"""ZeRO-3 engines side by side: flat-buffer ZeRO-3 (ours), FSDP2 (``fully_shard``) and FSDP1 (what Lightning's
``FSDPStrategy`` runs), training the same decoder from the same initial weights in one process group.

    python bench/zero3_flat.py [--world 2] [--size default|large|smoke] [--rounds 3] [--steps 3]

Why next to ``compare_strategies.py`` (its ``FS-ZeRO3`` rows run flat, the default engine, and ``FS-ZeRO3-fsdp2``
FSDP2): that benchmark spawns a fresh ``Trainer`` job per configuration, whose start-up dominates on a loaded machine. Here every rank builds the three
engines once and the rounds interleave them (the order rotates each round), so the engines see the same load; each
sample is the mean step time (forward, backward with its all-gathers / reduce-scatters, SGD step) of ``--steps``
steps after one warm-up step per engine. Reported: median and min-max over rounds of tokens/s, the ratio of the
medians to FSDP1, and the parameters + gradient bytes each rank holds after backward. Timing is never a test.
``--size large`` is a 160M-parameter decoder (issue 15's >= 100M row). Ratios are taken round by round
(same load), reported as median (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lightning_flagscale

from _procs import start_method  # bench/ is sys.path[0]

SIZES = {
    # compare_strategies.py's default decoder (23.9M parameters)
    "default": dict(hidden_size=512, num_layers=8, intermediate_size=1408, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=256),
    # 160M parameters: communication is a real share of the step
    "large": dict(hidden_size=1024, num_layers=8, intermediate_size=2816, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000),
    # the smoke test's (tests/test_bench_smoke.py): every engine's code path in seconds
    "smoke": dict(hidden_size=64, num_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256),
}  # fmt: skip
ENGINES = ("fsdp1", "fsdp2", "flat")
SEQ, BATCH_PER_RANK = 128, 2


def _build(engine: str, config, mesh):
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_flagscale.models.decoder import CausalLM, DecoderBlock
    from lightning_flagscale.parallel.data_parallel.optimizer import apply_fsdp
    from lightning_flagscale.parallel.data_parallel.zero3_flat import apply_flat_zero3

    model = CausalLM(config)
    model.init_weights(seed=0)
    blocks = list(model.layers.values())
    if engine == "fsdp1":
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({DecoderBlock}), device_id=torch.device("cpu"),
            sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
        )  # fmt: skip
        return wrapped, model
    if engine == "fsdp2":
        apply_fsdp(model, mesh, param_dtype=None, reduce_dtype=None, blocks=blocks)
        return model, model
    apply_flat_zero3(model, mesh, blocks=blocks, param_dtype=None, reduce_dtype=None)
    return model, model


def _held_bytes(model) -> int:
    from lightning_flagscale.distributed.dtensor import local_tensor

    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        total += local_tensor(p).numel() * p.element_size()
        if p.grad is not None:
            total += local_tensor(p.grad).numel() * p.grad.element_size()
    return total


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.config import TransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    config = TransformerConfig.from_preset("llama-tiny", **SIZES[args.size])
    engines = {name: _build(name, config, mesh) for name in ENGINES}
    optims = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, (m, _) in engines.items()}
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config.vocab_size, (BATCH_PER_RANK, SEQ + 1), generator=g)

    def step(name: str) -> None:
        wrapped, inner = engines[name]
        loss = inner.loss_fn(wrapped(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optims[name].step()
        optims[name].zero_grad()

    held = {}
    for name in ENGINES:  # warm-up (lazy init, allocator), then the bytes held after one backward
        step(name)
        wrapped, inner = engines[name]
        inner.loss_fn(wrapped(tokens[:, :-1]), tokens[:, 1:]).backward()
        held[name] = _held_bytes(inner if name != "fsdp1" else wrapped)
        optims[name].zero_grad()
    samples: dict[str, list[float]] = {name: [] for name in ENGINES}
    for r in range(args.rounds):
        order = ENGINES[r % len(ENGINES) :] + ENGINES[: r % len(ENGINES)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            dist.barrier()
            samples[name].append((time.perf_counter() - t0) / args.steps)
            if rank == 0:
                print(f"round {r} {name:6} {samples[name][-1]:.3f} s/step", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"samples": samples, "held_bytes": held}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _num_params(size: str) -> int:
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.models.decoder import CausalLM

    with torch.device("meta"):
        model = CausalLM(TransformerConfig.from_preset("llama-tiny", **SIZES[size]))
    return sum(p.numel() for p in model.parameters())


def _load_note(before: float) -> str:
    """How loaded the machine was, from the load average before and after the run (2 cores)."""
    after = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if max(before, after) <= cores + 1:
        return (
            f"Machine quiet (load average {before:.1f} -> {after:.1f} on {cores} cores, the run's own ranks included)."
        )
    return (
        f"Measured on a shared {cores}-core machine under load from other jobs (load average {before:.0f} ->"
        f" {after:.0f}): only ratios within this run mean anything."
    )


def _ratios(samples: dict[str, list[float]], peer: str, engine: str) -> str:
    """tokens/s of ``engine`` over ``peer``'s in the same round (step time ratio), median (min-max)."""
    ratios = sorted(p / e for p, e in zip(samples[peer], samples[engine]))
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    tmp = Path(args.out) / f".zero3_flat_{os.getpid()}.json"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    mp.start_processes(
        _worker, args=(args.world, _free_port(), args, str(tmp)), nprocs=args.world, start_method=start_method()
    )
    result = json.loads(tmp.read_text())
    tmp.unlink()
    tokens = args.world * BATCH_PER_RANK * SEQ
    rows = []
    for name in ENGINES:
        tps = sorted(tokens / s for s in result["samples"][name])
        rows.append({"engine": name, "tokens_per_s": statistics.median(tps), "min": tps[0], "max": tps[-1],
                     "held_mib": result["held_bytes"][name] / 2**20})  # fmt: skip
    report = {
        "command": "python bench/zero3_flat.py " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "num_params": _num_params(args.size),
        "world": args.world,
        "load_average": [load_before, os.getloadavg()[0]],
        "wall_s": time.perf_counter() - start,
        "rows": rows,
        "samples": result["samples"],
    }
    lines = [
        f"`{report['command']}`: {report['num_params'] / 1e6:.1f}M-parameter decoder ({args.size}), world"
        f" {args.world} (gloo, CPU, 1 thread per rank), seq {SEQ}, {BATCH_PER_RANK} samples per rank, fp32, SGD;"
        f" {args.rounds} interleaved round(s) of {args.steps} step(s) per engine. {_load_note(load_before)}"
        f" {report['date']}, wall {report['wall_s']:.0f} s.",
        "",
        "| engine | tokens/s median | min - max | vs FSDP1, same-round median (min-max) | vs FSDP2, same-round median"
        " (min-max) | params + grads held per rank MiB |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['tokens_per_s']:.0f} | {r['min']:.0f} - {r['max']:.0f} |"
                     f" {_ratios(result['samples'], 'fsdp1', r['engine'])} |"
                     f" {_ratios(result['samples'], 'fsdp2', r['engine'])} | {r['held_mib']:.1f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    stem = Path(args.out) / f"zero3_flat_{args.size}_w{args.world}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
