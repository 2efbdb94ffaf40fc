"""LoRA against full fine-tuning on CPU: step time and the state bytes each holds (issue 40 item 6).

    python bench/lora.py [--rounds 5] [--steps 3] [--ranks 8 16 64] [--out bench/results/lora.md] [--smoke]

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


def _load() -> str:
    return "load average {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


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
    args = parser.parse_args()
    if args.smoke:
        args.size, args.rounds, args.steps, args.ranks = "smoke", 1, 1, [8]
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
