"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention, YaRN RoPE, sigmoid group-limited routing.

Our module names are ``transformers``' (``self_attn.q_a_proj``, ``kv_a_proj_with_mqa``, ``mlp.gate.
e_score_correction_bias``, ``mlp.shared_experts.*``), so the map is one to one except the routed experts, stored
one tensor per expert on disk (grouped by ``convert.moe_family``'s ``Stack`` of gate/up ``Concat``s). The first
``first_k_dense_replace`` blocks keep a dense MLP; every later block is MoE. The router's correction bias is a
buffer and travels with the weights.

Multi-token prediction (``num_nextn_predict_layers = D``) is stored in DeepSeek's naming: MTP module ``k`` is layer
``model.layers.{num_hidden_layers + k}`` with the block's own names plus ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` (our ``mtp.layers.{k}.norm``) and copies of the shared embedding (``embed_tokens``) and head
(``shared_head.head``), read from the main tensors and written as copies of them. ``transformers`` writes the config
field but skips these layers: a checkpoint without them imports with ``num_nextn_predict_layers = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.decoder_family import field, reject_unless
from lightning_flagscale.convert.moe_family import MoEDecoderFamily
from lightning_flagscale.convert.registry import HFConversionError, register_family
from lightning_flagscale.convert.safetensors_io import HFCheckpointReader
from lightning_flagscale.convert.specs import Direct, Spec

__all__ = ["DeepseekV3Family"]

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_YARN_OPTIONAL = ("truncate", "attention_factor")


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling (default or YaRN) from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    merged = {**dict(hf.get("rope_scaling") or {}), **dict(hf.get("rope_parameters") or {})}
    theta = float(merged.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConversionError("config.json field 'partial_rotary_factor' != 1.0 is not supported.")
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise HFConversionError(f"config.json rope type {rope_type!r} is not supported; supported: default, yarn.")
    if merged.get("factor") is None:
        raise HFConversionError("config.json YaRN rope parameters lack 'factor'.")
    scaling: dict[str, Any] = {"rope_type": "yarn"}
    for key in _YARN_KEYS + _YARN_OPTIONAL:
        if merged.get(key) is not None:
            scaling[key] = merged[key]
    scaling.setdefault("original_max_position_embeddings", int(field(hf, "max_position_embeddings")))
    scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return theta, scaling


@dataclass(frozen=True)
class _Copies(Direct):
    """Read from ``name``; exported under ``name`` and every name of ``copies`` (the MTP layers' copies of the
    shared embedding and head)."""

    copies: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.copies)

    def split(self, full: torch.Tensor, hf_rows: int | None) -> dict[str, torch.Tensor]:
        one = super().split(full, hf_rows)[self.name]
        return {n: one for n in self.names()}


@dataclass(frozen=True)
class _ReadOnly(Direct):
    """Read from ``name``, never exported: a tensor that another of our names already writes (the last pipeline
    stage's copy of the embedding the MTP modules share)."""

    def split(self, full: torch.Tensor, hf_rows: int | None) -> dict[str, torch.Tensor]:
        return {}


@register_family
class DeepseekV3Family(MoEDecoderFamily):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    has_shared_expert = False  # not Qwen's gated ``shared_expert``: ``shared_experts`` is mapped below

    # ---- config.json -> TransformerConfig ----
    def check_hf(self, hf: dict[str, Any], max_seq_len: int) -> None:
        super().check_hf(hf, max_seq_len)
        heads = hf.get("num_attention_heads")
        if hf.get("num_key_value_heads") not in (None, heads):
            raise HFConversionError(
                f"config.json field 'num_key_value_heads'={hf['num_key_value_heads']} differs from "
                f"num_attention_heads={heads}; DeepSeek-V3's latent attention has one key/value head per query head."
            )
        reject_unless(hf, "topk_method", ("noaux_tc",), "routing is DeepSeek-V3's bias-corrected group top-k")
        reject_unless(hf, "scoring_func", ("sigmoid",), "DeepSeek-V3 scores experts with a sigmoid")
        reject_unless(hf, "moe_layer_freq", (1,), "every block after the dense ones is MoE")

    def config_from_hf(self, hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
        self.check_hf(hf, int(overrides.get("max_seq_len", hf.get("max_position_embeddings") or 4096)))
        theta, scaling = _rope_from_hf(hf)
        groups = hf.get("n_group")
        groups = int(groups) if groups else None
        values: dict[str, Any] = dict(
            name=str(hf.get("_name_or_path") or self.model_type),
            hf_source=hf.get("_name_or_path") or None,
            vocab_size=int(field(hf, "vocab_size")),
            hidden_size=int(field(hf, "hidden_size")),
            intermediate_size=int(field(hf, "intermediate_size")),
            num_layers=int(field(hf, "num_hidden_layers")),
            num_attention_heads=int(field(hf, "num_attention_heads")),
            max_seq_len=int(hf.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
            kv_lora_rank=int(field(hf, "kv_lora_rank")),
            qk_nope_head_dim=int(field(hf, "qk_nope_head_dim")),
            qk_rope_head_dim=int(field(hf, "qk_rope_head_dim")),
            v_head_dim=int(field(hf, "v_head_dim")),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            num_experts=int(field(hf, "n_routed_experts")),
            num_experts_per_tok=int(field(hf, "num_experts_per_tok")),
            moe_intermediate_size=int(field(hf, "moe_intermediate_size")),
            num_shared_experts=int(hf.get("n_shared_experts") or 0),
            router_type="sigmoid",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_k_dense_layers=int(hf.get("first_k_dense_replace") or 0),
            moe_router_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_router_num_groups=groups,
            moe_router_group_topk=int(hf["topk_group"]) if groups else None,
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0),
            # DeepSeek's config.json (not transformers' config class): the sequence-wise loss when ``seq_aux``
            moe_seq_aux_loss_coeff=float(hf.get("aux_loss_alpha") or 0.0) if hf.get("seq_aux") else 0.0,
        )
        values.update(overrides)
        return TransformerConfig(**values)

    # ---- TransformerConfig -> config.json ----
    def check_ours(self, config: TransformerConfig) -> None:
        if not config.is_mla or not config.is_moe:
            raise HFConversionError(
                "deepseek_v3 needs multi-head latent attention (kv_lora_rank) and routed experts (num_experts); got "
                f"kv_lora_rank={config.kv_lora_rank}, num_experts={config.num_experts}."
            )
        problems = {
            "router_type": (config.router_type, "sigmoid"),
            "moe_layer_freq": (config.moe_layer_freq, 1),
            "qk_norm": (config.qk_norm, False),
            "shared_expert_gate": (config.shared_expert_gate, False),
        }
        for key, (value, allowed) in problems.items():
            if value != allowed:
                raise HFConversionError(f"deepseek_v3 cannot express {key}={value!r} (HF uses {allowed!r}).")
        shared = config.shared_expert_intermediate_size
        if shared is not None and shared != config.moe_intermediate_size * config.num_shared_experts:
            raise HFConversionError(
                f"deepseek_v3's shared experts are num_shared_experts x moe_intermediate_size wide; got "
                f"shared_expert_intermediate_size={shared}."
            )
        if config.rope_scaling and config.rope_scaling.get("rope_type") not in ("yarn", "default"):
            raise HFConversionError(f"deepseek_v3 cannot express rope_scaling={config.rope_scaling}.")

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        self.check_ours(config)
        scaling = config.rope_scaling if config.rope_scaling and config.rope_scaling["rope_type"] == "yarn" else None
        params = {"rope_theta": config.rope_theta, "rope_type": "default", **(scaling or {})}
        return dict(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_attention_heads,
            head_dim=config.qk_rope_head_dim,  # what transformers writes (the RoPE width)
            max_position_embeddings=config.max_seq_len,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act="silu",
            attention_bias=config.attention_bias,
            attention_dropout=0.0,
            tie_word_embeddings=config.tie_word_embeddings,
            initializer_range=config.initializer_range,
            rope_theta=config.rope_theta,
            rope_scaling=dict(scaling) if scaling else None,
            rope_parameters=params,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            rope_interleave=config.rope_interleave,
            n_routed_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            n_shared_experts=config.num_shared_experts,
            norm_topk_prob=config.norm_topk_prob,
            first_k_dense_replace=config.first_k_dense_layers,
            routed_scaling_factor=config.moe_router_scaling_factor,
            n_group=config.moe_router_num_groups or 1,
            topk_group=config.moe_router_group_topk or 1,
            num_nextn_predict_layers=config.num_nextn_predict_layers,
            aux_loss_alpha=config.moe_seq_aux_loss_coeff,
            seq_aux=config.moe_seq_aux_loss_coeff > 0,
        )

    def checkpoint_hf_config(self, hf: dict[str, Any], root: Any) -> dict[str, Any]:
        """``transformers`` keeps ``num_nextn_predict_layers`` (default 1) in config.json but writes no MTP layer:
        without ``model.layers.{num_hidden_layers}.*`` tensors the checkpoint has no MTP modules."""
        if not int(hf.get("num_nextn_predict_layers") or 0):
            return hf
        prefix = f"model.layers.{int(field(hf, 'num_hidden_layers'))}."
        with HFCheckpointReader(root) as reader:
            present = any(name.startswith(prefix) for name in reader.weight_map)
        return hf if present else {**hf, "num_nextn_predict_layers": 0}

    def weight_specs(self, config: TransformerConfig) -> dict[str, Spec]:
        specs = super().weight_specs(config)
        depth, n = config.num_nextn_predict_layers, config.num_layers
        if not depth:
            return specs
        layers = [f"model.layers.{n + k}" for k in range(depth)]
        head = specs["lm_head.weight"]
        specs["embed_tokens.weight"] = _Copies(
            "model.embed_tokens.weight", pad_rows=True, copies=tuple(f"{p}.embed_tokens.weight" for p in layers)
        )
        specs["lm_head.weight"] = _Copies(
            head.name, pad_rows=True, copies=tuple(f"{p}.shared_head.head.weight" for p in layers)
        )
        specs["mtp.embed_tokens.weight"] = _ReadOnly("model.embed_tokens.weight", pad_rows=True)
        for k, p in enumerate(layers):
            ours = f"mtp.layers.{k}."
            specs.update({ours + key: spec for key, spec in self.block_specs(config, n + k).items()})
            for key, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                                ("norm", "shared_head.norm")):  # fmt: skip
                specs[f"{ours}{key}.weight"] = Direct(f"{p}.{theirs}.weight")
        return specs

    # ---- weights ----
    def block_specs(self, config: TransformerConfig, i: int) -> dict[str, Spec]:
        keys = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
        keys += ["self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight"]
        if config.q_lora_rank is None:
            keys.append("self_attn.q_proj.weight")
        else:
            keys += ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"]
        if config.attention_bias:
            keys += ["self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias"]
            keys += ["self_attn.q_a_proj.bias"] if config.q_lora_rank is not None else []
        specs: dict[str, Spec] = {k: Direct(f"model.layers.{i}.{k}") for k in keys}
        specs.update(self.mlp_specs(config, i))
        return specs

    def mlp_specs(self, config: TransformerConfig, i: int) -> dict[str, Spec]:
        specs = super().mlp_specs(config, i)  # dense MLP, or router + grouped experts
        if config.is_moe_layer(i):
            p = f"model.layers.{i}.mlp"
            specs["mlp.gate.e_score_correction_bias"] = Direct(f"{p}.gate.e_score_correction_bias")
            for name in ("gate_proj", "up_proj", "down_proj"):
                if config.num_shared_experts:
                    specs[f"mlp.shared_experts.{name}.weight"] = Direct(f"{p}.shared_experts.{name}.weight")
        return specs
