"""Lightning callbacks: progress reports, MoE telemetry, HF export."""

from lightning_flagscale.callbacks.hf_export import HFExportCallback
from lightning_flagscale.callbacks.moe import MoETelemetry
from lightning_flagscale.callbacks.report import LossReport

__all__ = ["HFExportCallback", "LossReport", "MoETelemetry"]
