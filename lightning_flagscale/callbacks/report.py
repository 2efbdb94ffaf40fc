"""``LossReport``: plain-text training progress that survives logs and pipes (where a progress bar does not)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

__all__ = ["LossReport"]


class LossReport(L.Callback):
    """Every ``every_n_steps`` optimizer steps, rank 0 logs step, loss, tokens/s and elapsed time; at the end of
    ``fit`` it reports the first and last smoothed losses, so a run shows at a glance whether it learned."""

    def __init__(self, every_n_steps: int = 10, smoothing: int = 10) -> None:
        self.every_n_steps = every_n_steps
        self.smoothing = smoothing
        self._losses: list[float] = []
        self._start = 0.0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()
        self._losses.clear()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch, idx) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is None:
            return
        self._losses.append(float(loss))
        step = trainer.global_step
        if step % self.every_n_steps == 0 and trainer.is_global_zero:
            tps = trainer.callback_metrics.get("tokens_per_s")
            tps_text = f"  tokens/s {float(tps):8.0f}" if tps is not None else ""
            rank_zero_info(
                f"step {step:5d}/{trainer.max_steps}  loss {float(loss):.4f}{tps_text}"
                f"  elapsed {time.perf_counter() - self._start:6.1f}s"
            )

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if len(self._losses) < 2 * self.smoothing:
            return
        first = sum(self._losses[: self.smoothing]) / self.smoothing
        last = sum(self._losses[-self.smoothing :]) / self.smoothing
        rank_zero_info(
            f"training loss (mean of {self.smoothing} steps): first {first:.4f} -> last {last:.4f}"
            f" ({(last - first) / first:+.1%}) in {time.perf_counter() - self._start:.1f}s"
        )
