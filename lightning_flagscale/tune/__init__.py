"""Auto-tuning of parallel layouts: enumerate, prune by memory, rank by a cost model (SEEDS.md 4-5 "Auto Search").

    lightning-flagscale tune --preset llama3-8b --devices 64 --memory-gb 80 --seq-len 8192 --global-batch 512

The search space is every ``ParallelConfig`` (tp, pp, cp, dp, ZeRO stage, micro-batch size) that validates for the
model and the world size. Each candidate gets

- a memory estimate per rank (``tune.memory.memory_breakdown``, per pipeline rank, the heaviest one decides): model
  states as this package holds them (``parallel.memory.expected_state_bytes`` per ZeRO stage and precision, dense
  parameters sharded over data x context ranks, experts over expert-data ranks; TP/EP splits, vocab padding, uneven
  pipeline splits), the activations our own layers keep per recompute policy (``tune.activations``, derived op by op
  and checked against autograd's saved tensors; Korthikanti's formula kept for comparison) times the (stage,
  micro-batch) pairs the schedule keeps alive (``tune.inflight``, read off torch's schedules), plus the loss's fp32
  temporaries, FSDP2 gathers and the optimizer step; validated in ``bench/results/tune_validation.md``;
- a step-time estimate: compute ``6 * active params * tokens / (devices * flops)`` (MoE: routed top-k experts
  only) inflated by the pipeline bubble ``(p-1)/(m+p-1)``, plus data-parallel traffic
  (``parallel.memory.comm_theory_bytes``: bf16 parameters gathered, fp32 gradients reduced), tensor-parallel
  all-reduces (4 per layer per micro-batch of ``s*b*h`` activations) and ring-CP K/V traffic, each over its link.

Candidates over the memory budget are pruned; the rest are ranked by predicted tokens per second. The model is
deliberately simple and documented: it orders layouts, it does not promise absolute numbers. Measured profiles
(``bench/``) are the way to calibrate ``flops`` and the bandwidths.
"""

from lightning_flagscale.tune.cli import tune_main
from lightning_flagscale.tune.cost import estimate_step_seconds
from lightning_flagscale.tune.hardware import Hardware
from lightning_flagscale.tune.memory import MemoryBreakdown, estimate_memory, memory_breakdown
from lightning_flagscale.tune.search import Candidate, search

__all__ = [
    "Candidate",
    "Hardware",
    "MemoryBreakdown",
    "estimate_memory",
    "estimate_step_seconds",
    "memory_breakdown",
    "search",
    "tune_main",
]
