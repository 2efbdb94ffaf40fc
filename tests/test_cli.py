"""The CLI: every shipped recipe parses into a full LightningCLI config; recipes resolve by name."""

from __future__ import annotations

import pytest
import yaml

from lightning_flagscale.cli import RECIPES_DIR, main, recipe_path

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_there_is_a_recipe_per_strategy_feature():
    for name in ("llama_tiny", "ddp", "zero1", "zero2", "zero3", "tp_sp", "pipeline", "context", "moe_tiny"):
        assert name in RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", name, "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"].endswith("FlagScaleStrategy")
    assert config["model"]["class_path"] == "lightning_flagscale.models.CausalLMModule"  # the default class
    assert config["model"]["init_args"]["config"] in ("llama-tiny", "mixtral-tiny")
    assert config["data"]["class_path"] == "lightning_flagscale.data.LMDataModule"


def test_command_line_overrides_any_field(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "recipes/llama_tiny.yaml", "--trainer.strategy.init_args.zero_stage", "3",
              "--model.learning_rate", "0.01", "--print_config"])  # fmt: skip
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"]["init_args"]["zero_stage"] == 3
    assert config["model"]["init_args"]["learning_rate"] == 0.01


def test_unknown_recipe_names_the_shipped_ones():
    with pytest.raises(SystemExit, match="llama_tiny"):
        recipe_path("no_such_recipe")


def test_help_lists_every_subcommand_with_a_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "convert", "tune", "bench", "recipes"):
        assert any(line.split()[:1] == [name] and len(line.split()) > 1 for line in out.splitlines()), name
    main([])  # no command: the same overview, no traceback
    assert "convert" in capsys.readouterr().out


def test_version(capsys):
    from lightning_flagscale import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-flagscale {__version__}"


def test_unknown_command_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "choose from 'fit', 'validate'" in capsys.readouterr().err


def test_fit_help_is_lightning_cli(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--trainer.max_steps" in out and "--model CONFIG" in out and "--data CONFIG" in out


def test_fit_parses_without_warnings(capsys, monkeypatch):
    import warnings

    monkeypatch.setattr("sys.argv", ["lightning-flagscale", "fit", "--config", "zero1", "--print_config"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # LightningCLI's "args parameter is intended to run from within Python" included
        with pytest.raises(SystemExit):
            main()
    assert "FlagScaleStrategy" in capsys.readouterr().out
