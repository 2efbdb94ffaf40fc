"""Typed, validated configuration: the parallel layout and the transformer shape.

Both dataclasses validate themselves where they live, before any process group exists, and every user
mistake raises ``ValueError``/``TypeError`` naming the value and the fix. Nothing here touches
``torch.distributed``: ``ParallelConfig`` is the one topology object the rest of the package reads.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "PRESETS",
    "ParallelConfig",
    "TransformerConfig",
    "check_known_fields",
]


def check_known_fields(cls: type, kwargs: dict[str, Any]) -> None:
    """Raise a ``TypeError`` naming unknown fields of dataclass ``cls`` and the closest valid name."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{cls.__name__} got an unknown field {key!r}.{hint} Valid fields: {', '.join(names)}.")


# --------------------------------------------------------------------------------------------------------------------
# Transformer shape
# --------------------------------------------------------------------------------------------------------------------


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
    """``None`` or the Llama-3 variant: ``{"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}``."""
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
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "llama3") not in ("llama3", "default"):
            raise ValueError(
                f"rope_scaling type {self.rope_scaling.get('rope_type')!r} is not supported; use 'llama3' or None."
            )
        if self.num_experts:
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} is larger than num_experts={self.num_experts};"
                    " lower the top-k or add experts."
                )
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            if self.moe_aux_loss_scope not in ("global", "local"):
                raise ValueError(f"moe_aux_loss_scope={self.moe_aux_loss_scope!r}; use 'global' or 'local'.")
            if self.moe_recompute not in (None, "light", "medium", "full"):
                raise ValueError(f"moe_recompute={self.moe_recompute!r}; use 'light', 'medium', 'full' or None.")
            if self.moe_hot_expert_replicas < 0 or self.moe_hot_expert_replicas > self.num_experts:
                raise ValueError(
                    f"moe_hot_expert_replicas={self.moe_hot_expert_replicas} must be in [0, num_experts="
                    f"{self.num_experts}]."
                )
        if self.attn_backend not in ("torch", "flash_attn", "transformer_engine"):
            raise ValueError(
                f"attn_backend={self.attn_backend!r} is unknown; use 'torch', 'flash_attn' or 'transformer_engine'."
            )

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

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the dense/MoE decoder (no padding), for planning and reports."""
        h, q, kv, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = h * q * d + 2 * h * kv * d + q * d * h
        if self.attention_bias:
            attn += q * d + 2 * kv * d
        if self.qk_norm:
            attn += 2 * d
        dense_mlp = 3 * h * self.intermediate_size
        total = 0
        for i in range(self.num_layers):
            total += attn + 2 * h
            if self.is_moe_layer(i):
                total += self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
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


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Presets as data: name -> fields. Tiny ones train on CPU in tests; real shapes are for planning and tuning.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(
        hf_source="meta-llama/Llama-3.2-1B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_seq_len=256,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 64},
        rms_norm_eps=1e-5,
    ),
    "qwen2-tiny": dict(
        hf_source="Qwen/Qwen2.5-0.5B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_seq_len=256,
        rope_theta=1000000.0,
        attention_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    "qwen3-tiny": dict(
        hf_source="Qwen/Qwen3-0.6B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_seq_len=256,
        rope_theta=1000000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    "mixtral-tiny": dict(
        hf_source="mistralai/Mixtral-8x7B-v0.1 (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_seq_len=256,
        rope_theta=1000000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        router_type="softmax",
        norm_topk_prob=True,
        moe_aux_loss_coeff=0.01,
    ),
    "qwen2-moe-tiny": dict(
        hf_source="Qwen/Qwen1.5-MoE-A2.7B (shape family)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_seq_len=256,
        rope_theta=1000000.0,
        attention_bias=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_shared_experts=1,
        shared_expert_intermediate_size=64,
        shared_expert_gate=True,
        router_type="softmax",
        norm_topk_prob=False,
        moe_aux_loss_coeff=0.001,
    ),
    "deepseek-v3-tiny": dict(
        hf_source="deepseek-ai/DeepSeek-V3 (router/expert layout; standard attention instead of MLA)",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_seq_len=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_shared_experts=1,
        router_type="sigmoid",
        norm_topk_prob=True,
        first_k_dense_layers=1,
        moe_router_bias_update_rate=1e-3,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_scaling_factor=2.5,
    ),
    # Real shapes, for planning, memory estimates and auto-tuning.
    "llama3-8b": dict(
        hf_source="meta-llama/Meta-Llama-3-8B",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "llama3.1-8b": dict(
        hf_source="meta-llama/Llama-3.1-8B",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5,
    ),
    "llama3-70b": dict(
        hf_source="meta-llama/Meta-Llama-3-70B",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_seq_len=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-7b": dict(
        hf_source="Qwen/Qwen2.5-7B",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_seq_len=32768,
        rope_theta=1000000.0,
        attention_bias=True,
        rms_norm_eps=1e-6,
    ),
    "qwen3-8b": dict(
        hf_source="Qwen/Qwen3-8B",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_seq_len=40960,
        rope_theta=1000000.0,
        qk_norm=True,
        rms_norm_eps=1e-6,
    ),
    "mixtral-8x7b": dict(
        hf_source="mistralai/Mixtral-8x7B-v0.1",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_seq_len=32768,
        rope_theta=1000000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        rms_norm_eps=1e-5,
    ),
}


# --------------------------------------------------------------------------------------------------------------------
# Parallel layout
# --------------------------------------------------------------------------------------------------------------------


RecomputeMode = Literal["none", "selective", "full"]


@dataclass(kw_only=True)
class ParallelConfig:
    """Degrees of every parallelism and the micro-batching around them.

    World = pp x dp x cp x tp, with tp fastest-varying in rank order (see ``parallel/mesh.py``). Experts fold
    over the dp x cp x tp ranks of a stage as edp x ep x etp (Megatron's MoE parallel folding).
    """

    tensor_parallel_size: int = 1
    """Megatron tensor parallel degree (heads, MLP columns/rows, vocab)."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages groups (ranks along the pipeline)."""
    virtual_pipeline_parallel_size: int = 1
    """Model chunks per pipeline rank (interleaved / V schedules)."""
    context_parallel_size: int = 1
    """Sequence split for attention (ring, Ulysses or both)."""
    context_parallel_mode: Literal["ring", "ulysses", "hybrid"] = "ring"
    """How attention is computed across the CP group."""
    ulysses_size: int | None = None
    """Ulysses degree inside CP for ``hybrid``; ``None`` means all of CP for ``ulysses`` and 1 for ``ring``."""
    expert_parallel_size: int = 1
    """Ranks the routed experts are split over."""
    expert_tensor_parallel_size: int = 1
    """Tensor parallel degree inside each expert; only 1 is supported (values > 1 are rejected)."""
    data_parallel_size: int | None = None
    """Data-parallel replicas; ``None`` derives it from the world size."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """0 = DDP, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters (FSDP2)."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over the TP group (needs TP > 1)."""
    micro_batch_size: int = 1
    """Samples per micro-batch fed through a pipeline schedule."""
    gradient_accumulation_steps: int = 1
    """Batches accumulated per optimizer step (sets the Trainer's ``accumulate_grad_batches``)."""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"] = "1f1b"
    """Pipeline schedule name."""
    pipeline_layers: list[int] | None = None
    """Explicit decoder layers per pipeline stage, e.g. ``[18, 14]``; ``None`` splits evenly or by cost."""
    hetero_dp_batch_sizes: list[int] | None = None
    """Heterogeneous data parallelism: samples per step for each data-parallel rank (stronger devices take more),
    e.g. ``[6, 2]``; ``None`` splits every batch evenly."""
    pipeline_balance: Literal["even", "cost"] = "even"
    """Without ``pipeline_layers``: equal layer slots per stage, or a split balancing per-unit parameter cost
    (embedding and LM head included)."""
    recompute: RecomputeMode | list[RecomputeMode] = "none"
    """Activation recompute per block: ``none``, ``selective`` (norms, activations) or ``full``; or one per stage."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_parallel_size",
            "context_parallel_size", "expert_parallel_size", "expert_tensor_parallel_size", "micro_batch_size",
            "gradient_accumulation_steps",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}.")
        if self.expert_tensor_parallel_size > 1:
            # Refused rather than ignored: nothing splits an expert's weights inside an EP rank (issue 11 item 5).
            raise ValueError(
                f"expert_tensor_parallel_size={self.expert_tensor_parallel_size} is not supported: experts are"
                " sharded across ranks by expert_parallel_size only, never split inside one. Set"
                " expert_tensor_parallel_size=1 (use expert_parallel_size to spread the experts)."
            )
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1 or None (auto), got {self.data_parallel_size}.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}.")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_parallel_size > 1 (it shards activations over the TP group);"
                " set tensor_parallel_size >= 2 or sequence_parallel=False."
            )
        if self.context_parallel_mode not in ("ring", "ulysses", "hybrid"):
            raise ValueError(
                f"context_parallel_mode={self.context_parallel_mode!r}; use 'ring', 'ulysses' or 'hybrid'."
            )
        if self.context_parallel_size % self.resolved_ulysses_size:
            raise ValueError(
                f"ulysses_size={self.resolved_ulysses_size} must divide context_parallel_size="
                f"{self.context_parallel_size} (hybrid CP = ring x ulysses)."
            )
        if self.virtual_pipeline_parallel_size > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(
                "virtual_pipeline_parallel_size > 1 needs pipeline_parallel_size > 1; raise the pipeline size or set"
                " virtual_pipeline_parallel_size=1."
            )
        modes = [self.recompute] if isinstance(self.recompute, str) else list(self.recompute)
        if any(m not in ("none", "selective", "full") for m in modes) or not modes:
            raise ValueError(f"recompute={self.recompute!r}: use 'none', 'selective' or 'full' (or one per stage).")
        if not isinstance(self.recompute, str) and len(modes) != self.num_stages:
            raise ValueError(
                f"recompute has {len(modes)} entries but there are {self.num_stages} pipeline stages; give one mode"
                " per stage (pipeline_parallel_size x virtual_pipeline_parallel_size) or a single mode."
            )
        if self.pipeline_balance not in ("even", "cost"):
            raise ValueError(f"pipeline_balance={self.pipeline_balance!r}; use 'even' or 'cost'.")
        if self.pipeline_layers is not None and len(self.pipeline_layers) != self.num_stages:
            raise ValueError(
                f"pipeline_layers has {len(self.pipeline_layers)} entries but there are {self.num_stages} stages"
                f" (pipeline_parallel_size x virtual_pipeline_parallel_size); give one layer count per stage."
            )

    # ---- derived sizes ----
    @property
    def resolved_ulysses_size(self) -> int:
        if self.ulysses_size is not None:
            return self.ulysses_size
        return self.context_parallel_size if self.context_parallel_mode == "ulysses" else 1

    @property
    def ring_size(self) -> int:
        return self.context_parallel_size // self.resolved_ulysses_size

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.virtual_pipeline_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one data replica: pp x cp x tp."""
        return self.pipeline_parallel_size * self.context_parallel_size * self.tensor_parallel_size

    @property
    def dp(self) -> int:
        if self.data_parallel_size is None:
            raise RuntimeError("data_parallel_size is not resolved yet; call resolve(world_size) first.")
        return self.data_parallel_size

    @property
    def tp_enabled(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline_parallel_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.context_parallel_size > 1

    @property
    def ep_enabled(self) -> bool:
        return self.expert_parallel_size > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def world_size(self) -> int:
        return self.dp * self.model_parallel_size

    # ---- validation against the outside world ----
    def resolve(self, world_size: int) -> ParallelConfig:
        """Derive ``data_parallel_size`` from ``world_size`` and check the product; returns ``self``."""
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"World size {world_size} is not divisible by pipeline x context x tensor = "
                f"{self.pipeline_parallel_size} x {self.context_parallel_size} x {self.tensor_parallel_size} = {mp};"
                " change the parallel sizes or the number of devices/nodes."
            )
        if self.data_parallel_size is None:
            self.data_parallel_size = world_size // mp
        elif self.data_parallel_size * mp != world_size:
            raise ValueError(
                f"data_parallel_size x pipeline x context x tensor = {self.data_parallel_size} x "
                f"{self.pipeline_parallel_size} x {self.context_parallel_size} x {self.tensor_parallel_size} = "
                f"{self.data_parallel_size * mp} does not match the world size {world_size}; set "
                f"data_parallel_size={world_size // mp} or leave it None (auto)."
            )
        if self.hetero_dp_batch_sizes is not None:
            from lightning_flagscale.parallel.hetero import check_hetero_batch_sizes

            check_hetero_batch_sizes(self.hetero_dp_batch_sizes, self.dp)
        folded = self.dp * self.context_parallel_size * self.tensor_parallel_size
        ep_etp = self.expert_parallel_size * self.expert_tensor_parallel_size
        if folded % ep_etp:
            raise ValueError(
                f"expert_parallel_size x expert_tensor_parallel_size = {ep_etp} must divide data x context x tensor"
                f" = {folded} (experts fold over the ranks of one pipeline stage); change expert_parallel_size."
            )
        return self

    def validate_model(self, config: TransformerConfig) -> None:
        """Check that ``config`` can be split the way this layout asks."""
        tp = self.tensor_parallel_size
        if config.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads={config.num_attention_heads} is not divisible by tensor_parallel_size={tp};"
                " choose a TP size that divides the head count."
            )
        if config.num_key_value_heads % tp:
            raise ValueError(
                f"num_key_value_heads={config.num_key_value_heads} is not divisible by tensor_parallel_size={tp};"
                " choose a TP size that divides the KV head count."
            )
        if config.intermediate_size % tp:
            raise ValueError(
                f"intermediate_size={config.intermediate_size} is not divisible by tensor_parallel_size={tp}."
            )
        if self.pp_enabled and self.pipeline_layers is None and config.num_layers < self.num_stages:
            raise ValueError(
                f"num_layers={config.num_layers} is smaller than pipeline x virtual stages = {self.num_stages};"
                " lower pipeline_parallel_size/virtual_pipeline_parallel_size."
            )
        if self.pipeline_layers is not None and sum(self.pipeline_layers) != config.num_layers:
            raise ValueError(
                f"pipeline_layers={self.pipeline_layers} sums to {sum(self.pipeline_layers)} but the model has "
                f"num_layers={config.num_layers}."
            )
        if self.cp_enabled:
            u = self.resolved_ulysses_size
            local_heads = config.num_attention_heads // tp
            if local_heads % u:
                raise ValueError(
                    f"Ulysses degree {u} does not divide the TP-local head count {local_heads}"
                    f" (num_attention_heads={config.num_attention_heads} / tensor_parallel_size={tp});"
                    " lower ulysses_size or use context_parallel_mode='ring'."
                )
        if self.ep_enabled:
            if not config.is_moe:
                raise ValueError("expert_parallel_size > 1 needs an MoE model (num_experts > 0).")
            if config.num_experts % self.expert_parallel_size:
                raise ValueError(
                    f"num_experts={config.num_experts} is not divisible by expert_parallel_size="
                    f"{self.expert_parallel_size}."
                )
