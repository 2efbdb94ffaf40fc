"""``LossReport``: plain-text training progress that survives logs and pipes (where a progress bar does not)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

__all__ = ["LossReport"]


class LossReport(L.Callback):
    """Every ``every_n_steps`` optimizer steps (and at the last one), rank 0 logs step, loss, tokens/s and elapsed
    time; at the end of ``fit`` it reports the first and last smoothed losses, so a run shows at a glance whether it
    learned. Runs shorter than ``2 * smoothing`` steps average over half their steps each (one step: the loss).

    The loss of a step is read once the step's hooks are done: a module may log ``train_loss`` in its own
    ``on_train_batch_end`` (``log_window_loss`` does), which Lightning calls after the callbacks', so reading it in
    this callback's ``on_train_batch_end`` would print the previous step's value next to this step's number. The
    number printed for step N is the one ``metrics.csv`` holds in its row ``step = N - 1`` (Lightning numbers logged
    steps from 0).
    """

    def __init__(self, every_n_steps: int = 10, smoothing: int = 10) -> None:
        self.every_n_steps = every_n_steps
        self.smoothing = smoothing
        self._losses: list[float] = []
        self._pending: int | None = None  # an optimizer step whose loss is not read yet
        self._last_step = 0
        self._start = 0.0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()
        self._losses.clear()
        self._pending, self._last_step = None, trainer.global_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch, idx) -> None:
        if trainer.global_step > self._last_step:  # else a micro-batch of an accumulation window
            self._pending = self._last_step = trainer.global_step

    # The first hooks after the module's `on_train_batch_end` and Lightning's metric update of that batch.
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._report(trainer)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer)

    def _report(self, trainer: L.Trainer) -> None:
        step, self._pending = self._pending, None
        if step is None:
            return
        loss = trainer.callback_metrics.get("train_loss")  # read on every rank: the same calls everywhere
        if loss is None:
            return
        self._losses.append(float(loss))
        last = trainer.max_steps is not None and step == trainer.max_steps
        if (step % self.every_n_steps == 0 or last) and trainer.is_global_zero:
            tps = trainer.callback_metrics.get("tokens_per_s")
            tps_text = f"  tokens/s {float(tps):8.0f}" if tps is not None else ""
            rank_zero_info(
                f"step {step:5d}/{trainer.max_steps}  loss {float(loss):.4f}{tps_text}"
                f"  elapsed {time.perf_counter() - self._start:6.1f}s"
            )

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer)
        if not self._losses:
            return
        window = max(1, min(self.smoothing, len(self._losses) // 2))
        first = sum(self._losses[:window]) / window
        last = sum(self._losses[-window:]) / window
        what = f"mean of {window} steps" if window > 1 else "one step"
        change = f" ({(last - first) / first:+.1%})" if first else ""
        rank_zero_info(
            f"training loss ({what}): first {first:.4f} -> last {last:.4f}{change}"
            f" in {time.perf_counter() - self._start:.1f}s"
        )
