"""Notices Lightning and torch print on every run of this package that a user cannot act on, filtered narrowly.

Each filter names the message and the dependency module that raises it (``warnings.filterwarnings(message=...,
module=...)``), so a user's own warnings, and the same deprecation raised from their code or ours, still print. Installed
when the package is imported (``lightning_flagscale/__init__.py``); importing this module imports nothing but the
standard library. What our own code triggered is fixed where it is called instead (e.g. ``weights_only`` passed to
``Trainer.save_checkpoint``).
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["DEPENDENCY_WARNINGS", "LIGHTNING_ADVERTISEMENT", "filter_dependency_notices"]

DEPENDENCY_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # Lightning 2.6's CombinedLoader builds a `LeafSpec()` for every dataloader; torch >= 2.10 deprecates it (once per
    # rank and fit). Nothing in a training script can avoid it: Lightning's own `_pytree` helper must change.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # Lightning's model summary knows no bit width for "bf16-mixed"/"16-mixed" and falls back to 32 bits, which is
    # right: under mixed precision (FlagScalePrecision included) the parameters are stored in fp32.
    (
        r"Precision (bf16|16)-mixed is not supported by the model summary",
        UserWarning,
        r"lightning\.pytorch\.utilities\.model_summary",
    ),
    # LightningCLI (2.6) calls jsonargparse APIs deprecated in jsonargparse 4.49 (add_instantiator, skip_none, ...):
    # hidden by Python's default filters, shown under -W default, an error under -W error::DeprecationWarning.
    ("", DeprecationWarning, r"lightning\.pytorch\.cli"),
    # Renamed in torch 2.13 (all_gather_single / reduce_scatter_single), still called inside torch (FSDP2). torch's
    # logging wrapper is the module the warning names whoever calls, so our code must not call them: it uses the new
    # names (distributed/collectives.py), which tests/test_cli_warnings.py checks.
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning, r"torch\."),
)
"""(message regex, category, raising module regex) of each dependency warning filtered."""

LIGHTNING_ADVERTISEMENT = "litlogger"
"""Lightning (2.6) logs a tip to install its cloud logging service on every Trainer: not about the run."""

_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _DropAdvertisement(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return LIGHTNING_ADVERTISEMENT not in str(record.msg)


_DROP_ADVERTISEMENT = _DropAdvertisement()


def filter_dependency_notices() -> None:
    """Install the filters (again is harmless: ``warnings`` keeps one copy of a filter, a logger one of a filter)."""
    for message, category, module in DEPENDENCY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    logging.getLogger(_RANK_ZERO_LOGGER).addFilter(_DROP_ADVERTISEMENT)
