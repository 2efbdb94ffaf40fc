"""The tuner's predictions against measured runs: per-rank peak memory and step time of >= 10 layouts on 4 processes.

    lightning-flagscale tune --calibrate --calibrate-dtype bf16 --calibrate-threads 1 \
        --calibrate-out bench/results/tune_cpu_profile.json          # first, on this machine
    python bench/tune_validation.py [--rounds 3] [--resume] [--profile hw.json] [--out bench/results/tune_validation]
    python bench/tune_validation.py --from-json bench/results/tune_validation.json   # rewrite the report only

A ~26M-parameter Llama-shaped model (and a ~29M MoE variant for EP) trains with ``FlagScaleStrategy`` +
``FlagScalePrecision("bf16-mixed")`` (our Megatron layout: bf16 parameters and activations, fp32 masters and
gradient buckets) and AdamW, clipping at 1.0 as every recipe does (the optimizer phase ``tune --calibrate``
times), on 4 CPU processes (gloo), for each layout in ``LAYOUTS``. Layouts are interleaved:
every round runs each layout once, so load drifts on this shared machine hit all layouts alike.

Per layout and rank, step 1 (Adam states exist) is measured for memory: the model states held at the start of the
step (``parallel.memory.state_bytes``) plus the peak of bytes allocated above that level during the step
(forward, backward, gradient reduction and optimizer step), counted from the allocator's events by
``tune.measure.AllocationPeak`` (``torch.profiler`` with ``profile_memory=True``: every CPU allocation and free
of the training thread, whatever made it; a free on gloo's worker threads is not seen, but is recovered when its
address is allocated again, see ``net_delta`` for what stays counted). The largest rank is compared with
``tune.memory.memory_breakdown`` for the layout's heaviest
rank. Every round profiles one step for memory, and the least reading is kept: a reading can only exceed the bytes
the training thread's allocator holds (gloo's reduce-scatter copy is allocated on the training thread and, in about
one call of six, freed by gloo's worker thread, unseen until its address is reused; an all-gather or all-reduce shows
nothing on the training thread), so each round is an upper bound of the same quantity. Every round times ``TIMED_STEPS`` steps after the Adam states
exist (wall clock from batch start to batch end, slowest rank, and the part before ``on_before_optimizer_step``;
median over all timed steps of all rounds: single steps of 4 ranks on 2 cores swing by 2x).

Predicted time is ``tune.cost.estimate_step`` on the profile that ``tune --calibrate`` measured here (bf16 kernels
with one thread, as each rank runs them; gloo links; the host's cores), with its one end-to-end factor
(``compute_scale``) fitted leave-one-out: each layout's on the other layouts' measured steps
(``tune.cost.fit_compute_scale``, least squares in log step time), so every layout is a prediction. ``--resume`` keeps the
runs saved in the JSON and runs only the missing ones (each run is a fresh 4-process world, saved when it ends; a
sweep killed half-way loses nothing already measured).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORLD, SEQ, GLOBAL_BATCH, MEMORY_STEP, TIMED_STEPS = 4, 64, 4, 1, 3
DENSE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=6, num_attention_heads=8,
             num_key_value_heads=4, max_seq_len=SEQ)  # fmt: skip
MOE = dict(DENSE, num_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=704)
# name -> (model, strategy kwargs). Every layout uses 4 ranks.
LAYOUTS: dict[str, tuple[str, dict]] = {
    "ddp": ("dense", dict(zero_stage=0)),
    "zero1": ("dense", dict(zero_stage=1)),
    "zero2": ("dense", dict(zero_stage=2)),
    "zero3": ("dense", dict(zero_stage=3)),
    "zero1-selective": ("dense", dict(zero_stage=1, recompute="selective")),
    "zero1-selective_mm": ("dense", dict(zero_stage=1, recompute="selective_mm")),
    "tp2-dp2": ("dense", dict(tensor_parallel_size=2, zero_stage=1)),
    "tp2-sp-dp2": ("dense", dict(tensor_parallel_size=2, sequence_parallel=True, zero_stage=1)),
    "pp2-1f1b-dp2": ("dense", dict(pipeline_parallel_size=2, zero_stage=1)),
    "pp4-gpipe": ("dense", dict(pipeline_parallel_size=4, pipeline_schedule="gpipe", pipeline_layers=[2, 1, 1, 2])),
    "pp2-interleaved": (
        "dense",
        dict(
            pipeline_parallel_size=2,
            pipeline_schedule="interleaved_1f1b",
            virtual_pipeline_parallel_size=2,
            pipeline_layers=[2, 1, 1, 2],
        ),
    ),
    "pp2-zbv": ("dense", dict(pipeline_parallel_size=2, pipeline_schedule="zbv", pipeline_layers=[2, 1, 1, 2])),
    "cp2-dp2": ("dense", dict(context_parallel_size=2, zero_stage=1)),
    "moe-ep2-dp4": ("moe", dict(expert_parallel_size=2, zero_stage=1)),
}


class _Tokens(torch.utils.data.Dataset):
    """Random token rows (no packing: one document per row, so attention runs SDPA's causal kernel)."""

    def __init__(self, vocab: int, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def _run_layout(name: str, measure_memory: bool) -> dict:
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
    from lightning_flagscale.accounting.state_bytes import state_bytes
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.models import CausalLMModule
    from lightning_flagscale.tune.measure import AllocationPeak

    kind, kwargs = LAYOUTS[name]
    out: dict = {"times": [], "fwd_bwd": []}

    class Measure(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            dist.barrier()
            self.profiled = measure_memory and trainer.global_step == MEMORY_STEP
            if self.profiled:
                opts = [getattr(o, "optimizer", o) for o in trainer.optimizers]
                out["state_start"] = vars(state_bytes(pl_module, opts))
                self.peak = AllocationPeak().__enter__()
            self.t0 = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # forward + backward (+ bubble, exposed TP/CP/EP/PP communication, gradient reduction in flight)
            self.t_fb = time.perf_counter() - self.t0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            elapsed = time.perf_counter() - self.t0
            if self.profiled:
                self.peak.__exit__(None, None, None)
                out["peak_delta"] = self.peak.peak_bytes
                out["net_delta"] = self.peak.net_bytes  # > 0: frees made on another thread, address never reused
            elif trainer.global_step - 1 >= MEMORY_STEP:  # step 0 allocates the Adam states: never timed
                out["times"].append(elapsed)
                out["fwd_bwd"].append(self.t_fb)

    config = TransformerConfig(**(DENSE if kind == "dense" else MOE))
    module = CausalLMModule(config, learning_rate=1e-4, warmup_steps=0)
    strategy = FlagScaleStrategy(**kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, plugins=[FlagScalePrecision("bf16-mixed")],
        max_steps=MEMORY_STEP + TIMED_STEPS + (1 if measure_memory else 0), gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Measure()],
    )  # fmt: skip
    parallel = strategy.parallel
    dp = parallel.data_parallel_size or WORLD // parallel.model_parallel_size
    loader = torch.utils.data.DataLoader(_Tokens(config.vocab_size, 64), batch_size=GLOBAL_BATCH // dp)
    trainer.fit(module, loader)
    return out


def _link_bandwidth() -> float:
    import torch.distributed as dist

    x = torch.ones(4 << 20)  # 16 MiB fp32
    dist.all_reduce(x)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 * (WORLD - 1) / WORLD / best  # ring all-reduce bytes per rank / time


def _worker(rank: int, port: int, name: str, measure_memory: bool, queue) -> None:
    """One rank of a fresh 4-process world that runs one layout once (a process per run: ranks that ran earlier
    layouts slowed down round after round, ~1.5x by the third, as their heaps aged)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    got = _run_layout(name, measure_memory=measure_memory)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, got)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def _spawn(target, *args):
    """Run ``target(rank, port, *args, queue)`` on 4 fresh processes; rank 0's ``queue.put`` is returned. A rank that
    dies fails the run naming it, and a world still running after 15 minutes is killed (``tune.calibrate``'s rule)."""
    from lightning_flagscale.tune.calibrate import _run_world

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    return _run_world(target, (port, *args, queue), WORLD, queue)


def _bandwidth_worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    bandwidth = _link_bandwidth()
    if rank == 0:
        queue.put(bandwidth)
    dist.destroy_process_group()


def _measure_all(args: argparse.Namespace) -> dict:
    """Every layout, ``args.rounds`` interleaved rounds, each run in a fresh process world; saved after each run."""
    results: dict = {"bandwidth": _spawn(_bandwidth_worker), "runs": {}}
    if args.resume and Path(args.out + ".json").exists():
        results = json.loads(Path(args.out + ".json").read_text())
    for r in range(args.rounds):
        for name in args.layouts:
            if len(results["runs"].get(name, [])) > r:
                continue
            gathered = _spawn(_worker, name, True)
            results["runs"].setdefault(name, []).append(gathered)
            # saved after every run: a crash late in the sweep keeps what was measured
            Path(args.out + ".json").write_text(json.dumps(results, indent=1, default=float))
            print(f"round {r} {name}: {max(max(g['times']) for g in gathered):.2f}s", flush=True)
    return results


def _setup(name: str):
    """(model, resolved ParallelConfig, seq_len, global batch) of a layout."""
    from lightning_flagscale.config import ParallelConfig, TransformerConfig

    kind, kwargs = LAYOUTS[name]
    return (
        TransformerConfig(**(DENSE if kind == "dense" else MOE)),
        ParallelConfig(**kwargs).resolve(WORLD),
        SEQ,
        GLOBAL_BATCH,
    )


def _predict(name: str, hw) -> tuple[object, object]:
    """(memory breakdown, step cost) predicted for a layout."""
    from lightning_flagscale.tune.cost import estimate_step
    from lightning_flagscale.tune.memory_model import memory_breakdown

    model, c, seq, batch = _setup(name)
    m = batch // (c.dp * c.micro_batch_size)
    return memory_breakdown(model, c, seq, m, backend="gloo"), estimate_step(model, c, seq, batch, hw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--profile", help="profile JSON from `tune --calibrate --calibrate-dtype bf16` (default: "
                        "bench/results/tune_cpu_profile.json)")  # fmt: skip
    parser.add_argument("--out", default="bench/results/tune_validation")
    parser.add_argument("--resume", action="store_true", help="keep the runs saved in OUT.json, run the missing ones")
    parser.add_argument("--from-json", help="rewrite the report from a saved JSON of measurements (no runs)")
    parser.add_argument("--note", help="how loaded the machine was (replaces the default 'measured under load')")
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the workers write OUT.json after every layout
    args.setup = _setup
    from bench._tune_report import write_report

    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        args.rounds = max(len(v) for v in results["runs"].values())
        write_report(results, args, _predict, Path(args.out + ".md"))
        return
    results = _measure_all(args)
    write_report(results, args, _predict, Path(args.out + ".md"))


if __name__ == "__main__":
    main()
