"""What a new user reads first: ``fit --help`` names the options set first, ``recipes`` lists what each recipe sets
(issue 41, items 1 and 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from lightning_flagscale.cli import main
from lightning_flagscale.recipe_files import RECIPES_DIR, describe_recipe


def test_fit_help_starts_with_the_options_set_first(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    head = "\n".join(out.splitlines()[:20])
    for option in ("--config RECIPE", "--data.source", "--data.tokenizer", "--model.hf_dir", "--model.config",
                   "--trainer.max_steps", "--model.help CausalLMModule", "--data.help LMDataModule"):  # fmt: skip
        assert option in head, option
    assert "--trainer.max_steps MAX_STEPS" in out  # LightningCLI's full list follows
    # `-c/--config` says that recipe names work.
    config_help = out[out.index("-c CONFIG, --config CONFIG") :].split("--print_config")[0]
    assert "recipe's name" in " ".join(config_help.split())


def test_validate_help_names_its_command(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert capsys.readouterr().out.startswith("lightning-flagscale validate --config RECIPE")


def test_recipe_lines_are_generated_from_what_the_recipe_sets():
    for path in RECIPES_DIR.glob("*.yaml"):
        recipe = yaml.safe_load(path.read_text())
        line = describe_recipe(path)
        trainer, strategy = recipe["trainer"], recipe["trainer"]["strategy"].get("init_args", {})
        assert line.startswith(f"{trainer['devices']} {trainer['accelerator']} processes"), (path.name, line)
        if "zero_stage" in strategy:
            stage = strategy["zero_stage"]
            assert ("DDP" if stage == 0 else f"ZeRO-{stage}") in line, (path.name, line)
        if "tensor_parallel_size" in strategy:
            assert f"TP={strategy['tensor_parallel_size']}" in line, (path.name, line)
        assert f"{trainer['max_steps']} steps" in line
    assert describe_recipe(RECIPES_DIR / "llama_tiny.yaml").startswith("4 cpu processes, DP=2, TP=2, ZeRO-1")
    assert "FSDP2" not in describe_recipe(RECIPES_DIR / "zero3.yaml")  # the engine is zero3_impl's choice


def test_recipes_help_is_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["recipes", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lightning-flagscale recipes") and "llama_tiny" not in out


@pytest.mark.own_processes
def test_recipes_into_a_closed_pipe_is_quiet():
    """``lightning-flagscale recipes | head -0``: the reader is gone before the list is written (the import takes
    seconds); no BrokenPipeError traceback, exit code 0."""
    code = "from lightning_flagscale.cli import main; main(['recipes'])"
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout is not None
    writer.stdout.close()
    _, err = writer.communicate(timeout=300)
    assert writer.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err
