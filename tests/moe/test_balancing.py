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


def test_expert_tensor_parallel_combinations_not_implemented_are_refused():
    # Accepted since issue 39 item 4 (tests/strategies/test_expert_tensor_parallel.py); these stay refused before launch.
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 is not supported with zero_stage=3"):
        ParallelConfig(expert_tensor_parallel_size=2, zero_stage=3)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 is not supported with zero_stage=3"):
        ParallelConfig(hetero_meshes=[{"expert_tensor_parallel_size": 2}, {}], hetero_layers=[1, 1], zero_stage=3)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size belong inside each mesh's dict"):
        ParallelConfig(expert_tensor_parallel_size=2, hetero_meshes=[{}, {}], hetero_layers=[1, 1])
    p = ParallelConfig(expert_tensor_parallel_size=2).resolve(2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size.*not divisible by expert_tensor_parallel_size=2"):
        p.validate_model(TransformerConfig.from_preset("mixtral-tiny", moe_intermediate_size=15))
    with pytest.raises(ValueError, match="moe_hot_expert_replicas=1 is not supported with expert_tensor_parallel"):
        p.validate_model(TransformerConfig.from_preset("mixtral-tiny", moe_hot_expert_replicas=1))
    with pytest.raises(ValueError, match="needs an MoE model"):
        p.validate_model(TransformerConfig.from_preset("llama-tiny"))


def test_expert_gradient_divisor_counts_each_token_copy_once():
    # ETP inside TP: the ETP ranks split the same rows; across data-parallel ranks: they all-gather distinct ones.
    inside = ParallelConfig(tensor_parallel_size=2, expert_tensor_parallel_size=2).resolve(4)
    across = ParallelConfig(expert_tensor_parallel_size=2).resolve(4)
    assert inside.etp_tokens_replicated and inside.expert_grad_divisor == 2
    assert not across.etp_tokens_replicated and across.expert_grad_divisor == 4
    assert ParallelConfig(expert_parallel_size=2, tensor_parallel_size=2).resolve(4).expert_grad_divisor == 4
    # Under SP with ETP = 1 each TP rank dispatches its own sequence chunk: each token once per (dp, cp) shard.
    chunks = ParallelConfig(expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True).resolve(4)
    assert chunks.moe_routes_sequence_chunks and chunks.expert_grad_divisor == 2
    etp_sp = ParallelConfig(tensor_parallel_size=2, expert_tensor_parallel_size=2, sequence_parallel=True).resolve(4)
    assert not etp_sp.moe_routes_sequence_chunks and etp_sp.expert_grad_divisor == 2  # whole sequence, ETP split


def test_etp_inside_tp_under_sequence_parallelism_reduce_scatters():
    # Issue 39: ETP = TP and ETP over part of a TP group (ETP dividing TP) under SP both reduce-scatter the partial
    # expert outputs (MoELayer.forward); without SP, or with ETP over data-parallel ranks, they do not.
    def layout(tp: int, etp: int, sp: bool = True) -> ParallelConfig:
        return ParallelConfig(tensor_parallel_size=tp, expert_tensor_parallel_size=etp, sequence_parallel=sp).resolve(4)

    assert layout(2, 2).etp_sequence_parallel and layout(4, 4).etp_sequence_parallel  # ETP = TP
    assert layout(4, 2).etp_sequence_parallel  # ETP over half of each TP group
    assert not layout(4, 2, sp=False).etp_sequence_parallel and not layout(4, 1).etp_sequence_parallel
    assert not layout(2, 4).etp_sequence_parallel  # ETP 4 over TP 2 x DP 2: distinct rows, all-gathered
