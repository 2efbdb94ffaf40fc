"""Heterogeneous meshes on CPU emulation: throughput against each device group training alone (issue 12, item 10).

Two device types, ``fast`` and ``slow``, two ranks each; ``FLAGSCALE_EMULATE_SLOWDOWN="fast=B,slow=BxF"`` (default
B = 10, F = 2) stretches every forward and backward of a rank by its factor (``parallel/hetero_mesh/ranks.py``: sleeping
(factor-1) x the CPU time just spent). Both types are emulated devices slower than one core (B > 1) so that most
device time is sleep: four processes on a 2-core machine shared with other jobs would otherwise measure the CPU
scheduler (a pipeline hands each micro-batch from process to process and waits for the receiver to get a core),
not the layout. The slow type is F times slower than the fast one. Configurations, measured in interleaved rounds (every round runs each once, so load drifts hit all alike):

* ``alone``: the fast pair and the slow pair each train the whole model with data parallelism (2 ranks, ZeRO-1),
  **at the same time** (two jobs of two processes): the sum of their throughputs is what the two device groups give
  when used separately. Running them together keeps the CPU contention of one 4-process hetero job (the cores are
  shared; disjoint devices would not contend). They run the same global batch in micro-batches of the same size as
  the hetero job (gradient accumulation), so that the ratio measures the layout (split, bubbles, boundary traffic),
  not how much faster a CPU kernel runs on a larger batch.
* ``even``: one hetero job, fast mesh (DP=2) then slow mesh (DP=2) as pipeline stages (1F1B), blocks split evenly.
* ``aware``: the same with ``hetero_layers=None``: the profiling pass measures both types and splits by speed.
* ``given``: the split from ``hetero_device_speed`` (the known slowdown), counting the LM head; ``ordered``: the same
  with ``hetero_mesh_order="speed"`` (the planner also chooses which mesh is the last stage, the one with the LM head
  and loss); ``warmup``: ``ordered`` with ``hetero_warmup="speed"`` (the first mesh's 1F1B warm-up from the stage
  times, so the slow first mesh does not wait for the first and last gradients); ``aware_rev``: ``aware`` with the
  meshes listed slow then fast.

Ratio = hetero samples/s / (fast alone + slow alone samples/s), per round (the alone pair of the same round).
Per-stage busy time (compute + emulated delay over the timed steps' wall time) comes from the same hooks. Writes a
markdown table, the raw numbers (JSON) and a bar chart (PNG).

    python bench/hetero.py [--rounds 3] [--steps 5] [--slowdown 2.0] [--out bench/results/hetero.md]
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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _procs import collect, context  # bench/ is sys.path[0]
from _timeline import draw_lanes, legend

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


class _Events:
    """Wall-clock intervals of this rank's stage work, for the timeline of one timed step (issue 42 item 5).

    ``F`` / ``B``: forward and backward of each stage module, hooked after the emulation's hooks so that they include
    its delay (the backward from its output's gradient to the end of the backward call, as ``BusyTimer`` times it);
    ``R``: blocking receives of the boundary (the wait for the neighbour stage), ``S``: posting the sends and, at the
    step's end, waiting for them. The runner's ``BoundaryComm`` methods are wrapped on this one instance (a benchmark
    probe on our own object; nothing in torch or Lightning is patched)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self._fwd: list[float] = []

    def install(self, stages: list[Any], comm: Any) -> None:
        from torch.autograd import Variable

        def pre(module: Any, args: Any) -> None:
            self._fwd.append(time.perf_counter())

        def post(module: Any, args: Any, output: Any) -> None:
            self.events.append(("F", self._fwd.pop(), time.perf_counter()))
            out = output if isinstance(output, torch.Tensor) else None
            if out is not None and out.requires_grad and torch.is_grad_enabled():
                out.register_hook(started)

        def started(grad: torch.Tensor) -> None:
            t0 = time.perf_counter()
            Variable._execution_engine.queue_callback(lambda: self.events.append(("B", t0, time.perf_counter())))

        for stage in stages:
            stage.register_forward_pre_hook(pre)
            stage.register_forward_hook(post)
        for name, kind in (("send", "S"), ("recv", "R"), ("wait", "S")):
            setattr(comm, name, self._timed(kind, getattr(comm, name)))

    def _timed(self, kind: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.events.append((kind, t0, time.perf_counter()))
            return out

        return timed

    def window(self, t0: float, t1: float) -> list[tuple[str, float, float]]:
        return [e for e in self.events if e[1] >= t0 and e[2] <= t1]


def _rank_main(rank: int, world: int, port: int, types: list[str], spec: dict, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
        NODE_RANK="0", LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", OMP_NUM_THREADS="1",
        FLAGSCALE_DEVICE_TYPE=types[rank], FLAGSCALE_EMULATE_SLOWDOWN=spec["slowdown"],
        FLAGSCALE_EMULATE_COST=spec.get("emulated_cost", "measured"),
    )  # fmt: skip
    import datetime
    import logging

    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.models import CausalLMModule

    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    marks: list[float] = []
    out: dict[str, Any] = {"rank": rank, "type": types[rank]}
    recorder = _Events()

    class Clock(L.Callback):
        def on_train_start(self, trainer, pl_module):
            pipeline = trainer.strategy._pipeline
            if pipeline is not None and hasattr(pipeline.runner, "_comm"):  # a hetero job: record its last step
                recorder.install(pipeline.stage_modules, pipeline.runner._comm)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == len(marks):
                return  # inside an accumulation window: the clock ticks once per optimizer step
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
                out["stage_types"] = [g.device_type for g in groups]
            if len(marks) == spec["steps"] and recorder.events:  # the last timed step, absolute perf_counter times
                out["timeline"] = dict(start=marks[-2], end=marks[-1], events=recorder.window(marks[-2], marks[-1]))

    config = TransformerConfig.from_preset("llama-tiny", **spec["model"])
    optimizer = spec.get("optimizer", "sgd")  # tune_hetero_validation.py trains as the recipes do (AdamW, bf16-mixed)
    module = CausalLMModule(config, learning_rate=0.01 if optimizer == "sgd" else 1e-4, warmup_steps=0,
                            min_lr_ratio=1.0, optimizer=optimizer)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=FlagScaleStrategy(**spec["strategy"]), max_steps=spec["steps"],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[Clock()], plugins=[FlagScalePrecision(spec.get("precision", "32-true"))],
        gradient_clip_val=spec.get("clip"),
    )  # fmt: skip
    data = _Tokens(config.vocab_size, 4096, spec["seq"])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=spec["loader_batch"]))
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
    base = dict(steps=args.steps, seq=args.seq, slowdown=slowdown, global_batch=2 * args.rank_batch, model=_model(args),
                emulated_cost=getattr(args, "emulated_cost", "measured"))  # fmt: skip
    if name == "alone":  # micro-batches of the hetero job's size, accumulated up to the same global batch
        accumulate = args.rank_batch // args.micro
        strategy = dict(data_parallel_size=2, zero_stage=1, gradient_accumulation_steps=accumulate)
        alone = dict(base, strategy=strategy, loader_batch=args.micro)
        return [(["fast", "fast"], alone), (["slow", "slow"], alone)]
    half = args.layers // 2
    meshes = [dict(data_parallel_size=2, device_type="fast"), dict(data_parallel_size=2, device_type="slow")]
    if (
        name == "aware_rev"
    ):  # pipeline order slow -> fast: the LM head and loss on the fast mesh (ranks keep their types)
        meshes = meshes[::-1]
    strategy = dict(
        hetero_meshes=meshes, hetero_layers=[half, half] if name == "even" else None, micro_batch_size=args.micro,
        pipeline_schedule="1f1b", zero_stage=1,
    )  # fmt: skip
    if name in ("given", "ordered", "warmup"):
        strategy["hetero_device_speed"] = {"fast": args.slowdown, "slow": 1.0}
    if name in ("ordered", "warmup"):  # the planner picks the mesh order too (issue 42 item 5): the head on the faster
        strategy["hetero_mesh_order"] = "speed"  # mesh
    if name == "warmup":  # and the first (slow) mesh's 1F1B warm-up from the stage times: no fill / drain wait
        strategy["hetero_warmup"] = "speed"
    return [(["fast", "fast", "slow", "slow"], dict(base, strategy=strategy, loader_batch=args.rank_batch))]


def _model(args: argparse.Namespace) -> dict[str, int]:
    return {**MODEL, "num_layers": getattr(args, "layers", MODEL["num_layers"])}


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = context()
    queue = ctx.Queue()
    jobs = _jobs(name, args)
    procs = [p for types, spec in jobs for p in _start(ctx, types, spec, queue)]
    results = collect(procs, queue, len(procs), timeout=1800, name=name)
    if name == "alone":  # one job per type: its throughput is what rank 0 of the job measured
        per_type = {t: next(r["samples_per_s"] for r in results if r["type"] == t and r["rank"] == 0)
                    for t in ("fast", "slow")}  # fmt: skip
        return dict(samples_per_s=sum(per_type.values()), per_type=per_type)
    ranks = sorted(results, key=lambda r: r["rank"])
    busy: dict[int, list[float]] = {}
    for r in ranks:
        busy.setdefault(r["stage"], []).append(r.get("busy_s", 0.0) / r["wall_s"])
    timed = args.steps - WARMUP
    busy_step = {}
    for r in ranks:
        busy_step.setdefault(r["stage"], []).append(r.get("busy_s", 0.0) / timed)
    timeline = [dict(rank=r["rank"], stage=r["stage"], **r["timeline"]) for r in ranks if "timeline" in r]
    return dict(
        samples_per_s=ranks[0]["samples_per_s"], layers=ranks[0]["layers"], step_s=ranks[0]["wall_s"] / timed,
        busy={s: statistics.mean(v) for s, v in sorted(busy.items())},
        busy_s_per_step={s: statistics.mean(v) for s, v in sorted(busy_step.items())},
        stage_types=ranks[0]["stage_types"], timeline=timeline,
    )  # fmt: skip


LABELS = {
    "even": "hetero, even split",
    "aware": "hetero, speed-aware split (profiled, `hetero_layers=None`)",
    "given": "hetero, speed-aware split (`hetero_device_speed`)",
    "ordered": "hetero, speed-aware split and mesh order (`hetero_device_speed`, `hetero_mesh_order='speed'`)",
    "warmup": "hetero, speed-aware split, mesh order and first-mesh warm-up (`ordered` + `hetero_warmup='speed'`)",
    "aware_rev": "hetero, speed-aware split (profiled), meshes slow then fast: LM head + loss on the fast mesh",
}
TYPES = ("fast", "slow")  # stage 0 is the fast mesh, stage 1 the slow one (unless the row names its stage types)


def _types(row: dict[str, Any]) -> list[str]:
    return row.get("stage_types") or list(TYPES)


def _summary(values: list[float], fmt: str = ".3g") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def _ratios(rows: dict[str, list[dict]], name: str) -> list[float]:
    """Per round: the hetero job's throughput over the sum of the groups alone measured in the same round."""
    return [h["samples_per_s"] / a["samples_per_s"] for h, a in zip(rows[name], rows["alone"])]


def _hetero(rows: dict[str, list[dict]]) -> list[str]:
    return [name for name in rows if name != "alone"]


def _busy_median(rows: dict[str, list[dict]], name: str, key: str = "busy") -> dict[int, float]:
    return {s: statistics.median(r[key][s] for r in rows[name]) for s in rows[name][0][key]}


def _bar_chart(rows: dict[str, list[dict]], png: Path) -> None:
    """Median busy fraction per stage as horizontal bars (PNG; skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels, values, colors = [], [], []
    for name in _hetero(rows):
        for s, frac in _busy_median(rows, name).items():
            kind = _types(rows[name][0])[s]
            labels.append(f"{name} {rows[name][0]['layers']}: stage {s} ({kind})")
            values.append(100 * frac)
            colors.append("tab:orange" if kind == "fast" else "tab:blue")
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    for y, v in enumerate(values[::-1]):
        ax.text(v + 1, y, f"{v:.0f}%", va="center", fontsize=8)
    ax.set_xlim(0, 110)
    ax.set_xlabel("busy time / wall time of the timed steps (%), median over rounds")
    ax.set_title("Per-stage busy time (compute + emulated delay)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


PHASES = {"compute": ("F", "B"), "receive wait": ("R",), "send": ("S",)}
"""Columns of the timeline table: the event kinds each one sums; idle is the rest of the step."""


def _fractions(row: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per stage, the share of the recorded step each phase takes (mean over the stage's ranks), idle the rest."""
    per_stage: dict[int, list[dict[str, float]]] = {}
    for lane in row.get("timeline", []):
        span = lane["end"] - lane["start"]
        share = {k: sum(e[2] - e[1] for e in lane["events"] if e[0] in kinds) / span for k, kinds in PHASES.items()}
        share["idle"] = max(0.0, 1.0 - sum(share.values()))
        per_stage.setdefault(lane["stage"], []).append(share)
    return {s: {k: statistics.mean(x[k] for x in v) for k in v[0]} for s, v in sorted(per_stage.items())}


def _timeline_table(rows: dict[str, list[dict]]) -> list[str]:
    """Per configuration and stage: compute, receive wait, send and idle over one timed step, median over rounds."""
    lines = [
        "| configuration | stage (device type) | blocks | compute | receive wait | send | idle |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in _hetero(rows):
        recorded = [_fractions(r) for r in rows[name] if r.get("timeline")]
        for s in recorded[0] if recorded else ():
            cells = [f"{100 * statistics.median(f[s][k] for f in recorded):.0f}%" for k in (*PHASES, "idle")]
            kind, blocks = _types(rows[name][0])[s], rows[name][0]["layers"][s]
            lines.append(f"| {name} | {s} ({kind}) | {blocks} | {' | '.join(cells)} |")
    return lines


def _median_round(runs: list[dict]) -> dict[str, Any]:
    ordered = sorted((r for r in runs if r.get("timeline")), key=lambda r: r["samples_per_s"])
    return ordered[len(ordered) // 2]


def _timeline_png(rows: dict[str, list[dict]], png: Path) -> bool:
    """One panel per hetero configuration (its median-throughput round): every rank's last timed step, on one time
    scale, ranks grouped by stage (PNG; skipped without matplotlib)."""
    names = [n for n in _hetero(rows) if any(r.get("timeline") for r in rows[n])]
    if not names:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    picked = {n: _median_round(rows[n]) for n in names}
    xmax = 1e3 * max(
        max(x["end"] for x in r["timeline"]) - min(x["start"] for x in r["timeline"]) for r in picked.values()
    )
    fig, axes = plt.subplots(len(names), 1, figsize=(14, 1.6 * len(names) + 0.8), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        row = picked[name]
        lanes = sorted(row["timeline"], key=lambda x: (x["stage"], x["rank"]))
        origin = min(x["start"] for x in lanes)
        span = max(x["end"] for x in lanes) - origin
        types = _types(row)
        draw_lanes(
            ax, [[(k, "", t0 - origin, t1 - origin) for k, t0, t1 in x["events"]] for x in lanes], span,
            [f"rank {x['rank']}: stage {x['stage']} ({types[x['stage']]}, {row['layers'][x['stage']]} blocks)"
             for x in lanes], {"F", "B"}, xmax,
        )  # fmt: skip
        busy = ", ".join(f"stage {s} {100 * f['compute']:.0f}%" for s, f in _fractions(row).items())
        ax.set_title(f"{LABELS[name]}: step {span:.2f} s, compute {busy}", fontsize=8)
    fig.legend(handles=legend(["F", "B", "S", "R"]), loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("Hetero pipeline, one timed step per rank (F/B include the emulated delay); x in ms", fontsize=10)
    fig.subplots_adjust(left=0.13, right=0.99, top=0.9, bottom=0.12, hspace=0.55)  # fixed: tight_layout costs ~0.2 s
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


def _busy_table(rows: dict[str, list[dict]]) -> list[str]:
    lines = [
        "| configuration | stage (device type) | blocks | busy / wall, median (min-max) | busy s per step, median |",
        "|---|---|---|---|---|",
    ]
    for name in _hetero(rows):
        per_step = _busy_median(rows, name, "busy_s_per_step")
        for s in rows[name][0]["busy"]:
            blocks = sorted({r["layers"][s] for r in rows[name]})
            frac = _summary([100 * r["busy"][s] for r in rows[name]], ".0f")
            kind = _types(rows[name][0])[s]
            lines.append(f"| {name} | {s} ({kind}) | {', '.join(map(str, blocks))} | {frac}% | {per_step[s]:.2f} |")
    return lines


def write_report(rows: dict[str, list[dict]], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    _bar_chart(rows, png)
    timeline = out.with_name(out.stem + "_timeline.png")
    drawn = _timeline_png(rows, timeline)
    alone = rows["alone"]
    summary: dict[str, Any] = {}
    lines = [
        "# Heterogeneous meshes: throughput vs. each device group alone (CPU emulation)",
        "",
        f"`python bench/hetero.py --rounds {args.rounds} --steps {args.steps} --slowdown {args.slowdown}"
        f" --base-slowdown {args.base_slowdown} --seq {args.seq} --rank-batch {args.rank_batch} --micro {args.micro}"
        f" --layers {_model(args)['num_layers']} --configs {','.join(_hetero(rows))}"
        + (" --emulated-cost least" if getattr(args, "emulated_cost", "measured") == "least" else "")
        + "`;"
        + (
            f" load average at the end of the run: {', '.join(f'{x:.1f}' for x in args.load_at_end)}."
            if getattr(args, "load_at_end", None)
            else ""
        ),
        "",
        (
            getattr(args, "note", None)
            or "**Measured under load**: a 2-core machine shared with several other engineers' jobs."
        )
        + " Every number is a median over interleaved rounds (each round runs every configuration once)"
        " with the min-max range.",
        "",
        f"Model: llama-tiny shape with {_model(args)}, sequence {args.seq}; global batch {2 * args.rank_batch} samples per"
        f" step in micro-batches of {args.micro} sample(s) per rank ({args.rank_batch // args.micro} micro-batches"
        f" per step and rank: 1F1B across the two meshes; gradient accumulation for the groups alone);"
        f" {args.steps - WARMUP} timed steps after {WARMUP} warm-up steps per job. Emulated factors: fast"
        f" {args.base_slowdown}x, slow {args.base_slowdown * args.slowdown}x one core ("
        + (
            "each forward / backward lasts the factor times the least CPU time a call of its shape took on the rank"
            if getattr(args, "emulated_cost", "measured") == "least"
            else "sleep of (factor-1) x the CPU time of each forward / backward"
        )
        + f"), so the slow type is {args.slowdown}x slower than the fast one.",
        "",
        "| configuration | blocks per stage, pipeline order | samples/s | ratio to fast alone + slow alone |",
        "|---|---|---|---|",
        f"| fast alone (DP=2) | all | {_summary([a['per_type']['fast'] for a in alone])} | |",
        f"| slow alone (DP=2) | all | {_summary([a['per_type']['slow'] for a in alone])} | |",
        f"| sum of the two | | {_summary([a['samples_per_s'] for a in alone])} | 100% |",
    ]
    for name in _hetero(rows):
        splits = sorted({tuple(r["layers"]) for r in rows[name]})
        ratio = [100 * x for x in _ratios(rows, name)]
        thr = _summary([r["samples_per_s"] for r in rows[name]])
        lines.append(f"| {LABELS[name]} | {', '.join(map(str, splits))} | {thr} | {_summary(ratio, '.0f')}% |")
        summary[name] = dict(ratio_pct=ratio, splits=[list(x) for x in splits])
    lines.append("")
    for name in _hetero(rows):
        if name != "even" and "even" in rows:
            gain = [100 * (a - e) for a, e in zip(_ratios(rows, name), _ratios(rows, "even"))]
            summary[name]["points_above_even"] = gain
            lines.append(f"{LABELS[name]} minus even split, per round: {_summary(gain, '.0f')} points.")
            speedup = [a["samples_per_s"] / e["samples_per_s"] for a, e in zip(rows[name], rows["even"])]
            summary[name]["speedup_over_even"] = speedup
            lines.append(
                f"{LABELS[name]} over even split, throughput per round: {_summary(speedup, '.2f')}x (same job"
                " structure, so the least load-sensitive number here)."
            )
    baseline = [a["per_type"]["fast"] / a["per_type"]["slow"] for a in alone]
    summary["alone_fast_over_slow"] = baseline
    lines.append(
        f"Baseline check: fast alone / slow alone = {_summary(baseline, '.2f')}x per round (emulated:"
        f" {args.slowdown}x); below it, CPU contention on the un-emulated work (Lightning's loop per accumulated"
        " micro-batch, optimizer, gradient reduction) slows the groups alone and inflates the ratios above."
    )
    lines += [
        "",
        f"Per-stage busy time (compute + emulated delay) over the timed steps' wall time (`{png.name}`):",
        "",
        *_busy_table(rows),
        "",
    ]
    if drawn:
        lines += [
            f"One timed step per stage from the timelines (`{timeline.name}`): compute (forward + backward, with the"
            " emulated delay), waiting in a receive for the neighbour stage, posting and completing sends, and idle"
            " (the rest: the pipeline's fill and drain, the loss, the optimizer and Lightning's loop); median over"
            " rounds, mean over a stage's ranks:",
            "",
            *_timeline_table(rows),
            "",
        ]
    out.write_text("\n".join(lines))
    record = dict(args=vars(args), model=_model(args), rows=rows, summary=summary, loadavg=os.getloadavg())
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    print("\n".join(lines))
    return summary


def _int_keys(row: dict[str, Any]) -> dict[str, Any]:
    """JSON turned the stage indices of the busy dicts into strings."""
    return {k: {int(s): v for s, v in x.items()} if k.startswith("busy") else x for k, x in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per job (the first 2 untimed)")
    parser.add_argument("--slowdown", type=float, default=2.0, help="slow type's time / fast type's time")
    parser.add_argument("--base-slowdown", type=float, default=10.0, help="fast type's emulated factor vs one core")
    parser.add_argument(
        "--emulated-cost",
        choices=("measured", "least"),
        default="measured",
        help="what the factor stretches (FLAGSCALE_EMULATE_COST): each call's CPU time, or the least a call of its"
        " shape took on the rank (the CPU-time noise of 4 processes on 2 cores is then not stretched)",
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank-batch", type=int, default=16, help="samples per data-parallel rank and step")
    parser.add_argument("--micro", type=int, default=1, help="samples per micro-batch and data-parallel rank")
    parser.add_argument(
        "--configs",
        default="even,aware",
        help="hetero configurations: even, aware, given, ordered (given + hetero_mesh_order='speed'), warmup (ordered +"
        " hetero_warmup='speed'), aware_rev (slow mesh first)",
    )
    parser.add_argument("--layers", type=int, default=MODEL["num_layers"], help="decoder blocks of the model")
    parser.add_argument("--note", help="how the machine was loaded (replaces the default 'measured under load')")
    parser.add_argument("--out", default="bench/results/hetero.md")
    parser.add_argument("--from-json", help="re-render the report of an earlier run's JSON (no measurement)")
    args = parser.parse_args()
    if args.from_json:
        record = json.loads(Path(args.from_json).read_text())
        rows = {name: [_int_keys(r) for r in runs] for name, runs in record["rows"].items()}
        write_report(rows, argparse.Namespace(**{**record["args"], "out": args.out}), Path(args.out))
        return
    rows: dict[str, list[dict]] = {"alone": []}
    rows.update({name: [] for name in args.configs.split(",")})
    for rnd in range(args.rounds):
        for name in rows:
            rows[name].append(run_config(name, args))
            print(f"round {rnd} {name}: {rows[name][-1]}", flush=True)
    args.load_at_end = os.getloadavg()
    write_report(rows, args, Path(args.out))


if __name__ == "__main__":
    main()
