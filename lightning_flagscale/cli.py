"""``lightning-flagscale``: one command for training recipes, conversion, layout search and benchmarks.

    lightning-flagscale fit --config recipes/llama_tiny.yaml [--trainer.max_steps 50 ...]
    lightning-flagscale validate --config recipes/llama_tiny.yaml --ckpt_path ckpt/
    lightning-flagscale convert hf-to-ckpt HF_DIR_OR_REPO_ID OUT | ckpt-to-hf CKPT OUT
    lightning-flagscale tune --preset llama3-8b --devices 64   best layouts by a memory + cost model
    lightning-flagscale bench [--quick]    FlagScale layouts next to Lightning's strategies (repository checkout)
    lightning-flagscale recipes            the shipped recipes, one line each

``fit``/``validate``/``test``/``predict`` are LightningCLI's (``lightning_flagscale.cli_train``); their ``--help`` is a short
list of the options set first, ``--help-all`` LightningCLI's full one. Every subcommand parses its options
(``cli_parsers.py``) before it imports torch or Lightning, so ``--help`` and argument errors answer at once. A recipe is a plain
LightningCLI YAML file: ``trainer`` (with ``strategy: class_path: ...FlagScaleStrategy``), ``model`` and ``data``
(``CausalLMModule`` / ``LMDataModule`` arguments by default, or any class by ``class_path``). Recipes shipped with the
package can be named without a path: ``--config llama_tiny`` finds ``lightning_flagscale/recipes/llama_tiny.yaml``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lightning_flagscale import __version__
from lightning_flagscale.cli_parsers import FIT_HELP, HELP_ALL, add_convert_parsers, recipes_parser, tune_parser
from lightning_flagscale.recipe_files import list_recipes

__all__ = [
    "SUBCOMMANDS",
    "TRACEBACK_VARIABLE",
    "main",
]

TRACEBACK_VARIABLE = "FLAGSCALE_TRACEBACK"
"""Set to 1 to see the traceback behind a one-line ``error:`` of ``fit``/``validate``/``test``/``predict``."""

_TRAINING = ("fit", "validate", "test", "predict")
SUBCOMMANDS: dict[str, str] = {
    "fit": "train a recipe (LightningCLI): --config NAME_OR_YAML [--trainer.X ... --model.X ... --data.X ...]",
    "validate": "run the validation loop of a recipe, e.g. on a checkpoint (--ckpt_path)",
    "test": "run the test loop of a recipe",
    "predict": "run the predict loop of a recipe",
    "convert": "Hugging Face <-> sharded checkpoint conversion (hf-to-ckpt, ckpt-to-hf); accepts Hub repo ids",
    "tune": "search parallel layouts for a model and a cluster (memory model + cost model)",
    "bench": "benchmark FlagScale layouts next to Lightning's DDP/FSDP/ModelParallel strategies",
    "recipes": "list the shipped recipes (usable as --config NAME)",
}


def _recipes(argv: list[str]) -> None:
    recipes_parser().parse_args(argv)
    try:
        list_recipes()
        sys.stdout.flush()
    except BrokenPipeError:
        # `recipes | head -3`: the reader left; say nothing more (Python would print a traceback at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _overview_parser() -> argparse.ArgumentParser:
    """The top-level parser, used for ``--help`` and ``--version``; each subcommand parses its own arguments."""
    parser = argparse.ArgumentParser(
        prog="lightning-flagscale",
        description="FlagScale/Megatron-class hybrid parallelism for the Lightning Trainer.",
        epilog="Run `lightning-flagscale COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-flagscale {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, text in SUBCOMMANDS.items():
        sub.add_parser(name, help=text)
    return parser


def _show_tracebacks() -> bool:
    return os.environ.get(TRACEBACK_VARIABLE, "").lower() in ("1", "true", "yes", "on")


def _train(argv: list[str]) -> None:
    if HELP_ALL in argv:  # LightningCLI's full list
        argv = ["--help" if arg == HELP_ALL else arg for arg in argv]
    elif "-h" in argv or "--help" in argv:  # the options set first, without importing Lightning
        print(FIT_HELP.replace("lightning-flagscale fit", f"lightning-flagscale {argv[0]}"), end="")  # CLI output
        raise SystemExit(0)
    from lightning_flagscale.cli_train import UsageError, run_lightning_cli

    try:
        run_lightning_cli(argv)
    except UsageError as err:
        if _show_tracebacks():
            raise
        # One line naming what to change; no worker process was started.
        print(f"lightning-flagscale {argv[0]}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _convert(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-flagscale")
    add_convert_parsers(parser.add_subparsers(dest="command", required=True))
    parser.parse_args(["convert", *argv])  # --help and argument errors, before torch is imported
    from lightning_flagscale.convert.cli import convert_main

    convert_main(argv)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command in _TRAINING:
        _train(argv)
    elif command == "convert":
        _convert(argv[1:])
    elif command == "tune":
        tune_parser().parse_args(argv[1:])  # --help and argument errors, before the search and torch are imported
        from lightning_flagscale.tune.cli import tune_main

        tune_main(argv[1:])
    elif command == "bench":
        from lightning_flagscale.bench_cli import bench_main

        bench_main(argv[1:])
    elif command in ("recipes", "list-recipes"):
        _recipes(argv[1:])
    elif command is None:
        _overview_parser().print_help()
    else:
        # --help / --version, or an unknown command: argparse prints the overview or names the valid commands.
        _overview_parser().parse_args(argv)


if __name__ == "__main__":
    main()
