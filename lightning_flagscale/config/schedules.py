"""Pipeline schedules by name: the one list of names, the placement each needs and the rules a layout must meet.

Pure data and checks (no ``torch.distributed`` import), so ``ParallelConfig`` runs every check that needs only the
layout when it is created, before any process is spawned; ``parallel/pipeline_parallel/runner.py`` maps the names to torch's
schedule classes and re-checks the micro-batch count once the batch size is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "SCHEDULE_NAMES",
    "SCHEDULE_SPECS",
    "ScheduleName",
    "ScheduleSpec",
    "default_virtual_size",
    "min_microbatches",
    "stage_placement",
    "validate_schedule",
]

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"]
"""Schedule names accepted by ``ParallelConfig.pipeline_schedule`` and ``FlagScaleStrategy``."""

SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """What a schedule needs from the layout."""

    torch_class: str
    """Class name in ``torch.distributed.pipelining.schedules``."""
    placement: Literal["loop", "v"]
    """``loop``: rank i holds stages i, i+p, ...; ``v``: rank i holds stages i and 2p-1-i."""
    stages_per_rank: int | None
    """Required model chunks per rank (``virtual_pipeline_parallel_size``); ``None`` accepts any."""
    split_backward: bool
    """Runs input- and weight-gradients as two autograd passes (zero-bubble family)."""


SCHEDULE_SPECS: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(torch_class="ScheduleGPipe", placement="loop", stages_per_rank=1, split_backward=False),
    "1f1b": ScheduleSpec(torch_class="Schedule1F1B", placement="loop", stages_per_rank=1, split_backward=False),
    "interleaved_1f1b": ScheduleSpec(
        torch_class="ScheduleInterleaved1F1B", placement="loop", stages_per_rank=None, split_backward=False
    ),
    "zero_bubble": ScheduleSpec(
        torch_class="ScheduleInterleavedZeroBubble", placement="loop", stages_per_rank=None, split_backward=True
    ),
    "zbv": ScheduleSpec(torch_class="ScheduleZBVZeroBubble", placement="v", stages_per_rank=2, split_backward=True),
    "dualpipev": ScheduleSpec(torch_class="ScheduleDualPipeV", placement="v", stages_per_rank=2, split_backward=True),
}
# The Literal (for LightningCLI and type checkers) and the table must name the same schedules.
assert tuple(SCHEDULE_SPECS) == SCHEDULE_NAMES, (tuple(SCHEDULE_SPECS), SCHEDULE_NAMES)


def _spec(schedule: str) -> ScheduleSpec:
    if schedule not in SCHEDULE_SPECS:
        raise ValueError(f"pipeline_schedule={schedule!r} is unknown; use one of {sorted(SCHEDULE_NAMES)}.")
    return SCHEDULE_SPECS[schedule]


def default_virtual_size(schedule: str, pipeline_parallel_size: int) -> int:
    """``virtual_pipeline_parallel_size`` when left unset: 2 for V-shaped schedules under PP, else 1."""
    required = _spec(schedule).stages_per_rank
    return required if required is not None and pipeline_parallel_size > 1 else 1


def stage_placement(stage: int, num_ranks: int, schedule: str) -> tuple[int, int]:
    """(pipeline rank, model chunk on that rank) of global ``stage`` under ``schedule``'s placement over ``num_ranks``
    ranks (or heterogeneous stage groups): looped ``(s mod p, s // p)``; V-shaped ``(s, 0)`` down the ranks, then
    ``(2p - 1 - s, 1)`` back up, so the last stage sits on rank 0 next to the first."""
    p = num_ranks
    if _spec(schedule).placement == "v":
        if not 0 <= stage < 2 * p:
            raise ValueError(f"V-shaped placement over {p} ranks has stages 0..{2 * p - 1}, not {stage}.")
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def min_microbatches(schedule: str, pipeline_parallel_size: int, virtual_pipeline_parallel_size: int = 1) -> int:
    """Fewest micro-batches ``schedule`` accepts at this layout (fewer would leave stages without work or deadlock)."""
    _spec(schedule)
    if schedule == "gpipe":
        return 1
    if schedule == "dualpipev":
        return 2 * pipeline_parallel_size  # torch: at least as many micro-batches as stages
    return pipeline_parallel_size


def validate_schedule(
    schedule: str, pipeline_parallel_size: int, virtual_pipeline_parallel_size: int, n_microbatches: int | None = None
) -> None:
    """Raise ``ValueError`` naming the fix when ``schedule`` cannot run this layout.

    Without ``n_microbatches`` only the layout is checked (what ``ParallelConfig`` does on creation); with it, the
    micro-batch count too (known once the batch size is, in the pipeline runner).
    """
    p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
    spec = _spec(schedule)
    if spec.stages_per_rank == 1 and v != 1:
        raise ValueError(
            f"pipeline_schedule={schedule!r} runs one stage per rank but virtual_pipeline_parallel_size={v}; use"
            " 'interleaved_1f1b' or 'zero_bubble' for virtual stages, or set virtual_pipeline_parallel_size=1."
        )
    if spec.placement == "v" and v != 2:
        raise ValueError(
            f"pipeline_schedule={schedule!r} is V-shaped: every rank holds exactly 2 stages (i and 2p-1-i), so it "
            f"needs virtual_pipeline_parallel_size=2, got {v} ({p * v} stages for {p} ranks); set it to 2 or leave"
            " it unset (auto)."
        )
    if n_microbatches is None:
        return
    need = min_microbatches(schedule, p, v)
    if n_microbatches < need:
        raise ValueError(
            f"pipeline_schedule={schedule!r} with pipeline_parallel_size={p} needs at least {need} micro-batches, "
            f"got {n_microbatches}; raise the batch size or lower micro_batch_size "
            "(micro-batches = batch per data-parallel rank / micro_batch_size)."
        )
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, n_microbatches // p)
        if n_microbatches % rounds:
            raise ValueError(
                f"pipeline_schedule={schedule!r} needs the micro-batch count to be a multiple of the number of "
                f"rounds (micro-batches // pipeline size = {rounds}), got {n_microbatches}; use a multiple of {p}."
            )
