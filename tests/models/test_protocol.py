"""The model protocol (issue 38 item 5): one ``Protocol`` per capability, the built-in decoder implements each, and a
module missing a capability is refused once, in the launching process before any worker starts, with a message
naming the missing part."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_flagscale import FlagScaleStrategy
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.models.protocol import (
    ConfiguredModel,
    ContextParallelAttention,
    GlobalTokenLoss,
    MoEModel,
    ParallelizableModel,
    PipelineInputs,
    PipelineModel,
    PrecisionLayoutModule,
    SeededModule,
    TensorParallelConstraints,
    TensorParallelHook,
    TensorParallelModel,
    WeightInit,
    WeightLoader,
    attention_modules,
    find_protocol_model,
    missing_protocol_parts,
    model_config,
    uses_global_token_loss,
)
from tests.strategies._lm import tiny_config


def test_the_decoder_implements_every_capability():
    with torch.device("meta"):
        module = CausalLMModule(tiny_config())
        module.configure_model()
    model = module.model
    for capability in (
        ParallelizableModel, WeightInit, TensorParallelModel, TensorParallelConstraints, TensorParallelHook,
        PipelineModel, PipelineInputs, MoEModel, ConfiguredModel,
    ):  # fmt: skip
        assert isinstance(model, capability), capability.__name__
    for capability in (WeightLoader, SeededModule, PrecisionLayoutModule, GlobalTokenLoss):
        assert isinstance(module, capability), capability.__name__
    assert attention_modules(model) and all(isinstance(m, ContextParallelAttention) for m in attention_modules(model))
    assert model_config(module) is module.config and uses_global_token_loss(module)
    assert missing_protocol_parts(model, tp=True, pp=True, cp=True, ep=False) == []


class OnlyLoss(nn.Module):
    """The two methods every layout needs, and no parallelism-specific part."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)

    def init_weights(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        nn.init.normal_(self.proj.weight)

    def loss_fn(self, out: Tensor, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
        return (out - labels).square().mean()


class OnlyLossModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = OnlyLoss()

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model.loss_fn(self.model(batch), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_missing_parts_are_named():
    model = OnlyLoss()
    assert isinstance(model, ParallelizableModel) and not isinstance(model, TensorParallelModel)
    assert find_protocol_model(OnlyLossModule()) is not None
    assert missing_protocol_parts(model, tp=True, pp=True, cp=True, ep=True) == [
        "tp_plan(sequence_parallel) for tensor parallelism",
        "pipeline_units() for pipeline parallelism",
        "attention modules with a `core_attention` child for context parallelism",
        "MoE layers (num_experts > 0) for expert parallelism",
    ]


@pytest.mark.parametrize(
    ("kwargs", "missing"),
    [
        (dict(tensor_parallel_size=2), r"lacks tp_plan\(sequence_parallel\) for tensor parallelism"),
        (dict(pipeline_parallel_size=2), r"lacks pipeline_units\(\) for pipeline parallelism"),
    ],
    ids=["tp", "pp"],
)
def test_a_missing_capability_is_refused_before_any_worker_starts(monkeypatch, kwargs, missing):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)  # a fresh command, as a user types it
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FlagScaleStrategy(**kwargs), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        with pytest.raises(ValueError, match=f"OnlyLossModule cannot run this layout: its model {missing}"):
            trainer.fit(OnlyLossModule(), DataLoader(torch.randn(4, 4), batch_size=2))
    finally:
        assert trainer.strategy.launcher.procs == [], "no worker may have been started"
