"""User errors of ``lightning-flagscale fit`` are one ``error:`` line, found before any worker starts (issue 41, item 2).

Each case runs the real entry point (``lightning_flagscale.cli.main``) with the strategy launcher replaced by one that
fails the test: the message must come from the checks that run before the launcher spawns anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_flagscale.cli import TRACEBACK_VARIABLE, main
from lightning_flagscale.cli_train import UsageError
from lightning_flagscale.strategies._resilience import FlagScaleLauncher

transformers = pytest.importorskip("transformers")


@pytest.fixture
def no_launch(monkeypatch):
    """The launcher starts the workers: reaching it means the error was not caught before spawn."""

    def launch(*args, **kwargs):
        raise AssertionError("the launcher was reached: a worker would have started")

    monkeypatch.setattr(FlagScaleLauncher, "launch", launch)
    monkeypatch.delenv(TRACEBACK_VARIABLE, raising=False)


def _hf_folder(root: Path, *, vocab_size: int = 300) -> Path:
    """A ``save_pretrained`` model folder, without tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root)
    return root


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("lightning-flagscale fit: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf = _hf_folder(root / "no_tokenizer")
    truncated = root / "truncated"
    truncated.mkdir()
    for file in hf.iterdir():
        (truncated / file.name).write_bytes(file.read_bytes())
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    corpus = root / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    return {"hf": hf, "truncated": truncated, "corpus": corpus}


def test_layout_that_does_not_divide_the_world_size(no_launch, capsys):
    line = _error_line(capsys, ["--config", "zero1", "--trainer.strategy.init_args.tensor_parallel_size", "3"])
    assert "World size 2 is not divisible by pipeline x context x tensor = 1 x 1 x 3 = 3" in line


def test_zbv_order_knobs_are_checked_before_launch(no_launch, capsys):
    knob = "--trainer.strategy.init_args.pipeline_chunk_costs"
    zbv = ["--config", "pipeline", "--trainer.strategy.init_args.pipeline_schedule", "zbv"]
    line = _error_line(capsys, [*zbv, knob, "[1, 0, 1]"])
    assert "pipeline_chunk_costs=(1.0, 0.0, 1.0): give three positive finite numbers" in line
    line = _error_line(capsys, ["--config", "pipeline", knob, "[1, 2, 1]"])  # the recipe's interleaved_1f1b
    assert "only pipeline_schedule='zbv' or 'dualpipev' generates its action order from them, got" in line


def test_malformed_mtp_loss_weight_schedule(no_launch, capsys):
    schedule = "[[100, 0.1], [50, 0]]"
    config = f'{{"preset": "deepseek-v3-tiny", "num_nextn_predict_layers": 1, "mtp_loss_weight_schedule": {schedule}}}'
    line = _error_line(capsys, ["--config", "deepseek_v3_tiny", "--model.config", config])
    assert "mtp_loss_weight_schedule steps must increase: 50 (in [50, 0]) follows 100" in line


def test_missing_hf_folder(no_launch, capsys):
    line = _error_line(capsys, ["--config", "zero1", "--model.hf_dir", "./no_such_model"])
    assert "'./no_such_model' is neither a local folder nor a Hugging Face Hub repo id" in line


def test_missing_path_that_looks_like_a_hub_id_is_one_message(no_launch, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    line = _error_line(capsys, ["--config", "zero1", "--model.hf_dir", "models/tiny_llama"])
    assert "'models/tiny_llama'" in line and "not in the Hugging Face cache" in line
    assert "no local folder has that path" in line


def test_hub_without_network_is_one_message_without_the_network_errors(no_launch, capsys, monkeypatch):
    """Online, an unreachable Hub raises a chain of connection errors inside ``snapshot_download``."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*args, **kwargs):
        try:
            raise ConnectionError("Failed to resolve 'huggingface.co'")
        except ConnectionError as err:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub.") from err

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    line = _error_line(capsys, ["--config", "zero1", "--model.hf_dir", "models/tiny_llama"])
    assert "the Hub could not be reached" in line and "Failed to resolve" not in line


def test_hf_folder_without_tokenizer_files_suggests_the_byte_tokenizer(no_launch, capsys, folders):
    argv = ["--config", "finetune_hf", "--model.hf_dir", str(folders["hf"]), "--data.source", str(folders["corpus"])]
    line = _error_line(capsys, argv)
    assert f"{folders['hf']} has no tokenizer files" in line and "--data.tokenizer byte" in line


def test_tokenizer_folder_without_tokenizer_files(no_launch, capsys, folders):
    line = _error_line(capsys, ["--config", "zero1", "--data.tokenizer", str(folders["hf"])])
    assert f"'{folders['hf']}' has no tokenizer files" in line and "--data.tokenizer byte" in line
    assert "Union subtypes" not in line  # jsonargparse's wrapper around the data module's own message


def test_truncated_safetensors(no_launch, capsys, folders):
    argv = ["--config", "finetune_hf", "--model.hf_dir", str(folders["truncated"]), "--data.source",
            str(folders["corpus"]), "--data.tokenizer", "byte"]  # fmt: skip
    line = _error_line(capsys, argv)
    assert f"{folders['truncated'] / 'model.safetensors'}: cannot read safetensors file (truncated or corrupt?)" in line


def test_missing_data_file(no_launch, capsys):
    line = _error_line(capsys, ["--config", "zero1", "--data.source", "no_such_corpus.txt"])
    assert "No data files found for source 'no_such_corpus.txt'" in line


def test_lightning_argument_errors(no_launch, capsys):
    line = _error_line(capsys, ["--config", "zero1", "--trainer.max_steps", "-5"])
    assert "`max_steps` must be a non-negative integer or -1" in line and "You passed in -5" in line
    line = _error_line(capsys, ["--config", "zero1", "--trainer.max_stepz", "5"])
    assert "unrecognized arguments: --trainer.max_stepz 5" in line
    line = _error_line(capsys, ["--config", "zero1", "--trainer.max_steps", "abc"])
    assert 'Parser key "trainer.max_steps"' in line and "abc" in line


def test_traceback_on_request(no_launch, monkeypatch):
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    with pytest.raises(UsageError, match="World size 2 is not divisible") as info:
        main(["fit", "--config", "zero1", "--trainer.strategy.init_args.tensor_parallel_size", "3"])
    assert isinstance(info.value.__cause__, ValueError)  # the original error, with its traceback


def test_errors_after_launch_keep_their_traceback(monkeypatch):
    """A failure once the launcher runs is not the user's mistake: no ``error:`` line, the exception itself."""

    def launch(*args, **kwargs):
        raise ValueError("a bug inside the run")

    monkeypatch.setattr(FlagScaleLauncher, "launch", launch)
    with pytest.raises(ValueError, match="a bug inside the run") as info:
        main(["fit", "--config", "zero1", "--trainer.max_steps", "1"])
    assert not isinstance(info.value, UsageError)


@pytest.mark.own_processes
def test_console_command_prints_one_line_and_starts_no_process(tmp_path):
    """The installed command, as a user runs it: exit code 2, the last stderr line is the error, no traceback,
    and no log folder is left behind."""
    env = {k: v for k, v in os.environ.items() if k != TRACEBACK_VARIABLE}
    command = [sys.executable, "-m", "lightning_flagscale.cli", "fit", "--config", "zero1",
               "--trainer.strategy.init_args.tensor_parallel_size", "3"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("lightning-flagscale fit: error: World size 2")
    assert not (tmp_path / "lightning_logs").exists()
