"""``lightning-flagscale fit|validate|test|predict``: LightningCLI with the built-in model and data as defaults.

``model:`` and ``data:`` take any ``LightningModule`` / ``LightningDataModule`` by ``class_path`` (LightningCLI's
subclass mode); without a ``class_path`` they are ``CausalLMModule`` / ``LMDataModule`` arguments, so recipes that
only list arguments keep working. A recipe logging to CSV also logs to TensorBoard when it is installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import warnings
from collections.abc import Generator
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

import lightning_flagscale  # noqa: F401  (registers the strategy)
from lightning_flagscale.convert import config_from_hf
from lightning_flagscale.convert.hf_import import ARCHITECTURE_FIELDS
from lightning_flagscale.convert.hub import resolve_hf_dir
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.recipe_files import recipe_path

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_MODEL",
    "FlagScaleCLI",
    "hf_model_config",
    "run_lightning_cli",
    "tensorboard_available",
    "tensorboard_beside_csv",
]

DEFAULT_MODEL = "lightning_flagscale.models.CausalLMModule"
DEFAULT_DATA = "lightning_flagscale.data.LMDataModule"


class FlagScaleCLI(LightningCLI):
    """LightningCLI in subclass mode for ``model`` and ``data``, defaulting to the built-in classes."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        hf_dir = hf_model_config(config)
        data = config.get("data")
        if data is not None and data.get("class_path") == DEFAULT_DATA and data.init_args.get("tokenizer") == "model":
            if hf_dir is None:
                raise ValueError("data.tokenizer='model' takes the tokenizer of model.hf_dir; set --model.hf_dir.")
            data.init_args.tokenizer = hf_dir

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        extra = tensorboard_beside_csv(trainer.loggers)
        if extra is not None:
            trainer.loggers = [*trainer.loggers, extra]
        return trainer


def _is_causal_lm_module(class_path: str | None) -> bool:
    if not class_path:
        return False
    import importlib

    module_name, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name, None)
    return isinstance(cls, type) and issubclass(cls, CausalLMModule)


def hf_model_config(config: Any) -> str | None:
    """``--model.hf_dir DIR_OR_REPO_ID`` (or ``--model.config hf:DIR_OR_REPO_ID``): the model's config comes from
    that Hugging Face folder, replacing the recipe's preset. Returns the local folder (Hub ids are resolved), or
    ``None`` when the model is not a ``CausalLMModule`` started from HF weights.

    A dict ``config`` keeps its non-architectural fields (e.g. ``max_seq_len``) as overrides; an architectural field
    that disagrees with the checkpoint is an error naming it.
    """
    model = config.get("model")
    if model is None or not _is_causal_lm_module(model.get("class_path")):
        return None
    init = model.init_args
    spec, hf_dir = init.get("config"), init.get("hf_dir")
    if isinstance(spec, str) and spec.startswith("hf:"):
        if hf_dir and hf_dir != spec[3:]:
            raise ValueError(f"model.config={spec!r} and model.hf_dir={hf_dir!r} name different models; give one.")
        hf_dir, spec = spec[3:], None
    if not hf_dir:
        return None

    local = resolve_hf_dir(hf_dir)
    fields = {k: v for k, v in (spec or {}).items() if k != "preset"} if isinstance(spec, dict) else {}
    hf_config = config_from_hf(local, **{k: v for k, v in fields.items() if k not in ARCHITECTURE_FIELDS})
    conflicts = [f"{k}={v!r} (model.config) vs {getattr(hf_config, k)!r}" for k, v in fields.items()
                 if k in ARCHITECTURE_FIELDS and getattr(hf_config, k) != v]  # fmt: skip
    if conflicts:
        raise ValueError(f"model.config disagrees with {local / 'config.json'}: " + "; ".join(conflicts))
    if isinstance(spec, str):
        rank_zero_info(f"model.config={spec!r} replaced by the config of {hf_dir} (model.hf_dir).")
    init.config = dataclasses.asdict(hf_config)
    init.hf_dir = str(local)
    return str(local)


def tensorboard_available() -> bool:
    from lightning_utilities.core.imports import RequirementCache

    return bool(RequirementCache("tensorboard")) or bool(RequirementCache("tensorboardX"))


def tensorboard_beside_csv(loggers: list[Logger]) -> Logger | None:
    """A ``TensorBoardLogger`` writing into the CSV logger's folder, when TensorBoard is installed and the recipe's
    loggers have a CSV logger but no TensorBoard one (recipes cannot say "if installed"); else ``None``."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not tensorboard_available():
        return None
    if any(isinstance(lg, TensorBoardLogger) for lg in loggers):
        return None
    csv = next((lg for lg in loggers if isinstance(lg, CSVLogger)), None)
    if csv is None:
        return None
    return TensorBoardLogger(csv.save_dir, name=csv.name, version=csv.version, default_hp_metric=False)


def _resolve_config_args(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = recipe_path(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + recipe_path(arg.split("=", 1)[1])
    return out


# Deprecation notices raised inside dependencies on every run, which a user of the command cannot act on.
_THIRD_PARTY_NOISE = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning 2.6's pytree helper under torch >= 2.10
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",  # renamed in torch 2.13
)


class _DropAdvertisement(logging.Filter):
    """Lightning (2.6) logs a tip to install a cloud logging service on every Trainer; it is not about this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


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
    quiet = _DropAdvertisement()
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addFilter(quiet)
    try:
        with _command_line(_resolve_config_args(argv)), warnings.catch_warnings():
            for pattern in _THIRD_PARTY_NOISE:
                warnings.filterwarnings("ignore", message=pattern)
            return FlagScaleCLI(
                LightningModule,
                LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                save_config_kwargs={"overwrite": True},
            )
    finally:
        rank_zero_logger.removeFilter(quiet)
