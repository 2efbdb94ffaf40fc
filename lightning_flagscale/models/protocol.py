"""The model protocol: what a model gives ``FlagScaleStrategy`` so that every parallelism can be applied to it.

The strategy never names a model class. It finds the protocol model on the LightningModule (the module itself or its
``model`` attribute) and hands it to :func:`lightning_flagscale.parallel.plan.parallelize`, which applies each
parallelism through the parts below. Each capability is one ``Protocol`` (checked with ``isinstance``); the runtime
asks these types, never the attributes. A model implements what the layouts it supports need; asking for a layout
whose part is missing fails once, in the launching process before any worker exists (and again in
``setup_environment`` for launchers that bypass ours), naming the missing part (:func:`validate_layout`).

================  ==========================  ================================================================
needed for        Protocol                    what the model provides
================  ==========================  ================================================================
every layout      ``ParallelizableModel``     ``init_weights(seed)``: deterministic, layout-independent init of
                                              the (possibly sharded, materialised) parameters;
                                              ``loss_fn(head_output, labels, num_items_in_batch=None)``: the
                                              token-loss sum divided by ``num_items_in_batch`` (the global label
                                              count of the optimizer step) or, without it, the local token mean.
TP (+SP)          ``TensorParallelModel``     ``tp_plan(sequence_parallel) -> {module name: ParallelStyle}``.
                  ``TensorParallelConstraints``  optional ``check_tensor_parallel(tp)``: raise naming what ``tp``
                                              does not divide (heads, widths, padded vocab).
                  ``TensorParallelHook``      optional ``on_tensor_parallel(tp_mesh, sequence_parallel)``: record
                                              what the loss needs (vocab shard, TP mesh), re-tie shared weights.
PP                ``PipelineModel``           ``pipeline_units() -> [module name, ...]`` in execution order,
                                              covering every parameter; blocks live in ``nn.ModuleDict``s keyed by
                                              index (``"layers.3"``) and are what even splits count;
                                              ``forward(x, **kwargs)`` skips absent units (a stage is a copy with
                                              the other units removed). Units before the first block (embedding,
                                              a vision tower) consume the raw inputs and stay on the first stage.
                  ``PipelineInputs``          optional ``pipeline_inputs(x, **kwargs) -> (x, kwargs)``: complete
                                              what later stages need (e.g. explicit positions), every keyword
                                              tensor batch-first (torch splits them along dim 0).
                  ``PipelineUnitCosts``       optional ``pipeline_unit_costs() -> {unit: cost}`` for
                                              ``pipeline_balance="cost"`` (default: parameter counts).
recompute         ``RecomputeUnits``          optional ``recompute_units()``: the repeated blocks (default: the
                                              blocks of ``pipeline_units()``, else ``layers``).
CP                ``ContextParallelAttention``  attention modules with a ``core_attention`` child (replaced by
                                              ring / Ulysses attention); one that sets ``context_parallel = False``
                                              keeps its own (it runs over inputs CP does not shard, e.g. patches).
                  ``CoreAttentionSettings``   optional ``backend`` and ``softmax_scale`` of a core attention, kept
                                              by its replacement.
                  ``ContextParallelBatch``    optional ``prepare_batch(batch) -> batch``, called on the full batch
                                              before the sequence is sharded, to add per-token tensors that need
                                              the whole sequence (multimodal positions, image-token ordinals) and
                                              ``cp_sequence_keys``, those keys (tensors [B, S, ...]), which
                                              ``shard_batch_for_cp`` slices along dim 1 with the token ids.
EP                ``MoEBlock``                MoE layers (``lightning_flagscale.moe``) with ``experts`` and
                                              ``num_experts``; ``MoEModel``: ``moe_aux_losses()`` for logging.
weight init       ``WeightInit``              ``init_weights(seed)`` (part of ``ParallelizableModel``; a pipeline
                                              stage copy keeps it).
                  ``WeightLoader``            optional, on the LightningModule: ``initialize_weights()`` fills the
                                              materialised model itself (e.g. streams HF weights); else
                                              ``init_weights(init_seed)`` (``SeededModule``: ``init_seed``).
precision         ``PrecisionLayoutModule``   optional class attribute ``precision_layout`` (``"megatron"``: the
                                              model's own half-precision layout; default ``"lightning"``).
token mean        ``GlobalTokenLoss``         optional ``global_token_loss = True`` on the LightningModule (below).
checkpoints       ``FrozenBaseModule``        optional, on the LightningModule: ``checkpoint_frozen_weights``
                                              (``False``: checkpoints leave the frozen parameters out, the module
                                              rebuilds them) and ``base_weights_reference() -> dict`` (their
                                              source and ``sha256``, checked on resume). LoRA (issue 40).
sizes             ``ConfiguredModel``         optional ``config`` (a ``TransformerConfig``: layer count, sequence
                                              length and heads the checks and profiling passes read).
================  ==========================  ================================================================

A LightningModule sets ``global_token_loss = True`` when its training step passes ``batch["num_items_in_batch"]``
to the loss: the strategy then attaches that count to every training batch and scales the returned loss so that the
data-parallel gradient average and Lightning's accumulation division give exactly one token mean per step.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.parallel.tensor_parallel.protocol import (
    TensorParallelConstraints,
    TensorParallelHook,
    TensorParallelModel,
)

__all__ = [
    "ConfiguredModel",
    "ContextParallelAttention",
    "ContextParallelBatch",
    "CoreAttentionSettings",
    "FrozenBaseModule",
    "GlobalTokenLoss",
    "MoEBlock",
    "MoEModel",
    "ParallelizableModel",
    "PipelineInputs",
    "PipelineModel",
    "PipelineUnitCosts",
    "PrecisionLayoutModule",
    "RecomputeUnits",
    "SeededModule",
    "TensorParallelConstraints",
    "TensorParallelHook",
    "TensorParallelModel",
    "WeightInit",
    "WeightLoader",
    "attention_modules",
    "find_protocol_model",
    "is_cp_attention",
    "is_moe_block",
    "missing_protocol_parts",
    "model_config",
    "saves_frozen_weights",
    "uses_global_token_loss",
    "validate_layout",
]


@runtime_checkable
class WeightInit(Protocol):
    """Weight init: deterministic, layout-independent init of the materialised (possibly sharded) parameters."""

    def init_weights(self, seed: int = 0) -> None: ...


@runtime_checkable
class ParallelizableModel(WeightInit, Protocol):
    """Every layout: deterministic init (:class:`WeightInit`) and the token loss."""

    def loss_fn(self, head_output: Any, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor: ...


@runtime_checkable
class PipelineModel(Protocol):
    """PP: the units a pipeline split cuts into stages, in execution order."""

    def pipeline_units(self) -> list[str]: ...


@runtime_checkable
class PipelineInputs(Protocol):
    """Optional under PP: complete the inputs later stages need, every keyword tensor batch-first."""

    def pipeline_inputs(self, x: Tensor, **kwargs: Any) -> tuple[Tensor, dict[str, Any]]: ...


@runtime_checkable
class PipelineUnitCosts(Protocol):
    """Optional under ``pipeline_balance="cost"``: each unit's cost (default: its parameter count)."""

    def pipeline_unit_costs(self) -> dict[str, float]: ...


@runtime_checkable
class RecomputeUnits(Protocol):
    """Optional: the repeated blocks recompute and ZeRO-3 wrap (default: the blocks of ``pipeline_units()``)."""

    def recompute_units(self) -> list[str]: ...


@runtime_checkable
class ContextParallelAttention(Protocol):
    """CP: an attention module whose core attention ring / Ulysses attention replaces."""

    core_attention: nn.Module


@runtime_checkable
class CoreAttentionSettings(Protocol):
    """Optional under CP: what the replaced core attention carries over to ring / Ulysses attention."""

    backend: str
    softmax_scale: float | None


@runtime_checkable
class ContextParallelBatch(Protocol):
    """Optional under CP: per-token tensors added to the full batch before the sequence is sharded."""

    cp_sequence_keys: tuple[str, ...]

    def prepare_batch(self, batch: dict[str, Any]) -> dict[str, Any]: ...


@runtime_checkable
class MoEBlock(Protocol):
    """EP: an MoE layer whose experts expert parallelism shards."""

    experts: nn.Module
    num_experts: int


@runtime_checkable
class MoEModel(Protocol):
    """Optional: the auxiliary MoE losses of the last forward, for logging."""

    def moe_aux_losses(self) -> dict[str, Tensor]: ...


@runtime_checkable
class WeightLoader(Protocol):
    """Optional, on the LightningModule: fill the materialised model itself (e.g. from HF weights)."""

    def initialize_weights(self) -> None: ...


@runtime_checkable
class SeededModule(Protocol):
    """Optional, on the LightningModule: the seed ``init_weights`` gets (default 0)."""

    init_seed: int


@runtime_checkable
class PrecisionLayoutModule(Protocol):
    """Optional, on the LightningModule: ``"megatron"`` (the model's own half-precision layout) or ``"lightning"``."""

    precision_layout: ClassVar[str]


@runtime_checkable
class GlobalTokenLoss(Protocol):
    """Optional, on the LightningModule: ``True`` when its loss divides by ``batch["num_items_in_batch"]``."""

    global_token_loss: bool


@runtime_checkable
class FrozenBaseModule(Protocol):
    """Optional, on the LightningModule: whether checkpoints hold its frozen parameters, and, when not, where they
    come from (``{"source": ..., "sha256": ...}``: a resume refuses a different base)."""

    checkpoint_frozen_weights: bool

    def base_weights_reference(self) -> dict[str, Any]: ...


@runtime_checkable
class ConfiguredModel(Protocol):
    """Optional: the model's config (a ``TransformerConfig`` is read for sizes)."""

    config: Any


def model_config(module: nn.Module | None) -> TransformerConfig | None:
    """``module.config`` when it is a ``TransformerConfig`` (layer count, sequence length, heads), else None."""
    config = module.config if isinstance(module, ConfiguredModel) else None
    return config if isinstance(config, TransformerConfig) else None


def saves_frozen_weights(module: nn.Module) -> bool:
    """Whether checkpoints of ``module`` hold its frozen parameters (all but a :class:`FrozenBaseModule` that says
    ``checkpoint_frozen_weights = False``)."""
    return not isinstance(module, FrozenBaseModule) or bool(module.checkpoint_frozen_weights)


def uses_global_token_loss(module: nn.Module) -> bool:
    """Whether ``module`` divides its token-loss sum by ``batch["num_items_in_batch"]`` (:class:`GlobalTokenLoss`)."""
    return isinstance(module, GlobalTokenLoss) and bool(module.global_token_loss)


def _has_child(module: nn.Module, name: str) -> bool:
    # Sub-modules live in ``_modules``, which ``isinstance`` against a Protocol does not see from Python 3.12 on
    # (it looks attributes up with ``inspect.getattr_static``): the module-valued members are checked here.
    return isinstance(module._modules.get(name), nn.Module)


def is_cp_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a :class:`ContextParallelAttention` (a ``core_attention`` child module)."""
    return _has_child(module, "core_attention")


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is a :class:`MoEBlock` (an ``experts`` child module and ``num_experts``)."""
    return _has_child(module, "experts") and hasattr(module, "num_experts")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` whose core attention CP replaces: every :class:`ContextParallelAttention`
    but those that set ``context_parallel = False`` (e.g. a vision tower over all image patches, replicated on every
    CP rank)."""
    return [m for m in model.modules() if is_cp_attention(m) and getattr(m, "context_parallel", True)]


def find_protocol_model(module: nn.Module) -> nn.Module | None:
    """The sub-module implementing the protocol: ``module`` itself or its ``model`` attribute (None if neither)."""
    for candidate in (module, getattr(module, "model", None)):
        if isinstance(candidate, nn.Module) and isinstance(candidate, ParallelizableModel):
            return candidate
    return None


def missing_protocol_parts(model: nn.Module | None, *, tp: bool, pp: bool, cp: bool, ep: bool) -> list[str]:
    """What ``model`` lacks for the requested parallelisms, as readable names (empty when everything is there)."""
    if model is None:
        return ["a model implementing init_weights(seed) and loss_fn(head_output, labels, num_items_in_batch)"]
    missing = []
    if tp and not isinstance(model, TensorParallelModel):
        missing.append("tp_plan(sequence_parallel) for tensor parallelism")
    if pp and not isinstance(model, PipelineModel):
        missing.append("pipeline_units() for pipeline parallelism")
    if cp and not any(is_cp_attention(m) for m in model.modules()):
        missing.append("attention modules with a `core_attention` child for context parallelism")
    if ep and not any(is_moe_block(m) for m in model.modules()):
        missing.append("MoE layers (num_experts > 0) for expert parallelism")
    return missing


def validate_layout(parallel: ParallelConfig, module: nn.Module) -> None:
    """Check the layout against the model before any process group exists (sizes, then protocol parts)."""
    config = model_config(module)
    if config is not None:
        parallel.validate_model(config)
    p = parallel
    if not (p.tp_enabled or p.pp_enabled or p.cp_enabled or p.ep_enabled):
        return
    model = find_protocol_model(module)
    if model is None and getattr(module, "model", None) is None and hasattr(module, "configure_model"):
        # `configure_model` builds the model later; its protocol parts are checked when the plan is applied.
        return
    missing = missing_protocol_parts(model, tp=p.tp_enabled, pp=p.pp_enabled, cp=p.cp_enabled, ep=p.ep_enabled)
    if missing:
        raise ValueError(
            f"{type(module).__name__} cannot run this layout: its model lacks {'; '.join(missing)} (see"
            " lightning_flagscale/models/protocol.py). Add them or set those parallel sizes to 1."
        )
