"""The CLI: every shipped recipe parses into a full LightningCLI config; recipes resolve by name."""

from __future__ import annotations

import pytest
import yaml

from lightning_flagscale.cli import main
from lightning_flagscale.recipe_files import RECIPES_DIR, recipe_path

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
    assert config["model"]["class_path"].endswith(("CausalLMModule", "VLMModule"))  # class_path, default or not
    presets = ("llama-tiny", "mixtral-tiny", "deepseek-v3-tiny", "qwen2.5-vl-tiny")
    model = config["model"]["init_args"]["config"]  # a preset name, or a preset with overrides
    assert (model["preset"] if isinstance(model, dict) else model) in presets
    if name == "deepseek_v3_tiny":  # trains with DeepSeek-V3's MTP module and its weight switch 0.3 -> 0.1 (issue 39)
        assert (model["num_nextn_predict_layers"], model["mtp_loss_weight"]) == (1, 0.3)
        # in tokens (DeepSeek's unit), at the tokens of 100 global batches: data batch x seq len x data ranks
        assert (model["mtp_loss_weight_schedule"], model["mtp_loss_weight_schedule_unit"]) == (
            [[204800, 0.1]],
            "tokens",
        )
        data, trainer = config["data"]["init_args"], config["trainer"]
        layout = strategy["init_args"]
        model_parallel = layout["tensor_parallel_size"] * layout["pipeline_parallel_size"]
        dp = trainer["devices"] // (model_parallel * layout["context_parallel_size"])
        assert 100 * data["batch_size"] * data["seq_len"] * dp == 204800 and trainer["max_steps"] == 150
    assert config["data"]["class_path"].endswith(("LMDataModule", "VLMDataModule"))


def test_command_line_overrides_any_field(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "recipes/llama_tiny.yaml", "--trainer.strategy.init_args.zero_stage", "3",
              "--model.learning_rate", "0.01", "--print_config"])  # fmt: skip
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"]["init_args"]["zero_stage"] == 3
    assert config["model"]["init_args"]["learning_rate"] == 0.01


def test_v_order_knobs_parse_from_the_command_line(capsys):
    # a list on the command line (or in YAML) fills the strategy's tuple field (issue 42)
    with pytest.raises(SystemExit):
        main(["fit", "--config", "pipeline", "--trainer.strategy.init_args.pipeline_schedule", "zbv",
              "--trainer.strategy.init_args.pipeline_chunk_costs", "[1, 2, 1]",
              "--trainer.strategy.init_args.pipeline_max_activations", "8", "--print_config"])  # fmt: skip
    init_args = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]
    assert (init_args["pipeline_chunk_costs"], init_args["pipeline_max_activations"]) == ([1.0, 2.0, 1.0], 8)
    with pytest.raises(SystemExit):  # or measured in training
        main(["fit", "--config", "pipeline", "--trainer.strategy.init_args.pipeline_schedule", "dualpipev",
              "--trainer.strategy.init_args.pipeline_chunk_costs", "auto", "--print_config"])  # fmt: skip
    init_args = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]
    assert init_args["pipeline_chunk_costs"] == "auto"


def test_unknown_recipe_names_the_shipped_ones():
    with pytest.raises(SystemExit, match="llama_tiny"):
        recipe_path("no_such_recipe")


def test_bench_runs_the_repository_script(capfd):
    """``lightning-flagscale bench`` runs ``bench/compare_strategies.py`` of this checkout (here: its ``--help``)."""
    from lightning_flagscale.bench_cli import find_bench_script

    assert find_bench_script() is not None and find_bench_script().name == "compare_strategies.py"
    main(["bench", "--help"])
    out = capfd.readouterr().out
    assert "lightning-flagscale bench" in out and "--quick" in out


def test_bench_outside_a_checkout_says_it_is_a_repository_tool(monkeypatch, tmp_path):
    import lightning_flagscale.bench_cli as bench_cli

    monkeypatch.setattr(bench_cli, "__file__", str(tmp_path / "site-packages" / "lightning_flagscale" / "bench_cli.py"))
    monkeypatch.chdir(tmp_path)
    assert bench_cli.find_bench_script() is None
    with pytest.raises(SystemExit, match=r"repository tool.*python bench/compare_strategies\.py"):
        main(["bench", "--quick"])


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


def test_fit_help_all_is_lightning_cli(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help-all"])
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
