"""Slow-rank detection: per-rank timing of every phase of a training step, compared across ranks.

At scale a single slow device (thermal throttling, a bad link, a noisy neighbour) drags the whole job, and the
first question is which rank and which phase (SEEDS.md section 4: "slow-node detection ... naming the slow rank
and phase"). Every ``every_n_steps`` optimizer steps all ranks exchange their mean phase times (one small
all-gather); a rank whose phase time exceeds ``threshold`` times the median over ranks is reported by rank 0
(warning + logged metrics).

Phases, from Lightning's hooks and ``FlagScaleStrategy.optimizer_step``'s order:

- ``data``: end of the previous batch to the start of this one (loading, host-to-device);
- ``forward``: batch start to ``on_before_backward`` (under pipeline parallelism the whole schedule runs here);
- ``backward``: ``on_before_backward`` to ``on_after_backward``;
- ``grad_sync``: ``on_after_backward`` to ``on_before_optimizer_step`` (data-parallel reduction, tied grads);
- ``optimizer``: ``on_before_optimizer_step`` to the batch end (clipping, step, ZeRO all-gather).

``level=0`` compares whole steps only; ``level=1`` compares every phase.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

__all__ = ["PHASES", "SlowRank", "SlowRankDetector", "find_slow_ranks"]

PHASES = ("data", "forward", "backward", "grad_sync", "optimizer")


@dataclass(frozen=True)
class SlowRank:
    """One finding: ``rank`` spent ``seconds`` in ``phase`` where the median rank spent ``median``."""

    rank: int
    phase: str
    seconds: float
    median: float

    def __str__(self) -> str:
        return (
            f"rank {self.rank} is slow in {self.phase}: {self.seconds * 1e3:.1f} ms per step vs a median of"
            f" {self.median * 1e3:.1f} ms ({self.seconds / max(self.median, 1e-12):.1f}x)"
        )


def find_slow_ranks(
    times: Sequence[dict[str, float]], *, threshold: float = 1.5, min_seconds: float = 1e-3
) -> list[SlowRank]:
    """Ranks whose time in a phase exceeds ``threshold`` x the median over ranks (and ``min_seconds``)."""
    found = []
    phases = sorted(set().union(*(t.keys() for t in times))) if times else []
    for phase in phases:
        values = [t.get(phase, 0.0) for t in times]
        median = statistics.median(values)
        for rank, value in enumerate(values):
            if value > threshold * median and value - median > min_seconds:
                found.append(SlowRank(rank, phase, value, median))
    return sorted(found, key=lambda s: s.seconds / max(s.median, 1e-12), reverse=True)


class SlowRankDetector(L.Callback):
    """Time each phase of every step on every rank and report ranks that are slower than their peers.

    Args:
        every_n_steps: optimizer steps between comparisons (the means cover those steps).
        threshold: a rank is slow in a phase when its time exceeds this multiple of the median rank's.
        min_seconds: ignore differences smaller than this (noise on tiny phases).
        level: 0 compares whole steps, 1 every phase.
        clock: time source (seconds); tests inject a deterministic one.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        threshold: float = 1.5,
        min_seconds: float = 1e-3,
        level: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if level not in (0, 1):
            raise ValueError(f"level={level}: use 0 (whole steps) or 1 (every phase).")
        self.every_n_steps = every_n_steps
        self.threshold = threshold
        self.min_seconds = min_seconds
        self.level = level
        self.clock = clock
        self.findings: list[SlowRank] = []
        self._sums: dict[str, float] = defaultdict(float)
        self._steps = 0
        self._marks: dict[str, float] = {}
        self._last_end: float | None = None

    def _mark(self, name: str) -> None:
        self._marks[name] = self.clock()

    def _add(self, phase: str, start: str, end: str) -> None:
        if start in self._marks and end in self._marks:
            self._sums[phase] += self._marks[end] - self._marks[start]

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._marks = {"start": self.clock()}
        if self._last_end is not None:
            self._sums["data"] += self._marks["start"] - self._last_end

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        self._mark("before_backward")

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("after_backward")

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._mark("before_optimizer")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch, idx) -> None:
        self._mark("end")
        self._last_end = self._marks["end"]
        self._add("forward", "start", "before_backward")
        self._add("backward", "before_backward", "after_backward")
        self._add("grad_sync", "after_backward", "before_optimizer")
        self._add("optimizer", "before_optimizer", "end")
        self._sums["step"] += self._marks["end"] - self._marks["start"]
        self._steps += 1
        if self._steps >= self.every_n_steps:
            self._compare(trainer, pl_module)

    def _compare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mine = {k: v / self._steps for k, v in self._sums.items()}
        if self.level == 0:
            mine = {"step": mine.get("step", 0.0)}
        else:
            mine.pop("step", None)
        self._sums.clear()
        self._steps = 0
        if dist.is_available() and dist.is_initialized():
            every: list[dict[str, float]] = [{}] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        self.findings = find_slow_ranks(every, threshold=self.threshold, min_seconds=self.min_seconds)
        if trainer.is_global_zero:
            for finding in self.findings:
                rank_zero_warn(f"Slow rank at step {trainer.global_step}: {finding}")
        worst = max((f.seconds / max(f.median, 1e-12) for f in self.findings), default=1.0)
        pl_module.log("slow_rank/worst_over_median", worst, rank_zero_only=True)
