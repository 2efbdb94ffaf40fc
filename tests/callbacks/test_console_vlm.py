"""Every recipe has the same console (issue 41, item 3): step progress bar, a loss line every N steps and at the last,
the closing summary at any run length, the loss plot and CSV, the console's loss equal to the CSV's for that step,
and no model-summary FLOPs of 0. The VLM recipe, the odd one out before, runs end to end on 4 ranks."""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_flagscale.callbacks import KnownFlopsRichModelSummary, LossReport
from lightning_flagscale.models.lightning import log_window_loss
from lightning_flagscale.recipe_files import RECIPES_DIR

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
CONSOLE = {"StepProgressBar", "LossReport", "LossCurvePlot"}


class _LogsAfterTheCallbacks(L.LightningModule):
    """Logs ``train_loss`` in its own ``on_train_batch_end`` (as the built-in modules do), i.e. after callbacks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self._window = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._window = log_window_loss(self, outputs, batch_idx, self._window)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(n: int = 40) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _report_lines(tmp_path: Path, max_steps: int, every: int = 10, accumulate: int = 1) -> tuple[list[str], Path]:
    handler = _Lines()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(tmp_path, name="run"),
            callbacks=[LossReport(every_n_steps=every)], enable_checkpointing=False, enable_model_summary=False,
            enable_progress_bar=False, log_every_n_steps=1, accumulate_grad_batches=accumulate,
        )  # fmt: skip
        trainer.fit(_LogsAfterTheCallbacks(), _loader())
    finally:
        logger.removeHandler(handler)
    return handler.lines, Path(trainer.loggers[0].log_dir) / "metrics.csv"


def _csv_losses(path: Path) -> dict[int, float]:
    rows = csv.DictReader(path.read_text().splitlines())
    return {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_console_loss_is_the_csv_loss_of_that_step(tmp_path, accumulate):
    lines, metrics = _report_lines(tmp_path, max_steps=12, every=3, accumulate=accumulate)
    printed = {int(line.split()[1].split("/")[0]): float(line.split()[3]) for line in lines if line.startswith("step")}
    assert sorted(printed) == [3, 6, 9, 12]
    csv_losses = _csv_losses(metrics)
    for step, loss in printed.items():  # Lightning's CSV numbers logged steps from 0: step N is row N - 1
        assert loss == pytest.approx(csv_losses[step - 1], abs=5e-5), (step, loss, csv_losses)
    assert len(set(printed.values())) == len(printed)


@pytest.mark.parametrize(("steps", "window"), [(1, "one step"), (3, "one step"), (7, "mean of 3 steps")])
def test_short_runs_still_close_with_first_and_last(tmp_path, steps, window):
    lines, metrics = _report_lines(tmp_path, max_steps=steps)
    closing = [line for line in lines if line.startswith("training loss")]
    assert len(closing) == 1 and f"({window})" in closing[0], lines
    assert any(line.startswith(f"step {steps:5d}/{steps}") for line in lines)  # the last step, below every_n_steps
    losses = _csv_losses(metrics)
    if steps == 1:
        assert f"first {losses[0]:.4f} -> last {losses[0]:.4f}" in closing[0]


def test_model_summary_without_flops_shows_no_flops(capsys):
    data = [(" ", ["0"]), ("Name", ["net"]), ("Type", ["Linear"]), ("Params", ["5"]), ("Mode", ["train"]),
            ("FLOPs", ["0"])]  # fmt: skip
    KnownFlopsRichModelSummary.summarize(data, 5, 5, 0.0, {"train": 1, "eval": 0}, total_flops=0)
    out = capsys.readouterr().out
    assert "FLOPs" not in out and "Linear" in out and "Total params" in out
    KnownFlopsRichModelSummary.summarize(data, 5, 5, 0.0, {"train": 1, "eval": 0}, total_flops=1200)
    assert "Total FLOPs" in capsys.readouterr().out  # a real count is Lightning's table, unchanged


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_has_the_same_console(name):
    trainer = yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text())["trainer"]
    callbacks = {cb["class_path"].rpartition(".")[2] for cb in trainer.get("callbacks", [])}
    assert callbacks >= CONSOLE, (name, CONSOLE - callbacks)
    assert trainer["logger"]["class_path"].endswith("CSVLogger")
    assert trainer.get("check_val_every_n_epoch", 1) is None and trainer.get("val_check_interval")


def _vlm_run(logs: str):
    from tests._cli import run_cli

    handler = _Lines()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cli = run_cli([
                "fit", "--config", "qwen2_5_vl_tiny", "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
                "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
                "--trainer.logger.init_args.save_dir", logs,
            ])  # fmt: skip
        finally:
            logger.removeHandler(handler)
    summaries = [type(cb).__name__ for cb in cli.trainer.callbacks if "ModelSummary" in type(cb).__name__]
    bars = [type(cb).__name__ for cb in cli.trainer.callbacks if "ProgressBar" in type(cb).__name__]
    return handler.lines, [str(w.message) for w in caught], cli.trainer.loggers[0].log_dir, summaries, bars


def test_vlm_recipe_console(launcher, tmp_path):
    lines, warned, log_dir, summaries, bars = launcher(4, _vlm_run, str(tmp_path / "logs"))[0]
    assert bars == ["StepProgressBar"] and summaries == ["KnownFlopsRichModelSummary"]
    step_lines = [line for line in lines if line.startswith("step")]
    assert len(step_lines) == 1 and step_lines[0].startswith("step     3/3"), lines
    assert any(line.startswith("training loss (one step): first") for line in lines), lines
    csv_losses = _csv_losses(Path(log_dir) / "metrics.csv")
    assert float(step_lines[0].split()[3]) == pytest.approx(csv_losses[2], abs=5e-5)
    # throughput from the second step on, as the text models log it (the first has no previous step to time from)
    rows = list(csv.DictReader((Path(log_dir) / "metrics.csv").open()))
    rates = {int(r["step"]): float(r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")}
    assert sorted(rates) == [1, 2] and min(rates.values()) > 0, rates
    assert (Path(log_dir) / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not [w for w in warned if "across ranks is zero" in w or "ambiguous collection" in w], warned


def test_runs_shorter_than_the_log_interval_still_log(monkeypatch):
    """``--trainer.max_steps 3`` on a recipe logging every 10 steps: the CSV (and so the loss plot) gets the last
    step instead of nothing."""
    from lightning_flagscale.cli import main
    from lightning_flagscale.strategies._resilience import FlagScaleLauncher

    seen = {}

    def launch(self, function, *args, trainer=None, **kwargs):
        seen["every"] = trainer.log_every_n_steps  # the run itself is not needed

    monkeypatch.setattr(FlagScaleLauncher, "launch", launch)
    main(["fit", "--config", "zero1", "--trainer.max_steps", "3"])
    assert seen["every"] == 3
    main(["fit", "--config", "zero1", "--trainer.max_steps", "30"])
    assert seen["every"] == 10  # the recipe's own interval when the run is longer
