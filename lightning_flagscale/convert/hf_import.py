"""Import Hugging Face weights into a ``CausalLM`` of any parallel layout, reading only the local shards.

``load_hf_weights`` walks the target module's own state dict: parameters that are DTensors (TP, FSDP, EP
shards) get exactly their local region read from disk (``safe_open(...).get_slice(name)[box]``), and parts a
pipeline stage does not hold are simply absent, so nothing is read for them. Names, shapes and the
architecture are checked against the *whole* checkpoint first, so a bad checkpoint fails on every rank
with the same message naming the file and tensor.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.hub import resolve_hf_dir
from lightning_flagscale.convert.registry import HFConversionError, HFFamily, family_for, read_hf_config
from lightning_flagscale.convert.safetensors_io import HFCheckpointReader
from lightning_flagscale.convert.specs import Box, Spec, full_box, hf_names
from lightning_flagscale.models.lora import is_adapter_name

__all__ = [
    "ARCHITECTURE_FIELDS",
    "causal_lm_from_hf",
    "config_from_hf",
    "load_hf_weights",
    "module_from_hf",
    "unwrap_causal_lm",
]

ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias", "qk_norm", "tie_word_embeddings",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
    "shared_expert_intermediate_size", "shared_expert_gate", "router_type", "norm_topk_prob",
    "first_k_dense_layers", "moe_layer_freq", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "rope_interleave",
)  # fmt: skip
"""TransformerConfig fields that change the math; the module and the checkpoint must agree on all of them."""
_EXTRA_ARCHITECTURE_FIELDS = ("vision", "mrope_section", "image_token_id")

# Wrappers that activation checkpointing / torch.compile / FSDP1 insert into FQNs (same list as models/decoder.py).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def config_from_hf(hf_dir: str | os.PathLike, *, revision: str | None = None, **overrides: Any) -> TransformerConfig:
    """``TransformerConfig`` of an HF folder or Hub repo id; ``overrides`` set non-architectural fields (e.g.
    ``max_seq_len``)."""
    root = resolve_hf_dir(hf_dir, revision=revision)
    return _family_config(read_hf_config(root), root, **overrides)


def _family_config(hf: dict[str, Any], root: Path, **overrides: Any) -> TransformerConfig:
    try:
        family = family_for(hf)
        return family.config_from_hf(family.checkpoint_hf_config(hf, root), **overrides)
    except HFConversionError as err:  # name the file: users often juggle several model folders
        raise HFConversionError(f"{root / 'config.json'}: {err}") from err


def unwrap_causal_lm(module: nn.Module) -> nn.Module:
    """The ``CausalLM`` inside ``module`` (itself, or ``module.model`` for the LightningModule)."""
    for candidate in (module, getattr(module, "model", None)):
        is_model = hasattr(candidate, "pipeline_units") or hasattr(candidate, "stage_modules")  # stages of a pipeline
        if isinstance(candidate, nn.Module) and is_model and hasattr(candidate, "config"):
            return candidate
    raise TypeError(
        f"{type(module).__name__} is neither a CausalLM nor a module with a CausalLM at `.model`; HF conversion "
        "needs the reference decoder (lightning_flagscale.models.CausalLM)."
    )


def _canonical(fqn: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def _check_architecture(ours: TransformerConfig, theirs: TransformerConfig, where: Path) -> None:
    diffs = [
        f"{f}={getattr(ours, f)!r} (module) vs {getattr(theirs, f)!r} (checkpoint)"
        for f in ARCHITECTURE_FIELDS
        if getattr(ours, f) != getattr(theirs, f)
    ]
    # Fields of config subclasses (VLMConfig's vision tower, M-RoPE sections, special token ids).
    diffs += [
        f"{f}={getattr(ours, f, None)!r} (module) vs {getattr(theirs, f, None)!r} (checkpoint)"
        for f in _EXTRA_ARCHITECTURE_FIELDS
        if getattr(ours, f, None) != getattr(theirs, f, None)
    ]
    if diffs:
        raise HFConversionError(f"The module's config does not match {where / 'config.json'}: " + "; ".join(diffs))


def _check_names(reader: HFCheckpointReader, family: HFFamily, specs: dict[str, Spec], tied: bool) -> None:
    expected = set(hf_names(specs))
    missing = sorted(n for n in expected if n not in reader)
    if missing:
        raise HFConversionError(
            f"{len(missing)} tensor(s) missing from the checkpoint at {reader.root} ({family.model_type}): "
            + ", ".join(missing[:10])
            + (" ..." if len(missing) > 10 else "")
        )
    unexpected = [
        n
        for n in reader.weight_map
        if n not in expected and not family.is_ignored(n) and not (tied and n == "lm_head.weight")
    ]
    if unexpected:
        listed = ", ".join(f"{n} (in {reader.weight_map[n]})" for n in sorted(unexpected)[:10])
        raise HFConversionError(
            f"{len(unexpected)} unexpected tensor(s) in the checkpoint at {reader.root} that no parameter of the "
            f"{family.model_type} model uses: {listed}{' ...' if len(unexpected) > 10 else ''}"
        )


def _local_box(tensor: Tensor, placements: Any = None) -> Box:
    """Global region held by this rank: all of a plain tensor, the local shard of a DTensor (under ``placements``
    instead of its own, when given)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return full_box(tensor.shape)
    # Private but stable helper (DCP and torchtitan use it): local shape and global offset of the shard.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tensor.placements if placements is None else placements
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    return tuple((o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_hf_weights(module: nn.Module, hf_dir: str | os.PathLike) -> int:
    """Copy the HF checkpoint in ``hf_dir`` into ``module`` (a ``CausalLM`` or a module holding one at ``.model``).

    Works on plain modules and on parallelised ones (DTensor parameters from TP/FSDP/EP, pipeline stages missing
    parts); each rank reads only its shards. Padded vocab rows become zero. Persistent buffers that HF does not
    have (e.g. MoE router state) are reset as ``init_weights`` does, so this call replaces ``init_weights``.
    Raises ``HFConversionError``/``CheckpointFormatError`` naming the field, file or tensor at fault.
    Returns the number of tensor bytes this rank read.
    """
    model = unwrap_causal_lm(module)
    root = resolve_hf_dir(hf_dir)
    hf = read_hf_config(root)
    family = family_for(hf)
    _check_architecture(model.config, _family_config(hf, root, max_seq_len=model.config.max_seq_len), root)
    specs = family.weight_specs(model.config)
    # Reset buffers first (as init_weights does), so a buffer that HF does provide is then overwritten by it.
    for sub in model.modules():
        for buf in sub.buffers(recurse=False):
            buf.zero_()
        if sub is not model and hasattr(sub, "reset_buffers"):
            sub.reset_buffers()
    with HFCheckpointReader(root) as reader:
        _check_names(reader, family, specs, model.config.tie_word_embeddings)
        param_ids = {id(p) for p in model.parameters()}
        # In checkpoint-file order, so that each shard is mapped once (the reader keeps one file open).
        items = sorted(model.state_dict(keep_vars=True).items(), key=lambda kv: _file_order(reader, specs, kv[0]))
        for fqn, target in items:
            name = _canonical(fqn)
            spec = specs.get(name)
            if spec is None:
                if is_adapter_name(name):
                    continue  # LoRA adapters are not in the base checkpoint: the module initialises them
                if id(target) in param_ids:
                    raise HFConversionError(
                        f"Parameter {name!r} of the module has no source in the {family.model_type} checkpoint map."
                    )
                continue  # a buffer HF does not have: reset above
            _load_one(reader, name, spec, target)
        return reader.bytes_read


def _file_order(reader: HFCheckpointReader, specs: dict[str, Spec], fqn: str) -> str:
    spec = specs.get(_canonical(fqn))
    return reader.weight_map.get(spec.names()[0], "") if spec is not None else ""


def _load_one(reader: HFCheckpointReader, name: str, spec: Spec, target: Tensor) -> None:
    if target.device.type == "meta":
        raise RuntimeError(f"Parameter {name!r} is on the meta device; materialise the module (to_empty) first.")
    expected = spec.global_shape(reader.shape, tuple(target.shape))
    if tuple(target.shape) != tuple(expected):
        sources = ", ".join(f"{n} {list(reader.shape(n))} in {reader.file_of(n)}" for n in spec.names()[:4])
        raise HFConversionError(
            f"Shape mismatch for {name!r}: the module has {list(target.shape)}, the checkpoint gives "
            f"{list(expected)} (from {sources})."
        )
    from torch.distributed.tensor import DTensor

    local = target.to_local() if isinstance(target, DTensor) else target
    strided = _strided_dim(target)
    if strided is None:
        local.copy_(spec.read(reader.read, reader.shape, _local_box(target), local.dtype))
        return
    # Expert tensor parallelism's gate/up chunk: rows of `split_factor` blocks, not one box. Read the box spanning
    # them (the strided mesh dim taken as replicated) and keep this rank's rows of each block.
    from torch.distributed.tensor import Replicate

    mesh_dim, placement = strided
    placements = [Replicate() if i == mesh_dim else pl for i, pl in enumerate(target.placements)]
    region = spec.read(reader.read, reader.shape, _local_box(target, placements), local.dtype)
    k, coord = target.device_mesh.size(mesh_dim), target.device_mesh.get_coordinate()[mesh_dim]
    blocks = region.chunk(placement.split_factor, dim=placement.dim)
    local.copy_(torch.cat([block.chunk(k, dim=placement.dim)[coord] for block in blocks], dim=placement.dim))


def _strided_dim(tensor: Tensor) -> tuple[int, Any] | None:
    """(mesh dim, placement) of a DTensor's ``_StridedShard`` placement, or None."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return None
    return next(((i, pl) for i, pl in enumerate(tensor.placements) if isinstance(pl, _StridedShard)), None)


def causal_lm_from_hf(
    hf_dir: str | os.PathLike,
    *,
    revision: str | None = None,
    vocab_multiple: int = 1,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> nn.Module:
    """A plain (single-process) ``CausalLM`` with the weights of ``hf_dir`` (a folder or a Hub repo id).

    Built on the meta device and materialised empty, so weights are allocated once and never randomly initialised.
    """
    hf_dir = resolve_hf_dir(hf_dir, revision=revision)
    config = config_from_hf(hf_dir, **overrides)
    model_cls = family_for(config).model_class  # CausalLM, or the family's own (the VLM)
    with torch.device("meta"):
        model = model_cls(config, vocab_multiple=vocab_multiple)
    model = model.to_empty(device="cpu")
    if dtype is not None:
        model = model.to(dtype)
    load_hf_weights(model, hf_dir)
    model.hf_dir = str(hf_dir)  # export reuses its family, token ids, tokenizer and generation config
    model.hf_config = read_hf_config(hf_dir)
    return model


def module_from_hf(module_cls: type, hf_dir: str | os.PathLike, /, **module_kwargs: Any) -> Any:
    """``module_cls(config, **module_kwargs)`` for an HF folder: the body of ``CausalLMModule.from_hf``.

    Config fields may be overridden through ``config_overrides={...}``. The HF folder is recorded on the module
    as ``hf_dir`` (and the raw ``config.json`` as ``hf_config``, reused on export for token ids); weights are
    loaded right away if the module already holds a materialised ``CausalLM`` at ``.model``, otherwise the
    strategy must call ``load_hf_weights(module, module.hf_dir)`` after parallelising and materialising it,
    in place of ``init_weights``. ``hf_dir`` may be a Hub repo id (``revision=`` picks a branch, tag or commit):
    the module then records the local snapshot folder.
    """
    overrides = module_kwargs.pop("config_overrides", None) or {}
    hf_dir = resolve_hf_dir(hf_dir, revision=module_kwargs.pop("revision", None))
    config = config_from_hf(hf_dir, **overrides)
    if "hf_dir" in inspect.signature(module_cls).parameters:  # lets save_hyperparameters/LightningCLI record it
        module_kwargs["hf_dir"] = str(hf_dir)
    module = module_cls(config, **module_kwargs)
    module.hf_dir = str(hf_dir)
    module.hf_config = read_hf_config(hf_dir)
    inner = getattr(module, "model", None)
    if isinstance(inner, nn.Module) and all(p.device.type != "meta" for p in inner.parameters()):
        load_hf_weights(inner, hf_dir)
    return module
