"""The parallelize plan: every parallelism applied to a protocol model, in one documented order, for one rank.

``parallelize(module, model, layout)`` takes the LightningModule, the protocol model it holds (see
``models/protocol.py``) and this rank's :class:`RankLayout` (its config, meshes, device and dtypes). Nothing here
reads global state, so different ranks may be given different layouts (heterogeneous meshes) without the strategy
knowing. The order, and why:

1. **Pipeline split** (outermost): each later step then works on this rank's stage modules only, so no rank ever
   parallelises (or materialises) layers it does not run.
2. **TP** on each stage: DTensor styles shard the full-size modules; everything after sees TP-local shapes.
3. **CP** swaps each core attention for ring / Ulysses attention over the TP-local heads (needs TP's head split).
4. **EP** shards experts over the expert mesh, and under ETP each expert's FFN over its "etp" dim (after TP: the
   rest of the block is tensor-parallel; experts follow the expert mesh's folding, not TP's).
5. **Recompute** wraps whole blocks, after TP/CP/EP changed what runs inside them (under PP the pipeline builder
   applies it per stage, with the replayable variant split-backward schedules need); then ``torch_compile`` compiles
   each (recompute-wrapped) block and the loss in place.
6. **ZeRO-3** (FSDP2) last: it shards whatever TP/EP left local (experts first, over the expert data-parallel
   ranks, each in its own unit inside its block's), and wraps the recompute-wrapped blocks.
7. **Materialise and initialise**: parameters were on the meta device until now; each rank allocates only its
   shards and fills them from per-parameter seeds (or streams HF weights via the module's ``initialize_weights``),
   so the result does not depend on the layout.
8. **Flat ZeRO-3** (``zero3_impl`` ``"flat"``, or ``"auto"`` where flat runs, instead of step 6): flattens the *materialised* TP-local parameters of
   each block and of the root into per-unit flat buffers and keeps this rank's shard (``zero3_flat.py``); each rank
   holds its TP-local model only while this runs. Expert modules become units of their own over ``edp`` and, under
   PP, each stage is a part whose units reduce-scatter once after the stage's last backward.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.config.hetero import StageGroup
from lightning_flagscale.config.schedules import SCHEDULE_SPECS
from lightning_flagscale.models.protocol import (
    PipelineModel,
    RecomputeUnits,
    SeededModule,
    WeightInit,
    WeightLoader,
    find_protocol_model,
    model_config,
)
from lightning_flagscale.moe.balance import moe_layers, set_moe_sequence_group
from lightning_flagscale.parallel.compile import apply_compile
from lightning_flagscale.parallel.context_parallel.attention import apply_cp
from lightning_flagscale.parallel.data_parallel.optimizer import apply_fsdp
from lightning_flagscale.parallel.data_parallel.zero3_flat import apply_flat_zero3
from lightning_flagscale.parallel.expert_parallel.apply import (
    apply_ep,
    set_moe_token_group,
    tag_chunk_routed_params,
    tag_expert_params,
)
from lightning_flagscale.parallel.hetero_dp.shares import gather_dp_speeds
from lightning_flagscale.parallel.hetero_mesh.build import build_hetero_layout, build_hetero_pipelined_model
from lightning_flagscale.parallel.hetero_mesh.profile import apply_profiled_split
from lightning_flagscale.parallel.hetero_mesh.ranks import (
    gather_rank_order,
    install_emulated_slowdown,
    rank_device_type,
)
from lightning_flagscale.parallel.mesh import ParallelMeshes, build_meshes
from lightning_flagscale.parallel.pipeline_parallel.model import (
    PipelinedModel,
    build_pipelined_model,
    exclude_tied_copy_from_norm,
)
from lightning_flagscale.parallel.pipeline_parallel.overlap import separate_chunk_groups
from lightning_flagscale.parallel.pipeline_parallel.recompute import apply_recompute, resolve_recompute
from lightning_flagscale.parallel.pipeline_parallel.runner import is_layer_unit
from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp
from lightning_flagscale.parallel.tensor_parallel.partial_grads import tag_tp_partial_params

__all__ = [
    "Parallelized",
    "RankLayout",
    "build_rank_meshes",
    "check_parallelized_layout",
    "parallelize",
    "parallelize_rank",
]


@dataclass(frozen=True)
class RankLayout:
    """What one rank applies: its parallel config, its meshes, its device and the ZeRO-3 dtypes."""

    config: ParallelConfig
    meshes: ParallelMeshes
    device: torch.device
    param_dtype: torch.dtype | None = None
    """FSDP2 compute dtype (None: the parameters' own)."""
    reduce_dtype: torch.dtype | None = None
    """FSDP2 gradient reduction dtype."""
    hetero_groups: list[StageGroup] | None = None
    """Heterogeneous meshes: every pipeline stage group; ``config`` and ``meshes`` are then this rank's group's."""


@dataclass
class Parallelized:
    """The result: the modules each later step (optimizer, checkpoint, clipping) must know about."""

    parts: list[nn.Module]
    """The model, or this rank's pipeline stage modules."""
    pipeline: PipelinedModel | None = None
    fsdp_roots: list[nn.Module] = field(default_factory=list)
    expert_grad_scale: float = 1.0
    """Factor for expert gradients after FSDP2's edp average (see ``_shard_experts``)."""
    hetero_groups: list[StageGroup] | None = None
    """Heterogeneous meshes: every stage group, with the block split the plan used (profiled when left open)."""
    dp_speeds: list[float] | None = None
    """``hetero_dp_batch_sizes="auto"``: every data-parallel rank's speed (the data loaders' shares)."""
    model: nn.Module | None = None
    """The protocol model (its batch hooks), found before the pipeline split replaced ``module.model``."""

    def tag_parameters(self, model: nn.Module, config: ParallelConfig) -> None:
        """Mark the tied pipeline copy (left out of the gradient norm), expert parameters (reduced over the
        expert-data-parallel group) and the weights whose gradients the optimizer step sums over TP: those of MoE blocks
        that route their own sequence chunk (``tag_chunk_routed_params``) and of the TP plan's modules on sequence or
        head shards (``tag_tp_partial_params``). Tags live on Parameter objects, which
        materialising and dtype/device moves may replace: call this last."""
        if self.pipeline is not None:
            exclude_tied_copy_from_norm(self.pipeline)
        if config.ep_enabled:
            tag_expert_params(model)
        if config.moe_routes_sequence_chunks:
            tag_chunk_routed_params(model)
        if config.tp_enabled:
            tag_tp_partial_params(model)


def check_predict_layout(parallel: ParallelConfig) -> None:
    """``trainer.predict`` returns each rank's full output for its samples: refuse layouts where a rank holds only part
    of the sequence or of the model's depth, before anything is parallelised."""
    split = [
        name for name, on in (
            ("pipeline_parallel_size > 1", parallel.pipeline_parallel_size > 1),
            ("context_parallel_size > 1", parallel.context_parallel_size > 1),
            ("hetero_meshes", parallel.hetero_enabled),
        ) if on
    ]  # fmt: skip
    if split:
        raise ValueError(
            f"trainer.predict with {', '.join(split)}: a rank holds only part of each sample's output there, and"
            " predict returns whole logits per rank. Predict with a layout of data, tensor, expert parallelism and"
            " ZeRO (the checkpoint reshards to it), or use trainer.validate / trainer.test for the loss."
        )


def build_rank_meshes(
    parallel: ParallelConfig, model: nn.Module, device: torch.device
) -> tuple[ParallelConfig, ParallelMeshes, list[StageGroup] | None]:
    """This rank's layout, its meshes and (heterogeneous meshes) every stage group; call it once the process group
    exists. Under ``hetero_meshes`` the returned config is this rank's stage group's (``parallel`` is the job's)."""
    if not parallel.hetero_enabled:
        return parallel, build_meshes(parallel, device.type), None
    config = model_config(model)
    if config is None:
        raise ValueError("hetero_meshes needs the module's `config.num_layers` to split the blocks over meshes.")
    order = gather_rank_order(parallel.hetero_meshes, device)  # ranks by device type
    groups, meshes, rank_config = build_hetero_layout(parallel, config.num_layers, device.type, order, config)
    return rank_config, meshes, groups


def parallelize_rank(
    module: nn.Module, layout: RankLayout, *, hetero: ParallelConfig | None, place: Callable[[], None]
) -> Parallelized:
    """Everything ``setup`` does to ``module`` on this rank, in order: the profiled block split of heterogeneous
    meshes (``hetero_layers`` left open), the data-parallel speeds (``hetero_dp_batch_sizes="auto"``),
    :func:`parallelize`, the emulated slowdown of a declared device type, ``place`` (the caller's dtype and device
    moves) and last the parameter tags, which those moves may replace (:meth:`Parallelized.tag_parameters`).

    A module this function already parallelised (an earlier ``fit`` / ``validate`` / ``test`` / ``predict`` of the
    process, by this strategy object or another) is not parallelised again: its recorded result is returned after
    ``place`` (which brings it back from the CPU where ``teardown`` left it), as Lightning's ``FSDPStrategy`` skips
    wrapping a wrapped module. With another layout it is refused (:func:`check_parallelized_layout`)."""
    job = hetero if hetero is not None else layout.config
    dtypes = (layout.param_dtype, layout.reduce_dtype)
    applied = check_parallelized_layout(module, job, dtypes)
    if applied is not None:
        place()
        result = applied.result
        result.tag_parameters(module.model if result.pipeline is not None else result.model, layout.config)
        return result
    model = find_protocol_model(module)
    groups = layout.hetero_groups
    if groups is not None and hetero is not None:  # hetero_layers=None: the split of a profiling pass on these ranks
        groups = apply_profiled_split(hetero, groups, model, layout.device)
        layout = dataclasses.replace(layout, hetero_groups=groups)
    speeds = gather_dp_speeds(layout.config, layout.meshes, model, layout.device)
    result = parallelize(module, model, layout)
    result.hetero_groups, result.dp_speeds, result.model = groups, speeds, model
    # Recorded on the module itself (not in a process-wide map, which would keep every fitted module alive).
    module.__dict__[_APPLIED_ATTR] = _Applied(copy.deepcopy(job), dtypes, result)
    stages = result.pipeline.stage_modules if result.pipeline is not None else [model]
    install_emulated_slowdown(stages, rank_device_type(groups), layout.device)
    place()
    result.tag_parameters(module.model if result.pipeline is not None else model, layout.config)
    return result


_APPLIED_ATTR = "_fs_parallelized"


@dataclass(frozen=True)
class _Applied:
    """What :func:`parallelize_rank` did to a module: the job's layout, the ZeRO-3 dtypes and the result."""

    layout: ParallelConfig
    dtypes: tuple[torch.dtype | None, torch.dtype | None]
    result: Parallelized


def check_parallelized_layout(
    module: nn.Module, layout: ParallelConfig, dtypes: tuple[torch.dtype | None, torch.dtype | None] | None = None
) -> _Applied | None:
    """None for a module not parallelised yet; the record of an earlier :func:`parallelize_rank` when ``layout`` (the
    job's resolved layout) and, if given, the ZeRO-3 ``(param_dtype, reduce_dtype)`` are the ones it ran with;
    else a ``ValueError`` naming both layouts. Every field counts, even those only the optimizers read (zero stages
    1 and 2, buckets): the plan does not track which fields shaped the module. The dtypes count under ZeRO-3 only,
    whose units keep them; other layouts hold what the precision plugin's ``convert_module`` makes of the weights, as
    under Lightning's own strategies."""
    applied = module.__dict__.get(_APPLIED_ATTR)
    if applied is None:
        return None
    if applied.layout != layout:
        raise ValueError(
            f"{type(module).__name__} was already parallelised by FlagScaleStrategy with the layout"
            f" {_describe(applied.layout)}; this run asks for {_describe(layout)}. A parallelised module keeps its"
            " layout: run this stage with the same layout, or build a new module for the new one (or load its"
            " checkpoint into one: checkpoints reshard across layouts)."
        )
    if dtypes is not None and layout.zero_stage == 3 and applied.dtypes != dtypes:
        raise ValueError(
            f"{type(module).__name__} was already parallelised by FlagScaleStrategy with ZeRO-3 (param_dtype,"
            f" reduce_dtype) = {applied.dtypes}; this run's precision asks for {dtypes}. Use the same precision, or"
            " build a new module."
        )
    return applied


def _describe(layout: ParallelConfig) -> str:
    """``ParallelConfig(...)`` with the fields that differ from the defaults (the resolved sizes included)."""
    default = ParallelConfig()
    fields = [
        f"{f.name}={getattr(layout, f.name)!r}"
        for f in dataclasses.fields(layout)
        if getattr(layout, f.name) != getattr(default, f.name)
    ]
    return f"ParallelConfig({', '.join(fields)})"


def parallelize(module: nn.Module, model: nn.Module | None, layout: RankLayout) -> Parallelized:
    """Apply the plan (module docstring) to ``model`` (the protocol model of ``module``, or None for DP-only)."""
    p = layout.config
    result = Parallelized(parts=[] if model is None else [model])
    if model is not None and layout.hetero_groups is not None:
        result.pipeline = build_hetero_pipelined_model(model, layout.hetero_groups, layout.meshes, p, layout.device)
        module.model = result.pipeline
        result.parts = list(result.pipeline.stage_modules)
    elif model is not None and p.pp_enabled:
        result.pipeline = build_pipelined_model(model, layout.meshes, p, layout.device)
        module.model = result.pipeline
        result.parts = list(result.pipeline.stage_modules)
    for part in result.parts:
        _apply_model_parallelisms(part, layout)
    if p.overlap_moe_expert_parallel_comm and result.pipeline is not None:
        # DualPipeV's paired forward and backward run at once: each model chunk's MoE layers get their own groups
        separate_chunk_groups(result.pipeline.stage_modules)
    flat = p.zero_stage == 3 and _use_flat_zero3(result, p)
    if p.zero_stage == 3 and not flat:
        targets = result.parts or [module]
        if p.ep_enabled:
            for target in targets:
                result.fsdp_roots.extend(_shard_experts(target, layout))
            # FSDP2 averages over edp; the expert owners already summed their EP group's tokens, so the mean over
            # the token shards (``expert_grad_divisor``) needs a further edp / divisor (1/ep when every TP rank
            # dispatches the whole sequence). Not `set_gradient_divide_factor`: it reduces with PREMUL_SUM, which
            # gloo lacks.
            result.expert_grad_scale = p.expert_data_parallel_size / p.expert_grad_divisor
        for target in targets:
            apply_fsdp(
                target, layout.meshes.dp_cp, param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype,
                blocks=None if target is module else _blocks(target),
            )  # fmt: skip
        result.fsdp_roots.extend(targets)
    materialize(module, module.model if result.pipeline is not None else model, layout.device)
    if flat:
        _apply_flat_zero3(result, layout)
    return result


def _flat_zero3_refusal(result: Parallelized, p: ParallelConfig) -> str | None:
    """Why flat ZeRO-3 cannot take these model parts (None: it can); checked on the meta model, before step 6."""
    if not result.parts:
        return "needs a protocol model (see models/protocol.py) whose blocks become the flat units"
    tied = result.pipeline.runner.tied if result.pipeline is not None else None
    for part in result.parts:
        layers = [layer for _, layer in moe_layers(part)] if p.ep_enabled else []
        if any(layer.hot_expert_config is not None for layer in layers):
            return "with hot-expert replication is not supported"
        for fqn, owner in _tied_modules(part, tied):
            if len(list(owner.parameters())) != 1:
                return f"with a tied {fqn!r} needs its module to hold that weight only"
    return None


def _use_flat_zero3(result: Parallelized, p: ParallelConfig) -> bool:
    """Whether ZeRO-3 runs flat: ``zero3_impl="flat"`` must (else a clear error), ``"auto"`` does where it can."""
    if p.resolved_zero3_impl != "flat":
        return False
    reason = _flat_zero3_refusal(result, p)
    if reason is None:
        return True
    if p.zero3_impl == "flat":
        raise ValueError(f"zero3_impl='flat' {reason}; use zero3_impl='fsdp2' (or 'auto') for this model.")
    rank_zero_info(f"zero3_impl='auto': ZeRO-3 runs on FSDP2 for this model (flat ZeRO-3 {reason}).")
    return False


def _apply_flat_zero3(result: Parallelized, layout: RankLayout) -> None:
    """Step 8: flat ZeRO-3 on each materialised model part (a protocol model: its blocks are the units)."""
    p, meshes = layout.config, layout.meshes
    spmd = meshes[("dp_cp", "tp")] if p.tp_enabled else None
    tied = result.pipeline.runner.tied if result.pipeline is not None else None
    for part in result.parts:
        blocks = _blocks(part)
        if blocks is None:
            layers = getattr(part, "layers", None)
            blocks = [] if layers is None else list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
        # as FSDP2's `_shard_experts`: expert units over edp, nested in their block's
        experts = [layer.experts for _, layer in moe_layers(part)] if p.ep_enabled else []
        apply_flat_zero3(
            part, meshes.dp_cp, blocks=blocks, param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype,
            spmd_mesh=spmd, experts=experts, expert_mesh=meshes["edp"] if experts else None,
            expert_spmd_mesh=meshes[("edp", "ep")] if experts else None,
            own_units=[owner for _, owner in _tied_modules(part, tied)], defer_reduce=result.pipeline is not None,
        )  # fmt: skip
    if p.ep_enabled:  # the shards are averaged over edp: the further edp / divisor of FSDP2's expert path
        result.expert_grad_scale = p.expert_data_parallel_size / p.expert_grad_divisor


def _tied_modules(part: nn.Module, tied: tuple[str, str] | None) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules of ``part`` holding a pipeline-tied weight (embedding / LM head on the first /
    last stage): each becomes its own flat unit, so that both copies are sharded into the same rows and their
    gradients can be summed."""
    owners = []
    for fqn in tied or ():
        module_name, _, attr = fqn.rpartition(".")
        try:
            owner = part.get_submodule(module_name)
        except AttributeError:
            continue
        if attr in owner._parameters:
            owners.append((fqn, owner))
    return owners


def _apply_model_parallelisms(part: nn.Module, layout: RankLayout) -> None:
    """TP -> CP -> EP -> recompute on one model or stage module (steps 2-5 of the module docstring)."""
    p, meshes = layout.config, layout.meshes

    # MoE (issue 10): global aux/z losses and bias-balancing counts over the ranks that share the step's tokens, with
    # the TP ranks when each routes its own sequence-parallel chunk.
    set_moe_token_group(part, meshes.group("dp_cp_tp" if p.moe_routes_sequence_chunks else "dp_cp"))
    # ... and the sequence-wise balance loss's per-sequence statistics over the shards of each sequence (issue 39).
    set_moe_sequence_group(part, meshes.group("cp") if p.cp_enabled else None)
    if p.tp_enabled:
        # the norms' (and QK-norm's) TP-partial weight gradients are summed once per step (tag_parameters)
        apply_tp(part, meshes["tp"], sequence_parallel=p.sequence_parallel, partial_grads_at_step=True)
    if p.cp_enabled:
        apply_cp(
            part, meshes["cp"], mode=p.context_parallel_mode, ulysses_size=p.resolved_ulysses_size,
            tp_size=p.tensor_parallel_size,
        )  # fmt: skip
    # EP and/or ETP, over the (ep, etp) dims of the expert mesh; a pipeline chunk of dense blocks only (DeepSeek-V3's
    # first_k_dense_replace layers on the first stage) has no experts to shard
    if p.ep_enabled and moe_layers(part):
        apply_ep(
            part, meshes[("ep", "etp")], etp_tokens_replicated=p.etp_tokens_replicated,
            etp_sequence_parallel=p.etp_sequence_parallel,
        )  # fmt: skip
    if not p.pp_enabled and p.recompute != "none":  # under PP, build_pipeline applies it per stage
        # A hetero stage group (pp = 1 inside its group) runs its pipeline schedule: split-backward ones backpropagate
        # each block twice (input, then weight gradients).
        replayable = SCHEDULE_SPECS[p.pipeline_schedule].split_backward
        apply_recompute(part, resolve_recompute(p.recompute, 1)[0], replayable=replayable, blocks=_blocks(part))
    if p.torch_compile and not p.pp_enabled:  # under PP, build_pipeline compiles each stage's blocks
        apply_compile(part, _blocks(part))


def _blocks(model: nn.Module) -> list[nn.Module] | None:
    """The repeated blocks of a protocol model present in ``model`` (recompute and FSDP units), None if unknown."""
    if isinstance(model, RecomputeUnits):
        return [model.get_submodule(u) for u in model.recompute_units()]
    if isinstance(model, PipelineModel):
        return [model.get_submodule(u) for u in model.pipeline_units() if is_layer_unit(u)]
    return None  # the callee's default: ``model.layers``


def _shard_experts(model: nn.Module, layout: RankLayout) -> list[nn.Module]:
    """ZeRO-3 for expert weights: FSDP2 over the expert-data-parallel ranks of the expert mesh (the experts are
    already ``Shard(0)`` over ep on that mesh), each expert group its own FSDP unit inside its block's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=layout.param_dtype, reduce_dtype=layout.reduce_dtype)
    return [fully_shard(layer.experts, mesh=layout.meshes["edp"], mp_policy=mp) for _, layer in moe_layers(model)]


def materialize(module: nn.Module, model: nn.Module | None, device: torch.device) -> None:
    """Allocate what is still on the meta device and initialise it (step 7 of the module docstring)."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return
    # Only what is on the meta device: `to_empty` on the whole LightningModule would also wipe state that was
    # built for real in `__init__` (e.g. torchmetrics accumulators). The model goes first, as a whole, so its
    # own `_apply` can keep tied weights tied.
    if model is not None:
        model.to_empty(device=device)
    for sub in module.modules():
        own = itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))
        if any(t.is_meta for t in own):
            sub.to_empty(device=device, recurse=False)
    target = model if model is not None else module
    if isinstance(module, WeightLoader):
        module.initialize_weights()
    elif isinstance(target, WeightInit):
        target.init_weights(seed=int(module.init_seed) if isinstance(module, SeededModule) else 0)
    else:
        raise TypeError(
            f"{type(target).__name__} was built on the meta device but has no `init_weights(seed)`; add one, or"
            " build the model in `__init__` instead of `configure_model`."
        )
