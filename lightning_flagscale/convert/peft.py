"""LoRA adapters in ``peft``'s format, both ways (issue 40 item 3), without importing ``peft``.

A ``peft`` LoRA folder is ``adapter_config.json`` (``peft.LoraConfig``'s fields) plus ``adapter_model.safetensors``
whose keys are ``base_model.model.<HF module name>.lora_A.weight`` / ``.lora_B.weight`` (peft drops the adapter
name ``default`` when it saves). Our adapters sit on the layers whose HF names the family's converter map gives
(``Direct`` specs: ``layers.0.self_attn.q_proj.weight`` <-> ``model.layers.0.self_attn.q_proj.weight``), so the
mapping is the converter's, plus the two suffixes.

- :func:`save_peft_adapter`: from a live module of any layout (every rank calls it; tensors are gathered as the HF
  export gathers them, rank 0 writes), ``peft.PeftModel.from_pretrained(hf_model, folder)`` then computes what the
  module computes.
- :func:`lora_config_from_peft` and :func:`load_peft_adapter`: continue training a peft adapter;
  ``CausalLMModule(hf_dir=base, lora=lora_config_from_peft(folder))`` starts from its weights (registered as the
  ``"peft"`` weight source, which ``models/lora.py`` calls for ``LoRAConfig.adapter_dir``).
- Merging for a plain HF checkpoint is ``export_hf`` itself: it writes adapted layers merged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.convert.hf_export import _family_from, _ModuleSource
from lightning_flagscale.convert.hf_import import _local_box, unwrap_causal_lm
from lightning_flagscale.convert.registry import HFConversionError
from lightning_flagscale.convert.safetensors_io import atomic_output_dir
from lightning_flagscale.convert.specs import Direct
from lightning_flagscale.distributed.dtensor import copy_global_into
from lightning_flagscale.models.lora import (
    ADAPTER_KEYS,
    MAGNITUDE_KEY,
    adapter_modules,
    expert_adapter_modules,
    is_adapter_name,
)

__all__ = [
    "ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "load_peft_adapter", "lora_config_from_peft", "module_from_peft",
    "save_peft_adapter",
]  # fmt: skip

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# peft options whose non-default values change the math in ways our adapters do not model: refused on import.
_UNSUPPORTED = {
    "fan_in_fan_out": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
    "alpha_pattern": {}, "layers_to_transform": None, "use_qalora": False, "lora_bias": False,
}  # fmt: skip


def _peft_module_names(config: Any, hf_config: dict | None, layers: list[str]) -> dict[str, str]:
    """Our adapted layer name -> the HF module name peft uses for it (from the family's converter map)."""
    specs = _family_from(hf_config or {}, config).weight_specs(config)
    names = {}
    for layer in layers:
        spec = specs.get(f"{layer}.weight")
        if not isinstance(spec, Direct):
            raise HFConversionError(
                f"LoRA layer {layer!r} has no one-to-one HF tensor (its map is {type(spec).__name__}); peft's format "
                "needs the adapted layer to be one HF module."
            )
        names[layer] = spec.name.removesuffix(".weight")
    return names


def save_peft_adapter(module: nn.Module, out_dir: str | os.PathLike, *, lora: LoRAConfig | None = None) -> Path:
    """Write the adapters of ``module`` (a ``CausalLMModule`` with ``lora=...`` or its model) as a peft folder.

    Under a process group every rank must call this; rank 0 writes. ``lora`` defaults to ``module.lora``.
    """
    lora = lora or getattr(module, "lora", None)
    if lora is None:
        raise ValueError("save_peft_adapter needs the module's LoRAConfig (module.lora) or lora=...")
    source = _ModuleSource(module)
    adapters = sorted(n for n in source.names if is_adapter_name(n))
    if not adapters:
        raise HFConversionError("The module has no LoRA adapters to save (build it with lora=LoRAConfig(...)).")
    experts = [n for n in adapters if _is_expert_adapter(n)]
    if any(n.rsplit(".", 2)[-2] == MAGNITUDE_KEY and n.rsplit(".", 1)[-1] in _EXPERT_SLOT for n in adapters):
        raise HFConversionError(
            "The module has per-expert DoRA adapters (use_dora with `experts` in target_modules), which peft's "
            "format cannot hold: peft's target_parameters wrapper refuses use_dora. Export the merged model "
            "(export_hf) instead, or train the experts' adapters without DoRA."
        )
    adapters = [n for n in adapters if not _is_expert_adapter(n)]
    layers = sorted({n.rsplit(".", 1)[0] if n.endswith("." + MAGNITUDE_KEY) else n.rsplit(".", 2)[0] for n in adapters})
    hf_names = _peft_module_names(source.config, source.hf_config, layers)
    if Path(out_dir).exists():
        raise FileExistsError(f"Output folder {str(out_dir)!r} already exists; remove it or choose another path.")
    if dist.is_initialized():
        dist.barrier()  # every rank checked before rank 0 creates the folder
    tensors = {}
    for name in adapters:  # every rank takes part in each gather
        full = source._get(name)
        if name.endswith("." + MAGNITUDE_KEY):  # DoRA's m: peft's key has no ".weight"
            key = f"{_PEFT_PREFIX}{hf_names[name.rsplit('.', 1)[0]]}.{MAGNITUDE_KEY}"
        else:
            layer, kind, _ = name.rsplit(".", 2)
            key = f"{_PEFT_PREFIX}{hf_names[layer]}.{kind}.weight"
        if full is not None:
            tensors[key] = full.contiguous()
    for name in experts:  # per-expert adapters: peft's target_parameters layout (module docstring)
        full = source._get(name)
        parent, kind, weight = name.rsplit(".", 2)
        key = f"{_PEFT_PREFIX}model.{parent.removesuffix('.' + kind)}.{_EXPERT_SLOT[weight]}{kind}.weight"
        if full is not None:
            tensors[key] = _expert_to_peft(kind, full)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with atomic_output_dir(out_dir) as tmp:
            save_file(tensors, str(tmp / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
            config = _peft_config(lora, sorted(hf_names.values()), source.hf_dir, experts=bool(experts))
            (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return Path(out_dir)


# Per-expert adapters (models/lora.py's LoRAGroupedExperts) in peft's ``target_parameters`` format: peft wraps the
# experts module once per targeted parameter, the first listed innermost (keys ``<experts>.base_layer.lora_A.weight``
# for gate_up_proj, ``<experts>.lora_A.weight`` for down_proj), each with one expert-major ``lora_A`` [E r, in] and
# one expert-minor ``lora_B`` [out, r E] (peft's ``ParamWrapper.get_delta_weight``); ours are [E, r, in] / [E, out, r].
EXPERT_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_EXPERT_SLOT = {"gate_up_proj": "base_layer.", "down_proj": ""}


def _is_expert_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _EXPERT_SLOT and name.rsplit(".", 2)[-2] in ADAPTER_KEYS


def _expert_to_peft(kind: str, t: Tensor) -> Tensor:
    if kind == "lora_A":  # [E, r, in] -> [E r, in]
        return t.reshape(-1, t.shape[-1]).contiguous()
    return t.permute(1, 2, 0).reshape(t.shape[1], -1).contiguous()  # [E, out, r] -> [out, r E] (expert fastest)


def _expert_from_peft(kind: str, t: Tensor, experts: int) -> Tensor:
    if kind == "lora_A":  # [E r, in] -> [E, r, in]
        return t.reshape(experts, -1, t.shape[-1])
    return t.reshape(t.shape[0], -1, experts).permute(2, 0, 1).contiguous()  # [out, r E] -> [E, out, r]


def _peft_config(lora: LoRAConfig, hf_modules: list[str], base: str | None, *, experts: bool = False) -> dict[str, Any]:
    # A regex of ours is matched against our names (``layers.0...``), peft's against its own (``model.layers.0...``):
    # the explicit module list means the same to both. The experts go to target_parameters.
    targets = hf_modules if isinstance(lora.target_modules, str) else [t for t in lora.target_modules if t != "experts"]
    return {
        "target_parameters": EXPERT_TARGET_PARAMETERS if experts else None,
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets,
        "use_rslora": lora.use_rslora, "use_dora": lora.use_dora, "init_lora_weights": lora.init_lora_weights, "inference_mode": False,
        **_UNSUPPORTED,
    }  # fmt: skip


def _read_peft_config(adapter_dir: Path) -> dict[str, Any]:
    file = adapter_dir / ADAPTER_CONFIG_FILE
    if not file.is_file():
        raise HFConversionError(f"{adapter_dir} is not a peft adapter folder (no {ADAPTER_CONFIG_FILE}).")
    return json.loads(file.read_text())


def lora_config_from_peft(adapter_dir: str | os.PathLike, **overrides: Any) -> LoRAConfig:
    """The ``LoRAConfig`` of a peft LoRA folder, starting from its weights (``adapter_dir``); ``overrides`` change
    training-only fields (``dropout``). Raises naming the peft option we do not support."""
    root = Path(adapter_dir)
    peft = _read_peft_config(root)
    if peft.get("peft_type", "LORA") != "LORA":
        raise HFConversionError(
            f"{root / ADAPTER_CONFIG_FILE}: peft_type={peft['peft_type']!r}; only LORA adapters load."
        )
    for key, default in _UNSUPPORTED.items():
        value = peft.get(key)
        if value not in (None, default) and value not in ([], {}, False):
            raise HFConversionError(
                f"{root / ADAPTER_CONFIG_FILE}: {key}={value!r} is not supported (only {default!r})."
            )
    parameters = peft.get("target_parameters") or []
    if parameters and parameters != EXPERT_TARGET_PARAMETERS:
        raise HFConversionError(
            f"{root / ADAPTER_CONFIG_FILE}: target_parameters={parameters!r}; only the grouped experts' "
            f"{EXPERT_TARGET_PARAMETERS} (in that order) map onto our per-expert adapters."
        )
    if parameters and peft.get("use_dora"):
        raise HFConversionError(
            f"{root / ADAPTER_CONFIG_FILE}: use_dora with target_parameters; peft defines no DoRA for "
            "target_parameters (its ParamWrapper refuses it), so the folder cannot hold per-expert magnitudes."
        )
    targets = peft.get("target_modules")
    if isinstance(targets, str):
        raise HFConversionError(
            f"{root / ADAPTER_CONFIG_FILE}: target_modules is a regex over peft's module names ({targets!r}); list the "
            "modules instead."
        )
    fields = dict(
        rank=int(peft["r"]), alpha=float(peft.get("lora_alpha", 8)), dropout=float(peft.get("lora_dropout", 0.0)),
        target_modules=[t.removeprefix("model.") for t in targets or []] + (["experts"] if parameters else []),
        use_rslora=bool(peft.get("use_rslora")),
        use_dora=bool(peft.get("use_dora")), adapter_dir=str(root),
    )  # fmt: skip
    return LoRAConfig(**{**fields, **overrides})


def module_from_peft(module_cls: type, adapter_dir: str | os.PathLike, /, **module_kwargs: Any) -> Any:
    """``module_cls.from_hf(base, lora=lora_config_from_peft(adapter_dir))``: the base model the adapter names
    (``base_model_name_or_path``, or ``hf_dir=...``) with the adapter's weights, ready to continue training."""
    base = module_kwargs.pop("hf_dir", None) or _read_peft_config(Path(adapter_dir)).get("base_model_name_or_path")
    if not base:
        raise HFConversionError(f"{adapter_dir}: no base_model_name_or_path in {ADAPTER_CONFIG_FILE}; pass hf_dir=...")
    return module_cls.from_hf(base, lora=lora_config_from_peft(adapter_dir), **module_kwargs)


@torch.no_grad()
def load_peft_adapter(module: nn.Module, adapter_dir: str | os.PathLike) -> None:
    """Copy the weights of a peft LoRA folder into the adapters of ``module`` (a model, a pipeline stage or a module
    holding one at ``.model``; plain or parallelised: each rank reads only its shard). Every adapter of ``module``
    must be in the file, and every tensor of the file must be an adapter of the model (checked on the whole file)."""
    root = Path(adapter_dir)
    peft = _read_peft_config(root)
    model = unwrap_causal_lm(module)
    layers = adapter_modules(model)
    hf_config = getattr(module, "hf_config", None) or getattr(model, "hf_config", None)
    hf_names = _peft_module_names(model.config, hf_config, sorted(layers))
    file = root / ADAPTER_WEIGHTS_FILE
    if not file.is_file():
        raise HFConversionError(f"{root} has no {ADAPTER_WEIGHTS_FILE} (peft's .bin format is not read).")
    with safe_open(str(file), framework="pt") as reader:
        keys = set(reader.keys())
        for layer, adapted in layers.items():
            for key in ADAPTER_KEYS:
                name = f"{_PEFT_PREFIX}{hf_names[layer]}.{key}.weight"
                name = name if name in keys else name.replace(".weight", ".default.weight")
                if name not in keys:
                    raise HFConversionError(f"{file}: no tensor {name!r} for the adapter of {layer!r}.")
                _copy_slice(reader, name, getattr(adapted, key).weight, file)
            if adapted.lora_magnitude_vector is not None:  # DoRA
                name = f"{_PEFT_PREFIX}{hf_names[layer]}.{MAGNITUDE_KEY}"
                if name not in keys:
                    raise HFConversionError(f"{file}: no tensor {name!r} for the DoRA magnitude of {layer!r}.")
                _copy_slice(reader, name, adapted.lora_magnitude_vector, file)
        for layer, experts in expert_adapter_modules(model).items():  # peft's target_parameters layout
            for weight, slot in _EXPERT_SLOT.items():
                for kind in ADAPTER_KEYS:
                    name = f"{_PEFT_PREFIX}model.{layer}.{slot}{kind}.weight"
                    if name not in keys:
                        raise HFConversionError(f"{file}: no tensor {name!r} for the expert adapters of {layer!r}.")
                    target = getattr(getattr(experts, kind), weight)
                    full = _expert_from_peft(kind, reader.get_tensor(name), experts.num_experts)
                    if tuple(full.shape) != tuple(target.shape):
                        raise HFConversionError(
                            f"{file}: {name} gives {kind} of {weight} the shape {list(full.shape)}, the module's is "
                            f"{list(target.shape)}."
                        )
                    copy_global_into(target, full.to(target.dtype))
    rank = int(peft["r"])
    if any(m.lora_A.weight.shape[0] != rank for m in layers.values()):
        raise HFConversionError(f"{root / ADAPTER_CONFIG_FILE}: r={rank} differs from the module's adapters.")


def _copy_slice(reader: Any, name: str, target: Tensor, file: Path) -> None:
    from torch.distributed.tensor import DTensor

    shape = tuple(reader.get_slice(name).get_shape())
    if shape != tuple(target.shape):
        raise HFConversionError(f"{file}: {name} has shape {list(shape)}, the module's adapter {list(target.shape)}.")
    box = _local_box(target)
    local = target.to_local() if isinstance(target, DTensor) else target
    region = reader.get_slice(name)[tuple(slice(a, b) for a, b in box)]
    local.copy_(region.to(local.dtype))
