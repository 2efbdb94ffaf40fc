"""``LossCurvePlot``: a PNG of the training and validation loss next to the CSV logger's ``metrics.csv``.

Written by rank 0 when ``fit`` ends (also after an interrupted run), from the CSV the logger wrote, so the picture
and the numbers always agree. Needs matplotlib (the ``dev``/``bench`` extras); without it the callback says so once
and does nothing.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

__all__ = ["LossCurvePlot", "plot_loss_curve"]


class LossCurvePlot(L.Callback):
    """Plot ``metrics`` (default ``train_loss`` and ``val_loss``) against the step into ``<csv log_dir>/<filename>``."""

    def __init__(self, filename: str = "loss_curve.png", metrics: tuple[str, ...] = ("train_loss", "val_loss")) -> None:
        self.filename = filename
        self.metrics = tuple(metrics)
        self.last_path: Path | None = None

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):  # an interrupted run still gets its curve so far
            self._write(trainer)

    def _write(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if logger is None:
            rank_zero_warn("LossCurvePlot needs a CSVLogger among the trainer's loggers; no plot written.")
            return
        logger.save()  # flush buffered rows
        source = Path(logger.log_dir) / "metrics.csv"
        if not source.is_file():
            return
        try:
            self.last_path = plot_loss_curve(source, source.parent / self.filename, self.metrics)
        except ImportError:
            rank_zero_warn("LossCurvePlot needs matplotlib (pip install matplotlib); no plot written.")
            return
        rank_zero_info(f"loss curve: {self.last_path}")


def _read_series(source: Path, metrics: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = {m: ([], []) for m in metrics}
    with source.open(newline="") as f:
        for row in csv.DictReader(f):
            for metric in metrics:
                value = row.get(metric)
                has_step = row.get("step") not in (None, "")
                if has_step and value not in (None, "") and math.isfinite(float(value)):
                    series[metric][0].append(int(float(row["step"])))
                    series[metric][1].append(float(value))
    return {m: s for m, s in series.items() if s[0]}


def plot_loss_curve(source: Path, target: Path, metrics: tuple[str, ...] = ("train_loss", "val_loss")) -> Path:
    """Plot the ``metrics`` columns of a Lightning ``metrics.csv`` against ``step``; returns ``target``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    series = _read_series(Path(source), metrics)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for metric, (steps, values) in series.items():
        style = "o-" if len(steps) < 30 else "-"
        ax.plot(steps, values, style, label=metric, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(Path(source).parent.as_posix()[-60:])
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend()
    fig.tight_layout()
    target = Path(target)
    fig.savefig(target)
    plt.close(fig)
    return target
