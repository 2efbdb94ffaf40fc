"""The model protocol: what a model gives ``FlagScaleStrategy`` so that every parallelism can be applied to it.

The strategy never names a model class. It finds the protocol model on the LightningModule (the module itself or its
``model`` attribute) and hands it to :func:`lightning_flagscale.parallel.plan.parallelize`, which applies each
parallelism through the parts below. A model implements what the layouts it supports need; asking for a layout whose
part is missing fails before any process group exists, naming the missing method.

================  ==========================================================================================
needed for        what the model provides
================  ==========================================================================================
every layout      ``init_weights(seed)``: deterministic, layout-independent init of the (possibly sharded,
                  materialised) parameters; ``loss_fn(head_output, labels, num_items_in_batch=None)``: the
                  token-loss sum divided by ``num_items_in_batch`` (the global label count of the optimizer step)
                  or, without it, the local token mean.
TP (+SP)          ``tp_plan(sequence_parallel) -> {module name: ParallelStyle}`` (DTensor styles).
PP                ``pipeline_units() -> [module name, ...]`` in execution order, covering every parameter; blocks
                  live in ``nn.ModuleDict``s keyed by index (``"layers.3"``) and are what even splits count;
                  ``forward(x, **kwargs)`` skips absent units (a stage is a copy with the other units removed).
                  Optional: ``pipeline_inputs(x, **kwargs) -> (x, kwargs)`` to complete what later stages need
                  (e.g. explicit positions) and make every keyword tensor batch-first (torch splits them along
                  dim 0 into micro-batches); ``pipeline_unit_costs() -> {unit: cost}`` for
                  ``pipeline_balance="cost"`` (default: parameter counts). Units before the first block (embedding,
                  a vision tower) consume the raw inputs and always stay together on the first stage.
CP                attention modules with a ``core_attention`` child (replaced by ring / Ulysses attention); one
                  that sets ``context_parallel = False`` keeps its own (it runs over inputs CP does not shard,
                  e.g. image patches). Optional: ``prepare_batch(batch) -> batch``, called by the strategy on
                  the full batch before the sequence is sharded, to add per-token tensors that need the whole
                  sequence (e.g. multimodal positions, image-token ordinals); ``cp_sequence_keys``, the added
                  keys (tensors [B, S, ...]) that ``shard_batch_for_cp`` slices along dim 1 with the token ids.
EP                MoE layers (``lightning_flagscale.moe``) with an ``experts`` module.
recompute         the repeated blocks of ``pipeline_units()`` (or, without PP, ``recompute_units()``).
================  ==========================================================================================

A LightningModule sets ``global_token_loss = True`` when its training step passes ``batch["num_items_in_batch"]``
to the loss: the strategy then attaches that count to every training batch and scales the returned loss so that the
data-parallel gradient average and Lightning's accumulation division give exactly one token mean per step.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_flagscale.config import ParallelConfig, TransformerConfig

__all__ = ["ParallelizableModel", "find_protocol_model", "missing_protocol_parts", "validate_layout"]


@runtime_checkable
class ParallelizableModel(Protocol):
    """The two methods every protocol model has; the parallelism-specific parts are in the module docstring."""

    def init_weights(self, seed: int = 0) -> None: ...

    def loss_fn(self, head_output: Any, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor: ...


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
    if tp and not hasattr(model, "tp_plan"):
        missing.append("tp_plan(sequence_parallel) for tensor parallelism")
    if pp and not hasattr(model, "pipeline_units"):
        missing.append("pipeline_units() for pipeline parallelism")
    if cp and not any(hasattr(m, "core_attention") for m in model.modules()):
        missing.append("attention modules with a `core_attention` child for context parallelism")
    if ep and not any(hasattr(m, "experts") and hasattr(m, "num_experts") for m in model.modules()):
        missing.append("MoE layers (num_experts > 0) for expert parallelism")
    return missing


def validate_layout(parallel: ParallelConfig, module: nn.Module) -> None:
    """Check the layout against the model before any process group exists (sizes, then protocol parts)."""
    config = getattr(module, "config", None)
    if isinstance(config, TransformerConfig):
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
