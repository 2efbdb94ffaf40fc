"""Auto-tuning of parallel layouts (issue 16; SEEDS.md 4-5 "Auto Search").

    lightning-flagscale tune --preset llama3-8b --devices 64 --seq-len 8192 --global-batch 512 --profile h100

- ``hardware.py``: :class:`HardwareProfile` (peak, memory, GEMM efficiency by size, SDPA efficiency, alpha-beta link
  model per collective and group size, intra/inter node), JSON load/save, built-in ``h100``/``h200``/``a100``.
- ``calibrate.py``: ``tune --calibrate`` measures this machine (GEMMs, SDPA, memory bandwidth, gloo collectives).
- ``memory_model.py`` (+ ``activations.py``, ``inflight.py``): bytes per rank at the peak, per pipeline rank: model states
  as this package holds them per ZeRO stage and precision, activations derived from our own layers per recompute
  policy, times the (stage, micro-batch) pairs each schedule keeps alive; checked in ``bench/tune_validation.py``.
- ``cost.py``: step time from per-block GEMM/attention/memory-bound times, recompute, each schedule's bubble, and
  exposed TP/SP/CP/EP/PP/DP communication through the link model; ``calibrate_compute_scale`` fits the one
  end-to-end factor on a measured or published step, ``fit_compute_scale`` on several (least squares in log time).
- ``search.py``: the layout space (TP, PP, VPP, schedule, CP + mode, EP, ETP, DP, ZeRO, SP, micro-batch, recompute),
  divisibility and memory pruning, ranking.
- ``runner.py``: ``tune --run K`` trains the top K here with history pruning and writes the winner as a recipe.
- ``hetero.py``: heterogeneous plans (per-mesh layouts + layer split, or hetero-DP batch shares).
"""

from lightning_flagscale.tune.cli import tune_main
from lightning_flagscale.tune.cost import (
    MeasuredStep,
    StepCost,
    calibrate_compute_scale,
    estimate_step,
    estimate_step_seconds,
    fit_compute_scale,
)
from lightning_flagscale.tune.hardware import BUILTIN_PROFILES, Hardware, HardwareProfile, LinkPoint, load_profile
from lightning_flagscale.tune.memory_model import MemoryBreakdown, estimate_memory, memory_breakdown
from lightning_flagscale.tune.search import Candidate, SearchResult, SearchSpace, search

__all__ = [
    "BUILTIN_PROFILES",
    "Candidate",
    "Hardware",
    "HardwareProfile",
    "LinkPoint",
    "MeasuredStep",
    "MemoryBreakdown",
    "SearchResult",
    "SearchSpace",
    "StepCost",
    "calibrate_compute_scale",
    "estimate_memory",
    "estimate_step",
    "estimate_step_seconds",
    "fit_compute_scale",
    "load_profile",
    "memory_breakdown",
    "search",
    "tune_main",
]
