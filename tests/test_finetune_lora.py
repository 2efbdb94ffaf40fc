"""LoRA fine-tuning from the CLI (issue 40 item 5): ``lightning-flagscale fit --config finetune_lora --model.hf_dir
DIR`` on 2 processes (a tiny random HF Llama; fewer steps and shorter samples than the recipe's for CPU time) writes
a peft adapter and a merged HF folder; peft on the base model and transformers on the merged folder give the same
logits, and the adapters moved away from their no-op init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_finetune_hf import _build_hf_folder

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _fine_tune(hf: str, logs: str):
    from tests._cli import run_cli

    cli = run_cli([
        "fit", "--config", "finetune_lora", "--model.hf_dir", hf, "--trainer.max_steps", "6",
        "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1", "--data.seq_len", "32",
        "--data.num_train_samples", "64", "--trainer.logger.init_args.save_dir", logs,
    ])  # fmt: skip
    exports = {type(cb).__name__: cb.last_export for cb in cli.trainer.callbacks if hasattr(cb, "last_export")}
    return str(exports["PeftExportCallback"]), str(exports["HFExportCallback"]), cli.model.lora.rank


def test_finetune_lora_recipe_writes_a_peft_adapter_and_a_merged_model(launcher, tmp_path):
    hf = _build_hf_folder(tmp_path / "hf")
    adapter, merged, rank = launcher(2, _fine_tune, str(hf), str(tmp_path / "logs"))[0]
    assert rank == 8 and Path(adapter, "adapter_config.json").is_file()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        merged_logits = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
    assert (adapted - before).abs().max() > 1e-4  # the adapters trained
    torch.testing.assert_close(merged_logits, adapted, rtol=0, atol=1e-4)
