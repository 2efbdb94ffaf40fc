"""Export to a Hugging Face folder from a live (possibly parallelised) module or a sharded DCP checkpoint.

Tensors are produced one at a time in checkpoint order and streamed into size-capped safetensors shards, so
rank 0's peak memory is about one shard plus one full tensor, whatever the model size:

- live module: every rank walks the same FQN list; a DTensor is gathered with ``full_tensor()`` by the ranks
  holding it (its own mesh), and the lowest such rank sends it to rank 0 (pipeline stages other than rank 0's).
- DCP folder (written by the strategy with ``torch.distributed.checkpoint``, keys ``state_dict.<module FQN>``):
  each tensor is loaded alone with ``dcp.load(..., no_dist=True)``, which reassembles it from any layout.

Everything is written into a temporary folder that is renamed at the end (never half-written) and an
existing output folder is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.hf_import import unwrap_causal_lm
from lightning_flagscale.convert.hub import push_folder_to_hub
from lightning_flagscale.convert.lora_checkpoint import holds_lora_adapters, module_from_lora_checkpoint
from lightning_flagscale.convert.registry import HFConversionError, HFFamily, config_classes, family_for
from lightning_flagscale.convert.safetensors_io import ShardedSafetensorsWriter, atomic_output_dir
from lightning_flagscale.convert.specs import Direct
from lightning_flagscale.models.lora import adapter_modules, expert_adapter_modules, is_adapter_name, merged_weight

__all__ = ["MODEL_CONFIG_FILE", "TOKENIZER_FILES", "export_hf", "is_dcp_checkpoint", "write_model_config"]

MODEL_CONFIG_FILE = "model_config.json"
"""Our ``TransformerConfig`` next to a DCP checkpoint's ``.metadata`` (HF export needs the architecture)."""
HF_CONFIG_FILE = "hf_config.json"
"""The original ``config.json`` kept next to a checkpoint imported from HF (token ids, model_type)."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.json", "chat_template.jinja",
)  # fmt: skip
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_DCP_PREFIXES = ("state_dict.model.", "state_dict.", "model.", "")
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def write_model_config(ckpt_dir: str | os.PathLike, config: TransformerConfig) -> None:
    """Store ``config`` next to a DCP checkpoint so that ``export_hf(ckpt_dir, ...)`` can rebuild the HF config."""
    (Path(ckpt_dir) / MODEL_CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / ".metadata").is_file()


def export_hf(
    src: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "2GB",
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    model_type: str | None = None,
    config: TransformerConfig | None = None,
    generation_config: dict[str, Any] | None = None,
    push_to_hub: str | None = None,
    hub_revision: str | None = None,
    hub_private: bool | None = None,
) -> Path:
    """Write ``src`` as a Hugging Face folder ``out_dir`` (config.json, safetensors shards + index, ...).

    ``src``: a ``CausalLM`` / ``CausalLMModule`` (under a process group every rank must call this; rank 0 writes)
    or the folder of a DCP checkpoint (the architecture comes from ``config``, else a ``model_config.json`` in
    it, else ``hyper_parameters["config"]`` in the strategy's ``meta.pt``; a LoRA run's checkpoint is rebuilt as
    its adapted module, base and adapters, and written merged: ``convert/lora_checkpoint.py``). ``model_type``
    picks the HF family (default: the one the model was imported from, else inferred from its features);
    ``dtype`` casts the exported weights (default: as stored); ``tokenizer_dir`` (default: the HF folder the
    model came from, if known) provides tokenizer files to copy. Padded vocab rows are dropped.
    ``push_to_hub="org/name"`` then uploads the folder with ``huggingface_hub`` (rank 0; the repo is created if
    missing, ``hub_revision`` names a branch, ``hub_private`` its visibility on creation).
    """
    kwargs = dict(max_shard_size=max_shard_size, tokenizer_dir=tokenizer_dir, dtype=dtype, model_type=model_type,
                  config=config, generation_config=generation_config, push_to_hub=push_to_hub,
                  hub_revision=hub_revision, hub_private=hub_private)  # fmt: skip
    if isinstance(src, (str, os.PathLike)) and holds_lora_adapters(src):  # a LoRA run's: the adapted module, merged
        src = module_from_lora_checkpoint(src)
    if isinstance(src, (str, os.PathLike)):
        return _export(_DCPSource(Path(src), config), out_dir, **kwargs)
    with contextlib.ExitStack() as stack:
        # Flat ZeRO-3 (parallel/data_parallel/zero3_flat.py) holds row ranges of each parameter: every rank gathers the full
        # parameters for the export (found by the attribute it documents; convert/ does not import parallel/).
        for m in src.modules():
            if "_fs_flat_zero3" in m.__dict__:
                stack.enter_context(m.__dict__["_fs_flat_zero3"].full_params())
        return _export(_ModuleSource(src), out_dir, **kwargs)


def _export(
    source: _DCPSource | _ModuleSource,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str,
    tokenizer_dir: str | os.PathLike | None,
    dtype: torch.dtype | None,
    model_type: str | None,
    config: TransformerConfig | None,
    generation_config: dict[str, Any] | None,
    push_to_hub: str | None,
    hub_revision: str | None,
    hub_private: bool | None,
) -> Path:
    config = source.config
    hf_base = source.hf_config or {}
    family = family_for({"model_type": model_type}) if model_type else _family_from(hf_base, config)
    specs = family.weight_specs(config)
    # User errors are raised on every rank before any collective, so all ranks fail alike and nothing is written.
    if Path(out_dir).exists():
        raise FileExistsError(f"Output folder {str(out_dir)!r} already exists; remove it or choose another path.")
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"tokenizer_dir {str(tokenizer_dir)!r} does not exist.")
    if dist.is_initialized():
        # Every rank has checked before rank 0 creates the folder: without this, a rank that reaches the check late
        # (a source without collectives, e.g. flat ZeRO-3 gathered beforehand) would see rank 0's finished output.
        dist.barrier()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        if isinstance(source, _ModuleSource):
            for name in specs:  # take part in the gathers; rank 0 writes
                if not (config.tie_word_embeddings and name == "lm_head.weight"):
                    source.get(name)
        dist.barrier()
        return Path(out_dir)
    with atomic_output_dir(out_dir) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_size)
        out_dtype = dtype
        for name, spec in specs.items():
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue  # HF tied checkpoints store only the embedding
            full = source.get(name)
            out_dtype = out_dtype or full.dtype
            hf_rows = config.vocab_size if isinstance(spec, Direct) and spec.pad_rows else None
            for hf_name, tensor in spec.split(full, hf_rows).items():
                writer.add(hf_name, tensor.to(dtype) if dtype is not None else tensor)
            del full
        writer.finish()
        hf_config = _hf_config_json(family, config, hf_base, out_dtype or torch.float32)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        _write_extras(tmp, source.hf_dir, tokenizer_dir, generation_config)
    if push_to_hub is not None:
        push_folder_to_hub(out_dir, push_to_hub, revision=hub_revision, private=hub_private)
    if dist.is_initialized():
        dist.barrier()
    return Path(out_dir)


def _family_from(hf_base: dict[str, Any], config: TransformerConfig) -> HFFamily:
    if hf_base.get("model_type"):
        return family_for(hf_base)
    return family_for(config)


def _hf_config_json(
    family: HFFamily, config: TransformerConfig, base: dict[str, Any], dtype: torch.dtype
) -> dict[str, Any]:
    out = family.config_to_hf(config)
    out.update({k: base[k] for k in _CARRIED_KEYS if k in base})
    # transformers 4.x reads torch_dtype, 5.x dtype.
    out["torch_dtype"] = out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def _write_extras(
    tmp: Path, hf_dir: str | None, tokenizer_dir: str | os.PathLike | None, generation_config: dict | None
) -> None:
    if generation_config is not None:
        (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    elif hf_dir and (Path(hf_dir) / "generation_config.json").is_file():
        shutil.copy2(Path(hf_dir) / "generation_config.json", tmp / "generation_config.json")
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else (Path(hf_dir) if hf_dir else None)
    if tok is not None and tok.is_dir():
        for file in TOKENIZER_FILES:
            if (tok / file).is_file():
                shutil.copy2(tok / file, tmp / file)


# ---------------------------------------------------------------------------------------------------------------------
# Sources: one full tensor per FQN of our CausalLM
# ---------------------------------------------------------------------------------------------------------------------


def _canonical(fqn: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


class _ModuleSource:
    """Full tensors of a live module; collective when a process group exists (every rank calls ``get``).

    A layer with LoRA adapters (``models/lora.py``) is exported merged, ``W + scaling * B @ A``: the HF model then
    computes what the adapted module does (issue 40).
    """

    def __init__(self, module: nn.Module) -> None:
        model = unwrap_causal_lm(module)
        self.config: TransformerConfig = model.config
        self.hf_dir: str | None = getattr(module, "hf_dir", None) or getattr(model, "hf_dir", None)
        self.hf_config: dict | None = getattr(module, "hf_config", None) or getattr(model, "hf_config", None)
        self.tensors: dict[str, Tensor] = {_canonical(k): v for k, v in model.state_dict(keep_vars=True).items()}
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        if self.distributed:
            # Who holds what (pipeline stages hold different parts): the lowest holder sends to rank 0.
            mine = {k: (tuple(v.shape), v.dtype) for k, v in self.tensors.items()}
            every: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(every, mine)
            self.owner = {}
            self.meta = {}
            for rank, held in enumerate(every):
                for k, meta in held.items():
                    self.owner.setdefault(k, rank)
                    self.meta.setdefault(k, meta)
        self.names = set(self.owner) if self.distributed else set(self.tensors)
        self.scaling = self._adapter_scaling(model)

    def _adapter_scaling(self, model: nn.Module) -> float | None:
        """The scale of the adapters (one LoRA config per model); None without adapters."""
        scales = {m.scaling for m in (*adapter_modules(model).values(), *expert_adapter_modules(model).values())}
        if self.distributed:  # a pipeline stage may hold none of them
            every: list[set] = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(every, scales)
            scales = set().union(*every)
        if len(scales) > 1:
            raise HFConversionError(f"Adapters with different scales {sorted(scales)}: cannot merge them for export.")
        if not scales and any(is_adapter_name(n) for n in self.names):
            raise HFConversionError("The module holds LoRA tensors but no LoRALinear layer: cannot merge them.")
        return next(iter(scales), None)

    def get(self, name: str) -> Tensor:
        """The full tensor ``name`` (rank 0; None elsewhere under a process group), adapters merged in."""
        full = self._get(name)
        layer = name.removesuffix(".weight")
        parent, _, leaf = name.rpartition(".")  # per-expert adapters: <experts>.lora_A.<gate_up_proj|down_proj>
        magnitude = None
        if self.scaling is not None and f"{layer}.lora_A.weight" in self.names:
            lora_a, lora_b = self._get(f"{layer}.lora_A.weight"), self._get(f"{layer}.lora_B.weight")
            if f"{layer}.lora_magnitude_vector" in self.names:  # DoRA: rows rescaled to m
                magnitude = self._get(f"{layer}.lora_magnitude_vector")
        elif self.scaling is not None and f"{parent}.lora_A.{leaf}" in self.names:
            lora_a, lora_b = self._get(f"{parent}.lora_A.{leaf}"), self._get(f"{parent}.lora_B.{leaf}")
            if f"{parent}.lora_magnitude_vector.{leaf}" in self.names:  # per-expert DoRA: each expert's rows
                magnitude = self._get(f"{parent}.lora_magnitude_vector.{leaf}")
        else:
            return full
        return full if full is None else merged_weight(full, lora_a, lora_b, self.scaling, magnitude)

    @torch.no_grad()
    def _get(self, name: str) -> Tensor:
        from torch.distributed.tensor import DTensor

        local = self.tensors.get(name)
        full = None
        if local is not None:
            full = local.full_tensor() if isinstance(local, DTensor) else local.detach()
            full = full.cpu()
        if not self.distributed:
            if full is None:
                raise HFConversionError(f"The module has no tensor {name!r} (a pipeline stage without a group?).")
            return full
        if name not in self.owner:
            raise HFConversionError(f"No rank holds tensor {name!r}; cannot export an incomplete model.")
        owner, rank = self.owner[name], dist.get_rank()
        if owner == 0:
            return full if rank == 0 else None  # type: ignore[return-value]
        if rank == owner:
            dist.send(full.contiguous(), dst=0)
        elif rank == 0:
            shape, dtype = self.meta[name]
            full = torch.empty(shape, dtype=dtype)
            dist.recv(full, src=owner)
        return full  # type: ignore[return-value]


def _to_config(value: Any) -> TransformerConfig:
    """A TransformerConfig from what a checkpoint stores: the object, its dict, or a preset name."""
    if isinstance(value, TransformerConfig):
        return value

    for config_cls in config_classes():  # a family's own config class (the VLM's) claims its presets and dicts
        if config_cls.owns(value):
            return config_cls.from_preset(value) if isinstance(value, str) else config_cls.from_dict(dict(value))
    if isinstance(value, str):
        return TransformerConfig.from_preset(value)
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    return TransformerConfig(**{k: v for k, v in dict(value).items() if k in known})


class _DCPSource:
    """Full tensors of a DCP checkpoint folder, loaded one by one in a single process (any saved layout)."""

    def __init__(self, path: Path, config: TransformerConfig | None) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not is_dcp_checkpoint(path):
            raise HFConversionError(f"{path} is not a DCP checkpoint folder (no .metadata file).")
        self.path = path
        self.reader = FileSystemReader(str(path))
        metadata = self.reader.read_metadata()
        self.meta = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        adapters = sorted(k for k in self.meta if ".lora_A." in k or ".lora_B." in k)
        if adapters:  # exporting the base alone would silently drop what the run trained
            raise HFConversionError(
                f"{path} holds LoRA adapters ({adapters[0]}, ...), which an export of the checkpoint folder does not"
                " merge; export from the trained module instead (export_hf(module, out_dir) or HFExportCallback merge"
                " them), or save the adapters alone with convert.peft.save_peft_adapter."
            )
        hf_config = path / HF_CONFIG_FILE
        self.hf_config = json.loads(hf_config.read_text()) if hf_config.is_file() else None
        self.hf_dir: str | None = str(path)  # hf_to_ckpt copies tokenizer/generation files here
        self.config = config or self._read_config(path)
        self.keys = self._match_keys()

    def _read_config(self, path: Path) -> TransformerConfig:
        """``model_config.json`` (hf_to_ckpt), else the module's ``hyper_parameters["config"]`` in the strategy's
        ``meta.pt`` (Lightning's non-tensor checkpoint entries, see ``checkpoint/sharded.py``)."""
        file = path / MODEL_CONFIG_FILE
        if file.is_file():
            return _to_config(json.loads(file.read_text()))
        meta = path / "meta.pt"
        if meta.is_file():
            # Our own file written by the strategy (Lightning loop state, hparams): a trusted pickle.
            hparams = torch.load(meta, map_location="cpu", weights_only=False).get("hyper_parameters") or {}
            if hparams.get("config") is not None:
                if hparams.get("hf_dir") and self.hf_config is None:
                    hf_file = Path(hparams["hf_dir"]) / "config.json"
                    self.hf_config = json.loads(hf_file.read_text()) if hf_file.is_file() else None
                    self.hf_dir = str(hparams["hf_dir"])
                return _to_config(hparams["config"])
        raise HFConversionError(
            f"{path} has neither {MODEL_CONFIG_FILE} nor a meta.pt with hyper_parameters['config']; pass "
            "config=TransformerConfig(...) to export_hf, or save it with write_model_config(ckpt_dir, config)."
        )

    def _match_keys(self) -> dict[str, str]:
        """Our FQN -> DCP key, trying the prefixes the strategy may use (``state_dict.model.`` first)."""
        canonical = {_canonical(k): k for k in self.meta}
        for prefix in _DCP_PREFIXES:
            found = {k[len(prefix) :]: v for k, v in canonical.items() if k.startswith(prefix)}
            if "norm.weight" in found or "layers.0.input_layernorm.weight" in found:
                return found
        raise HFConversionError(
            f"{self.path}: no model weights found (looked for keys like 'state_dict.model.norm.weight'; the "
            f"checkpoint has e.g. {sorted(self.meta)[:5]})."
        )

    def get(self, name: str) -> Tensor:
        import torch.distributed.checkpoint as dcp

        key = self.keys.get(name)
        if key is None:
            raise HFConversionError(f"{self.path}: the checkpoint has no tensor for {name!r} (expected by the model).")
        meta = self.meta[key]
        out = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
        with warnings.catch_warnings():  # single-process on purpose: silence DCP's "assuming no_dist" warning
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(out, storage_reader=self.reader, no_dist=True)
        return out[key]
