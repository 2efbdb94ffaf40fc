"""Lightning callbacks: progress bar and reports, loss plot, slow-rank detection, MoE telemetry, HF export, in-memory
checkpoints, garbage collection between steps, and no empty log folder after a failed run."""

from lightning_flagscale.callbacks.empty_logs import DropEmptyLogDir
from lightning_flagscale.callbacks.hf_export import HFExportCallback
from lightning_flagscale.callbacks.loss_plot import LossCurvePlot
from lightning_flagscale.callbacks.manual_gc import ManualGC
from lightning_flagscale.callbacks.memory_checkpoint import MemoryCheckpoint
from lightning_flagscale.callbacks.moe import MoETelemetry
from lightning_flagscale.callbacks.progress import StepProgressBar
from lightning_flagscale.callbacks.report import LossReport
from lightning_flagscale.callbacks.slow_rank import SlowRankDetector
from lightning_flagscale.callbacks.summary import KnownFlopsRichModelSummary

__all__ = [
    "DropEmptyLogDir",
    "HFExportCallback",
    "KnownFlopsRichModelSummary",
    "LossCurvePlot",
    "LossReport",
    "ManualGC",
    "MemoryCheckpoint",
    "MoETelemetry",
    "SlowRankDetector",
    "StepProgressBar",
]
