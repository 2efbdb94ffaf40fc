"""``TransformerConfig``: shape and numerics of a decoder-only transformer (dense or MoE), validated on creation."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_flagscale.config.fields import check_known_fields
from lightning_flagscale.config.presets import PRESETS

__all__ = ["TransformerConfig"]


@dataclass(kw_only=True)
class TransformerConfig:
    """Shape and numerics of a decoder-only transformer (dense or MoE)."""

    name: str = "custom"
    """Preset name or free label."""
    hf_source: str | None = None
    """Hugging Face model this shape mirrors, for reference."""
    vocab_size: int = 256
    """Number of real tokens; the embedding is padded to ``padded_vocab_size`` for TP."""
    hidden_size: int = 64
    """Model width."""
    intermediate_size: int = 128
    """SwiGLU inner width of dense MLPs."""
    num_layers: int = 2
    """Number of decoder blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (GQA); ``None`` means equal to ``num_attention_heads``."""
    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden_size // num_attention_heads``."""
    max_seq_len: int = 256
    """Longest sequence the RoPE tables are built for."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """``None``, the Llama-3 variant ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` or YaRN ``{"rope_type": "yarn", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}`` (DeepSeek-V3; ``mscale_all_dim`` also scales the softmax)."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the LM head."""
    initializer_range: float = 0.02
    """Std of the normal init of weights."""
    attn_backend: Literal["torch", "flash_attn", "transformer_engine"] = "torch"
    """Core-attention kernel: ``torch`` runs anywhere; the others need their package and a GPU."""
    # ---- multi-head latent attention (DeepSeek-V2/V3 MLA; kv_lora_rank None means standard attention) ----
    kv_lora_rank: int | None = None
    """MLA: width of the joint key/value latent (``kv_a_proj_with_mqa`` -> RMSNorm -> ``kv_b_proj``); ``None``:
    standard multi-head / grouped-query attention."""
    q_lora_rank: int | None = None
    """MLA: width of the low-rank query (``q_a_proj`` -> RMSNorm -> ``q_b_proj``); ``None`` projects q directly."""
    qk_nope_head_dim: int = 0
    """MLA: per-head width of the query/key part without position encoding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head width of the rotary query part; the rotary key part is one head shared by all heads."""
    v_head_dim: int | None = None
    """MLA: per-head value width; ``None`` means ``qk_nope_head_dim + qk_rope_head_dim``."""
    rope_interleave: bool = False
    """MLA: the rotary query/key channels come in interleaved pairs (DeepSeek checkpoints), de-interleaved by RoPE."""
    # ---- multi-token prediction (DeepSeek-V3 MTP; 0 means none) ----
    num_nextn_predict_layers: int = 0
    """MTP depth D: modules after the main model, the k-th predicting the token k + 1 positions ahead (HF's
    ``num_nextn_predict_layers``). Each is RMSNorm(hidden) and RMSNorm(embedding of the tokens shifted by k),
    concatenated, projected 2h -> h, one transformer block, its own final norm and the shared LM head."""
    mtp_loss_weight: float = 0.1
    """MTP loss weight lambda: the training loss gets ``lambda / D * sum_k L_k`` on top of the unchanged main loss
    (Megatron's ``--mtp-loss-scaling-factor``); the weight until the first switch of ``mtp_loss_weight_schedule``."""
    mtp_loss_weight_schedule: list[list[int | float]] | None = None
    """Piecewise-constant MTP loss weight: ``[[at, weight], ...]``, ``at`` >= 1 and increasing in the unit of
    ``mtp_loss_weight_schedule_unit``, sets the weight to ``weight`` from that point on; ``mtp_loss_weight`` holds
    before the first switch. DeepSeek-V3's 0.3 for the first 10T tokens, then 0.1: ``mtp_loss_weight=0.3``,
    ``mtp_loss_weight_schedule=[[10_000_000_000_000, 0.1]]``, ``mtp_loss_weight_schedule_unit="tokens"``. Pairs may be
    tuples; they are kept as ``[int, float]`` lists (YAML and JSON dumps give those back unchanged)."""
    mtp_loss_weight_schedule_unit: Literal["steps", "tokens"] = "steps"
    """What the switch points of ``mtp_loss_weight_schedule`` count: ``steps``, optimizer steps done
    (``trainer.global_step``); ``tokens``, input tokens trained on in the optimizer steps done, over every data (and
    context) rank and accumulation step: samples x sequence length of each global batch, padding and ignored labels
    included (``CausalLMModule.tokens_trained``, saved in checkpoints). A step uses the weight of the count at its
    start, so a switch lands on the first step after the count reaches it."""
    # ---- MoE (num_experts == 0 means dense) ----
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 2
    """Top-k experts per token."""
    moe_intermediate_size: int | None = None
    """Inner width of each routed expert; ``None`` means ``intermediate_size``."""
    num_shared_experts: int = 0
    """Always-active shared experts (DeepSeek / Qwen2-MoE)."""
    shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert block; ``None`` means ``moe_intermediate_size * num_shared_experts``."""
    shared_expert_gate: bool = False
    """Sigmoid gate on the shared expert output (Qwen2-MoE)."""
    router_type: Literal["softmax", "sigmoid"] = "softmax"
    """Router scoring function."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to one."""
    first_k_dense_layers: int = 0
    """Leading blocks that keep a dense MLP (DeepSeek-V3)."""
    moe_layer_freq: int = 1
    """Every n-th block (after the dense ones) is MoE."""
    moe_aux_loss_coeff: float = 0.0
    """Switch-style load-balancing loss coefficient."""
    moe_z_loss_coeff: float = 0.0
    """Router z-loss coefficient."""
    moe_seq_aux_loss_coeff: float = 0.0
    """DeepSeek-V3's complementary sequence-wise balance loss factor alpha (f and P per sequence; HF ``aux_loss_alpha``
    with ``seq_aux``); layout-invariant, context-parallel shards of a sequence included."""
    moe_router_bias_update_rate: float = 0.0
    """DeepSeek-V3 aux-loss-free balancing: bias update speed (0 disables)."""
    moe_capacity_factor: float | None = None
    """``None`` for dropless routing; otherwise tokens over capacity are dropped."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: number of expert groups each token may use."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: number of expert groups."""
    moe_router_scaling_factor: float = 1.0
    """Multiplier on routing weights (DeepSeek-V3 ``routed_scaling_factor``)."""
    moe_aux_loss_scope: Literal["global", "local"] = "global"
    """Token statistics of the aux and z losses: ``global`` sums them over every rank holding the micro-batch's
    tokens (Megatron-Core's global aux loss; training does not depend on the layout), ``local`` uses each rank's."""
    moe_recompute: Literal["light", "medium", "full"] | None = None
    """MoE activation recompute: ``light`` (activation, permute, router), ``medium`` (+ shared expert, expert FC1),
    ``full`` (whole block, all-to-alls included) or ``None``."""
    moe_recompute_token_threshold: int | None = None
    """Adaptive MoE recompute: only when the busiest expert-parallel rank holds more rows than this."""
    moe_hot_expert_replicas: int = 0
    """Under expert parallelism, replicate this many of the most-loaded experts on every EP rank (0 = off)."""
    moe_hot_expert_enable_imbalance: float = 1.5
    """Hot-expert replication starts when max/mean tokens per expert reaches this."""
    moe_hot_expert_disable_imbalance: float = 1.2
    """Hot-expert replication stops when max/mean tokens per expert falls to this."""

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.kv_lora_rank is not None:
            self._check_mla()
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly or change one of them."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of num_key_value_heads="
                f"{self.num_key_value_heads} (grouped-query attention)."
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", "llama3")
            if rope_type not in ("llama3", "default", "yarn"):
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use 'llama3', 'yarn' or None.")
            missing = [k for k in ("factor", "original_max_position_embeddings") if k not in self.rope_scaling]
            if rope_type == "yarn" and missing:
                raise ValueError(f"rope_scaling of type 'yarn' needs {missing}; got {self.rope_scaling}.")
        if self.num_experts:
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} is larger than num_experts={self.num_experts};"
                    " lower the top-k or add experts."
                )
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            if min(self.moe_aux_loss_coeff, self.moe_z_loss_coeff, self.moe_seq_aux_loss_coeff) < 0:
                raise ValueError(
                    f"MoE loss coefficients must be >= 0; got moe_aux_loss_coeff={self.moe_aux_loss_coeff},"
                    f" moe_z_loss_coeff={self.moe_z_loss_coeff}, moe_seq_aux_loss_coeff={self.moe_seq_aux_loss_coeff}."
                )
            if self.moe_aux_loss_scope not in ("global", "local"):
                raise ValueError(f"moe_aux_loss_scope={self.moe_aux_loss_scope!r}; use 'global' or 'local'.")
            if self.moe_recompute not in (None, "light", "medium", "full"):
                raise ValueError(f"moe_recompute={self.moe_recompute!r}; use 'light', 'medium', 'full' or None.")
            if self.moe_hot_expert_replicas < 0 or self.moe_hot_expert_replicas > self.num_experts:
                raise ValueError(
                    f"moe_hot_expert_replicas={self.moe_hot_expert_replicas} must be in [0, num_experts="
                    f"{self.num_experts}]."
                )
        if self.num_nextn_predict_layers < 0 or self.mtp_loss_weight < 0:
            raise ValueError(
                f"num_nextn_predict_layers={self.num_nextn_predict_layers} and mtp_loss_weight="
                f"{self.mtp_loss_weight} must be >= 0."
            )
        if self.mtp_loss_weight_schedule_unit not in ("steps", "tokens"):
            raise ValueError(
                f"mtp_loss_weight_schedule_unit={self.mtp_loss_weight_schedule_unit!r} is unknown; use 'steps' or"
                " 'tokens'."
            )
        if self.mtp_loss_weight_schedule is not None:
            self.mtp_loss_weight_schedule = self._check_mtp_schedule(self.mtp_loss_weight_schedule)
        if self.attn_backend not in ("torch", "flash_attn", "transformer_engine"):
            raise ValueError(
                f"attn_backend={self.attn_backend!r} is unknown; use 'torch', 'flash_attn' or 'transformer_engine'."
            )

    def _check_mtp_schedule(self, schedule: Any) -> list[list[int | float]]:
        """``mtp_loss_weight_schedule`` as a list of ``[int at, float weight]`` (lists, which YAML and JSON dumps
        give back unchanged), or a ValueError saying what to fix."""
        unit = self.mtp_loss_weight_schedule_unit
        what = unit[:-1]  # "step" or "token": the name of a switch point in the messages
        example = "1000" if unit == "steps" else "10_000_000_000_000"
        usage = (
            f" Give a list of [{what}, weight] pairs, e.g. [[{example}, 0.1]]: the weight becomes 0.1 once {example}"
            f" {unit} are done (mtp_loss_weight before)."
        )
        if not self.num_nextn_predict_layers:
            raise ValueError(
                "mtp_loss_weight_schedule is set but num_nextn_predict_layers=0 (no MTP module to weight); set"
                " num_nextn_predict_layers >= 1 or drop the schedule."
            )
        if isinstance(schedule, (str, bytes, dict)) or not hasattr(schedule, "__iter__"):
            raise ValueError(f"mtp_loss_weight_schedule={schedule!r} is not a list of ({what}, weight) pairs.{usage}")
        out: list[list[int | float]] = []
        for entry in schedule:
            pair = list(entry) if isinstance(entry, (list, tuple)) else None
            if pair is None or len(pair) != 2:
                raise ValueError(f"mtp_loss_weight_schedule entry {entry!r} is not a ({what}, weight) pair.{usage}")
            at, weight = pair
            if unit == "tokens" and isinstance(at, float) and at.is_integer():
                at = int(at)  # YAML reads 1.0e13 as a float
            if isinstance(at, bool) or not isinstance(at, int):
                raise ValueError(f"mtp_loss_weight_schedule {what} {at!r} (in {entry!r}) is not an integer.{usage}")
            number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
            if not number or not math.isfinite(weight) or weight < 0:
                raise ValueError(
                    f"mtp_loss_weight_schedule weight {weight!r} (in {entry!r}) must be a finite number >= 0.{usage}"
                )
            if at < 1:
                raise ValueError(
                    f"mtp_loss_weight_schedule {what} {at} (in {entry!r}) must be >= 1: the weight of {what} 0 is"
                    f" mtp_loss_weight={self.mtp_loss_weight}."
                )
            if out and at <= out[-1][0]:
                raise ValueError(
                    f"mtp_loss_weight_schedule {unit} must increase: {at} (in {entry!r}) follows {out[-1][0]}.{usage}"
                )
            out.append([at, float(weight)])
        return out

    def mtp_loss_weight_at(self, done: int) -> float:
        """The MTP loss weight of a step that starts with ``done`` optimizer steps (``trainer.global_step``) or
        tokens (``CausalLMModule.tokens_trained``) behind it, as ``mtp_loss_weight_schedule_unit`` says: the last
        switch at or before ``done``, else ``mtp_loss_weight``."""
        weight = self.mtp_loss_weight
        for start, value in self.mtp_loss_weight_schedule or ():
            if done < start:
                break
            weight = value
        return weight

    def _check_mla(self) -> None:
        """MLA shapes: every head has its own key and value (from the latent), so no grouped KV heads."""
        for name in ("kv_lora_rank", "qk_rope_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"Multi-head latent attention needs {name} >= 1, got {getattr(self, name)}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates channel pairs).")
        if self.qk_nope_head_dim < 0 or (self.q_lora_rank is not None and self.q_lora_rank < 1):
            raise ValueError(
                f"qk_nope_head_dim={self.qk_nope_head_dim} must be >= 0 and q_lora_rank={self.q_lora_rank} >= 1 or None."
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"Multi-head latent attention has one key/value head per query head; set num_key_value_heads="
                f"{self.num_attention_heads} (or None) instead of {self.num_key_value_heads}."
            )
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim is None:
            self.head_dim = qk
        elif self.head_dim != qk:
            raise ValueError(
                f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = {qk} under MLA (or None)."
            )
        if self.v_head_dim is None:
            self.v_head_dim = qk
        elif self.v_head_dim < 1:
            raise ValueError(f"v_head_dim={self.v_head_dim} must be >= 1.")

    @property
    def is_mla(self) -> bool:
        """Whether attention is DeepSeek's multi-head latent attention."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates per head: ``qk_rope_head_dim`` under MLA, else ``head_dim``."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` uses a routed-expert MLP."""
        if not self.is_moe or index < self.first_k_dense_layers:
            return False
        return (index - self.first_k_dense_layers) % self.moe_layer_freq == 0

    def padded_vocab_size(self, multiple: int = 1) -> int:
        """Vocabulary rounded up to a multiple of ``multiple`` (the TP size): rows past ``vocab_size`` are padding."""
        return math.ceil(self.vocab_size / multiple) * multiple

    def num_params(self, include_embedding: bool = True, *, active: bool = False) -> int:
        """Parameter count of the dense/MoE decoder (no padding), for planning and reports.

        ``active=True`` counts only what one token runs through: ``num_experts_per_tok`` routed experts per MoE
        layer (plus shared experts and the router), the FLOP-relevant count (6 x active params x tokens).
        """
        h, q, kv, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        if self.is_mla:
            attn = self._mla_params()
        else:
            attn = h * q * d + 2 * h * kv * d + q * d * h
            if self.attention_bias:
                attn += q * d + 2 * kv * d
            if self.qk_norm:
                attn += 2 * d
        dense_mlp = 3 * h * self.intermediate_size
        total = 0
        # MTP modules (DeepSeek-V3): a block each, plus enorm, hnorm, eh_proj (2h -> h) and their own final norm.
        for i in range(self.num_layers + self.num_nextn_predict_layers):
            total += attn + 2 * h + (3 * h + 2 * h * h if i >= self.num_layers else 0)
            if self.is_moe_layer(i):
                routed = self.num_experts_per_tok if active else self.num_experts
                total += routed * 3 * h * self.moe_intermediate_size + h * self.num_experts
                if self.num_shared_experts:
                    shared = (
                        self.shared_expert_intermediate_size or self.moe_intermediate_size * self.num_shared_experts
                    )
                    total += 3 * h * shared + (h if self.shared_expert_gate else 0)
            else:
                total += dense_mlp
        total += h  # final norm
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def _mla_params(self) -> int:
        """Parameters of one MLA attention (projections, latent norms, biases on q_a / kv_a / o)."""
        h, n, d, v = self.hidden_size, self.num_attention_heads, self.head_dim, self.v_head_dim
        kv_a = self.kv_lora_rank + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = h * n * d
        else:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * d
        total = q + h * kv_a + self.kv_lora_rank + self.kv_lora_rank * n * (self.qk_nope_head_dim + v) + n * v * h
        if self.attention_bias:
            total += (self.q_lora_rank or 0) + kv_a + h
        return total

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TransformerConfig:
        """Build a config from a registered preset name, with optional field overrides."""
        if name not in PRESETS:
            close = difflib.get_close_matches(name, list(PRESETS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Unknown preset {name!r}.{hint} Available: {', '.join(sorted(PRESETS))}.")
        check_known_fields(cls, overrides)
        return cls(**{**PRESETS[name], "name": name, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
