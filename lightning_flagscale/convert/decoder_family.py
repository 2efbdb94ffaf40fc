"""Shared mapping for Llama-like decoders (Llama, Mistral, Qwen2, Qwen3 and the attention half of their MoEs).

Our module names are the HF ones minus the ``model.`` prefix, and our RoPE uses HF's rotate-half convention,
so every dense tensor maps one to one (no q/k permutation, unlike Meta's original checkpoints). What differs
between families is which optional tensors exist (q/k/v bias, q/k norm) and the ``config.json`` fields.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.convert.registry import HFConversionError, HFFamily
from lightning_flagscale.convert.specs import Direct, Spec
from lightning_flagscale.models.decoder import CausalLM

__all__ = ["DenseDecoderFamily", "field", "max_seq_len_ok", "reject_unless", "rope_from_hf", "rope_to_hf"]

# Declarative name map of one block: our suffix under ``layers.{i}.`` == HF suffix under ``model.layers.{i}.``.
ATTENTION_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
)
ATTENTION_BIAS_KEYS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
QK_NORM_KEYS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
DENSE_MLP_KEYS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")

_ROPE_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def field(hf: dict[str, Any], key: str, default: Any = ...) -> Any:
    """``hf[key]``; a missing required field is an error naming it (HF defaults are not guessed silently)."""
    value = hf.get(key, default)
    if value is ...:
        raise HFConversionError(f"config.json has no {key!r} field, which is required to build the model.")
    return value


def reject_unless(hf: dict[str, Any], key: str, allowed: tuple[Any, ...], why: str) -> None:
    """Raise if ``hf[key]`` is present and not one of ``allowed`` (absent means the HF default, which is allowed)."""
    if key in hf and hf[key] not in allowed:
        raise HFConversionError(
            f"config.json field {key!r}={hf[key]!r} is not supported ({why}); supported values: {list(allowed)}."
        )


def rope_from_hf(hf: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the legacy (``rope_theta``/``rope_scaling``) or v5 (``rope_parameters``)."""
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        raise HFConversionError("config.json field 'rope_parameters' is per layer type; only one RoPE is supported.")
    legacy = dict(hf.get("rope_scaling") or {})
    merged = {**legacy, **params}
    theta = float(merged.pop("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFConversionError("config.json field 'partial_rotary_factor' != 1.0 is not supported (full RoPE only).")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise HFConversionError(
            f"config.json field 'rope_scaling.rope_type'={rope_type!r} is not supported; supported: default, llama3."
        )
    missing = [k for k in _ROPE_LLAMA3_KEYS if k not in merged]
    if missing:
        raise HFConversionError(f"config.json llama3 'rope_scaling' lacks {missing}.")
    scaling = {"rope_type": "llama3", **{k: merged[k] for k in _ROPE_LLAMA3_KEYS}}
    scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return theta, scaling


def rope_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """Both spellings: legacy keys for transformers 4.x, ``rope_parameters`` for 5.x (they agree)."""
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    if scaling is not None and scaling.get("rope_type", "llama3") == "default":
        scaling = None
    params = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if scaling is not None:
        params.update(scaling)
    return {"rope_theta": config.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


class DenseDecoderFamily(HFFamily):
    """Llama-like family; subclasses set class attributes and extend the checks."""

    model_class = CausalLM
    implied: ClassVar[dict[str, Any]] = {}
    """TransformerConfig fields fixed by the architecture (e.g. Qwen2 always has q/k/v bias)."""
    attention_bias_key: ClassVar[str | None] = "attention_bias"
    """``config.json`` field of the q/k/v bias flag (``None``: the architecture fixes it, see ``implied``)."""
    attention_bias_default: ClassVar[bool] = False
    """Its value when the field is absent."""
    is_moe_family: ClassVar[bool] = False
    default_rope_theta: ClassVar[float] = 10000.0
    default_rms_norm_eps: ClassVar[float] = 1e-6

    # ---- config.json -> TransformerConfig ----
    def check_hf(self, hf: dict[str, Any], max_seq_len: int) -> None:
        """Reject values our decoder cannot reproduce exactly; subclasses add their own fields."""
        reject_unless(hf, "hidden_act", ("silu",), "the MLP is SwiGLU")
        reject_unless(hf, "mlp_bias", (False, None), "MLP projections have no bias")
        reject_unless(hf, "attention_dropout", (0, 0.0, None), "no attention dropout")
        reject_unless(hf, "use_sliding_window", (False, None), "no sliding-window attention")
        if "layer_types" in hf and any(t != "full_attention" for t in hf["layer_types"] or ()):
            raise HFConversionError(
                f"config.json field 'layer_types'={hf['layer_types']} is not supported; every layer must be "
                "'full_attention' (no sliding-window attention)."
            )

    def config_from_hf(self, hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
        heads = int(field(hf, "num_attention_heads"))
        hidden = int(field(hf, "hidden_size"))
        theta, scaling = rope_from_hf(hf, self.default_rope_theta)
        values: dict[str, Any] = dict(
            name=str(hf.get("_name_or_path") or self.model_type),
            hf_source=hf.get("_name_or_path") or None,
            vocab_size=int(field(hf, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(field(hf, "intermediate_size")),
            num_layers=int(field(hf, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            max_seq_len=int(hf.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(hf.get("rms_norm_eps", self.default_rms_norm_eps)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(hf.get(self.attention_bias_key, self.attention_bias_default))
            if self.attention_bias_key
            else False,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        values.update(self.implied)
        values.update(self.extra_from_hf(hf))
        values.update(overrides)
        self.check_hf(hf, values["max_seq_len"])
        return TransformerConfig(**values)

    def extra_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """Family-specific TransformerConfig fields (MoE settings)."""
        return {}

    # ---- TransformerConfig -> config.json ----
    def check_ours(self, config: TransformerConfig) -> None:
        for key, value in self.implied.items():
            if getattr(config, key) != value:
                raise HFConversionError(f"{self.model_type} requires {key}={value!r}, got {getattr(config, key)!r}.")
        if config.qk_norm and "qk_norm" not in self.implied:
            raise HFConversionError(f"{self.model_type} has no q/k norm; export with model_type='qwen3'.")
        if config.attention_bias and not self.attention_bias_key and not self.implied.get("attention_bias"):
            raise HFConversionError(f"{self.model_type} has no attention bias; export with model_type='qwen2'.")
        if config.is_mla:
            raise HFConversionError(f"{self.model_type} has no latent attention; export with model_type='deepseek_v3'.")
        if config.is_moe != self.is_moe_family:
            raise HFConversionError(
                f"{self.model_type} cannot express num_experts={config.num_experts}; pick "
                f"{'an MoE' if config.is_moe else 'a dense'} family."
            )

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        self.check_ours(config)
        out: dict[str, Any] = dict(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_seq_len,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act="silu",
            attention_dropout=0.0,
            tie_word_embeddings=config.tie_word_embeddings,
            initializer_range=config.initializer_range,
            **rope_to_hf(config),
        )
        if self.attention_bias_key:
            out[self.attention_bias_key] = config.attention_bias
        out.update(self.extra_to_hf(config))
        return out

    def extra_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        return {}

    # ---- weights ----
    def block_specs(self, config: TransformerConfig, i: int) -> dict[str, Spec]:
        keys = list(ATTENTION_KEYS)
        if config.attention_bias:
            keys += ATTENTION_BIAS_KEYS
        if config.qk_norm:
            keys += QK_NORM_KEYS
        specs: dict[str, Spec] = {k: Direct(f"model.layers.{i}.{k}") for k in keys}
        specs.update(self.mlp_specs(config, i))
        return specs

    def mlp_specs(self, config: TransformerConfig, i: int) -> dict[str, Spec]:
        """Our ``mlp.*`` suffixes of block ``i``; MoE families override for their expert layers."""
        return {k: Direct(f"model.layers.{i}.{k}") for k in DENSE_MLP_KEYS}

    def weight_specs(self, config: TransformerConfig) -> dict[str, Spec]:
        specs: dict[str, Spec] = {"embed_tokens.weight": Direct("model.embed_tokens.weight", pad_rows=True)}
        for i in range(config.num_layers):
            specs.update({f"layers.{i}.{k}": v for k, v in self.block_specs(config, i).items()})
        specs["norm.weight"] = Direct("model.norm.weight")
        # Tied checkpoints store only the embedding; our lm_head shares that tensor (and on a last pipeline
        # stage, which has no embedding, it is read from the embedding's HF name).
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        specs["lm_head.weight"] = Direct(head, pad_rows=True)
        return specs


def max_seq_len_ok(sliding_window: Any, max_seq_len: int) -> bool:
    """A sliding window at least as long as every sequence we run is plain causal attention."""
    return (
        sliding_window is None
        or (isinstance(sliding_window, int) and sliding_window >= max_seq_len)
        or (isinstance(sliding_window, float) and math.isinf(sliding_window))
    )
