"""``lightning-flagscale fit|validate|test|predict``: LightningCLI with the built-in model and data as defaults.

``model:`` and ``data:`` take any ``LightningModule`` / ``LightningDataModule`` by ``class_path`` (LightningCLI's
subclass mode); without a ``class_path`` they are ``CausalLMModule`` / ``LMDataModule`` arguments, so recipes that
only list arguments keep working.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Generator

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "FlagScaleCLI", "run_lightning_cli"]

DEFAULT_MODEL = "lightning_flagscale.models.CausalLMModule"
DEFAULT_DATA = "lightning_flagscale.data.LMDataModule"


class FlagScaleCLI(LightningCLI):
    """LightningCLI in subclass mode for ``model`` and ``data``, defaulting to the built-in classes."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})


def _resolve_config_args(argv: list[str]) -> list[str]:
    from lightning_flagscale.cli import recipe_path

    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = recipe_path(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + recipe_path(arg.split("=", 1)[1])
    return out


@contextlib.contextmanager
def _command_line(argv: list[str]) -> Generator[None, None, None]:
    """Run with ``sys.argv`` set to the resolved command line.

    LightningCLI warns when given ``args=`` while ``sys.argv`` holds arguments (it assumes a script that both
    parses its own command line and passes one), and Lightning's subprocess launcher re-runs ``sys.argv`` on the
    other ranks: both want the command line in ``sys.argv``, with recipe names already turned into paths.
    """
    saved = sys.argv
    sys.argv = [saved[0] if saved else "lightning-flagscale", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def run_lightning_cli(argv: list[str]) -> FlagScaleCLI:
    import lightning_flagscale  # noqa: F401  (registers the strategy)

    with _command_line(_resolve_config_args(argv)):
        return FlagScaleCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
        )
