"""Write the trained model as a Hugging Face folder at the end of ``fit`` (issue 6).

Every rank takes part (DTensor shards are gathered over their meshes, pipeline stages send their tensors to
rank 0); rank 0 writes into a temporary folder renamed into place, so a crash never leaves a half-written model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_flagscale.convert.hf_export import export_hf

__all__ = ["HFExportCallback"]


def format_out_dir(template: str, trainer: L.Trainer) -> Path:
    """An export folder template filled from the trainer: ``{step}``, ``{epoch}`` and ``{log_dir}``."""
    log_dir = trainer.log_dir if "{log_dir}" in template else None
    return Path(template.format(step=trainer.global_step, epoch=trainer.current_epoch, log_dir=log_dir))


class HFExportCallback(L.Callback):
    """Export ``pl_module`` (a ``CausalLMModule``) with ``export_hf`` when ``fit`` ends.

    Args:
        out_dir: target folder; ``{step}``, ``{epoch}`` and ``{log_dir}`` (the logger's folder of this run) are
            filled in from the trainer. It must not exist.
        max_shard_size: safetensors shard cap, e.g. ``"2GB"``.
        tokenizer_dir: tokenizer files to copy (default: those of the HF folder the model was imported from).
        dtype: cast the exported weights (e.g. ``torch.bfloat16``); default keeps the trained (master) dtype.
        model_type: HF family to export as (default: the imported one, else inferred from the config).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        max_shard_size: int | str = "2GB",
        tokenizer_dir: str | os.PathLike | None = None,
        dtype: torch.dtype | None = None,
        model_type: str | None = None,
    ) -> None:
        self.out_dir = str(out_dir)
        self.max_shard_size = max_shard_size
        self.tokenizer_dir = tokenizer_dir
        self.dtype = dtype
        self.model_type = model_type
        self.last_export: Path | None = None

    def resolve_out_dir(self, trainer: L.Trainer) -> Path:
        return format_out_dir(self.out_dir, trainer)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = self.resolve_out_dir(trainer)
        kwargs: dict[str, Any] = dict(
            max_shard_size=self.max_shard_size,
            tokenizer_dir=self.tokenizer_dir,
            dtype=self.dtype,
            model_type=self.model_type,
        )
        self.last_export = export_hf(pl_module, out, **kwargs)
        rank_zero_info(f"HFExportCallback: wrote Hugging Face model to {out}")
