"""Precision plugins."""

from lightning_flagscale.precision.flagscale import DynamicLossScaler, FlagScalePrecision, as_flagscale_precision

__all__ = ["DynamicLossScaler", "FlagScalePrecision", "as_flagscale_precision"]
