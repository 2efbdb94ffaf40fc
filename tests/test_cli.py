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
    model = config["model"].get("init_args", config["model"])  # class_path recipes (the VLM) nest their arguments
    assert model["config"] in ("llama-tiny", "mixtral-tiny", "qwen2.5-vl-tiny")


def test_command_line_overrides_any_field(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "recipes/llama_tiny.yaml", "--trainer.strategy.init_args.zero_stage", "3",
              "--model.learning_rate", "0.01", "--print_config"])  # fmt: skip
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"]["init_args"]["zero_stage"] == 3
    assert config["model"]["learning_rate"] == 0.01


def test_unknown_recipe_names_the_shipped_ones():
    with pytest.raises(SystemExit, match="llama_tiny"):
        recipe_path("no_such_recipe")
