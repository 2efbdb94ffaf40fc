"""Lightning callbacks: progress reports, MoE telemetry, HF export."""

from lightning_flagscale.callbacks.report import LossReport

__all__ = ["LossReport"]
