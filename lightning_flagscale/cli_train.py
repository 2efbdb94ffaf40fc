"""``lightning-flagscale fit|validate|test|predict``: LightningCLI with the built-in model and data as defaults.

``model:`` and ``data:`` take any ``LightningModule`` / ``LightningDataModule`` by ``class_path`` (LightningCLI's
subclass mode); without a ``class_path`` they are ``CausalLMModule`` / ``LMDataModule`` arguments, so recipes that
only list arguments keep working. A recipe logging to CSV also logs to TensorBoard when it is installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from argparse import ArgumentError
from collections.abc import Generator
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile
from lightning import __version__ as lightning_version
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_flagscale.callbacks import DropEmptyLogDir, KnownFlopsRichModelSummary
from lightning_flagscale.convert import config_from_hf
from lightning_flagscale.convert.hf_import import ARCHITECTURE_FIELDS
from lightning_flagscale.convert.hub import resolve_hf_dir
from lightning_flagscale.convert.safetensors_io import HFCheckpointReader
from lightning_flagscale.data import LMDataModule, resolve_data_files
from lightning_flagscale.data.tokenizers import TOKENIZER_FILES
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.recipe_files import recipe_path
from lightning_flagscale.strategies import FlagScaleStrategy
from lightning_flagscale.strategies._resilience import validate_before_launch

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_MODEL",
    "FlagScaleCLI",
    "UsageError",
    "check_hf_weights",
    "hf_model_config",
    "run_lightning_cli",
    "tensorboard_available",
    "tensorboard_beside_csv",
]

DEFAULT_MODEL = "lightning_flagscale.models.CausalLMModule"
DEFAULT_DATA = "lightning_flagscale.data.LMDataModule"
_SUBCOMMANDS = ("fit", "validate", "test", "predict")


_USER_ERRORS = (ArgumentError, ValueError, TypeError, OSError, MisconfigurationException)
"""Raised while parsing, instantiating or checking the run before launch, these are mistakes in the command line or
the recipe; raised later, while training, they are bugs and keep their traceback."""


def _user_message(err: BaseException) -> str:
    """The message of ``err`` on one line. jsonargparse reports a class that refused its arguments inside a long
    "Does not validate against any of the Union subtypes" text that quotes the original: that one is used."""
    inner = None if isinstance(err, ArgumentError) else err.__cause__ or err.__context__
    while isinstance(inner, _USER_ERRORS) and str(inner) and str(inner) in str(err):
        err, inner = inner, inner.__cause__ or inner.__context__
    message = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, ArgumentError):
        message += " (`--help` lists the options)"
    return message


class UsageError(ValueError):
    """A mistake in the command line or the recipe, found before any worker process started. ``lightning-flagscale``
    prints its message as one ``error:`` line (``FLAGSCALE_TRACEBACK=1`` shows the traceback)."""


class FlagScaleCLI(LightningCLI):
    """LightningCLI in subclass mode for ``model`` and ``data``, defaulting to the built-in classes.

    Every check that needs no worker runs before the launcher spawns any (the layout against the world size, the HF
    folder's config, weights and tokenizer files, the data files); what fails there is re-raised as a
    :class:`UsageError` carrying the original message.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._launching = False
        try:
            super().__init__(*args, **kwargs)
        except _USER_ERRORS as err:
            if self._launching or isinstance(err, UsageError):
                raise
            raise UsageError(_user_message(err)) from err

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # LightningCLI's own, with a `--config` help that says recipe names work (resolved in `_resolve_config_args`).
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning_version}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument(
            "-c", "--config", action=ActionConfigFile,
            help="A shipped recipe's name (`lightning-flagscale recipes` lists them) or a YAML/JSON file path.",
        )  # fmt: skip
        return parser

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.get("trainer")
        steps, every = (trainer.get("max_steps"), trainer.get("log_every_n_steps")) if trainer else (None, None)
        if isinstance(steps, int) and isinstance(every, int) and 0 < steps < every:
            trainer.log_every_n_steps = steps  # a run shorter than the interval still logs a row: CSV and loss plot
        hf_dir = hf_model_config(config)
        data = config.get("data")
        if data is not None and data.get("class_path") == DEFAULT_DATA and data.init_args.get("tokenizer") == "model":
            if hf_dir is None:
                raise ValueError("data.tokenizer='model' takes the tokenizer of model.hf_dir; set --model.hf_dir.")
            if not any((Path(hf_dir) / name).is_file() for name in TOKENIZER_FILES):
                raise ValueError(
                    f"data.tokenizer='model' takes the tokenizer of model.hf_dir, but {hf_dir} has no tokenizer files"
                    f" ({', '.join(TOKENIZER_FILES)}); pass --data.tokenizer byte (UTF-8 bytes as ids 0-255, for a"
                    " model with at least 256 ids) or --data.tokenizer DIR (the folder with the model's tokenizer)."
                )
            data.init_args.tokenizer = hf_dir

    def before_fit(self) -> None:
        """The strategy launcher's own checks (layout against world size, model, data), run here so that what fails
        is reported as a user error: after this hook the launcher spawns the workers."""
        strategy, datamodule = self.trainer.strategy, self.datamodule
        if isinstance(datamodule, LMDataModule) and datamodule.source != "synthetic":
            resolve_data_files(datamodule.source)  # a missing file or an unknown format, by name
        if isinstance(strategy, FlagScaleStrategy):
            world_size = strategy.num_nodes * strategy.num_processes
            # The check the launcher repeats (on a copy of the layout) once the trainer has connected the module.
            validate_before_launch(strategy.parallel, self.model, world_size, datamodule, strategy._check_layout)
        self._launching = True

    before_validate = before_test = before_predict = before_fit

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        # The Rich summary Lightning adds by default shows FLOPs of 0 for modules without `example_input_array`.
        trainer.callbacks = [DropEmptyLogDir()] + [
            KnownFlopsRichModelSummary(cb._max_depth, **cb._summarize_kwargs) if type(cb) is RichModelSummary else cb
            for cb in trainer.callbacks
        ]  # a run failing before it logs anything leaves no empty version_N folder
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
    check_hf_weights(local)
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


def check_hf_weights(hf_dir: str | Path) -> None:
    """Open the header of every safetensors file of ``hf_dir`` (a missing, truncated or corrupt shard raises
    ``CheckpointFormatError`` naming it, as ``convert hf-to-ckpt`` does), reading no tensor data."""
    with HFCheckpointReader(hf_dir) as reader:
        first_of_file = {file: name for name, file in reversed(reader.weight_map.items())}
        for name in first_of_file.values():
            reader.shape(name)


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
    with _command_line(_resolve_config_args(argv)):
        return FlagScaleCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            # Argument errors raise (and become one `error:` line) instead of printing the 500-line usage.
            parser_kwargs={"exit_on_error": False, **{c: {"exit_on_error": False} for c in _SUBCOMMANDS}},
        )
