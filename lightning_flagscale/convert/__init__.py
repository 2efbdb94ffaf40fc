"""Hugging Face <-> lightning-flagscale conversion (issue 6).

- ``load_hf_weights(module, hf_dir)``: stream HF safetensors into a plain or parallelised ``CausalLM``.
- ``causal_lm_from_hf(hf_dir)`` / ``module_from_hf(CausalLMModule, hf_dir)``: build and load.
- ``export_hf(module_or_dcp_dir, out_dir)``: write an HF folder loadable by ``AutoModelForCausalLM``.
- ``save_peft_adapter`` / ``load_peft_adapter`` / ``lora_config_from_peft``: LoRA adapters in peft's format
  (``peft.py``); ``export_hf`` writes adapted layers merged.
- ``hf_to_ckpt`` / ``ckpt_to_hf``: the ``lightning-flagscale convert`` commands.
- Every ``hf_dir`` may be a Hub repo id (``resolve_hf_dir``: cache, ``HF_HUB_OFFLINE``); ``export_hf(...,
  push_to_hub=repo_id)`` uploads the result (``push_folder_to_hub``).
- Families are registered by ``model_type`` from their folders, ``models/<family>/hf.py``, on top of the shared
  decoder and MoE mappings here (``decoder_family.py``, ``moe_family.py``); ``supported_model_types()`` lists them.
"""

from lightning_flagscale.convert.cli import add_convert_subcommands, ckpt_to_hf, hf_to_ckpt
from lightning_flagscale.convert.hf_export import export_hf, is_dcp_checkpoint, write_model_config
from lightning_flagscale.convert.hf_import import causal_lm_from_hf, config_from_hf, load_hf_weights, module_from_hf
from lightning_flagscale.convert.hub import push_folder_to_hub, resolve_hf_dir
from lightning_flagscale.convert.peft import (
    load_peft_adapter,
    lora_config_from_peft,
    module_from_peft,
    save_peft_adapter,
)
from lightning_flagscale.convert.registry import (
    HFConversionError,
    HFFamily,
    family_for,
    register_family,
    supported_model_types,
)
from lightning_flagscale.convert.safetensors_io import CheckpointFormatError
from lightning_flagscale.models.weights import WeightSource, register_weight_source

# Model code never imports converters: it finds them here, registered (see models/weights.py). Both the text and
# the vision-language modules resolve "hf" through it.
register_weight_source("hf", WeightSource(build_module=module_from_hf, load_weights=load_hf_weights))
# LoRA adapters in peft's format (issue 40): LoRAConfig(adapter_dir=...) starts the adapters from one.
register_weight_source("peft", WeightSource(build_module=module_from_peft, load_weights=load_peft_adapter))

__all__ = [
    "CheckpointFormatError",
    "HFConversionError",
    "HFFamily",
    "add_convert_subcommands",
    "causal_lm_from_hf",
    "ckpt_to_hf",
    "config_from_hf",
    "export_hf",
    "family_for",
    "hf_to_ckpt",
    "is_dcp_checkpoint",
    "load_hf_weights",
    "load_peft_adapter",
    "lora_config_from_peft",
    "module_from_hf",
    "module_from_peft",
    "push_folder_to_hub",
    "register_family",
    "resolve_hf_dir",
    "save_peft_adapter",
    "supported_model_types",
    "write_model_config",
]
