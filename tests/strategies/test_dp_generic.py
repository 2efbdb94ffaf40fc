"""DDP / ZeRO-1/2/3 on a model WITHOUT the model protocol (a user's own LightningModule) match one process."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_flagscale import FlagScaleStrategy
from tests._oracle import global_batch_indices

STEPS, GLOBAL_BATCH, LR = 3, 8, 1e-2


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g), torch.randn(STEPS * GLOBAL_BATCH, 4, generator=g)
    )


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class TinyNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


def _reference(clip: float | None = None):
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    x, y = _data().tensors
    losses = []
    for step in range(STEPS):
        sl = global_batch_indices(len(x), GLOBAL_BATCH, step)
        loss = F.mse_loss(net(x[sl]), y[sl])
        losses.append(loss.item())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _run(zero_stage: int, clip: float | None):
    import torch.distributed as dist

    world = dist.get_world_size()
    model = TinyNet()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=FlagScaleStrategy(zero_stage=zero_stage), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=clip,
    )  # fmt: skip
    trainer.fit(model, DataLoader(_data(), batch_size=GLOBAL_BATCH // world))
    losses = torch.tensor(model.losses)
    dist.all_reduce(losses)
    losses /= world
    from torch.distributed.tensor import DTensor

    params = {}
    for name, p in model.net.named_parameters():
        params[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return losses.tolist(), params


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_data_parallel_matches_single_process(launcher, zero_stage):
    clip = 0.05  # small enough to clip on every step: exercises the global-norm computation on shards
    results = launcher(2, _run, zero_stage, clip)
    ref_losses, ref_params = _reference(clip)
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-7, msg=f"{name} (zero_stage={zero_stage})")
