"""CausalLMModule on a plain single-device Trainer: builds, trains, validates, schedules the LR."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models import CausalLM
from lightning_flagscale.models.lightning import CausalLMModule, param_groups, warmup_cosine_lambda


def _batches(n: int, vocab: int = 256, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, seq + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[0, :4] = -100
        out.append({"input_ids": ids[:, :-1], "labels": labels})
    return out


def test_config_forms():
    assert CausalLMModule("qwen3-tiny").config.qk_norm
    mod = CausalLMModule({"preset": "llama-tiny", "num_layers": 1})
    assert mod.config.num_layers == 1 and mod.hparams.config == {"preset": "llama-tiny", "num_layers": 1}
    assert CausalLMModule({"vocab_size": 32, "hidden_size": 16, "num_attention_heads": 2}).config.vocab_size == 32
    with pytest.raises(TypeError, match="num_layer"):
        CausalLMModule({"num_layer": 2})


def test_trainer_fit_and_validate(tmp_path):
    module = CausalLMModule(TransformerConfig.from_preset("llama-tiny", num_layers=1), warmup_steps=2, init_seed=5)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, limit_val_batches=2, val_check_interval=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    train, val = _batches(4), _batches(2)
    trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
    metrics = trainer.callback_metrics
    assert {"train_loss", "tokens_per_s", "val_loss", "val_ppl"} <= set(metrics)
    assert math.isclose(metrics["val_ppl"].item(), math.exp(metrics["val_loss"].item()), rel_tol=1e-5)
    # Token-weighted validation loss, recomputed by hand with the trained weights.
    model = module.model
    with torch.no_grad():
        total = sum(model.loss_fn(model(b["input_ids"]), b["labels"]) * (b["labels"] != -100).sum() for b in val)
    expected = total / sum((b["labels"] != -100).sum() for b in val)
    assert math.isclose(metrics["val_loss"].item(), expected.item(), rel_tol=1e-5)
    # Built eagerly with the module's seed (the strategy-free path), then trained: weights moved.
    fresh = CausalLM(module.config)
    fresh.init_weights(5)
    assert not torch.equal(fresh.layers["0"].mlp.up_proj.weight, model.layers["0"].mlp.up_proj.weight)
    lrs = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert lrs[0] < module.hparams.learning_rate


def test_param_groups_exempt_norms_biases_embeddings():
    model = CausalLM(TransformerConfig.from_preset("qwen2-tiny", num_layers=1))
    decay, no_decay = param_groups(model, 0.1)
    assert no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert id(model.embed_tokens.weight) in ids(no_decay)  # tied head too, listed once
    assert id(model.layers["0"].self_attn.q_proj.bias) in ids(no_decay)
    assert id(model.layers["0"].input_layernorm.weight) in ids(no_decay)
    assert id(model.layers["0"].self_attn.q_proj.weight) in ids(decay)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_warmup_cosine_schedule():
    f = warmup_cosine_lambda(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [round(f(s), 6) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == 1.0 and math.isclose(f(9), 0.55) and math.isclose(f(14), 0.1) and math.isclose(f(100), 0.1)
    assert warmup_cosine_lambda(2, math.inf, 0.1)(50) == 1.0
