"""Registry of Hugging Face model families, keyed by ``config.json``'s ``model_type``.

A family is one small adapter (``models/<family>/hf.py``): ``config.json`` <-> ``TransformerConfig`` and a
declarative map from our parameter FQNs to HF tensor specs, with the model class it builds. Adding a family is one
file with ``@register_family`` in the family's folder, which registers when ``lightning_flagscale.models`` imports
it (``import lightning_flagscale`` does); nothing here dispatches on name prefixes (the torchtitan
``state_dict_adapter`` shape, STYLE.md 7).
"""

from __future__ import annotations

import abc
import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.specs import Spec

__all__ = [
    "HFConversionError",
    "HFFamily",
    "config_classes",
    "family_for",
    "lightning_module_for",
    "read_hf_config",
    "register_family",
    "supported_model_types",
]


class HFConversionError(ValueError):
    """A Hugging Face config or checkpoint that cannot be mapped exactly; the message names the field or tensor."""


class HFFamily(abc.ABC):
    """One HF architecture family: config mapping both ways and the weight name map."""

    model_type: ClassVar[str]
    """``config.json`` ``model_type`` this family handles."""
    architecture: ClassVar[str]
    """``architectures[0]`` written on export, e.g. ``LlamaForCausalLM``."""
    ignored_tensors: ClassVar[tuple[str, ...]] = (r"\.rotary_emb\.inv_freq$",)
    """Regexes of HF tensors that carry no weights (old checkpoints saved RoPE buffers)."""
    model_class: ClassVar[type]
    """The model built for this family's configs (``model_class(config, vocab_multiple=...)``)."""
    config_class: ClassVar[type[TransformerConfig]] = TransformerConfig
    """The config class of this family; a subclass (e.g. ``VLMConfig``) says which stored configs are its own
    through ``owns(value)``."""
    lightning_module: ClassVar[type | None] = None
    """The LightningModule that trains this family's ``config_class`` when it is not ``CausalLMModule`` (the VLM's
    ``VLMModule``): what a checkpoint of a stored config is rebuilt with (:func:`lightning_module_for`)."""

    @abc.abstractmethod
    def config_from_hf(self, hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
        """Map ``config.json`` (``overrides`` replace fields, e.g. ``max_seq_len``); any value that would change
        the math and is unsupported raises ``HFConversionError`` naming the field."""

    @abc.abstractmethod
    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        """The ``config.json`` dict for ``config`` (model_type and architectures included)."""

    @abc.abstractmethod
    def weight_specs(self, config: TransformerConfig) -> dict[str, Spec]:
        """Every parameter FQN of the full ``CausalLM`` -> the HF tensors it is made of."""

    def checkpoint_hf_config(self, hf: dict[str, Any], root: Any) -> dict[str, Any]:
        """``config.json`` as the checkpoint at ``root`` realises it (a family may correct fields its weights
        contradict, e.g. layers a writer skipped); the default is ``hf`` unchanged."""
        return hf

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.search(p, hf_name) for p in self.ignored_tensors)


_FAMILIES: dict[str, HFFamily] = {}


def register_family(cls: type[HFFamily]) -> type[HFFamily]:
    """Class decorator: make ``cls`` the converter for ``cls.model_type``."""
    if cls.model_type in _FAMILIES:
        raise ValueError(f"HF family {cls.model_type!r} is registered twice.")
    _FAMILIES[cls.model_type] = cls()
    return cls


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def config_classes() -> list[type[TransformerConfig]]:
    """The config classes of the registered families other than ``TransformerConfig`` itself (e.g. ``VLMConfig``)."""
    found = [f.config_class for f in _FAMILIES.values() if f.config_class is not TransformerConfig]
    return list(dict.fromkeys(found))


def lightning_module_for(config: Any) -> type | None:
    """The registered family's own LightningModule for ``config`` (a config object, or the preset name or dict of
    fields a checkpoint stored, as ``config_class.owns`` reads it); ``None``: ``CausalLMModule``'s."""
    for family in _FAMILIES.values():
        cls = family.config_class
        if family.lightning_module is None or cls is TransformerConfig:
            continue
        if isinstance(config, cls) or (isinstance(config, (str, dict)) and cls.owns(config)):
            return family.lightning_module
    return None


def family_for(hf_config: dict[str, Any] | TransformerConfig) -> HFFamily:
    """The family for an HF config dict (by ``model_type``) or for one of our configs (by its features)."""
    if isinstance(hf_config, TransformerConfig):
        return _family_for_ours(hf_config)
    model_type = hf_config.get("model_type")
    if model_type not in _FAMILIES:
        arch = hf_config.get("architectures")
        raise HFConversionError(
            f"Unsupported architecture: model_type={model_type!r} (architectures={arch}); supported model types: "
            f"{', '.join(sorted(_FAMILIES))}."
        )
    return _FAMILIES[model_type]


def _family_for_ours(config: TransformerConfig) -> HFFamily:
    """Pick the HF family that can express ``config``: a stored ``hf_model_type`` or inferred from features."""
    stored = getattr(config, "hf_model_type", None)  # e.g. VLMConfig: a family its features alone do not name
    if stored is not None:
        name = stored
    elif config.is_mla:
        name = "deepseek_v3"
    elif config.is_moe:
        if config.num_shared_experts:
            name = "qwen2_moe"
        elif config.qk_norm:
            name = "qwen3_moe"
        else:
            name = "mixtral"
    elif config.qk_norm:
        name = "qwen3"
    elif config.attention_bias:
        name = "qwen2"
    else:
        name = "llama"
    if name not in _FAMILIES:
        raise HFConversionError(f"No registered HF family can express this config (needs {name!r}).")
    return _FAMILIES[name]


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFConversionError(f"{path} does not exist; is {str(hf_dir)!r} a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFConversionError(f"{path} is not valid JSON: {err}") from err
