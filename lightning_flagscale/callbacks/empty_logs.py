"""``DropEmptyLogDir``: a run that fails before it logs anything leaves no empty ``version_N`` folder behind.

Lightning creates each logger's folder (``lightning_logs/<name>/version_N``) before the data module's and the
model's ``setup``; a run failing there (a corpus too small to split, a layout error found on the workers) left that
folder empty, and the next run took ``version_N+1``. ``lightning-flagscale fit`` adds this callback.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from typing_extensions import override

__all__ = ["DropEmptyLogDir"]


class DropEmptyLogDir(L.Callback):
    """On an exception, rank 0 removes each logger's ``log_dir`` if it is empty, and the folders up to and including
    the logger's ``save_dir`` that this leaves empty (never the working directory or one above it). A folder holding
    anything (a config, metrics, a checkpoint, another run) is kept."""

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not trainer.is_global_zero:
            return
        cwd = Path.cwd().resolve()
        for logger in trainer.loggers:
            log_dir, save_dir = getattr(logger, "log_dir", None), getattr(logger, "save_dir", None)
            if log_dir is None:
                continue
            folder = Path(log_dir).resolve()
            top = Path(save_dir).resolve() if save_dir else folder
            while folder.is_dir() and not any(folder.iterdir()) and folder != cwd and folder not in cwd.parents:
                os.rmdir(folder)
                if folder == top or top not in folder.parents:
                    break
                folder = folder.parent
