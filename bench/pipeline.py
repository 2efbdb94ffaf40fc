"""Pipeline-schedule bubbles measured on CPU against theory, with per-rank timelines (issues 3 and 42; not a test).

Runs every schedule of ``lightning_flagscale.parallel.pipeline_parallel.runner`` at p = 4 ranks and m micro-batches
(default 8) through the same ``PipelineRunner`` the strategy uses, on a model whose per-layer cost is known exactly:
each layer sleeps ``F`` ms in forward, ``I`` ms for its input gradient and ``W`` ms for its weight gradient, in the
ratio ``--fbw`` (sleeping, not computing, so 4 processes on a 2-core machine do not distort each other's timings).
Eight layers in total: 2 per stage for the one-stage-per-rank schedules, 1 per stage for the virtual / V ones, after a
free stand-in embedding whose output requires grad, so the first layer computes its input gradient as in a real
model and every rank owns the same work (issue 42 item 2: without it the first stage skipped one I per micro-batch,
rank 0 carried 1/6 less work, and that alone made the ideal ZB-V and DualPipeV bubble 9.8% instead of 5.9%).

Every action is timed on every rank: F, B (full backward) or I (input gradient) and W (weight gradient), and the
point-to-point sends and receive waits of torch's schedule runner; the rest of a rank's time is idle (host work of the
runner between actions, the loss). Per schedule it reports

* the measured bubble (time not in F/B/I/W over the makespan, averaged over ranks),
* the ideal bubble of the same action order (each rank's measured order replayed with each action's sleep time and
  no communication or host cost: what this schedule would give with free host and network),
* the theory for these costs with all ranks starting together (formulas in ``_theory`` and in the results file;
  ZB-V and DualPipeV: torch's action order replayed with exact costs), and the least any V schedule can idle,
* where the measured idle time goes: receive waits, send posting, host time between actions, host time inside
  actions (measured action time minus its sleeps),

and draws each schedule's measured timeline next to its ideal one (PNG).

    python bench/pipeline.py [--out bench/results] [--m 8] [--fbw 1:1:1] [--ms 30] [--iters 5]
    python bench/pipeline.py --smoke --out /tmp/x     # 1 ms layers, one measured iteration (the test runs this)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lightning_flagscale
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import collect, context, free_port  # bench/ is on sys.path
from _timeline import draw_lanes, legend

P, LAYERS, HIDDEN = 4, 8, 16


ZBV_4P = "zbv_4p"
GENERATED = {
    ZBV_4P: ("zbv", 4 * P),  # ZB-V with 4p activations
    "dualpipev_gen": ("dualpipev", None),
    "dualpipev_3p": ("dualpipev", 3 * P),
}
"""Rows running an order generated for --fbw (``pipeline_chunk_costs``): name -> (schedule, activations per rank,
``pipeline_max_activations``; None: torch's order's own). ``zbv_4p``: ZB-V with 4p; ``dualpipev_gen``: DualPipeV at
torch's memory (2p + 1); ``dualpipev_3p``: DualPipeV with 3p."""


def _schedules() -> list[tuple[str, int]]:
    """Every schedule at its default virtual size (interleaved 1F1B with 2 chunks per rank), then the generated
    orders (``GENERATED``)."""
    from lightning_flagscale.config.schedules import SCHEDULE_NAMES, default_virtual_size

    out = [(name, 2 if name == "interleaved_1f1b" else default_virtual_size(name, P)) for name in SCHEDULE_NAMES]
    return [*out, *((name, 2) for name in GENERATED)]


# ---- a model of known cost ------------------------------------------------------------------------------------------

_SLEPT = [0.0]  # seconds slept on this rank so far (each action's ideal cost is the difference across it)


def _sleep(seconds: float) -> None:
    if seconds:
        time.sleep(seconds)
        _SLEPT[0] += seconds


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        _sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _sleep(ctx.bwd_s)
        return grad, None, None


class _Layer(nn.Module):
    # y = sleep_F,I(x) * sleep_W(w): the input gradient and the weight gradient are separate autograd paths, so
    # zero-bubble schedules can run them at different times, as they do for a real linear layer.
    def __init__(self, ms: float, fbw: tuple[float, float, float]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))
        self.f, self.i, self.w = (ms * x / 1000 for x in fbw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.f, self.i) * _Sleep.apply(self.weight, 0.0, self.w)


class _Embed(nn.Module):
    """Free stand-in for a token embedding: its output requires grad, so the first layer computes its input gradient
    as in a real model (without it the first stage skipped one I per micro-batch and carried 1/6 less work)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _SleepLM(nn.Module):
    """Implements the pipeline protocol (``layers`` ModuleDict, ``pipeline_units``, ``loss_fn``) with no head."""

    def __init__(self, ms: float, fbw: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> None:
        super().__init__()
        self.embed: nn.Module | None = _Embed()
        self.layers = nn.ModuleDict({str(i): _Layer(ms, fbw) for i in range(LAYERS)})

    def pipeline_units(self) -> list[str]:
        return ["embed", *(f"layers.{i}" for i in self.layers)]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return x

    def loss_fn(self, out: torch.Tensor, target: torch.Tensor, num_items: Any = None) -> torch.Tensor:
        return (out - target).pow(2).sum() / (num_items if num_items is not None else out.numel())


# ---- instrumentation ----------------------------------------------------------------------------------------------

_EVENTS: list[tuple[str, int, int, float, float, float]] = []  # (kind, stage, micro-batch, start, end, slept)


def _timed(kind: str, stage: int, mb: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    slept0, t0 = _SLEPT[0], time.perf_counter()
    out = fn(*args, **kwargs)
    _EVENTS.append((kind, stage, mb, t0, time.perf_counter(), _SLEPT[0] - slept0))
    return out


def _instrument_p2p() -> None:
    """Time torch's P2P posting (``S``: sends, ``R``: receives posted) and waits (``S`` / ``R`` by what was posted)."""
    from torch.distributed.pipelining import schedules

    batch, wait = schedules._batch_p2p, schedules._wait_batch_p2p
    kinds: dict[int, str] = {}

    def _batch_p2p(ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
        kind = "S" if all(op.op is dist.isend for op in ops) else "R"
        works = _timed(kind, -1, -1, batch, ops, desc=desc) if ops else []
        for w in works:
            kinds[id(w)] = kind
        return works

    def _wait_batch_p2p(works: list[Any]) -> None:
        if works:
            kind = kinds.pop(id(works[0]), "R")
            for w in works[1:]:
                kinds.pop(id(w), None)
            _timed(kind, -1, -1, wait, works)

    schedules._batch_p2p, schedules._wait_batch_p2p = _batch_p2p, _wait_batch_p2p


def _stage_cls() -> type:
    from lightning_flagscale.parallel.pipeline_parallel.runner import StatelessInferenceStage

    class _TimedStage(StatelessInferenceStage):
        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            fn = super().forward_one_chunk
            return _timed("F", self.stage_index, fwd_chunk_id, fn, fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(
            self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, **kw: Any
        ) -> None:
            fn = super().backward_one_chunk
            kind = "B" if full_backward else "I"
            _timed(kind, self.stage_index, bwd_chunk_id, fn, bwd_chunk_id, loss=loss, full_backward=full_backward, **kw)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            fn = super().backward_weight_one_chunk
            _timed("W", self.stage_index, bwd_chunk_id, fn, bwd_chunk_id, last_backward=last_backward)

    return _TimedStage


def _run_rank(rank: int, port: int, opts: dict, queue: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_flagscale.config import ParallelConfig
    from lightning_flagscale.parallel.pipeline_parallel.runner import build_pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("pp",))
    _instrument_p2p()
    m = opts["m"]
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(m, HIDDEN, generator=gen), torch.randn(m, HIDDEN, generator=gen)
    runners = {}
    for name, v in opts["schedules"]:
        schedule, cap = GENERATED.get(name, (name, None))
        # the generated rows: the order generated for the layers' costs, set as a user sets it
        knobs = dict(pipeline_chunk_costs=opts["fbw"], pipeline_max_activations=cap) if name in GENERATED else {}
        cfg = ParallelConfig(
            pipeline_parallel_size=P, virtual_pipeline_parallel_size=v, pipeline_schedule=schedule, **knobs
        )
        runners[name] = build_pipeline(_SleepLM(opts["ms"], opts["fbw"]), mesh, cfg, device="cpu")
        runners[name].stage_cls = _stage_cls()
    out: dict[str, list] = {name: [] for name in runners}
    if opts.get("manual_gc"):  # Python's cyclic collector between steps only (Megatron's --manual-gc)
        gc.disable()
    # round 0 warms up every schedule's communicators and shape metadata; then rounds interleave the schedules (each
    # round runs every schedule once), so a load drift on this shared machine hits all of them alike
    for it in range(opts["iters"] + 1):
        for name, runner in runners.items():
            if opts.get("manual_gc"):
                gc.collect()
            dist.barrier()
            _EVENTS.clear()
            start = time.perf_counter()
            runner.step((x,), {}, target)
            end = time.perf_counter()
            if it:
                out[name].append((start, end, list(_EVENTS)))
    gathered = [None] * P if rank == 0 else None
    dist.gather_object(out, gathered, dst=0)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


# ---- analysis -----------------------------------------------------------------------------------------------------

COMPUTE = ("F", "B", "I", "W")


def _chunk_costs(v: int, fbw: tuple[float, float, float]) -> tuple[float, float, float]:
    """F, I, W of one stage (chunk) for one micro-batch, in layer units: LAYERS / (P v) layers per stage."""
    k = LAYERS // (P * v)
    return (k * fbw[0], k * fbw[1], k * fbw[2])


def _theory(name: str, v: int, m: int, fbw: tuple[float, float, float]) -> float:
    """Bubble of ``name`` with every stage costing ``fbw`` per layer, all ranks starting together (module docstring).

    GPipe / 1F1B: (p-1)(F+I+W) idle per rank; interleaved 1F1B the same with chunk costs; ZB-H1 (p-1)(F+I-W);
    ZB-V and DualPipeV: torch's own action order replayed with these chunk costs and free host and P2P
    (``orders.simulate``): ZB-V's is (p-1)F when I = W (the least any V order can idle), DualPipeV's has no closed form
    without F&B overlap; the ``GENERATED`` rows: the order ``orders.zbv_order`` / ``orders.dualpipev_order``
    generates for these costs, replayed the same way."""
    from lightning_flagscale.parallel.pipeline_parallel.orders import (
        dualpipev_order,
        simulate,
        torch_v_order,
        zbv_order,
    )

    f, i, w = _chunk_costs(v, fbw)
    if name in GENERATED:
        schedule, cap = GENERATED[name]
        generate = zbv_order if schedule == "zbv" else dualpipev_order
        return simulate(generate(P, m, (f, i, w), cap), P * v, (f, i, w)).bubble
    if name in ("zbv", "dualpipev"):
        return simulate(torch_v_order(name, P, m), P * v, (f, i, w)).bubble
    busy = m * v * (f + i + w)
    idle = (P - 1) * ((f + i + w) if name in ("gpipe", "1f1b", "interleaved_1f1b") else max(0.0, f + i - w))
    return idle / (busy + idle)


def _v_bound(m: int, fbw: tuple[float, float, float]) -> float:
    from lightning_flagscale.parallel.pipeline_parallel.orders import v_lower_bound

    return v_lower_bound(P, m, _chunk_costs(2, fbw))


def _ideal(ranks_events: list[list[tuple]], num_stages: int) -> list[list[tuple]]:
    """Replay each rank's measured compute order with each action's sleep time and free communication
    (``orders.simulate``, the replay the tests check the schedules' theory with)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    from lightning_flagscale.parallel.pipeline_parallel.orders import simulate

    kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD,
             "I": _ComputationType.BACKWARD_INPUT, "W": _ComputationType.BACKWARD_WEIGHT}  # fmt: skip
    names = {v: k for k, v in kinds.items()}
    durations = {(e[0], e[1], e[2]): e[5] for events in ranks_events for e in events if e[0] in COMPUTE}
    order = {r: [_Action(s, kinds[kind], mb) for kind, s, mb, *_ in events if kind in COMPUTE]
             for r, events in enumerate(ranks_events)}  # fmt: skip
    cost = lambda a: durations[(names[a.computation_type], a.stage_index, a.microbatch_index)]  # noqa: E731
    timeline = simulate(order, num_stages, cost).timeline
    out = []
    for r in range(len(ranks_events)):
        rows = []
        for a, start, end in timeline[r]:
            kind = names[a.computation_type]
            rows.append((kind, a.stage_index, a.microbatch_index, start, end, end - start))
        out.append(rows)
    return out


def _bubble(ranks_events: list[list[tuple]], start: float, span: float) -> tuple[float, list[dict]]:
    ranks = []
    for events in ranks_events:
        by = {k: sum(e[4] - e[3] for e in events if e[0] == k) for k in (*COMPUTE, "S", "R")}
        busy = sum(by[k] for k in COMPUTE)
        slept = sum(e[5] for e in events if e[0] in COMPUTE)
        # outside every action and P2P call: before the rank's first call and after its last one (the step's start,
        # the loss broadcast and the wait for the slowest rank), and the host gaps between calls
        edges = (min(e[3] for e in events) + span - max(e[4] for e in events)) if events else span
        # the rank's own span, from its first compute action's start to its last one's end (the ZB and DualPipe
        # papers' count: a rank's wait for its first input and its early finish are not bubble there)
        compute = [e for e in events if e[0] in COMPUTE]
        own = (max(e[4] for e in compute) - min(e[3] for e in compute)) if compute else 0.0
        ranks.append({
            "busy": busy, "idle": span - busy, "send": by["S"], "recv": by["R"], "slept": slept,
            "host_in_actions": busy - slept, "edges": edges, "host_between": span - busy - by["S"] - by["R"] - edges,
            "own_span": own, "own_idle": own - busy,
        })  # fmt: skip
    return sum(r["idle"] for r in ranks) / (len(ranks) * span), ranks


def _own_bubble(ranks: list[dict]) -> float:
    """Idle inside each rank's own span (first compute start to last compute end) over that span, mean of ranks."""
    return sum(r["own_idle"] / r["own_span"] for r in ranks if r["own_span"]) / len(ranks)


def _analyse(
    gathered: list[dict], schedules: list[tuple[str, int]], m: int, fbw: tuple[float, float, float]
) -> list[dict]:
    rows = []
    for name, v in schedules:
        per_iter = []
        for it in range(len(gathered[0][name])):
            start = min(g[name][it][0] for g in gathered)
            span = max(g[name][it][1] for g in gathered) - start
            events = [
                [(k, s, mb, t0 - start, t1 - start, sl) for k, s, mb, t0, t1, sl in g[name][it][2]] for g in gathered
            ]
            per_iter.append((span, events))
        bubbles = sorted(_bubble(events, 0.0, span)[0] for span, events in per_iter)
        own_bubbles = sorted(_own_bubble(_bubble(events, 0.0, span)[1]) for span, events in per_iter)
        # the iteration of the median makespan is split and drawn; the bubble is given as median (min - max)
        span, events = sorted(per_iter, key=lambda x: x[0])[len(per_iter) // 2]
        bubble, ranks = _bubble(events, 0.0, span)
        ideal = _ideal(events, P * v)
        ideal_span = max(e[4] for r in ideal for e in r)
        ideal_bubble, ideal_ranks = _bubble(ideal, 0.0, ideal_span)
        rows.append({
            "name": name, "v": v, "theory": _theory(name, v, m, fbw), "bubble": bubble, "bubbles": bubbles, "span": span, "ranks": ranks,
            "ideal_bubble": ideal_bubble, "ideal_span": ideal_span, "events": events, "ideal": ideal,
            "own_bubble": _own_bubble(ranks), "own_bubbles": own_bubbles, "ideal_own_bubble": _own_bubble(ideal_ranks),
        })  # fmt: skip
    return rows


def _med(values: list[float]) -> str:
    mid = sorted(values)[len(values) // 2]
    return f"{mid * 100:.1f}% ({min(values) * 100:.1f}-{max(values) * 100:.1f})"


def _table(rows: list[dict], opts: dict) -> list[str]:
    ms, m, (f, i, w) = opts["ms"], opts["m"], opts["fbw"]
    lines = [
        f"p = {P}, m = {m}, {LAYERS} sleep-timed layers (and a free embedding), F : I : W = {f:g} : {i:g} : {w:g} with"
        f" one unit = {ms:g} ms per layer; bubble = time outside F/B/I/W over the makespan (all ranks start together"
        f" and the step ends with the last one), averaged over ranks; median (min - max) over {opts['iters']}"
        " measured rounds (each runs every schedule once, interleaved), the split and the timeline from the round of median makespan.",
        "",
        "Theory, per rank with F, I, W the costs of one stage (a V chunk or interleaved chunk is one layer, a 1F1B"
        " stage two): GPipe, 1F1B and interleaved 1F1B idle (p-1)(F+I+W) out of m v (F+I+W) + idle; ZB-H1"
        " (p-1)(F+I-W); ZB-V and DualPipeV: torch's action order replayed with these costs and free host and P2P"
        " (`orders.simulate`); zbv_4p: `zbv` running the order `orders.zbv_order` generates for these costs with up"
        " to 4p activations per rank (2x 1F1B's; `ParallelConfig(pipeline_chunk_costs=..., pipeline_max_activations=16)`),"
        " dualpipev_gen / dualpipev_3p: `dualpipev` running the order `orders.dualpipev_order` generates for these costs"
        " (torch's pairs and sequence, each backward split into its input gradient and a weight gradient placed in a"
        " wait) at torch's memory (2p + 1 = 9 activations per rank) / with up to 3p = 12, replayed the same way. No V schedule whose ranks start together idles less than (p-1)F per rank (the last"
        f" rank's first forward waits for p-1 others, and every rank carries 2m(F+I+W)): {_v_bound(m, opts['fbw']) * 100:.1f}%"
        " here, the 'V bound'.",
        "",
        "Per-rank span: the ZB-V paper's 0 and DeepSeek's (PP/2-1)(F&B+B-3W) for DualPipeV count each rank's idle time"
        " from its own first F/B/I/W to its own last (a later rank's wait for its first input and an earlier rank's"
        " finish are not bubble there); the two 'per-rank span' columns give the bubble so counted, measured and for"
        " the same order replayed with free host and P2P (the theory of that order). Both counts are honest about"
        " different things: the makespan one is what a training step costs when every step ends in the optimizer.",
        "",
        "| schedule | v | makespan ms | measured bubble | ideal (same order, free host + P2P) | theory |"
        " per-rank span: measured | per-rank span: ideal |"
        " recv wait | send | before first / after last call | host between calls | host inside actions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        keys = ("recv", "send", "edges", "host_between")
        avg = {k: sum(x[k] for x in r["ranks"]) / P / r["span"] * 100 for k in keys}
        inside = sum(x["host_in_actions"] for x in r["ranks"]) / P / r["span"] * 100
        lines.append(
            f"| {r['name']} | {r['v']} | {r['span'] * 1e3:.0f} | {_med(r['bubbles'])} | {r['ideal_bubble'] * 100:.1f}%"
            f" | {r['theory'] * 100:.1f}% | {_med(r['own_bubbles'])} | {r['ideal_own_bubble'] * 100:.1f}%"
            f" | {avg['recv']:.1f}% | {avg['send']:.1f}% | {avg['edges']:.1f}%"
            f" | {avg['host_between']:.1f}%"
            f" | {inside:.1f}% |"
        )
    lines += [
        "",
        "The last five columns split the measured bubble (receive waits + sends + time before a rank's first and"
        " after its last F/B/I/W/P2P call: step start, loss broadcast, waiting for the slowest rank + host time"
        " between calls) and show the host time inside actions (their time minus their sleeps, counted as busy),"
        " each as a share of the makespan averaged over ranks. Per-rank busy / idle ms:",
        "",
    ]
    for r in rows:
        per_rank = ", ".join(f"{x['busy'] * 1e3:.0f}/{x['idle'] * 1e3:.0f}" for x in r["ranks"])
        lines.append(f"- {r['name']}: {per_rank}")
    return lines


def _plot(rows: list[dict], out: Path, opts: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional: pip install 'lightning-flagscale[bench]'
        print("matplotlib not installed; no timeline PNG")
        return False
    fig, axes = plt.subplots(len(rows), 2, figsize=(18, 1.9 * len(rows)), squeeze=False)
    for (ax_m, ax_i), r in zip(axes, rows):
        xmax = r["span"] * 1e3  # one scale per schedule: measured and ideal side by side
        for ax, events, span, bubble, what in (
            (ax_m, r["events"], r["span"], r["bubble"], "measured"),
            (ax_i, r["ideal"], r["ideal_span"], r["ideal_bubble"], "ideal (same order)"),
        ):
            lanes = [[(kind, f"{kind}{mb}", t0, t1) for kind, _stage, mb, t0, t1, _ in evs] for evs in events]
            draw_lanes(ax, lanes, span, [f"rank {rank}" for rank in range(P)], set(COMPUTE), xmax)
            ax.set_title(
                f"{r['name']} (v={r['v']}) {what}: {span * 1e3:.0f} ms, bubble {bubble * 100:.1f}%"
                f" (theory {r['theory'] * 100:.1f}%)",
                fontsize=8,
            )
    handles = legend(["F", "B", "I", "W", "S", "R"])
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(
        f"Pipeline timelines, p={P} m={opts['m']}, F:I:W={':'.join(f'{x:g}' for x in opts['fbw'])} x {opts['ms']:g}"
        " ms/layer: measured (left), the same action"
        " order replayed with free host and P2P (right); x in ms",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="folder for MD/JSON/PNG")
    parser.add_argument("--stem", default=None, help="file name stem (default: pipeline, pipeline_m16 for --m 16)")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--ms", type=float, default=30.0, help="milliseconds of one cost unit of a layer")
    parser.add_argument("--fbw", default="1:1:1", help="F:I:W cost of a layer in units of --ms (I: input gradient)")
    parser.add_argument(
        "--iters", type=int, default=5, help="measured rounds, each running every schedule once (median reported)"
    )
    parser.add_argument("--only", nargs="+", default=None, help="a subset of the schedules")
    parser.add_argument("--smoke", action="store_true", help="1 ms layers, one measured iteration (seconds)")
    parser.add_argument(
        "--manual-gc", action="store_true", help="Python's garbage collector between steps only, not inside one"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is abandoned")
    args = parser.parse_args(argv)
    if args.smoke:
        args.ms, args.iters = 1.0, 1
    schedules = [s for s in _schedules() if args.only is None or s[0] in args.only]
    if args.smoke:  # the smoke run covers the runner's six schedules and one generated DualPipeV order
        schedules = [s for s in schedules if s[0] not in GENERATED or s[0] == "dualpipev_gen"]
    fbw = tuple(float(x) for x in args.fbw.split(":"))
    if len(fbw) != 3 or min(fbw) < 0:
        parser.error(f"--fbw takes three costs F:I:W such as 1:2:1, got {args.fbw!r}")
    opts = {"m": args.m, "ms": args.ms, "fbw": fbw, "iters": args.iters, "schedules": schedules}
    opts["manual_gc"] = args.manual_gc
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(r, port, opts, queue)) for r in range(P)]
    for proc in procs:
        proc.start()
    (gathered,) = collect(procs, queue, 1, timeout=args.timeout, name="bench/pipeline.py")
    rows = _analyse(gathered, schedules, args.m, opts["fbw"])
    ratio = "" if fbw == (1.0, 1.0, 1.0) else "_fbw" + "".join(f"{x:g}" for x in fbw)
    stem = args.stem or ("pipeline" if args.m == 8 else f"pipeline_m{args.m}") + ratio
    args.out.mkdir(parents=True, exist_ok=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    command = "python bench/pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    png = args.out / f"{stem}_timeline.png"
    lines = [f"# Pipeline bubbles: measured, ideal and theory (`{command.strip()}`)", "", *_table(rows, opts)]
    if _plot(rows, png, opts):
        lines += ["", f"![per-rank timelines, measured and ideal]({png.name})"]
    lines += ["", f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at the end: {load}."]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    keys = (
        "name",
        "v",
        "theory",
        "bubble",
        "bubbles",
        "ideal_bubble",
        "span",
        "ideal_span",
        "ranks",
        "own_bubble",
        "own_bubbles",
        "ideal_own_bubble",
    )
    summary = [{k: r[k] for k in keys}
               for r in rows]  # fmt: skip
    (args.out / f"{stem}.json").write_text(json.dumps({"command": command, "opts": opts, "rows": summary}, indent=1))
    print("\n".join(lines))
    print(f"wrote {args.out / stem}.md, .json" + (", _timeline.png" if png.exists() else ""))


if __name__ == "__main__":
    main()
