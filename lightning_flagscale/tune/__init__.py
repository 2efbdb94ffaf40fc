"""Auto-tuning of parallel layouts: enumerate, prune by memory, rank by a cost model (SEEDS.md 4-5 "Auto Search").

    lightning-flagscale tune --preset llama3-8b --devices 64 --memory-gb 80 --seq-len 8192 --global-batch 512

The search space is every ``ParallelConfig`` (tp, pp, cp, dp, ZeRO stage, micro-batch size) that validates for the
model and the world size. Each candidate gets

- a memory estimate per rank: model states as this package holds them under ``bf16-mixed`` at the backward peak
  (``parallel.memory.expected_state_bytes``: bf16 params, full bf16 gradients until the reduction below ZeRO-3,
  fp32 main gradients, masters and Adam states, divided as each ZeRO stage divides them) for the parameters of the
  busiest pipeline stage (embedding and head counted on the end stages) plus activations (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models": ``s*b*h*(34 + 5*a*s/h)`` bytes per layer per
  micro-batch, with the TP/SP and CP divisions, times the micro-batches a 1F1B stage keeps alive, or without PP
  all micro-batches of the per-rank batch, which run as one);
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
from lightning_flagscale.tune.memory import estimate_memory
from lightning_flagscale.tune.search import Candidate, search

__all__ = ["Candidate", "Hardware", "estimate_memory", "estimate_step_seconds", "search", "tune_main"]
