"""Search: enumerate valid layouts, prune by divisibility and memory, rank by predicted throughput (issue 16 item 4).

The space: TP, PP, VPP and schedule, CP and its mode (ring, Ulysses, hybrid), EP, ETP (1 and the TP size by
default), DualPipeV's expert all-to-all overlap (``overlap_moe_expert_parallel_comm``, where it runs), DP (derived),
ZeRO stage, sequence parallelism, micro-batch size and recompute policy. Every candidate is a
``ParallelConfig`` that validated against the world size, the model (heads, experts, layers per stage) and the
schedule's micro-batch rule (``config/schedules.py``); candidates over the device memory are pruned
(``tune.memory.estimate_memory``); the rest are ranked by the cost model (``tune.cost``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.schedules import SCHEDULE_NAMES, min_microbatches, validate_schedule
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.parallel.pipeline_parallel.recompute import RECOMPUTE_MODES
from lightning_flagscale.tune.cost import StepCost, estimate_step
from lightning_flagscale.tune.hardware import HardwareProfile
from lightning_flagscale.tune.memory_model import estimate_memory

__all__ = ["Candidate", "SearchResult", "SearchSpace", "describe_layout", "enumerate_layouts", "search"]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Values tried for each knob (DP is derived from the world size)."""

    schedules: tuple[str, ...] = SCHEDULE_NAMES
    virtual_sizes: tuple[int, ...] = (2, 4)
    """Chunks per rank tried for the interleaved schedules (V schedules always use 2)."""
    context_parallel_modes: tuple[str, ...] = ("ring", "ulysses", "hybrid")
    expert_tensor_parallel_sizes: tuple[int, ...] | None = None
    """ETP sizes tried for MoE models; ``None``: 1 and the layout's TP size (Megatron-Core's default ETP)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (True, False)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    """``selective_mm`` is skipped for MoE models (``ParallelConfig.validate_model`` refuses it there)."""
    max_tensor_parallel: int | None = None
    """Upper bound on TP (e.g. the devices of one node); ``None`` allows any divisor."""
    max_context_parallel: int | None = None
    """Upper bound on CP (short sequences gain nothing from it); ``None`` allows any divisor."""
    moe_comm_overlap: tuple[bool, ...] = (False, True)
    """``overlap_moe_expert_parallel_comm`` values tried where it runs (DualPipeV with EP, no TP, ETP, CP or
    ZeRO-3): DualPipeV's paired forward and backward hide each other's expert all-to-alls."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.schedules) - set(SCHEDULE_NAMES))
        if unknown:
            raise ValueError(f"Unknown pipeline schedule(s) {unknown}; the search knows {list(SCHEDULE_NAMES)}.")
        modes = sorted(set(self.context_parallel_modes) - {"ring", "ulysses", "hybrid"})
        if modes:
            raise ValueError(f"Unknown context-parallel mode(s) {modes}; use 'ring', 'ulysses' or 'hybrid'.")
        if self.expert_tensor_parallel_sizes is not None and any(v < 1 for v in self.expert_tensor_parallel_sizes):
            raise ValueError(f"expert_tensor_parallel_sizes={self.expert_tensor_parallel_sizes} must be >= 1.")
        if any(v < 2 for v in self.virtual_sizes) or any(m < 1 for m in self.micro_batch_sizes):
            raise ValueError("virtual_sizes must be >= 2 (chunks per rank) and micro_batch_sizes >= 1.")


def describe_layout(c: ParallelConfig) -> str:
    """Short human form of a layout, e.g. ``tp2 pp4/v2 interleaved_1f1b cp2 ring dp4 zero1 sp mbs1 rc=none``."""
    parts = [f"tp{c.tensor_parallel_size}"]
    if c.pp_enabled:
        vpp = f"/v{c.virtual_pipeline_parallel_size}" if c.virtual_pipeline_parallel_size > 1 else ""
        parts.append(f"pp{c.pipeline_parallel_size}{vpp} {c.pipeline_schedule}")
    if c.cp_enabled:
        parts.append(f"cp{c.context_parallel_size} {c.context_parallel_mode}")
    if c.expert_parallel_size > 1:
        parts.append(f"ep{c.expert_parallel_size}")
    if c.expert_tensor_parallel_size > 1:
        parts.append(f"etp{c.expert_tensor_parallel_size}")
    if c.overlap_moe_expert_parallel_comm:
        parts.append("a2a-overlap")
    parts += [f"dp{c.dp}", f"zero{c.zero_stage}"]
    if c.sequence_parallel:
        parts.append("sp")
    parts += [f"mbs{c.micro_batch_size}", f"rc={c.recompute}"]
    return " ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """One layout with its predictions."""

    config: ParallelConfig
    memory_bytes: float
    cost: StepCost

    @property
    def step_seconds(self) -> float:
        return self.cost.step_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.cost.tokens_per_second

    def describe(self) -> str:
        return describe_layout(self.config)


@dataclass
class SearchResult:
    """Ranked candidates and why the others were dropped."""

    candidates: list[Candidate]
    considered: int
    """Layouts that validated (before memory pruning)."""
    pruned: Counter = field(default_factory=Counter)
    """Reason -> count: ``memory``, ``invalid: <first words of the ValueError>``, ``batch``, ..."""
    smallest_memory: float | None = None
    """Lowest predicted memory among valid layouts (to say by how much nothing fits)."""

    def __iter__(self):  # ``best, considered = search(...)``, the pre-profile form
        return iter((self.candidates, self.considered))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, layers: int, space: SearchSpace) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    for name in space.schedules:
        if name in ("gpipe", "1f1b"):
            yield name, 1
        elif name in ("zbv", "dualpipev"):
            yield name, 2
        else:
            for v in space.virtual_sizes:
                if layers >= pp * v:
                    yield name, v


def _cp_modes(cp: int, space: SearchSpace) -> Iterator[tuple[str, int | None]]:
    if cp == 1:
        yield "ring", None
        return
    for mode in space.context_parallel_modes:
        if mode == "hybrid":
            if cp >= 4:
                yield mode, 2
        else:
            yield mode, None


def _structures(model: TransformerConfig, devices: int, space: SearchSpace) -> Iterator[dict]:
    """Degrees and schedule (everything but ZeRO, SP, micro-batch and recompute)."""
    experts = [1] + ([e for e in _divisors(model.num_experts) if e > 1] if model.is_moe else [])
    for tp, pp, cp in itertools.product(_divisors(devices), repeat=3):
        if devices % (tp * pp * cp) or (space.max_tensor_parallel and tp > space.max_tensor_parallel):
            continue
        if space.max_context_parallel and cp > space.max_context_parallel:
            continue
        etps = space.expert_tensor_parallel_sizes or ((1, tp) if model.is_moe and tp > 1 else (1,))
        for (schedule, vpp), (mode, ulysses), ep, etp in itertools.product(
            _schedules(pp, model.num_layers, space), _cp_modes(cp, space), experts, etps
        ):
            yield dict(
                tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp, pipeline_schedule=schedule,
                virtual_pipeline_parallel_size=vpp, context_parallel_mode=mode, ulysses_size=ulysses,
                expert_parallel_size=ep, expert_tensor_parallel_size=etp,
            )  # fmt: skip


def _batch_fits(c: ParallelConfig, seq_len: int, global_batch: int) -> str | None:
    """Why the batch/sequence cannot run this layout, or None."""
    if global_batch % (c.dp * c.micro_batch_size):
        return "batch: global batch not divisible by dp x micro_batch_size"
    m = global_batch // (c.dp * c.micro_batch_size)
    if m % c.gradient_accumulation_steps:
        return "batch: micro-batches not divisible by gradient_accumulation_steps"
    if c.cp_enabled and seq_len % (2 * c.context_parallel_size):
        return "sequence: seq_len not divisible by 2 x context_parallel_size"
    if c.sequence_parallel and (seq_len // c.context_parallel_size) % c.tensor_parallel_size:
        return "sequence: local sequence not divisible by tensor_parallel_size (SP)"
    if c.pp_enabled:
        p, v = c.pipeline_parallel_size, c.virtual_pipeline_parallel_size
        if m < min_microbatches(c.pipeline_schedule, p, v):
            return "pipeline: too few micro-batches for the schedule"
        try:
            validate_schedule(c.pipeline_schedule, p, v, m // c.gradient_accumulation_steps)
        except ValueError:
            return "pipeline: micro-batch count does not fit the schedule's rounds"
    return None


def enumerate_layouts(
    model: TransformerConfig, devices: int, *, seq_len: int, global_batch: int, space: SearchSpace | None = None
) -> tuple[list[ParallelConfig], Counter]:
    """Every layout of the space that ``ParallelConfig`` accepts and the batch can run; and why others were not."""
    space = space or SearchSpace()
    refused: Counter = Counter()
    out: list[ParallelConfig] = []
    for structure in _structures(model, devices, space):
        tp = structure["tensor_parallel_size"]
        for zero, sp, mbs, rc in itertools.product(
            space.zero_stages, space.sequence_parallel, space.micro_batch_sizes, space.recompute
        ):
            if (sp and tp == 1) or (rc == "selective_mm" and model.is_moe):
                continue
            for overlap in _overlap_options(structure, zero, space):
                try:
                    c = ParallelConfig(
                        **structure, zero_stage=zero, sequence_parallel=sp, micro_batch_size=mbs, recompute=rc,
                        overlap_moe_expert_parallel_comm=overlap,
                    )  # fmt: skip
                    c.resolve(devices)
                    c.validate_model(model)
                except ValueError as err:
                    refused["invalid: " + " ".join(str(err).split()[:4])] += 1
                    continue
                reason = _batch_fits(c, seq_len, global_batch)
                if reason:
                    refused[reason] += 1
                    continue
                out.append(c)
    return out, refused


def _overlap_options(structure: dict, zero: int, space: SearchSpace) -> tuple[bool, ...]:
    """The ``overlap_moe_expert_parallel_comm`` values to try: ``space.moe_comm_overlap`` where the overlap runs
    (``ParallelConfig`` refuses it elsewhere), else off."""
    runs = (
        structure["pipeline_schedule"] == "dualpipev" and structure["pipeline_parallel_size"] > 1
        and structure["expert_parallel_size"] > 1 and structure["tensor_parallel_size"] == 1
        and structure["expert_tensor_parallel_size"] == 1 and structure["context_parallel_size"] == 1 and zero != 3
    )  # fmt: skip
    return space.moe_comm_overlap if runs else (False,)


def search(
    model: TransformerConfig,
    devices: int,
    *,
    seq_len: int,
    global_batch: int,
    hardware: HardwareProfile | None = None,
    space: SearchSpace | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    top_k: int | None = 10,
    grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> SearchResult:
    """The ``top_k`` fastest layouts that fit in memory (``None``: all), with the pruning counts.
    ``grad_bucket_numel``: the strategy's gradient bucket size (one collective per bucket; ZeRO-2's staging)."""
    if devices < 1 or seq_len < 1 or global_batch < 1:
        raise ValueError(
            f"devices={devices}, seq_len={seq_len}, global_batch={global_batch}: each must be at least 1 (devices to"
            " plan for, tokens a sequence, sequences a step)."
        )
    hw = hardware or HardwareProfile()
    space = space or SearchSpace()
    if micro_batch_sizes is not None:
        space = SearchSpace(**{**space.__dict__, "micro_batch_sizes": tuple(micro_batch_sizes)})
    layouts, pruned = enumerate_layouts(model, devices, seq_len=seq_len, global_batch=global_batch, space=space)
    found: list[Candidate] = []
    smallest: float | None = None
    cache: dict = {}
    for c in layouts:
        m = global_batch // (c.dp * c.micro_batch_size)
        memory = estimate_memory(model, c, seq_len, m, bucket_numel=grad_bucket_numel)
        smallest = memory if smallest is None else min(smallest, memory)
        if memory > hw.memory_bytes:
            pruned["memory"] += 1
            continue
        unpriced = hw.unpriced_ring(model.attn_backend) if c.ring_size > 1 else None
        if unpriced:  # a kernel the profile cannot price (ring CP through the torch block kernel on a GPU)
            pruned["kernel: " + " ".join(unpriced.split()[:6])] += 1
            continue
        cost = estimate_step(model, c, seq_len, global_batch, hw, cache=cache, grad_bucket_numel=grad_bucket_numel)
        found.append(Candidate(c, memory, cost))
    found.sort(key=lambda cand: (cand.step_seconds, cand.memory_bytes))  # equal speed: the leaner layout first
    return SearchResult(found if top_k is None else found[:top_k], len(layouts), pruned, smallest)
