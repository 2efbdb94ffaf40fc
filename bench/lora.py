"""LoRA against full fine-tuning on CPU: step time, the state bytes each holds and peak memory (issue 40 item 6).

    python bench/lora.py [--rounds 5] [--steps 3] [--ranks 8 16 64] [--out bench/results/lora.md] [--smoke]
                         [--dist-only]

One process, fp32, AdamW, a Llama-shaped decoder (``--size``); full fine-tuning and LoRA of each rank on the seven
projections of every block (``CausalLMModule(lora=...)``), each a training step = forward + backward + optimizer
step + zero_grad on the same batch. Rounds interleave the variants (the order reversed every other round), each
round timing ``--steps`` steps of each after one warm-up step; the table gives each variant's median step time over
the rounds, and the LoRA/full ratio's median and min-max over the rounds. State bytes: measured on the module and its
optimizer after the steps (``accounting.state_bytes.state_bytes``) beside the formula (``expected_state_bytes`` with
the frozen base as ``frozen_params``, as ``tune`` prices it). Peak memory: one more step under ``torch.profiler``
with ``profile_memory=True``; the running sum of its allocation events (frees negative), in time order, peaks at the
bytes allocated above the step's start (activations, gradients, Adam's temporaries); added to the state held at the
start (parameters and Adam states, no gradients) it gives the step's peak. The machine is shared: the load average
(``uptime``) is recorded before and after.

Then per rank under DDP and ZeRO-3 (FSDP2) on 2 gloo processes (``FlagScaleStrategy``, fp32, AdamW, the global batch
split over the ranks; a fresh world, every variant and layout one ``Trainer.fit`` after the other): step 0 allocates
Adam's states, steps 1 to 3 are measured. Per rank and step: the state held at the step's start
(``state_bytes``) plus the peak of the bytes allocated above it during the step (forward, backward, gradient
reduction, optimizer step) from ``tune.measure.AllocationPeak`` (the allocator's events on the training thread);
the least of the steps is kept (a free on one of gloo's threads is unseen until its address is reused, so a
reading can only be high). DDP's persistent fp32 gradient buckets, held across steps but pointed to by no ``.grad``
at the step's start, are added to that start. Beside it: the state bytes at the optimizer step (measured, and
``expected_state_bytes``' formula, the frozen base as parameters only) and the tuner's predicted peak
(``tune.memory_model.memory_breakdown(..., backend="gloo", lora=...)``) and its error against the larger rank's
peak, in bytes. ``--dist-only`` runs this table alone and replaces its section of ``--out``, the one-process table kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from lightning_flagscale.accounting.state_bytes import expected_state_bytes, state_bytes
from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.models.lora import is_adapter_name

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIZES = {
    "default": dict(hidden_size=512, intermediate_size=1376, num_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=2048, batch=4, seq=256),
    "smoke": dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, batch=1, seq=16),
}  # fmt: skip


class Variant:
    """One module (full fine-tuning or LoRA of one rank), its optimizer and batch, stepped on demand."""

    def __init__(self, name: str, config: TransformerConfig, lora: LoRAConfig | None, batch: dict) -> None:
        self.name, self.batch = name, batch
        torch.manual_seed(0)
        self.module = CausalLMModule(config, lora=lora, optimizer="adamw", learning_rate=1e-4, warmup_steps=0)
        self.module.configure_model()
        self.optimizer = self.module.configure_optimizers()["optimizer"]
        self.step()  # warm-up: Adam states allocated, kernels chosen

    def step(self) -> None:
        self.module._loss(self.batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def time_steps(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - start) / steps

    def bytes(self) -> tuple[float, float]:
        """(measured state bytes, the formula's) at an optimizer step (gradients held, Adam states allocated)."""
        self.module._loss(self.batch).backward()
        self.optimizer.step()
        measured = state_bytes(self.module.model, [self.optimizer]).total
        self.optimizer.zero_grad()
        named = list(self.module.model.named_parameters())
        trained = sum(p.numel() for n, p in named if p.requires_grad)
        frozen = sum(p.numel() for n, p in named if not p.requires_grad)
        assert self.name == "full" or all(is_adapter_name(n) for n, p in named if p.requires_grad)
        return measured, expected_state_bytes(trained, 1, 0, "32-true", frozen_params=frozen).total

    def peak_bytes(self) -> tuple[float, float]:
        """(state bytes at the step's start, peak allocated bytes above it over one step) on the CPU allocator, from
        torch.profiler's memory events."""
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        start = state_bytes(self.module.model, [self.optimizer]).total  # gradients are None here (zero_grad)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step()
        allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.typed[0] == _EventType.Allocation:
                allocations.append((event.start_time_ns, event.typed[1].alloc_size))
        running = peak = 0
        for _, delta in sorted(allocations):
            running += delta
            peak = max(peak, running)
        return start, peak


# The 2-process layouts of the peak-memory table (ZeRO-3 on FSDP2: the engine whose state bytes the formula prices
# exactly; flat ZeRO-3 adds its row padding, see docs/lora.md)
WORLD = 2
DIST_LAYOUTS = {"DDP": dict(zero_stage=0), "ZeRO-3": dict(zero_stage=3, zero3_impl="fsdp2")}
MEASURED_STEPS = (1, 2, 3)  # a reading can only be high: the least of three


class _Tokens(torch.utils.data.Dataset):
    """Random token rows of ``seq + 1`` tokens (inputs and next-token labels)."""

    def __init__(self, vocab: int, n: int, seq: int) -> None:
        self.tokens = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def _persistent_grad_bytes(trainer, pl_module) -> int:
    """Bytes of the gradient buckets DDP and ZeRO-1 keep allocated across steps (``grad_buckets.py``: one persistent
    fp32 buffer per bucket) that no ``.grad`` points into at the step's start: held, but neither in ``state_bytes``
    then nor allocated during the step."""
    if not getattr(trainer.strategy, "_dist_optimizers", None):
        return 0  # FSDP2 (ZeRO-3): gradients are allocated in the step
    seen = {p.grad.untyped_storage().data_ptr() for p in pl_module.parameters() if p.grad is not None}
    dopts = trainer.strategy._dist_optimizers.values()
    buffers = {b.buffer.untyped_storage().data_ptr(): b.buffer.untyped_storage().nbytes()
               for d in dopts for b in d.buckets if b.persistent and b.buffer is not None}  # fmt: skip
    return sum(n for ptr, n in buffers.items() if ptr not in seen)


def _dist_variant(layout: dict, config: TransformerConfig, lora: LoRAConfig | None, rank_batch: int, seq: int) -> dict:
    """One ``Trainer.fit`` on this rank: state bytes at the optimizer step and the peak of each measured step."""
    import lightning as L

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
    from lightning_flagscale.tune.measure import AllocationPeak

    out: dict = {"peaks": []}

    class Measure(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.peak = None
            if trainer.global_step in MEASURED_STEPS:
                opts = [getattr(o, "optimizer", o) for o in trainer.optimizers]
                self.start = state_bytes(pl_module, opts).total + _persistent_grad_bytes(trainer, pl_module)
                self.peak = AllocationPeak().__enter__()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == MEASURED_STEPS[0]:
                out["state"] = state_bytes(pl_module, [getattr(optimizer, "optimizer", optimizer)]).total

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.peak is not None:
                self.peak.__exit__(None, None, None)
                out["peaks"].append(self.start + self.peak.peak_bytes)

    torch.manual_seed(0)
    module = CausalLMModule(config, lora=lora, optimizer="adamw", learning_rate=1e-4, warmup_steps=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=FlagScaleStrategy(**layout), plugins=[FlagScalePrecision("32-true")],
        max_steps=max(MEASURED_STEPS) + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Measure()],
    )  # fmt: skip
    data = _Tokens(config.vocab_size, WORLD * rank_batch * (max(MEASURED_STEPS) + 1), seq)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=rank_batch))
    named = {id(p): (n, p) for n, p in module.model.named_parameters()}.values()
    numel = {n: (p.shape.numel() if hasattr(p, "full_tensor") else p.numel(), p.requires_grad) for n, p in named}
    out["trained"] = sum(v for v, trains in numel.values() if trains)
    out["frozen"] = sum(v for v, trains in numel.values() if not trains)
    return out


def _dist_rank(rank: int, port: int, config: TransformerConfig, loras: dict, rank_batch: int, seq: int, queue) -> None:
    """One rank of the 2-process world: every layout x variant, gathered to rank 0, which puts them on ``queue``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {(layout, name): _dist_variant(kwargs, config, lora, rank_batch, seq)
               for layout, kwargs in DIST_LAYOUTS.items() for name, lora in loras.items()}  # fmt: skip
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def run_distributed(config: TransformerConfig, loras: dict, batch_size: int, seq: int) -> list[str]:
    """The peak-memory table per rank under DDP and ZeRO-3 on 2 processes (module docstring)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _procs import collect, context, free_port, stop

    from lightning_flagscale.config import ParallelConfig
    from lightning_flagscale.tune.memory_model import memory_breakdown

    rank_batch = max(1, batch_size // WORLD)
    ctx, queue, port = context(), None, free_port()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_dist_rank, args=(r, port, config, loras, rank_batch, seq, queue)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        (gathered,) = collect(procs, queue, 1, name="lora peak memory")
    finally:
        stop(procs)
    lines = [
        "",
        f"## Peak memory per rank: DDP and ZeRO-3 (FSDP2), {WORLD} processes",
        "",
        f"Batch {rank_batch} x {seq} tokens per rank (global {WORLD * rank_batch}), fp32, AdamW; each rank's peak: the "
        f"state at the step's start plus the most bytes allocated above it during the step, the least of steps "
        f"{MEASURED_STEPS[0]} to {MEASURED_STEPS[-1]}; the tuner's prediction is `memory_breakdown(..., "
        "backend='gloo', lora=...)` for the same layout.",
        "",
        "| layout | variant | trained params | state bytes at the step, rank 0 (measured) | formula | peak rank 0 | "
        "peak rank 1 | peak vs full | tune's predicted peak | tune minus the larger peak (bytes) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout, kwargs in DIST_LAYOUTS.items():
        c = ParallelConfig(**kwargs, micro_batch_size=rank_batch).resolve(WORLD)
        full_peak = None
        for name, lora in loras.items():
            per_rank = [g[layout, name] for g in gathered]
            peaks = [min(r["peaks"]) for r in per_rank]
            full_peak = full_peak or max(peaks)
            trained, frozen = per_rank[0]["trained"], per_rank[0]["frozen"]
            formula = expected_state_bytes(trained, WORLD, kwargs["zero_stage"], "32-true",
                                           frozen_params=frozen if lora is not None else 0).total  # fmt: skip
            predicted = memory_breakdown(config, c, seq, 1, precision="32-true", backend="gloo", lora=lora).peak
            lines.append(
                f"| {layout} | {name} | {trained:,} | {per_rank[0]['state']:,.0f} | {formula:,.0f} | {peaks[0]:,.0f} | "
                f"{peaks[1]:,.0f} | {max(peaks) / full_peak:.2f}x | {predicted:,.0f} | "
                f"{predicted - max(peaks):+,.0f} ({100 * (predicted / max(peaks) - 1):+.3f}%) |"
            )
    lines += [
        "",
        "State bytes at the step: parameters + gradients + master copies + Adam states on rank 0 (+ Adam's 4-byte step "
        "counter per trained tensor, which the formula leaves out); ZeRO-3 shards all of them, LoRA's frozen base as "
        "parameters only. Peak vs full: the larger rank's peak over full fine-tuning's in the same layout. A reading "
        "can only be high: a block allocated before the step's profiler started (step 1: step 0's gradients) is "
        "never seen freed, nor one freed on gloo's thread until its address comes back, so a rank's reading can "
        "exceed the other's by the gradients' bytes.",
    ]
    return lines


def _load() -> str:
    return "load average {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def _loras(ranks: list[int]) -> dict:
    return {"full": None} | {f"LoRA r={r}": LoRAConfig(rank=r, alpha=2.0 * r, target_modules=TARGETS) for r in ranks}


def run_dist_only(args: argparse.Namespace) -> str:
    """The per-rank table alone, in place of its section of ``args.out`` (the one-process table above it kept)."""
    size = dict(SIZES[args.size])
    batch_size, seq = size.pop("batch"), size.pop("seq")
    config = TransformerConfig.from_preset("llama-tiny", **size, max_seq_len=seq)
    kept = (
        args.out.read_text().split("\n## Peak memory per rank")[0].rstrip("\n").split("\n") if args.out.exists() else []
    )
    return "\n".join(kept + run_distributed(config, _loras(args.ranks), batch_size, seq)) + "\n"


def run(args: argparse.Namespace) -> str:
    size = dict(SIZES[args.size])
    batch_size, seq = size.pop("batch"), size.pop("seq")
    config = TransformerConfig.from_preset("llama-tiny", **size, max_seq_len=seq)
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    load_before = _load()
    variants = [Variant("full", config, None, batch)] + [
        Variant(f"LoRA r={r}", config, LoRAConfig(rank=r, alpha=2.0 * r, target_modules=TARGETS), batch)
        for r in args.ranks
    ]
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_ in range(args.rounds):
        for v in variants if round_ % 2 == 0 else reversed(variants):
            times[v.name].append(v.time_steps(args.steps))
    load_after = _load()
    full = times["full"]
    lines = [
        "# LoRA vs full fine-tuning on CPU (issue 40 item 6)",
        "",
        f"`python bench/lora.py --size {args.size} --rounds {args.rounds} --steps {args.steps} --threads "
        f"{args.threads}`: one process, fp32, AdamW; {config.num_layers} layers, hidden {config.hidden_size}, "
        f"intermediate {config.intermediate_size}, vocab {config.vocab_size}; batch {batch_size} x {seq} tokens; "
        f"LoRA on the seven projections of every block. Before: {load_before}; after: {load_after} "
        f"({os.cpu_count()} CPUs, shared).",
        "",
        "| variant | trainable params | median step (ms) | vs full: median (min-max) | state bytes measured | "
        "formula | step peak above start (profiler) | gradients (formula, 4 B/trained param) | peak (start + step) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        ratios = [t / f for t, f in zip(times[v.name], full, strict=True)]
        trainable = sum(p.numel() for p in v.module.model.parameters() if p.requires_grad)
        measured, formula = v.bytes()
        start, peak = v.peak_bytes()
        lines.append(
            f"| {v.name} | {trainable:,} | {1e3 * statistics.median(times[v.name]):.1f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {measured:,.0f} | "
            f"{formula:,.0f} | {peak:,.0f} | {4 * trainable:,} | {start + peak:,.0f} |"
        )
    lines += [
        "",
        "State bytes: parameters + gradients + Adam states (+ Adam's 4-byte step counter per trained tensor, which "
        "the formula leaves out); LoRA keeps the base as parameters only. Step peak: the most bytes allocated above "
        "the step's start during one step (forward, backward, AdamW step, zero_grad), the running sum of "
        "torch.profiler's allocation events in time order: activations, gradients and the optimizer's temporaries "
        "as far as they are live at once (the gradient column is the formula's, not a split of the peak: backward "
        "frees activations as gradients appear). Peak: that plus the state held at the start (parameters and Adam "
        "states, no gradients); the same batch for every variant.",
    ]
    lines += run_distributed(config, _loras(args.ranks), batch_size, seq)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora.md"))
    parser.add_argument("--smoke", action="store_true", help="the smallest size, one round of one step")
    parser.add_argument("--dist-only", action="store_true", help="the per-rank peak table alone, in place in --out")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.rounds, args.steps, args.ranks = "smoke", 1, 1, [8]
    report = run_dist_only(args) if args.dist_only else run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
