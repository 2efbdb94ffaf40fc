"""What a new user reads first: ``--help`` of every subcommand answers without importing torch or Lightning and
describes every option, ``fit --help`` names the options set first, ``recipes`` lists what each recipe sets, ``tune
--preset`` lists the presets (issue 41, items 1 and 5)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_flagscale.cli import _overview_parser, main
from lightning_flagscale.cli_parsers import FIT_HELP, add_convert_parsers, recipes_parser, tune_parser
from lightning_flagscale.recipe_files import RECIPES_DIR, describe_recipe

HELP_COMMANDS = [
    [], ["fit"], ["validate"], ["test"], ["predict"], ["convert"], ["convert", "hf-to-ckpt"], ["convert", "ckpt-to-hf"],
    ["tune"], ["recipes"],
]  # fmt: skip


@pytest.mark.own_processes
def test_every_help_answers_without_torch_or_lightning():
    """``--help`` of each subcommand, in a fresh interpreter: each exits 0 with its usage, and afterwards neither
    torch nor Lightning (nor the models) has been imported: what makes `--help` take seconds."""
    code = (
        "import contextlib, io, json, sys\n"
        "from lightning_flagscale.cli import main\n"
        f"outs = []\nfor argv in {HELP_COMMANDS!r}:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n            main([*argv, '--help'])\n"
        "        except SystemExit as e:\n            assert e.code in (0, None), (argv, e.code)\n"
        "    outs.append(buf.getvalue())\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'transformers')\n"
        "               or m.startswith('lightning_flagscale.models'))\n"
        "print(json.dumps({'heavy': heavy, 'outs': outs}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["heavy"] == []
    for argv, out in zip(HELP_COMMANDS, result["outs"]):
        assert out.startswith(f"usage: lightning-flagscale {' '.join(argv)}".rstrip()), (argv, out[:200])


BENCH_OPTIONS = Path(__file__).resolve().parents[1] / "bench" / "compare_options.py"


def _bench_options():
    if "compare_options" not in sys.modules:  # bench/ is not a package: loaded by path (its dataclasses need the entry)
        spec = importlib.util.spec_from_file_location("compare_options", BENCH_OPTIONS)
        sys.modules["compare_options"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["compare_options"])
    return sys.modules["compare_options"]


@pytest.mark.own_processes
def test_bench_help_answers_from_a_file_that_imports_no_torch():
    """``bench --help`` runs ``bench/compare_options.py``, which imports the standard library only, and prints the
    benchmark's options with ``compare_strategies.py``'s description."""
    tree = ast.parse(BENCH_OPTIONS.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    command = [sys.executable, "-c", "from lightning_flagscale.cli import main; main(['bench', '--help'])"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: lightning-flagscale bench") and "--quick" in proc.stdout
    assert "FlagScaleStrategy side by side with Lightning's built-in strategies" in proc.stdout


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {"lightning-flagscale": _overview_parser(), "recipes": recipes_parser(), "tune": tune_parser()}
    parsers["bench"] = _bench_options().build_parser("the benchmark")
    root = argparse.ArgumentParser(prog="lightning-flagscale")
    for parser in add_convert_parsers(root.add_subparsers()):
        parsers[parser.prog] = parser
    return parsers


def test_every_option_of_every_subcommand_is_described():
    undescribed = [
        f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
        for name, parser in _parsers().items()
        for action in parser._actions
        if not (action.help or "").strip() and not isinstance(action, argparse._SubParsersAction)
    ]
    assert undescribed == []
    # every subcommand is described in the overview, and every convert command in `convert --help`
    overview = _overview_parser().format_help()
    for command in ("fit", "validate", "test", "predict", "convert", "tune", "bench", "recipes"):
        assert re.search(rf"^    {command} +\S", overview, re.M), command
    from lightning_flagscale.tune.hardware import BUILTIN_PROFILES

    profile = next(a.help for a in tune_parser()._actions if a.dest == "profile")
    assert all(name in profile for name in BUILTIN_PROFILES), profile
    convert = _parsers()["lightning-flagscale convert"].format_help()
    assert re.search(r"hf-to-ckpt\s+HF safetensors", convert) and re.search(r"ckpt-to-hf\s+sharded DCP", convert)


def test_an_option_without_help_is_found():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int)
    assert [a.option_strings for a in parser._actions if not a.help] == [["--seq-len"]]


def test_fit_help_starts_with_the_options_set_first(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == FIT_HELP
    for option in ("--config RECIPE", "--data.source", "--data.tokenizer", "--model.hf_dir", "--model.config",
                   "--trainer.max_steps", "--model.help CausalLMModule", "--data.help LMDataModule",
                   "fit --help-all"):  # fmt: skip
        assert option in out, option


def test_fit_help_all_is_lightning_clis_full_list(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help-all"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.max_steps MAX_STEPS" in out and "--ckpt_path CKPT_PATH" in out
    # `-c/--config` says that recipe names work.
    config_help = out[out.index("-c CONFIG, --config CONFIG") :].split("--print_config")[0]
    assert "recipe's name" in " ".join(config_help.split())


def test_the_options_of_the_short_fit_help_exist(capsys, tmp_path):
    """Every ``--section.option`` that ``fit --help`` names is one LightningCLI accepts: set together they parse, and
    the resolved configuration holds each value."""
    (tmp_path / "corpus.txt").write_text("hello\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", "zero1", "--data.source", str(tmp_path / "corpus.txt"), "--data.tokenizer", "byte",
              "--data.seq_len", "32", "--data.batch_size", "2", "--model.config", "qwen3-tiny", "--trainer.max_steps",
              "3", "--trainer.devices", "2", "--trainer.strategy.init_args.zero_stage", "2",
              "--trainer.strategy.init_args.tensor_parallel_size", "1",
              "--trainer.strategy.init_args.pipeline_parallel_size", "1", "--ckpt_path", "ck", "--print_config"])  # fmt: skip
    config = yaml.safe_load(capsys.readouterr().out)
    data, model, trainer = config["data"]["init_args"], config["model"]["init_args"], config["trainer"]
    assert (data["seq_len"], data["batch_size"], data["tokenizer"]) == (32, 2, "byte")
    assert model["config"] == "qwen3-tiny" and (trainer["max_steps"], str(trainer["devices"])) == (3, "2")
    assert trainer["strategy"]["init_args"]["zero_stage"] == 2 and config["ckpt_path"] == "ck"
    named = set(re.findall(r"--(?:data|model|trainer)\.[a-z_.]+[a-z_]", FIT_HELP))
    assert named == {"--data.source", "--data.tokenizer", "--data.seq_len", "--data.batch_size", "--model.config",
                     "--model.hf_dir", "--trainer.max_steps", "--trainer.devices", "--model.help", "--data.help",
                     "--trainer.strategy.init_args.zero_stage", "--trainer.strategy.help"}  # fmt: skip


@pytest.mark.parametrize("argv", [["--preset"], ["--preset", "help"], ["--list-presets"]])
def test_tune_lists_the_presets(argv, capsys):
    from lightning_flagscale.config import PRESETS
    from lightning_flagscale.tune import tune_main

    tune_main(argv)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == sorted(PRESETS)
    assert re.match(r"llama3-8b +8\.0B parameters, 32 layers x 4096; meta-llama/Meta-Llama-3-8B$",
                    next(line for line in lines if line.startswith("llama3-8b ")))  # fmt: skip


def test_an_unknown_tune_preset_names_the_valid_ones():
    from lightning_flagscale.config import PRESETS
    from lightning_flagscale.tune import tune_main

    with pytest.raises(SystemExit) as exit_info:
        tune_main(["--preset", "llama3-9b", "--devices", "8"])
    message = str(exit_info.value.code)
    assert "Unknown preset 'llama3-9b'" in message and "Did you mean 'llama3-8b'?" in message
    assert all(name in message for name in PRESETS)


def test_validate_help_names_its_command(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: lightning-flagscale validate --config RECIPE") and "validate --help-all" in out


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
    # A preset with overrides reads as the preset and its settings, not as a Python dict.
    deepseek = describe_recipe(RECIPES_DIR / "deepseek_v3_tiny.yaml")
    settings = (
        "num_nextn_predict_layers=1, mtp_loss_weight=0.3, mtp_loss_weight_schedule=[[204800, 0.1]],"
        " mtp_loss_weight_schedule_unit=tokens"
    )
    model = f"deepseek-v3-tiny ({settings})"
    assert model in deepseek and "{" not in deepseek


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
