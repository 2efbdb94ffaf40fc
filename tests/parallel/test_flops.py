"""Model FLOPs per token (``accounting/flops.py``): the matmul term equals what torch's FLOP counter sees in a real
forward + backward of the decoder, the attention and MoE terms follow their closed forms, and the peak table and
MFU arithmetic hold."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.accounting.flops import (
    PEAK_FLOPS,
    device_peak_flops,
    flops_per_token,
    model_flops_utilization,
    peak_flops_from_name,
)
from lightning_flagscale.config import TransformerConfig
from tests.strategies._lm import TokenDataset, make_module, tiny_config


def _attention_term(config: TransformerConfig, seq: int) -> int:
    return 12 * config.num_layers * config.num_attention_heads * config.head_dim * seq


def _norm_params(config: TransformerConfig) -> int:
    return config.num_layers * 2 * config.hidden_size + config.hidden_size


@pytest.mark.parametrize("tie", [False, True])
def test_matmul_term_matches_torch_flop_counter(tie):
    """Every aten.mm of a training step (forward, input and weight gradients, LM head included even when tied) is
    6 x the matmul weights per token; the formula's only extras are the norm weights (PaLM's N) and attention."""
    from torch.utils.flop_counter import FlopCounterMode

    config = tiny_config(tie_word_embeddings=tie)
    seq = 32
    module = make_module(config)
    module.configure_model()
    batch = TokenDataset(config.vocab_size, 4, seq=seq).batch(torch.arange(4))
    with FlopCounterMode(display=False) as counter:
        module._loss(batch).backward()
    counted = counter.get_flop_counts()["Global"]
    mm = sum(v for op, v in counted.items() if "mm" in str(op))
    tokens = batch["input_ids"].numel()
    want = flops_per_token(config, seq) - _attention_term(config, seq) - 6 * _norm_params(config)
    assert mm == want * tokens


def test_attention_term_grows_with_the_sequence():
    config = tiny_config()
    assert flops_per_token(config, 256) - flops_per_token(config, 128) == _attention_term(config, 128)
    # llama-tiny by hand: h=32, 4 heads of 8, kv 2 heads, ffn 64, vocab 256, 2 layers.
    h, d, q, kv, ffn, vocab = 32, 8, 4, 2, 64, 256
    per_layer = h * q * d + 2 * h * kv * d + q * d * h + 3 * h * ffn + 2 * h
    matmul = 2 * per_layer + h + vocab * h
    assert flops_per_token(config, 16) == 6 * matmul + 12 * 2 * q * d * 16


def test_moe_counts_active_experts_only():
    base = dict(num_layers=3, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                num_key_value_heads=2, num_experts=8, first_k_dense_layers=1)  # fmt: skip
    top1 = TransformerConfig.from_preset("mixtral-tiny", **base, num_experts_per_tok=1)
    top2 = TransformerConfig.from_preset("mixtral-tiny", **base, num_experts_per_tok=2)
    more_experts = TransformerConfig.from_preset("mixtral-tiny", **{**base, "num_experts": 16}, num_experts_per_tok=2)
    moe_layers = 2  # layers 1 and 2 (layer 0 is dense)
    assert flops_per_token(top2, 64) - flops_per_token(top1, 64) == 6 * moe_layers * 3 * 32 * 16
    # Idle experts cost no FLOPs; only the router grows (h x E per MoE layer).
    assert flops_per_token(more_experts, 64) - flops_per_token(top2, 64) == 6 * moe_layers * 32 * 8


def test_peak_table_and_mfu():
    assert peak_flops_from_name("NVIDIA H100 80GB HBM3") == PEAK_FLOPS["H100"]
    assert peak_flops_from_name("NVIDIA H100 PCIe") == PEAK_FLOPS["H100 PCIe"]
    assert peak_flops_from_name("NVIDIA H200") == PEAK_FLOPS["H200"]
    assert peak_flops_from_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_from_name("NVIDIA L40S") == PEAK_FLOPS["L40S"]
    assert peak_flops_from_name("NVIDIA L40") == PEAK_FLOPS["L40"]
    assert peak_flops_from_name("Some Future GPU") is None
    assert device_peak_flops("cpu") > 1e8  # a measured float32 matmul rate
    assert model_flops_utilization(1000.0, 6e9, 8, 1e12) == pytest.approx(1000 * 6e9 / 8e12)
    with pytest.raises(ValueError, match="num_devices"):
        model_flops_utilization(1.0, 1.0, 0, 1.0)


def test_mfu_is_logged_next_to_tokens_per_s(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_flagscale.models import CausalLMModule

    config = tiny_config(num_layers=1)
    module = CausalLMModule(config, warmup_steps=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TokenDataset(config.vocab_size, 12, seq=16), batch_size=4))
    metrics = trainer.callback_metrics
    ratio = metrics["mfu"].item() / metrics["tokens_per_s"].item()
    assert ratio == pytest.approx(flops_per_token(config, 16) / device_peak_flops("cpu"), rel=1e-5)
    assert 0 < metrics["mfu"].item() < 1
