"""Recipes name any LightningModule / LightningDataModule by ``class_path`` (issue #17, item 2).

The recipe ``tests/recipes/user_module_zero1.yaml`` trains ``UserRegressor`` (a module of this file, outside the
package, without the model protocol) on ``UserData`` under ``FlagScaleStrategy(zero_stage=1)`` on 2 processes
through ``lightning-flagscale fit``; losses and weights after 3 plain-SGD steps match one process (rel. 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests._oracle import global_batch_indices

RECIPE = str(Path(__file__).parent / "recipes" / "user_module_zero1.yaml")
STEPS, WORLD, PER_RANK, LR, HIDDEN = 3, 2, 4, 0.1, 16


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    n = STEPS * WORLD * PER_RANK
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 3, generator=g))


def _net(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 3))


class UserRegressor(L.LightningModule):
    instances: list[UserRegressor] = []

    def __init__(self, hidden: int = 32, learning_rate: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = _net(hidden)
        self.losses: list[float] = []
        UserRegressor.instances.append(self)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)


class UserData(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=self.batch_size)


def _fit_recipe(root: str):
    import torch.distributed as dist

    from tests._cli import run_cli

    module = run_cli(["fit", "--config", RECIPE, "--trainer.default_root_dir", root]).model
    assert module is UserRegressor.instances[-1]
    losses = torch.tensor(module.losses)
    dist.all_reduce(losses)
    params = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return (losses / dist.get_world_size()).tolist(), params, type(module.trainer.strategy).__name__


def _reference():
    net = _net(HIDDEN)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = _data().tensors
    losses = []
    for step in range(STEPS):
        idx = global_batch_indices(len(x), WORLD * PER_RANK, step)
        loss = F.mse_loss(net(x[idx]), y[idx])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, net.state_dict()


def test_recipe_names_a_user_module_by_class_path(capsys):
    from lightning_flagscale.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", RECIPE, "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"] == {"class_path": "tests.test_recipe_any_module.UserRegressor",
                               "init_args": {"hidden": HIDDEN, "learning_rate": LR}}  # fmt: skip
    assert config["data"]["class_path"] == "tests.test_recipe_any_module.UserData"


def test_user_module_trains_under_zero1_from_a_recipe(launcher, tmp_path):
    ref_losses, ref_params = _reference()
    for losses, params, strategy in launcher(WORLD, _fit_recipe, str(tmp_path)):
        assert strategy == "FlagScaleStrategy"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-7, msg=name)
