"""MoETelemetry: logs routing telemetry through Lightning and applies the bias update after each step."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_flagscale.callbacks.moe import MoETelemetry
from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.moe import build_moe
from tests.moe._reference import init_moe


class _TinyMoE(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        cfg = TransformerConfig.from_preset("deepseek-v3-routing-tiny", moe_aux_loss_coeff=0.01)
        self.mlp = init_moe(build_moe(cfg, 1))

    def training_step(self, batch, batch_idx):
        return self.mlp(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4, 64), batch_size=2)


def test_telemetry_logged_and_bias_updated():
    model = _TinyMoE()
    bias0 = model.mlp.gate.e_score_correction_bias.clone()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[MoETelemetry(per_expert=True)],
    )  # fmt: skip
    trainer.fit(model)
    m = trainer.callback_metrics
    assert float(m["moe/mlp/imbalance"]) >= 1.0
    # the preset's sequence-wise loss (issue 39 item 5) is an aux loss of its own, in the layer's total
    aux, seq = float(m["moe/mlp/aux_loss"]), float(m["moe/mlp/seq_aux_loss"])
    assert aux > 0 and seq > 0 and float(m["moe/aux_loss_total"]) == pytest.approx(aux + seq, rel=1e-6)
    assert sum(float(m[f"moe/mlp/tokens/{e}"]) for e in range(8)) == 2 * 4 * 2
    steps = (model.mlp.gate.e_score_correction_bias - bias0).abs() / 1e-3
    assert torch.allclose(steps.round(), steps) and steps.max() > 0  # whole sign steps, at most 2 of them
    assert model.mlp.load_accum.sum() == 0
