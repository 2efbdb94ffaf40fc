"""``StepProgressBar``: Rich progress counted in optimizer steps when the run is bounded by ``max_steps``.

Lightning's bars count batches per epoch and title them ``Epoch e/max_epochs-1``; a run bounded by ``max_steps``
has ``max_epochs=-1``, so the title reads ``Epoch 0/-2`` and the count restarts every epoch of a small corpus. Here
the training bar shows ``global_step/max_steps`` across epochs, and the logger's version number (``v_num``) is not
shown as if it were a metric.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["StepProgressBar"]


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` with a step-based training bar (``Step 120/150``) and no ``v_num``."""

    def _counts_steps(self) -> bool:
        trainer = self._trainer
        return trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0

    @property
    @override
    def total_train_batches(self) -> int | float:
        if self._counts_steps():
            return self.trainer.max_steps
        return super().total_train_batches

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._counts_steps() and self.train_progress_bar_id is not None and self.progress is not None:
            # One bar for the whole run: a new epoch only changes the title.
            self.progress.update(self.train_progress_bar_id, description=self._get_train_description(0))
            self.refresh()
            return
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch, idx) -> None:
        if not self._counts_steps():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # resumed mid-epoch
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        # A module that logs `train_loss` in its own `on_train_batch_end` (`log_window_loss`) does so after this
        # callback's: refresh the shown metrics once that step is done, so they belong to the step shown.
        super().on_train_batch_start(trainer, pl_module, batch, idx)
        if self._counts_steps() and self.train_progress_bar_id is not None and self.progress is not None:
            self._update_metrics(trainer, pl_module)
            self.refresh()

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if not self._counts_steps():
            return super()._get_train_description(current_epoch)
        text = f"Step (epoch {self.trainer.current_epoch})"
        return f"{text:{len(self.validation_description)}}"

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
