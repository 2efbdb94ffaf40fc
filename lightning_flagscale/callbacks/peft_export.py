"""Write the trained LoRA adapters as a ``peft`` folder at the end of ``fit`` (issue 40).

Every rank takes part (adapters are gathered as the HF export gathers weights); rank 0 writes. The merged model is
``HFExportCallback``'s job: ``export_hf`` writes adapted layers merged.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_flagscale.callbacks.hf_export import format_out_dir
from lightning_flagscale.convert.peft import save_peft_adapter

__all__ = ["PeftExportCallback"]


class PeftExportCallback(L.Callback):
    """Save ``pl_module``'s adapters (a ``CausalLMModule`` with ``lora=...``) with ``save_peft_adapter`` when ``fit``
    ends.

    Args:
        out_dir: target folder; ``{step}``, ``{epoch}`` and ``{log_dir}`` (the logger's folder of this run) are
            filled in from the trainer. It must not exist.
    """

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = str(out_dir)
        self.last_export: Path | None = None

    def resolve_out_dir(self, trainer: L.Trainer) -> Path:
        return format_out_dir(self.out_dir, trainer)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = self.resolve_out_dir(trainer)
        self.last_export = save_peft_adapter(pl_module, out)
        rank_zero_info(f"PeftExportCallback: wrote the LoRA adapters (peft format) to {out}")
