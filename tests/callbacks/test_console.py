"""Console and loggers (issue #17, item 4): step-based progress bar without ``v_num``, loss-curve PNG, TensorBoard."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_flagscale.callbacks import LossCurvePlot, StepProgressBar


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int = 12) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def _fit(tmp_path, callbacks, max_steps: int = 7) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(tmp_path, name="run"),
        callbacks=callbacks, enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
        val_check_interval=2, check_val_every_n_epoch=None, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(_Tiny(), _loader(), _loader(4))  # 3 batches an epoch: the run spans 3 epochs
    return trainer


def test_progress_bar_counts_steps_across_epochs_without_v_num(tmp_path):
    seen = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            task = bar.progress.tasks[bar.train_progress_bar_id]
            seen.append((task.completed, task.total, str(task.description)))

    bar = StepProgressBar()
    trainer = _fit(tmp_path, [bar, Watch()])
    assert trainer.current_epoch >= 2
    # The bar's own update runs before the watcher (callback order): step k of 7, never reset by a new epoch.
    assert [(c, t) for c, t, _ in seen] == [(k, 7) for k in range(1, 8)]
    assert all("Step" in d and "/-2" not in d for _, _, d in seen)
    metrics = bar.get_metrics(trainer, trainer.lightning_module)
    assert "v_num" not in metrics and "train_loss" in metrics


def test_epoch_bounded_runs_keep_lightnings_epoch_bar(tmp_path):
    bar = StepProgressBar()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, callbacks=[bar],
                        enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(_Tiny(), _loader())
    assert bar._get_train_description(1).startswith("Epoch 1/1")


def test_loss_curve_png_next_to_the_csv(tmp_path):
    plot = LossCurvePlot()
    trainer = _fit(tmp_path, [plot])
    log_dir = trainer.loggers[0].log_dir
    assert plot.last_path is not None and str(plot.last_path.parent) == log_dir
    assert plot.last_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from lightning_flagscale.callbacks.loss_plot import _read_series

    series = _read_series(plot.last_path.parent / "metrics.csv", ("train_loss", "val_loss"))
    assert series["train_loss"][0] == list(range(7)) and series["val_loss"][0] == [1, 3, 5]


def test_tensorboard_joins_the_csv_logger_only_when_installed(tmp_path, monkeypatch):
    from lightning_flagscale import cli_train

    csv = CSVLogger(tmp_path, name="run")
    if not cli_train.tensorboard_available():
        assert cli_train.tensorboard_beside_csv([csv]) is None
    # What happens where TensorBoard is installed (it is not a dependency): the choice, not TensorBoard's writing.
    monkeypatch.setattr(cli_train, "tensorboard_available", lambda: True)
    monkeypatch.setattr("lightning.fabric.loggers.tensorboard._TENSORBOARD_AVAILABLE", True)
    tb = cli_train.tensorboard_beside_csv([csv])
    assert tb is not None and tb.log_dir == csv.log_dir
    assert cli_train.tensorboard_beside_csv([csv, tb]) is None  # the recipe already has one
    assert cli_train.tensorboard_beside_csv([]) is None  # logger: false stays off


@pytest.mark.parametrize("name", ["llama_tiny", "zero1", "pipeline"])
def test_recipes_validate_by_steps_across_epochs(name):
    import yaml

    from lightning_flagscale.recipe_files import recipe_path

    trainer = yaml.safe_load(Path(recipe_path(name)).read_text())["trainer"]
    assert trainer["check_val_every_n_epoch"] is None and isinstance(trainer["val_check_interval"], int)
    classes = [cb["class_path"].rsplit(".", 1)[1] for cb in trainer["callbacks"]]
    assert {"StepProgressBar", "LossCurvePlot"} <= set(classes)
