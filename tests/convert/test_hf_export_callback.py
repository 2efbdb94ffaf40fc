"""HF round trip through training: import -> two optimizer steps -> HFExportCallback -> transformers logits."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.callbacks.hf_export import HFExportCallback
from lightning_flagscale.convert import load_hf_weights, module_from_hf
from lightning_flagscale.models import CausalLMModule
from tests.convert._hf import hf_logits, make_hf_model, save

pytest.importorskip("transformers")


def test_export_after_training_matches_our_logits(tmp_path):
    import lightning as L
    from transformers import AutoModelForCausalLM

    hf_model = make_hf_model("qwen3", num_hidden_layers=1)
    hf_dir = save(hf_model, tmp_path / "hf")
    module = module_from_hf(CausalLMModule, hf_dir, learning_rate=1e-2, warmup_steps=0)
    assert module.hf_dir == str(hf_dir) and module.config.qk_norm
    module.configure_model()
    load_hf_weights(module, hf_dir)  # what the strategy does instead of init_weights once `from_hf` is wired
    ids = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(2))
    batches = [{"input_ids": ids[i : i + 2, :-1], "labels": ids[i : i + 2, 1:]} for i in (0, 2)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[HFExportCallback(tmp_path / "export-{step}")],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    out = tmp_path / "export-2"
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    module.model.eval()
    with torch.no_grad():
        ours = module.model.logits(module.model(ids))
    theirs = hf_logits(reloaded, ids)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (theirs - hf_logits(hf_model, ids)).abs().max() > 1e-3  # the weights really were trained
    assert (out / "generation_config.json").is_file()
