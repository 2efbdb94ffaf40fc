"""Pipeline-schedule bubbles measured on CPU against theory, plus a timeline PNG (issue 3; not a test).

Runs every schedule of ``lightning_flagscale.parallel.pipeline_parallel.runner`` at p=4 ranks, m=8 micro-batches through the same
``PipelineRunner`` the strategy uses, on a model whose per-layer cost is known exactly: each layer sleeps ``F`` ms
in forward, ``I`` ms for its input gradient and ``W`` ms for its weight gradient (sleeping, not computing, so 4
processes on a 2-core machine do not distort each other's timings). Eight layers in total: 2 per stage for the
one-stage-per-rank schedules, 1 per stage for the virtual/V ones, so every rank owns the same work.

Per schedule and rank it reports busy and idle time, the measured bubble (idle / makespan) next to the theory,
and the peak number of live micro-batch activations per stage (forwarded, weight gradient not yet done). Theory
per rank with F = I = W per layer: 1F1B/GPipe (p-1)/(m+p-1); interleaved 1F1B divides the bubble by v; ZB-H1
leaves (p-1)(F+I-W), about a third of 1F1B's (p-1)(F+I+W); ZB-V ~0; DualPipeV (p/2-1)(F&B+B-3W) per DeepSeek.

    python bench/pipeline.py [--out bench/results/tmp/pipeline_timeline.png] [--ms 30] [--iters 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_flagscale.parallel.pipeline_parallel.runner import StatelessInferenceStage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.config.schedules import SCHEDULE_NAMES, default_virtual_size
from lightning_flagscale.parallel.pipeline_parallel.runner import build_pipeline

P, M, LAYERS, HIDDEN = 4, 8, 8, 16
# Every schedule at its default virtual size, except interleaved 1F1B, which is shown with 2 chunks per rank.
SCHEDULES = [(name, 2 if name == "interleaved_1f1b" else default_virtual_size(name, P)) for name in SCHEDULE_NAMES]


# ---- a model of known cost ------------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        if fwd_s:
            time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class _Layer(nn.Module):
    # y = sleep_F,I(x) * sleep_W(w): the input gradient and the weight gradient are separate autograd paths, so
    # zero-bubble schedules can run them at different times, as they do for a real linear layer.
    def __init__(self, ms: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))
        self.s = ms / 1000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.s, self.s) * _Sleep.apply(self.weight, 0.0, self.s)


class _SleepLM(nn.Module):
    """Implements the pipeline protocol (``layers`` ModuleDict, ``pipeline_units``, ``loss_fn``) with no head."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Layer(ms) for i in range(LAYERS)})

    def pipeline_units(self) -> list[str]:
        return [f"layers.{i}" for i in self.layers]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x

    def loss_fn(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()


# ---- instrumentation ----------------------------------------------------------------------------------------------

_EVENTS: list[tuple[str, int, int, float, float]] = []  # (kind, stage, micro-batch, start, end)


class _TimedStage(StatelessInferenceStage):
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        _EVENTS.append(("F", self.stage_index, fwd_chunk_id, t0, time.perf_counter()))
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, **kw: Any) -> None:
        t0 = time.perf_counter()
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, **kw)
        _EVENTS.append(("B" if full_backward else "I", self.stage_index, bwd_chunk_id, t0, time.perf_counter()))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        t0 = time.perf_counter()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        _EVENTS.append(("W", self.stage_index, bwd_chunk_id, t0, time.perf_counter()))


def _run_rank(rank: int, port: int, ms: float, iters: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("pp",))
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randn(M, HIDDEN, generator=gen), "labels": torch.randn(M, HIDDEN, generator=gen)}
    out = {}
    for name, v in SCHEDULES:
        cfg = ParallelConfig(pipeline_parallel_size=P, virtual_pipeline_parallel_size=v, pipeline_schedule=name)
        runner = build_pipeline(_SleepLM(ms), mesh, cfg)
        runner.stage_cls = _TimedStage
        runs = []
        for it in range(iters + 1):  # the first iteration warms up communicators and metadata
            dist.barrier()
            _EVENTS.clear()
            start = time.perf_counter()
            runner.step(batch)
            end = time.perf_counter()
            if it:
                runs.append((start, end, list(_EVENTS)))
        out[name] = runs
    gathered = [None] * P if rank == 0 else None
    dist.gather_object(out, gathered, dst=0)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


# ---- analysis -----------------------------------------------------------------------------------------------------


def _theory(name: str, v: int, ms: float) -> float:
    """Bubble fraction of one rank's makespan for F = I = W = ``ms`` per layer."""
    layers_per_stage = LAYERS // (P * v)
    f = i = w = ms * layers_per_stage
    busy = M * v * (f + i + w)
    if name in ("gpipe", "1f1b"):
        idle = (P - 1) * (f + i + w)
    elif name == "interleaved_1f1b":
        idle = (P - 1) * (f + i + w)  # per-chunk costs are already 1/v of the 1F1B stage's
    elif name == "zero_bubble":
        idle = (P - 1) * (f + i - w)
    elif name == "zbv":
        idle = 0.0
    else:  # DualPipeV, DeepSeek-V3 report: (PP/2 - 1)(F&B + B - 3W), F&B = F + B without overlap on CPU
        idle = max(0.0, (P / 2 - 1) * ((f + i + w) + (i + w) - 3 * w))
    return idle / (busy + idle)


def _analyse(gathered: list[dict], ms: float) -> list[dict]:
    rows = []
    for name, v in SCHEDULES:
        per_iter = []
        for it in range(len(gathered[0][name])):
            start = min(g[name][it][0] for g in gathered)
            end = max(g[name][it][1] for g in gathered)
            span = end - start
            ranks = []
            for g in gathered:
                events = g[name][it][2]
                busy = sum(e[4] - e[3] for e in events)
                live: dict[int, int] = {}
                peak: dict[int, int] = {}
                for kind, stage, _, _, _ in sorted(events, key=lambda e: e[4]):
                    live[stage] = live.get(stage, 0) + (1 if kind == "F" else -1 if kind in ("B", "W") else 0)
                    peak[stage] = max(peak.get(stage, 0), live[stage])
                ranks.append({"busy": busy, "idle": span - busy, "peak": peak, "events": events})
            per_iter.append({"span": span, "start": start, "ranks": ranks})
        best = min(per_iter, key=lambda r: r["span"])  # least disturbed by the OS scheduler
        bubble = sum(r["idle"] for r in best["ranks"]) / (P * best["span"])
        rows.append({"name": name, "v": v, "theory": _theory(name, v, ms), "bubble": bubble, **best})
    return rows


def _report(rows: list[dict]) -> None:
    print(f"p={P} m={M}, {LAYERS} layers, F=I=W per layer; bubble = idle / makespan, averaged over ranks")
    print(f"{'schedule':18s} {'v':>2s} {'makespan':>9s} {'bubble':>7s} {'theory':>7s}  per-rank busy/idle ms")
    for r in rows:
        per_rank = " ".join(f"{x['busy'] * 1e3:.0f}/{x['idle'] * 1e3:.0f}" for x in r["ranks"])
        print(
            f"{r['name']:18s} {r['v']:2d} {r['span'] * 1e3:7.0f}ms {r['bubble'] * 100:6.1f}% {r['theory'] * 100:6.1f}%"
            f"  {per_rank}"
        )
    print("peak live micro-batch activations per stage:")
    for r in rows:
        peaks = {s: n for x in r["ranks"] for s, n in x["peak"].items()}
        print(f"  {r['name']:18s} " + " ".join(f"s{s}:{peaks[s]}" for s in sorted(peaks)))
    one_f = next(r for r in rows if r["name"] == "1f1b")
    print(
        f"targets: 1F1B within 5 pp of theory: {abs(one_f['bubble'] - one_f['theory']) <= 0.05}; "
        + "; ".join(f"{n} below 1F1B: {next(r for r in rows if r['name'] == n)['bubble'] < one_f['bubble']}"
                    for n in ("zbv", "dualpipev"))
    )  # fmt: skip


def _plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional: pip install 'lightning-flagscale[bench]'
        print("matplotlib not installed; skipping the timeline PNG")
        return
    colors = {"F": "#4c72b0", "B": "#55a868", "I": "#55a868", "W": "#dd8452"}
    fig, axes = plt.subplots(len(rows), 1, figsize=(14, 2.0 * len(rows)), sharex=True)
    for ax, r in zip(axes, rows):
        for rank, x in enumerate(r["ranks"]):
            for kind, _stage, mb, t0, t1 in x["events"]:
                left, width = (t0 - r["start"]) * 1e3, (t1 - t0) * 1e3
                ax.barh(P - 1 - rank, width, left=left, color=colors[kind], edgecolor="black", linewidth=0.3)
                ax.text(left + width / 2, P - 1 - rank, f"{kind}{mb}", ha="center", va="center", fontsize=5)
        ax.set_yticks(range(P), [f"rank {P - 1 - i}" for i in range(P)], fontsize=7)
        ax.set_title(
            f"{r['name']} (v={r['v']}): bubble {r['bubble'] * 100:.1f}% (theory {r['theory'] * 100:.1f}%)", fontsize=9
        )
    axes[-1].set_xlabel("ms  (blue: forward, green: backward / input-grad, orange: weight-grad)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    print(f"timeline: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tmp" / "pipeline_timeline.png")
    parser.add_argument("--ms", type=float, default=30.0, help="F = I = W cost of one layer in milliseconds")
    parser.add_argument("--iters", type=int, default=3, help="measured iterations per schedule (best is kept)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_run_rank, args=(r, port, args.ms, args.iters, queue)) for r in range(P)]
    for proc in procs:
        proc.start()
    gathered = queue.get(timeout=600)
    for proc in procs:
        proc.join()
    rows = _analyse(gathered, args.ms)
    _report(rows)
    _plot(rows, args.out)


if __name__ == "__main__":
    main()
