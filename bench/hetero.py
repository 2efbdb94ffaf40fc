"""Heterogeneous meshes on CPU emulation: throughput against each device group training alone (issue 12, item 10).

Two device types, ``fast`` and ``slow``, two ranks each; ``FLAGSCALE_EMULATE_SLOWDOWN="fast=B,slow=BxF"`` (default
B = 5, F = 2) stretches every forward and backward of a rank by its factor (``parallel/hetero_ranks.py``: sleeping
(factor-1) x the CPU time just spent). Both types are emulated devices slower than one core (B > 1) so that most
device time is sleep: four processes on a 2-core machine shared with other jobs would otherwise measure the CPU
scheduler (a pipeline hands each micro-batch from process to process and waits for the receiver to get a core),
not the layout. The slow type is F times slower than the fast one. Configurations, measured in interleaved rounds (every round runs each once, so load drifts hit all alike):

* ``alone``: the fast pair and the slow pair each train the whole model with data parallelism (2 ranks, ZeRO-1),
  **at the same time** (two jobs of two processes): the sum of their throughputs is what the two device groups give
  when used separately. Running them together keeps the CPU contention of one 4-process hetero job (the cores are
  shared; disjoint devices would not contend).
* ``even``: one hetero job, fast mesh (DP=2) then slow mesh (DP=2) as pipeline stages (1F1B), blocks split evenly.
* ``aware``: the same with ``hetero_layers=None``: the profiling pass measures both types and splits by speed.

Ratio = hetero samples/s / (fast alone + slow alone samples/s). Per-stage busy time (compute + emulated delay over
the timed steps' wall time) comes from the same hooks. Writes a markdown table and a bar chart (PNG).

    python bench/hetero.py [--rounds 3] [--steps 6] [--slowdown 2.0] [--out bench/results/hetero.md]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WARMUP = 2
MODEL = dict(num_layers=6, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int, seq: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def _timer_of(trainer: Any, pl_module: Any) -> Any:
    stages = getattr(trainer.strategy._pipeline, "stage_modules", None) or list(pl_module.modules())
    return next((m._fs_busy_timer for m in stages if hasattr(m, "_fs_busy_timer")), None)


def _rank_main(rank: int, world: int, port: int, types: list[str], spec: dict, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
        NODE_RANK="0", LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", OMP_NUM_THREADS="1",
        FLAGSCALE_DEVICE_TYPE=types[rank], FLAGSCALE_EMULATE_SLOWDOWN=spec["slowdown"],
    )  # fmt: skip
    import datetime
    import logging

    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScaleStrategy
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.models import CausalLMModule

    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    marks: list[float] = []
    out: dict[str, Any] = {"rank": rank, "type": types[rank]}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks.append(time.perf_counter())
            timer = _timer_of(trainer, pl_module)
            if len(marks) == WARMUP and timer is not None:
                timer.reset()
            if len(marks) == spec["steps"] and timer is not None:
                out["busy_s"] = timer.busy_s
            groups = trainer.strategy._hetero_groups
            if groups is not None:
                out["layers"] = [g.num_layers for g in groups]
                out["stage"] = next(g.index for g in groups if rank in g.ranks)

    config = TransformerConfig.from_preset("llama-tiny", **MODEL)
    module = CausalLMModule(config, learning_rate=0.01, warmup_steps=0, min_lr_ratio=1.0, optimizer="sgd")
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=FlagScaleStrategy(**spec["strategy"]), max_steps=spec["steps"],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[Clock()],
    )  # fmt: skip
    data = _Tokens(config.vocab_size, 4096, spec["seq"])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=spec["rank_batch"]))
    wall = marks[-1] - marks[WARMUP - 1]
    out.update(wall_s=wall, samples_per_s=spec["global_batch"] * (len(marks) - WARMUP) / wall)
    queue.put(out)
    dist.destroy_process_group()


def _start(ctx: Any, types: list[str], spec: dict, queue: Any) -> list[Any]:
    port = _port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, len(types), port, types, spec, queue), daemon=True)
        for r in range(len(types))
    ]  # daemons: an interrupted benchmark leaves no rank behind
    for p in procs:
        p.start()
    return procs


def _jobs(name: str, args: argparse.Namespace) -> list[tuple[list[str], dict]]:
    """(device type per rank, spec) of every job that one configuration runs concurrently."""
    slowdown = f"fast={args.base_slowdown},slow={args.base_slowdown * args.slowdown}"
    base = dict(steps=args.steps, seq=args.seq, slowdown=slowdown, rank_batch=args.rank_batch)
    if name == "alone":
        alone = dict(base, strategy=dict(data_parallel_size=2, zero_stage=1), global_batch=2 * args.rank_batch)
        return [(["fast", "fast"], alone), (["slow", "slow"], alone)]
    half = MODEL["num_layers"] // 2
    meshes = [dict(data_parallel_size=2, device_type="fast"), dict(data_parallel_size=2, device_type="slow")]
    strategy = dict(
        hetero_meshes=meshes, hetero_layers=[half, half] if name == "even" else None, micro_batch_size=args.micro,
        pipeline_schedule="1f1b", zero_stage=1,
    )  # fmt: skip
    return [(["fast", "fast", "slow", "slow"], dict(base, strategy=strategy, global_batch=2 * args.rank_batch))]


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    jobs = _jobs(name, args)
    procs = [p for types, spec in jobs for p in _start(ctx, types, spec, queue)]
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{name}: a rank exited with {p.exitcode}")
    results.sort(key=lambda r: r["rank"])
    if name == "alone":  # one job per type: its throughput is what rank 0 of the job measured
        per_type = {t: next(r["samples_per_s"] for r in results if r["type"] == t and r["rank"] == 0)
                    for t in ("fast", "slow")}  # fmt: skip
        return dict(samples_per_s=sum(per_type.values()), per_type=per_type)
    ranks = sorted(results, key=lambda r: r["rank"])
    busy = {}
    for r in ranks:
        busy.setdefault(r["stage"], []).append(r.get("busy_s", 0.0) / r["wall_s"])
    return dict(samples_per_s=ranks[0]["samples_per_s"], layers=ranks[0]["layers"],
                busy={s: statistics.mean(v) for s, v in sorted(busy.items())})  # fmt: skip


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def _ratios(rows: dict[str, list[dict]], name: str) -> list[float]:
    """Per round: the hetero job's throughput over the sum of the groups alone measured in the same round."""
    return [h["samples_per_s"] / a["samples_per_s"] for h, a in zip(rows[name], rows["alone"])]


def _bar_chart(rows: dict[str, list[dict]], png: Path) -> str:
    """Median busy fraction per stage (PNG with matplotlib; the same bars as text for the markdown)."""
    busy = {name: {s: statistics.median(r["busy"][s] for r in rows[name]) for s in rows[name][0]["busy"]}
            for name in ("even", "aware")}  # fmt: skip
    text = []
    for name, stages in busy.items():
        for s, frac in stages.items():
            kind = "fast" if s == 0 else "slow"
            text.append(f"{name:5s} stage {s} ({kind}) |{'#' * round(40 * frac):40s}| {100 * frac:.0f}%")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n".join(text)
    fig, ax = plt.subplots(figsize=(6, 2.6))
    labels, values = [], []
    for name, stages in busy.items():
        for s, frac in stages.items():
            labels.append(f"{name}: stage {s} ({'fast' if s == 0 else 'slow'})")
            values.append(100 * frac)
    ax.barh(labels[::-1], values[::-1], color=["tab:orange", "tab:blue"] * len(busy))
    ax.set_xlim(0, 100)
    ax.set_xlabel("busy time / wall time of the timed steps (%), median over rounds")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return "\n".join(text)


def write_report(rows: dict[str, list[dict]], args: argparse.Namespace, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    bars = _bar_chart(rows, png)
    alone = rows["alone"]
    lines = [
        "# Heterogeneous meshes: throughput vs. each device group alone (CPU emulation)",
        "",
        f"`python bench/hetero.py --rounds {args.rounds} --steps {args.steps} --slowdown {args.slowdown}"
        f" --base-slowdown {args.base_slowdown}"
        f" --seq {args.seq} --rank-batch {args.rank_batch} --micro {args.micro}`; load average at the end:"
        f" {', '.join(f'{x:.1f}' for x in os.getloadavg())}.",
        "",
        "**Measured under load**: a 2-core machine shared with several other engineers' jobs (load averages far above"
        " 2); every number is a median over interleaved rounds with the min-max range, and is noisy.",
        "",
        f"Model: llama-tiny shape with {MODEL}, sequence {args.seq}; global batch {2 * args.rank_batch} samples per"
        f" step; {args.steps - WARMUP} timed steps after {WARMUP} warm-up steps per job. Emulated factors: fast"
        f" {args.base_slowdown}x, slow {args.base_slowdown * args.slowdown}x one core (sleep of (factor-1) x the CPU"
        " time of each forward / backward), so the slow type is"
        f" {args.slowdown}x slower than the fast one.",
        "",
        "| configuration | blocks per stage (fast, slow) | samples/s | ratio to fast alone + slow alone |",
        "|---|---|---|---|",
        f"| fast alone (DP=2) | all | {_summary([a['per_type']['fast'] for a in alone])} | |",
        f"| slow alone (DP=2) | all | {_summary([a['per_type']['slow'] for a in alone])} | |",
        f"| sum of the two | | {_summary([a['samples_per_s'] for a in alone])} | 100% |",
    ]
    for name, label in (("even", "hetero, even split"), ("aware", "hetero, speed-aware split (profiled)")):
        splits = sorted({tuple(r["layers"]) for r in rows[name]})
        ratio = [100 * x for x in _ratios(rows, name)]
        thr = _summary([r["samples_per_s"] for r in rows[name]])
        lines.append(f"| {label} | {', '.join(map(str, splits))} | {thr} | {_summary(ratio)}% |")
    gain = [100 * (a - e) for a, e in zip(_ratios(rows, "aware"), _ratios(rows, "even"))]
    lines += [
        "",
        f"Speed-aware minus even split, per round: {_summary(gain)} points.",
        "",
        f"Per-stage busy time (compute + emulated delay) / wall time, median over rounds (`{png.name}`):",
        "",
        "```",
        bars,
        "```",
        "",
    ]
    out.write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per job (the first 2 untimed)")
    parser.add_argument("--slowdown", type=float, default=2.0, help="slow type's time / fast type's time")
    parser.add_argument("--base-slowdown", type=float, default=5.0, help="fast type's emulated factor vs one core")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank-batch", type=int, default=8, help="samples per data-parallel rank and step")
    parser.add_argument("--micro", type=int, default=1, help="hetero micro-batch per first-mesh DP rank")
    parser.add_argument("--out", default="bench/results/hetero.md")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {"alone": [], "even": [], "aware": []}
    for rnd in range(args.rounds):
        for name in rows:
            rows[name].append(run_config(name, args))
            print(f"round {rnd} {name}: {rows[name][-1]}", flush=True)
    write_report(rows, args, Path(args.out))


if __name__ == "__main__":
    main()
