"""Fine-tuning a Hugging Face checkpoint from the CLI (issue #17, item 5 second half).

``lightning-flagscale fit --config finetune_hf --model.hf_dir HF --data.source corpus.txt`` on 2 processes: the
config comes from ``HF/config.json`` (the recipe's preset does not conflict), the tokenizer from the same folder
(``data.tokenizer: model``), and ``HFExportCallback`` writes an HF folder at the end that ``transformers`` loads and
that has learned the corpus (lower loss than the starting checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "small",
    "cat",
    "sleeps",
    "on",
    "the",
    "warm",
    "mat",
]


def _corpus() -> list[str]:
    return [" ".join(WORDS[i % 5 :] + WORDS[: i % 5]) for i in range(200)]


def _build_hf_folder(root: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(_corpus(), trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(root)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root)
    return root


def _fine_tune(hf: str, corpus: str, logs: str):
    from tests._cli import run_cli

    cli = run_cli([
        "fit", "--config", "finetune_hf", "--model.hf_dir", hf, "--data.source", corpus, "--data.seq_len", "32",
        "--data.batch_size", "4", "--trainer.max_steps", "12", "--trainer.val_check_interval", "6",
        "--trainer.limit_val_batches", "1", "--model.learning_rate", "0.01", "--model.warmup_steps", "0",
        "--trainer.logger.init_args.save_dir", logs,
    ])  # fmt: skip
    export = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "HFExportCallback").last_export
    return str(export), cli.model.hf_dir, cli.model.config.intermediate_size


def _lm_loss(model, tok, lines: list[str]) -> float:
    ids = tok(" <eos> ".join(lines[:40]), return_tensors="pt").input_ids[:, :64]
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def test_finetune_recipe_trains_an_hf_checkpoint_and_exports_it(launcher, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = _build_hf_folder(tmp_path / "hf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_corpus()) + "\n")
    export, hf_dir, intermediate = launcher(2, _fine_tune, str(hf), str(corpus), str(tmp_path / "logs"))[0]
    assert hf_dir == str(hf) and intermediate == 64  # the HF config, not the recipe's llama-tiny preset (176)
    export = Path(export)
    assert export.parent.parent.name == "finetune_hf" and (export / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(export)
    before = _lm_loss(AutoModelForCausalLM.from_pretrained(hf), tok, _corpus())
    after = _lm_loss(AutoModelForCausalLM.from_pretrained(export), tok, _corpus())
    assert after < 0.8 * before, (before, after)


def test_hf_dir_takes_the_config_and_refuses_conflicts(tmp_path):
    from jsonargparse import Namespace

    from lightning_flagscale.cli_train import DEFAULT_MODEL, hf_model_config

    hf = _build_hf_folder(tmp_path / "hf")

    def cfg(**init):
        return Namespace(model=Namespace(class_path=DEFAULT_MODEL, init_args=Namespace(**init)))

    for config in (cfg(config="llama-tiny", hf_dir=str(hf)), cfg(config=f"hf:{hf}", hf_dir=None)):
        assert hf_model_config(config) == str(hf)
        assert config.model.init_args.config["intermediate_size"] == 64
        assert config.model.init_args.hf_dir == str(hf)
    kept = cfg(config={"max_seq_len": 48}, hf_dir=str(hf))
    hf_model_config(kept)
    assert kept.model.init_args.config["max_seq_len"] == 48
    with pytest.raises(ValueError, match=r"hidden_size=64 \(model.config\) vs 32"):
        hf_model_config(cfg(config={"hidden_size": 64}, hf_dir=str(hf)))
    with pytest.raises(ValueError, match="name different models"):
        hf_model_config(cfg(config="hf:org/other", hf_dir=str(hf)))
    assert hf_model_config(cfg(config="llama-tiny", hf_dir=None)) is None
