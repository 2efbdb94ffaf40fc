"""Lightning callbacks: progress reports, slow-rank detection, MoE telemetry, HF export."""

from lightning_flagscale.callbacks.hf_export import HFExportCallback
from lightning_flagscale.callbacks.moe import MoETelemetry
from lightning_flagscale.callbacks.report import LossReport
from lightning_flagscale.callbacks.slow_rank import SlowRankDetector

__all__ = ["HFExportCallback", "LossReport", "MoETelemetry", "SlowRankDetector"]
