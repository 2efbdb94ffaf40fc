"""Aux-free bias balancing is done by the model itself: under Lightning's own strategy and in a plain loop."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.moe import balance_after_step, build_moe, moe_layers
from tests.moe._reference import init_moe
from tests.strategies._lm import TokenDataset


def _config() -> TransformerConfig:
    return TransformerConfig.from_preset("deepseek-v3-routing-tiny", num_layers=2, hidden_size=32, intermediate_size=64)


def _biases(module: torch.nn.Module) -> torch.Tensor:
    return torch.stack([layer.gate.e_score_correction_bias.clone() for _, layer in moe_layers(module)])


def test_bias_balancing_under_lightning_single_device_strategy():
    # No FlagScaleStrategy, no callback: CausalLMModule runs the update after each optimizer step itself.
    torch.manual_seed(0)
    module = CausalLMModule(_config(), warmup_steps=0)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TokenDataset(256, 24), batch_size=2))
    steps = _biases(module) / 1e-3
    assert torch.allclose(steps.round(), steps, atol=1e-4) and steps.abs().max() > 0
    assert steps.abs().max() <= 3  # one sign step per optimizer step, not per batch (accumulation)
    assert all(layer.load_accum.sum() == 0 for _, layer in moe_layers(module))


def test_balance_after_step_in_a_plain_loop():
    cfg = _config()
    layer = init_moe(build_moe(cfg, 1))
    layer.gate.e_score_correction_bias.zero_()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    handle = balance_after_step(opt, layer)
    layer(torch.randn(2, 8, 32)).square().mean().backward()
    load = layer.load_accum.clone()
    opt.step()
    assert torch.equal(layer.gate.e_score_correction_bias, 1e-3 * torch.sign(load.mean() - load))
    assert layer.load_accum.sum() == 0
    handle.remove()


def test_expert_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 is not supported"):
        ParallelConfig(expert_parallel_size=2, expert_tensor_parallel_size=2)
