"""Search: enumerate valid layouts, prune by memory, rank by predicted step time."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.tune.cost import estimate_step_seconds
from lightning_flagscale.tune.hardware import Hardware
from lightning_flagscale.tune.memory import estimate_memory

__all__ = ["Candidate", "search"]


@dataclass(frozen=True)
class Candidate:
    """One layout with its predictions."""

    config: ParallelConfig
    memory_bytes: float
    step_seconds: float
    tokens_per_second: float

    def describe(self) -> str:
        c = self.config
        return (
            f"tp={c.tensor_parallel_size} pp={c.pipeline_parallel_size} cp={c.context_parallel_size} dp={c.dp}"
            f" zero={c.zero_stage} sp={int(c.sequence_parallel)} mbs={c.micro_batch_size}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(
    model: TransformerConfig,
    devices: int,
    *,
    seq_len: int,
    global_batch: int,
    hardware: Hardware | None = None,
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4),
    top_k: int = 10,
) -> tuple[list[Candidate], int]:
    """The ``top_k`` fastest layouts that fit in memory, and how many valid layouts were considered."""
    hw = hardware or Hardware()
    found: list[Candidate] = []
    considered = 0
    for tp, pp, cp in itertools.product(_divisors(devices), repeat=3):
        if devices % (tp * pp * cp):
            continue
        dp = devices // (tp * pp * cp)
        for zero, sp, mbs in itertools.product((0, 1, 2, 3), (False, True), micro_batch_sizes):
            if (sp and tp == 1) or global_batch % (dp * mbs):
                continue
            try:
                c = ParallelConfig(
                    tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp, zero_stage=zero,
                    sequence_parallel=sp, micro_batch_size=mbs, data_parallel_size=dp,
                ).resolve(devices)  # fmt: skip
                c.validate_model(model)
            except ValueError:
                continue
            if seq_len % (2 * cp) or (sp and seq_len % tp):
                continue
            m = global_batch // (dp * mbs)
            if pp > 1 and m < pp:
                continue
            considered += 1
            memory = estimate_memory(model, c, seq_len, m)
            if memory > hw.memory_bytes:
                continue
            seconds = estimate_step_seconds(model, c, seq_len, global_batch, hw)
            found.append(Candidate(c, memory, seconds, global_batch * seq_len / seconds))
    found.sort(key=lambda cand: (cand.step_seconds, cand.memory_bytes))  # equal speed: the leaner layout first
    return found[:top_k], considered
