"""A LoRA run's DCP checkpoint as the adapted module, for a merged HF export (issue 40 items 3-4).

The checkpoint holds the adapters (and their optimizer state), not the frozen base: ``meta.pt`` names the base
(``base_weights``: the HF folder or the preset and ``init_seed``, with a SHA-256) and holds the module's
``hyper_parameters`` (config, ``hf_dir``, ``init_seed``, ``lora``). :func:`module_from_lora_checkpoint` rebuilds the
module on this process's CPU from them (the base read from ``hf_dir`` or re-initialised from the seed, its hash
checked against the checkpoint's), then reads the adapters in; ``export_hf`` then writes it merged
(``W + scaling * B @ A``), as it does for a trained module. A checkpoint written before adapters-only checkpoints
(base and adapters both in it, no ``base_weights``) gives the base from the checkpoint instead.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.convert.registry import HFConversionError, lightning_module_for
from lightning_flagscale.models.lightning import CausalLMModule
from lightning_flagscale.models.lora import check_base_weights, is_adapter_name

__all__ = ["holds_lora_adapters", "module_from_lora_checkpoint"]

_PREFIX = "state_dict."


def _tensor_keys(path: Path) -> dict[str, TensorStorageMetadata]:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def holds_lora_adapters(path: str | os.PathLike) -> bool:
    """Whether the DCP checkpoint folder ``path`` holds LoRA adapter weights."""
    path = Path(path)
    return (path / ".metadata").is_file() and any(is_adapter_name(k) for k in _tensor_keys(path))


def _module_class(config: Any) -> type:
    """The family's own LightningModule for a stored config (``VLMModule`` for a VLM's: the object, or a preset name
    or dict ``VLMConfig.owns``), else ``CausalLMModule``."""
    return lightning_module_for(config) or CausalLMModule


def module_from_lora_checkpoint(path: str | os.PathLike) -> Any:
    """The adapted ``CausalLMModule`` (or ``VLMModule``) a LoRA checkpoint folder was saved from, on this process's
    CPU (module docs)."""
    path = Path(path)
    meta_file = path / "meta.pt"
    if not meta_file.is_file():
        raise HFConversionError(
            f"{path} holds LoRA adapters but no meta.pt with the run's hyper_parameters (base, LoRA config), so "
            "they cannot be merged; export from the trained module (export_hf(module, out_dir) or HFExportCallback), "
            "or save the adapters alone with convert.peft.save_peft_adapter."
        )
    meta = torch.load(meta_file, map_location="cpu", weights_only=False)  # the strategy's own file: trusted
    hparams = dict(meta.get("hyper_parameters") or {})
    lora = LoRAConfig.from_value(hparams.get("lora"))
    if lora is None or "config" not in hparams:
        raise HFConversionError(f"{path}: meta.pt's hyper_parameters hold no LoRA config and model config to merge.")
    hparams["lora"] = dataclasses.replace(lora, adapter_dir=None)  # the checkpoint's adapters replace the start
    module = _module_class(hparams["config"])(**hparams)
    module.configure_model()  # base from hf_dir or the seeded init, adapters initialised (then overwritten)
    saved_base = meta.get("base_weights")
    if saved_base is not None:
        check_base_weights(saved_base, module.base_weights_reference(), path)
    stored = _tensor_keys(path)
    wanted = {
        name: p
        for name, p in module.state_dict(keep_vars=True).items()
        if is_adapter_name(name) or saved_base is None or _PREFIX + name in stored
    }
    missing = sorted(n for n in wanted if _PREFIX + n not in stored)
    if missing:
        raise HFConversionError(f"{path}: the checkpoint has no tensor for {missing[:3]} (expected by the module).")
    out = {_PREFIX + n: torch.empty(tuple(stored[_PREFIX + n].size), dtype=stored[_PREFIX + n].properties.dtype)
           for n in wanted}  # fmt: skip
    with warnings.catch_warnings():  # single-process on purpose: silence DCP's "assuming no_dist" warning
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    with torch.no_grad():
        for name, p in wanted.items():
            p.copy_(out[_PREFIX + name])
    return module
