"""Resilience pieces of ``FlagScaleStrategy`` that run around the training loop rather than inside a step.

- :class:`FlagScaleLauncher`: Lightning's script launcher, plus two things done in the launching process before
  any worker exists: the layout checks (one error, once, instead of one traceback per spawned rank) and the
  choice of the checkpoint to resume from when ``resume="auto"``.
- :func:`auto_resume_path`: the newest complete checkpoint in the folders of the ``ModelCheckpoint`` callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_flagscale.checkpoint.recovery import find_latest_checkpoint

__all__ = ["FlagScaleLauncher", "auto_resume_path", "fit_arguments"]

# `Trainer.fit` hands `_fit_impl(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)`
# to the launcher; these are the positions read here.
_FIT_DATA, _FIT_DATAMODULE, _FIT_CKPT = 1, 3, 4


def fit_arguments(function: Callable, args: tuple) -> dict[str, Any] | None:
    """The datamodule and ckpt_path a launched ``Trainer.fit`` was given, or None for validate/test/predict."""
    if getattr(function, "__name__", "") != "_fit_impl" or len(args) <= _FIT_CKPT:
        return None
    import lightning as L

    datamodule = args[_FIT_DATAMODULE]
    if datamodule is None and isinstance(args[_FIT_DATA], L.LightningDataModule):
        datamodule = args[_FIT_DATA]
    return {"datamodule": datamodule, "ckpt_path": args[_FIT_CKPT]}


def auto_resume_path(trainer: Any) -> Path | None:
    """The newest complete checkpoint in the ``dirpath`` of the trainer's ``ModelCheckpoint`` callbacks, or None.

    Incomplete checkpoints are skipped with a warning (``checkpoint.recovery``); they are cleaned up by rank 0 when
    the chosen checkpoint is loaded.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders = [Path(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if not folders:
        raise ValueError(
            "FlagScaleStrategy(resume='auto') looks for checkpoints in the `dirpath` of a ModelCheckpoint callback;"
            " add `ModelCheckpoint(dirpath=..., every_n_train_steps=N, save_last=True)` to the Trainer's callbacks."
        )
    found = [p for p in (find_latest_checkpoint(f) for f in folders) if p is not None]
    if not found:
        return None
    from lightning_flagscale.checkpoint.sharded import read_meta

    return max(found, key=lambda p: (int(read_meta(p).get("global_step", -1)), p.stat().st_mtime))


class FlagScaleLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (it spawns nothing when the processes were created externally, e.g. torchrun)
    that first runs ``validate(datamodule)`` and, for ``resume="auto"``, picks the checkpoint to resume from."""

    def __init__(
        self, *args: Any, validate: Callable[[Any], None], resume: str | None, spawn: bool, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._validate = validate
        self._resume = resume
        self._spawn = spawn

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        fit = fit_arguments(function, args)
        self._validate(fit["datamodule"] if fit else None)
        chosen = None
        if fit is not None and self._resume == "auto" and fit["ckpt_path"] is None and trainer is not None:
            if trainer.ckpt_path is None:
                chosen = auto_resume_path(trainer)
            if chosen is not None:
                rank_zero_info(f"FlagScaleStrategy(resume='auto'): resuming from {chosen}")
                trainer.ckpt_path = str(chosen)  # Lightning's own (public) way to choose the checkpoint of `fit`
        try:
            if self._spawn:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            return function(*args, **kwargs)
        finally:
            if chosen is not None:
                trainer.ckpt_path = None  # a later `validate`/`test` must not reload it
