"""DualPipeV's point on CPU: the expert all-to-all a step exposes, 1F1B vs DualPipeV without and with overlap.

Issue 42 item 3. A MoE model (mixtral-tiny shape, 4 blocks) trains under EP 2 x PP 2 (4 ranks, gloo) in three
configurations: 1F1B, DualPipeV as torch runs it (each paired forward and backward one after the other) and DualPipeV
with ``overlap_moe_expert_parallel_comm=True`` (the pair's forward on a helper thread,
``parallel/pipeline_parallel/overlap.py``). Emulated device, as in ``bench/pipeline.py``: every block's forward
sleeps ``--fwd-ms`` and its backward ``--bwd-ms`` holding the rank's one emulated device (a lock: two threads compute one
at a time; a sleep frees the core, so four ranks on two cores do not contend), and every expert all-to-all (dispatch and combine, forward and backward) sleeps ``--link-ms`` inside the
collective before the real exchange (the wire). Each configuration runs twice per round, with and without that link
time; the difference of the two step times is the all-to-all time the schedule exposes. Rounds interleave every
job; the table gives the median and min-max over rounds.

    python bench/dualpipe_overlap.py [--rounds 3] [--steps 5] [--out bench/results/dualpipe_overlap.md]
    python bench/dualpipe_overlap.py --smoke --out /tmp/overlap.md      # one round, one configuration, seconds
    python bench/dualpipe_overlap.py --from-json bench/results/dualpipe_overlap.json --out /tmp/overlap.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _procs import collect, context, free_port

WORLD = 4
WARMUP = 2  # steps before the clock starts
MODEL = dict(num_layers=4, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=256, max_seq_len=64)  # fmt: skip
CONFIGS = {
    "1f1b": dict(pipeline_schedule="1f1b"),
    "dualpipev": dict(pipeline_schedule="dualpipev"),
    "dualpipev_overlap": dict(pipeline_schedule="dualpipev", overlap_moe_expert_parallel_comm=True),
}
LABELS = {
    "1f1b": "1F1B",
    "dualpipev": "DualPipeV, pairs in turn (torch's runtime)",
    "dualpipev_overlap": "DualPipeV, pairs overlapped (`overlap_moe_expert_parallel_comm`)",
}


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int, seq: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def _emulate(spec: dict[str, Any], stats: dict[str, float]) -> None:
    """Sleep ``link_ms`` inside every expert all-to-all (forward and backward), counting calls and their time."""
    from lightning_flagscale.parallel.expert_parallel import apply as ep

    link = spec["link_ms"] / 1000.0
    forward, backward = ep._AllToAll.forward, ep._AllToAll.backward

    def timed(fn: Any) -> Any:
        def run(ctx: Any, *args: Any) -> Any:
            start = time.perf_counter()
            if link:
                time.sleep(link)
            out = fn(ctx, *args)
            stats["a2a_calls"] += 1
            stats["a2a_s"] += time.perf_counter() - start
            return out

        return staticmethod(run)

    ep._AllToAll.forward, ep._AllToAll.backward = timed(forward), timed(backward)


def _sleep_blocks(stage_modules: list[Any], fwd_s: float, bwd_s: float) -> None:
    """Every decoder block: its forward sleeps ``fwd_s``, its backward ``bwd_s`` (on the output's gradient), holding
    the rank's one emulated device: a paired forward and backward on two threads compute one at a time, as on one
    accelerator, and only communication (the link sleep, outside the lock) overlaps computation."""
    device = threading.Lock()

    def compute(seconds: float) -> None:
        with device:
            time.sleep(seconds)

    def after_forward(module: Any, args: Any, output: torch.Tensor) -> None:
        compute(fwd_s)
        if output.requires_grad:

            def backward(grad: torch.Tensor) -> torch.Tensor:
                compute(bwd_s)
                return grad

            output.register_hook(backward)

    for stage in stage_modules:
        for block in getattr(stage, "layers", {}).values():
            block.register_forward_hook(after_forward)


def _rank_main(rank: int, port: int, spec: dict[str, Any], queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank),
        NODE_RANK="0", LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0", OMP_NUM_THREADS="1",
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
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=900))
    stats = {"a2a_calls": 0.0, "a2a_s": 0.0}
    _emulate(spec, stats)
    marks: list[float] = []
    counted: dict[str, float] = {}

    class Clock(L.Callback):
        def on_train_start(self, trainer, pl_module):
            _sleep_blocks(trainer.strategy._pipeline.stage_modules, spec["fwd_ms"] / 1000, spec["bwd_ms"] / 1000)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks.append(time.perf_counter())
            if len(marks) == WARMUP:
                counted.update(stats)

    config = TransformerConfig.from_preset("mixtral-tiny", **MODEL, moe_aux_loss_coeff=0.0)
    module = CausalLMModule(config, learning_rate=0.01, warmup_steps=0, min_lr_ratio=1.0, optimizer="sgd")
    strategy = dict(pipeline_parallel_size=2, expert_parallel_size=2, micro_batch_size=1, **CONFIGS[spec["config"]])
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=FlagScaleStrategy(**strategy), max_steps=spec["steps"],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[Clock()], plugins=[FlagScalePrecision("32-true")],
    )  # fmt: skip
    data = _Tokens(config.vocab_size, 4096, spec["seq"])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=spec["micro_batches"]))
    timed = len(marks) - WARMUP
    queue.put(dict(
        rank=rank, step_s=(marks[-1] - marks[WARMUP - 1]) / timed,
        a2a_per_step=(stats["a2a_calls"] - counted["a2a_calls"]) / timed,
        a2a_s_per_step=(stats["a2a_s"] - counted["a2a_s"]) / timed,
    ))  # fmt: skip
    dist.destroy_process_group()


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, spec, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = sorted(collect(procs, queue, WORLD, timeout=1800, name=spec["config"]), key=lambda r: r["rank"])
    return dict(
        step_s=results[0]["step_s"],  # every rank ends a step together (the loss broadcast): rank 0's clock
        a2a_per_step=statistics.mean(r["a2a_per_step"] for r in results),
        a2a_s_per_step=statistics.mean(r["a2a_s_per_step"] for r in results),
    )


def _summary(values: list[float], fmt: str = ".3g") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def write_report(data: dict[str, Any], out: Path) -> None:
    args, rounds = data["args"], data["rounds"]
    configs = [c for c in CONFIGS if all(c in r for r in rounds)]
    exposed = {c: [1000 * (r[c]["link"]["step_s"] - r[c]["free"]["step_s"]) for r in rounds] for c in configs}
    lines = [
        "# DualPipeV's overlap: exposed expert all-to-all per step (`python bench/dualpipe_overlap.py`)",
        "",
        f"`python bench/dualpipe_overlap.py --rounds {args['rounds']} --steps {args['steps']} --fwd-ms"
        f" {args['fwd_ms']} --bwd-ms {args['bwd_ms']} --link-ms {args['link_ms']} --micro-batches"
        f" {args['micro_batches']} --seq {args['seq']}`; {data['env']}.",
        "",
        f"mixtral-tiny shape, {MODEL['num_layers']} blocks, {MODEL['num_experts']} experts top-"
        f"{MODEL['num_experts_per_tok']}, EP 2 x PP 2 on 4 gloo ranks, {args['micro_batches']} micro-batches of one"
        f" sequence of {args['seq']} tokens per data-parallel rank and step. Emulated device: each block's forward"
        f" sleeps {args['fwd_ms']} ms and its backward {args['bwd_ms']} ms, one computation at a time per rank (a"
        " lock: the overlapped pair's two threads share one device); each expert all-to-all (2 in a block's"
        f" forward, 2 in its backward) sleeps {args['link_ms']} ms inside the collective. Exposed all-to-all = step"
        " time with the link time minus without it (same job otherwise), per round; median (min-max) over"
        f" {len(rounds)} interleaved rounds, {args['steps'] - WARMUP} timed steps per job after {WARMUP} warm-up"
        " steps.",
        "",
        "| schedule | step ms, no link time | step ms, link time | all-to-all per rank and step (calls, ms) |"
        " exposed ms | exposed / 1F1B's |",
        "|---|---|---|---|---|---|",
    ]
    for c in configs:
        free = [1000 * r[c]["free"]["step_s"] for r in rounds]
        link = [1000 * r[c]["link"]["step_s"] for r in rounds]
        calls = statistics.median(r[c]["link"]["a2a_per_step"] for r in rounds)
        a2a_ms = [1000 * r[c]["link"]["a2a_s_per_step"] for r in rounds]
        ratio = [e / b for e, b in zip(exposed[c], exposed["1f1b"], strict=True)] if "1f1b" in exposed else []
        lines.append(
            f"| {LABELS[c]} | {_summary(free, '.0f')} | {_summary(link, '.0f')} | {calls:.0f}, {_summary(a2a_ms, '.0f')}"
            f" | {_summary(exposed[c], '.0f')} | {_summary(ratio, '.2f') if ratio else ''} |"
        )
    lines += [
        "",
        "The all-to-all column is the time a rank spends inside its all-to-alls (the link time plus the wait for the"
        " peer), summed over both threads under overlap. 1F1B and DualPipeV in turn expose every all-to-all on the"
        " critical path; with overlap a pair's forward all-to-alls wait while its backward computes and the other"
        " way round, so only the part that finds no computation to hide behind stays exposed (the warm-up and"
        " cool-down phases of DualPipeV, which have no pairs, and pairs whose two halves wait at the same time).",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every job")
    parser.add_argument("--steps", type=int, default=5, help=f"steps per job ({WARMUP} warm-up)")
    parser.add_argument("--fwd-ms", type=float, default=10.0, help="emulated forward of one block, ms")
    parser.add_argument("--bwd-ms", type=float, default=20.0, help="emulated backward of one block, ms")
    parser.add_argument("--link-ms", type=float, default=5.0, help="emulated wire time of one all-to-all, ms")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step and data-parallel rank")
    parser.add_argument("--seq", type=int, default=32, help="sequence length")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=None, help="a subset of the schedules")
    parser.add_argument("--smoke", action="store_true", help="one round of the overlapped schedule, 3 steps, 1 ms")
    parser.add_argument("--from-json", type=Path, default=None, help="render the report of a saved run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dualpipe_overlap.md")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        write_report(json.loads(args.from_json.read_text()), args.out)
        return
    if args.smoke:
        args.rounds, args.steps, args.fwd_ms, args.bwd_ms, args.link_ms = 1, WARMUP + 1, 1.0, 1.0, 1.0
        args.only = args.only or ["dualpipev_overlap"]
    configs = args.only or list(CONFIGS)
    rounds = []
    for k in range(args.rounds):
        row: dict[str, Any] = {}
        for c in configs:  # every job once per round, the link time on and off back to back
            base = dict(config=c, steps=args.steps, fwd_ms=args.fwd_ms, bwd_ms=args.bwd_ms, seq=args.seq,
                        micro_batches=args.micro_batches)  # fmt: skip
            row[c] = {"free": run_job({**base, "link_ms": 0.0}), "link": run_job({**base, "link_ms": args.link_ms})}
            print(f"round {k + 1}/{args.rounds} {c}: {row[c]}", flush=True)
        rounds.append(row)
    env = f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at the end: " + ", ".join(
        f"{x:.1f}" for x in os.getloadavg()
    )
    data = dict(args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, rounds=rounds, env=env)
    json_out = args.out.with_suffix(".json")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(data, indent=1))
    write_report(data, args.out)


if __name__ == "__main__":
    main()
