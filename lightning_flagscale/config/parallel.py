"""``ParallelConfig``: the one topology object (degrees of every parallelism and the micro-batching around them).

It validates itself where it lives, before any process group exists, and every user mistake raises
``ValueError``/``TypeError`` naming the value and the fix. Nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from lightning_flagscale.config.hetero import (
    StageGroup,
    check_hetero_batch_sizes,
    check_hetero_layout,
    hetero_virtual_size,
    parse_hetero_meshes,
)
from lightning_flagscale.config.layer_split import (
    check_orderable,
    edge_extra_blocks,
    even_layer_counts,
    plan_stage_groups,
)
from lightning_flagscale.config.schedules import SCHEDULE_SPECS, ScheduleName, default_virtual_size, validate_schedule
from lightning_flagscale.config.transformer import TransformerConfig

__all__ = [
    "DEFAULT_BUCKET_NUMEL",
    "DataParallelConfig",
    "HeteroConfig",
    "ParallelConfig",
    "ParallelSizes",
    "PipelineConfig",
    "RecomputeMode",
]


DEFAULT_BUCKET_NUMEL = 1 << 22  # 4M elements (16 MiB in fp32) per bucket: several buckets to overlap, few launches

RecomputeMode = Literal["none", "selective", "selective_mm", "full"]
"""From the least to the most recomputation."""
SELECTIVE_MM_ON_MOE = (
    "recompute='selective_mm' recomputes every second matmul of a block, and an MoE block's matmul count depends on"
    " its routing; use 'selective' or 'full' for MoE models (or moe_recompute)."
)


@dataclass(kw_only=True)
class ParallelSizes:
    """Degrees of every parallelism: world = pp x dp x cp x tp (tp fastest in rank order, ``parallel/mesh.py``);
    experts fold over a stage's dp x cp x tp ranks as edp x ep x etp (Megatron's MoE parallel folding)."""

    tensor_parallel_size: int = 1
    """Megatron tensor parallel degree (heads, MLP columns/rows, vocab)."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over the TP group (needs TP > 1; with ``hetero_meshes``, on
    every mesh whose TP is > 1, resliced along the sequence at the boundaries)."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages groups (ranks along the pipeline)."""
    virtual_pipeline_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved / V schedules); ``None`` (auto) means 2 for the V-shaped schedules
    (``zbv``, ``dualpipev``) under pipeline parallelism and 1 otherwise. With ``hetero_meshes``: model chunks per
    stage group (``interleaved_1f1b`` / ``zero_bubble``: any; ``zbv`` / ``dualpipev``: 2, the auto value)."""
    context_parallel_size: int = 1
    """Sequence split for attention (ring, Ulysses or both)."""
    context_parallel_mode: Literal["ring", "ulysses", "hybrid"] = "ring"
    """How attention is computed across the CP group."""
    ulysses_size: int | None = None
    """Ulysses degree inside CP for ``hybrid``; ``None`` means all of CP for ``ulysses`` and 1 for ``ring``."""
    expert_parallel_size: int = 1
    """Ranks the routed experts are split over."""
    expert_tensor_parallel_size: int = 1
    """Tensor parallel degree inside each expert (ETP): gate/up column- and down row-sharded over that many ranks,
    folded with EP over a stage's ranks. Megatron-Core defaults it to ``tensor_parallel_size``; here it stays 1 so that
    existing layouts (e.g. TP 2 x EP 4 on 4 ranks, where EP x TP would not fit) keep their meaning: set it explicitly."""
    data_parallel_size: int | None = None
    """Data-parallel replicas; ``None`` derives it from the world size."""

    def __post_init__(self) -> None:
        self._check_sizes()

    @property
    def resolved_ulysses_size(self) -> int:
        if self.ulysses_size is not None:
            return self.ulysses_size
        return self.context_parallel_size if self.context_parallel_mode == "ulysses" else 1

    @property
    def ring_size(self) -> int:
        return self.context_parallel_size // self.resolved_ulysses_size

    def _check_sizes(self) -> None:
        for name in (
            "tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_parallel_size",
            "context_parallel_size", "expert_parallel_size", "expert_tensor_parallel_size",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is None and name == "virtual_pipeline_parallel_size":
                continue  # auto, resolved by ParallelConfig
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}.")
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1 or None (auto), got {self.data_parallel_size}.")
        if self.context_parallel_mode not in ("ring", "ulysses", "hybrid"):
            raise ValueError(
                f"context_parallel_mode={self.context_parallel_mode!r}; use 'ring', 'ulysses' or 'hybrid'."
            )
        if self.context_parallel_size % self.resolved_ulysses_size:
            raise ValueError(
                f"ulysses_size={self.resolved_ulysses_size} must divide context_parallel_size="
                f"{self.context_parallel_size} (hybrid CP = ring x ulysses)."
            )


@dataclass(kw_only=True)
class DataParallelConfig:
    """How data-parallel replicas keep and reduce their state (Megatron's ``DistributedDataParallelConfig``): the ZeRO
    stage and engine, the gradient buckets and what overlaps with compute."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    """0 = DDP, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters (FSDP2 or flat, see ``zero3_impl``)."""
    zero3_impl: Literal["auto", "fsdp2", "flat"] = "auto"
    """ZeRO-3 engine: our flat-buffer ZeRO-3 (``parallel/data_parallel/zero3_flat.py``), torch's FSDP2 (per-parameter shards), or
    ``"auto"``: flat wherever it runs (measured ahead of FSDP2 and of Lightning's FSDPStrategy,
    ``bench/results/compare_strategies.md``), FSDP2 for what flat refuses: hetero meshes and split-backward pipeline
    schedules here (``resolved_zero3_impl``), non-protocol modules, hot-expert replication and tied weights that
    share a module with other parameters when the model is parallelised (logged). ``"flat"`` refuses those layouts
    with an error instead."""
    grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL
    """Gradient elements per bucket (DDP, ZeRO-1/2): one collective per bucket, launched as soon as it is full."""
    overlap_grad_reduce: bool = True
    """Reduce each bucket while backward runs (DDP, ZeRO-1/2); ``False`` reduces them all after backward."""
    overlap_param_gather: bool = False
    """ZeRO-1/2: leave the all-gather of the updated weights in flight after the optimizer step; each module waits
    for its parameters before its next forward (Megatron's ``overlap_param_gather``)."""

    def __post_init__(self) -> None:
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}.")
        numel = self.grad_bucket_numel
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
            raise ValueError(f"grad_bucket_numel={numel!r} must be a positive number of elements per bucket.")
        if self.overlap_param_gather and self.zero_stage not in (1, 2):
            raise ValueError(
                f"overlap_param_gather=True overlaps ZeRO-1/2's parameter all-gather with the next forward, but"
                f" zero_stage={self.zero_stage} has none to overlap (stage 0 keeps whole weights, ZeRO-3"
                " prefetches its own); set zero_stage=1 or 2, or drop overlap_param_gather."
            )


@dataclass(kw_only=True)
class PipelineConfig:
    """Micro-batching, the pipeline schedule and split, and activation recompute."""

    micro_batch_size: int = 1
    """Samples per micro-batch fed through a pipeline schedule."""
    gradient_accumulation_steps: int = 1
    """Batches accumulated per optimizer step (sets the Trainer's ``accumulate_grad_batches``)."""
    pipeline_schedule: ScheduleName = "1f1b"
    """Pipeline schedule name (see ``config/schedules.py``)."""
    pipeline_layers: list[int] | None = None
    """Explicit decoder layers per pipeline stage, e.g. ``[18, 14]``; ``None`` splits evenly or by cost."""
    pipeline_balance: Literal["even", "cost"] = "even"
    """Without ``pipeline_layers``: equal layer slots per stage, or a split balancing per-unit parameter cost
    (embedding and LM head included)."""
    recompute: RecomputeMode | list[RecomputeMode] = "none"
    """Activation recompute per block: ``none``, ``selective`` (norms, activations), ``selective_mm`` (that and every
    second matmul, torchtitan's op-level policy; dense blocks) or ``full``; or one per stage."""
    torch_compile: bool = False
    """Compile each decoder block and the loss with ``torch.compile`` (in place: parameter names unchanged), after
    TP / CP / EP / recompute and before ZeRO-3, as torchtitan does. Fuses the norms, rotary, SwiGLU and the loss's
    fp32 cast into few kernels (one GPU, 1B Llama: ``docs/gpu.md``); under ``selective`` recompute the op policy runs
    once at compile time instead of at every op. The first step pays the compilation (and the first step whose label
    count differs, once). Tested with DDP / ZeRO-1, ZeRO-3 (FSDP2), TP (+ SP), CP, 1F1B pipelines and recompute;
    refused with pipeline parallelism's split-backward schedules (``zero_bubble``, ``zbv``, ``dualpipev``),
    ``hetero_meshes`` and MoE models. Under TP, a ``full``-recomputed block keeps its checkpoint eager around its
    compiled body (``parallel/compile.py``)."""
    overlap_moe_expert_parallel_comm: bool = False
    """DualPipeV only (Megatron's flag name): run each paired forward and backward of two micro-batches at the same
    time, so one's expert all-to-all waits while the other computes (``parallel/pipeline_parallel/overlap.py``).
    Needs ``pipeline_schedule="dualpipev"``, ``expert_parallel_size > 1``, and no TP, CP, ZeRO-3 or hetero meshes."""
    pipeline_chunk_costs: tuple[float, float, float] | Literal["auto"] | None = None
    """``zbv`` and ``dualpipev`` only: relative forward : input-gradient : weight-gradient cost of one model chunk for
    one micro-batch, e.g. ``[1, 2, 1]``; the schedule runs the action order generated for them (``orders.zbv_order``,
    ``orders.dualpipev_order``: torch's own unless another is strictly faster). ``"auto"``: measured on the second
    training step (torch's order runs the first two), averaged over every rank, then the generated order runs; not with
    ``hetero_meshes``. ``None``: equal costs."""
    pipeline_max_activations: int | None = None
    """``zbv`` and ``dualpipev`` only: activations one pipeline rank may hold (forwards whose weight gradient has not
    run), at least 2; ``None``: what torch's order holds, 2p for ZB-V (a 1F1B rank's), 2p + 1 for DualPipeV (p:
    pipeline ranks, or stage groups with ``hetero_meshes``). With input gradients dearer than weight gradients, more
    lets the order idle less: ZB-V at 4p idles only the (p-1)F no V schedule avoids; DualPipeV keeps its pairs and
    places its weight gradients in its waits."""

    def __post_init__(self) -> None:
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}.")
        modes = [self.recompute] if isinstance(self.recompute, str) else list(self.recompute)
        if any(m not in get_args(RecomputeMode) for m in modes) or not modes:
            raise ValueError(
                f"recompute={self.recompute!r}: use 'none', 'selective', 'selective_mm' or 'full' (or one per stage)."
            )
        if self.pipeline_balance not in ("even", "cost"):
            raise ValueError(f"pipeline_balance={self.pipeline_balance!r}; use 'even' or 'cost'.")
        self._check_v_order()

    def _check_v_order(self) -> None:
        costs, cap = self.pipeline_chunk_costs, self.pipeline_max_activations
        if costs is not None and costs != "auto":
            if not isinstance(costs, (tuple, list)) or len(costs) != 3 or any(
                not isinstance(c, (int, float)) or isinstance(c, bool) or not 0 < c < float("inf") for c in costs
            ):  # fmt: skip
                raise ValueError(
                    f"pipeline_chunk_costs={costs!r}: give three positive finite numbers, the forward, input-gradient"
                    " and weight-gradient cost of one model chunk, e.g. [1, 2, 1], or 'auto' (measured in training)."
                )
            self.pipeline_chunk_costs = tuple(float(c) for c in costs)  # a YAML list, or ints, compare equal
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 2):
            raise ValueError(
                f"pipeline_max_activations={cap!r}: give an integer >= 2 (the first micro-batch's forwards through both"
                " chunks of the first rank run before any backward) or None (2p, what a 1F1B rank holds)."
            )
        knobs = [n for n in ("pipeline_chunk_costs", "pipeline_max_activations") if getattr(self, n) is not None]
        if knobs and self.pipeline_schedule not in ("zbv", "dualpipev"):
            raise ValueError(
                f"{' and '.join(knobs)}: only pipeline_schedule='zbv' or 'dualpipev' generates its action order from"
                f" them, got pipeline_schedule={self.pipeline_schedule!r}; set one of those or leave"
                f" {' and '.join(knobs)} at None."
            )


@dataclass(kw_only=True)
class HeteroConfig:
    """Heterogeneous training: process meshes chained as pipeline stages, or uneven data-parallel shares."""

    hetero_meshes: list[dict[str, Any]] | None = None
    """Heterogeneous process meshes in rank order, each a dict of ``tensor_parallel_size``, ``data_parallel_size``,
    ``pipeline_parallel_size``, ``context_parallel_size``, ``expert_parallel_size``, ``expert_tensor_parallel_size``,
    ``device_type``; chained as
    pipeline stages (see ``config/hetero.py``). The global TP/PP/CP/EP/DP sizes must then stay at their defaults.
    Ranks reporting a ``device_type`` (``FLAGSCALE_DEVICE_TYPE``) fill the meshes declaring it, else rank order."""
    hetero_layers: list[int] | None = None
    """With ``hetero_meshes``: model blocks per pipeline stage over all meshes, e.g. ``[3, 1]`` (with virtual stages,
    split evenly over each stage's chunks, or one entry per virtual stage in pipeline order); ``None`` splits them
    in proportion to each stage's ranks x its device type's speed (``hetero_device_speed``, else measured by a short
    profiling pass on the ranks, ``parallel/hetero_mesh/profile.py``)."""
    hetero_device_speed: dict[str, float] | None = None
    """Relative speed of each ``device_type`` of ``hetero_meshes`` (e.g. ``{"fast": 2.0, "slow": 1.0}``), used when
    ``hetero_layers`` is ``None``; with ``hetero_dp_batch_sizes="auto"``, of each ``FLAGSCALE_DEVICE_TYPE``."""
    hetero_mesh_order: Literal["given", "speed"] = "given"
    """Order in which ``hetero_meshes`` become pipeline stages: as listed, or ``"speed"``: the order (of every
    permutation, ties as listed) whose ``hetero_device_speed`` split has the fastest slowest stage, counting the LM head
    where the order puts it (last stage group; first under ``zbv`` / ``dualpipev``), so a faster mesh takes it. Each
    mesh keeps its ranks; ``micro_batch_size`` and the loader's batch size stay per data-parallel rank of
    ``hetero_meshes[0]`` as listed. Needs ``hetero_device_speed``."""
    hetero_warmup: Literal["1f1b", "speed"] = "1f1b"
    """1F1B warm-up forwards of the first stage group of ``hetero_meshes``: the standard ``G - 1`` (``"1f1b"``), or
    ``"speed"``: enough that, at the ``hetero_device_speed`` stage times, the first group does not wait for the first
    micro-batch's gradient nor, at the end, for the last one's (``config/layer_split.py::speed_warmup``). It pays where
    the first mesh sets the pace (a slower first mesh, as ``hetero_mesh_order="speed"`` makes it when the head goes
    to the faster one); each extra warm-up holds one more micro-batch's activations on the first mesh. Needs
    ``hetero_device_speed`` and ``pipeline_schedule="1f1b"`` without virtual stages."""
    hetero_dp_batch_sizes: list[int] | Literal["auto"] | None = None
    """Heterogeneous data parallelism: samples per step for each data-parallel rank (stronger devices take more),
    e.g. ``[6, 2]``; ``"auto"``: shares of the usual global batch (DataLoader batch size x DP) in proportion to each
    rank's speed, from ``hetero_device_speed`` by ``FLAGSCALE_DEVICE_TYPE`` or a profiling pass
    (``parallel/hetero_dp/shares.py``); ``None`` splits every batch evenly."""

    def __post_init__(self) -> None:
        self._check_hetero_fields()

    def _check_hetero_fields(self) -> None:
        if self.hetero_meshes is None and self.hetero_layers is not None:
            raise ValueError("hetero_layers needs hetero_meshes.")
        if self.hetero_meshes is None and self.hetero_device_speed is not None and self.hetero_dp_batch_sizes != "auto":
            raise ValueError("hetero_device_speed needs hetero_meshes or hetero_dp_batch_sizes='auto'.")
        self._check_auto_shares()
        self._check_mesh_order()
        self._check_warmup()

    def _check_warmup(self) -> None:
        warmup = self.hetero_warmup
        if warmup not in ("1f1b", "speed"):
            raise ValueError(f"hetero_warmup={warmup!r}; use '1f1b' (G - 1 warm-up forwards) or 'speed'.")
        if warmup == "1f1b":
            return
        if self.hetero_meshes is None or self.hetero_device_speed is None:
            raise ValueError(
                "hetero_warmup='speed' sets the first stage group's warm-up from the stage times at"
                " hetero_device_speed; give hetero_meshes and hetero_device_speed, or use hetero_warmup='1f1b'."
            )
        if self.pipeline_schedule != "1f1b" or self.virtual_pipeline_parallel_size not in (None, 1):
            raise ValueError(
                f"hetero_warmup='speed' sets 1F1B's warm-up; pipeline_schedule={self.pipeline_schedule!r} with"
                f" virtual_pipeline_parallel_size={self.virtual_pipeline_parallel_size} orders its own. Use"
                " pipeline_schedule='1f1b' without virtual stages, or hetero_warmup='1f1b'."
            )

    def _check_mesh_order(self) -> None:
        order = self.hetero_mesh_order
        if order not in ("given", "speed"):
            raise ValueError(f"hetero_mesh_order={order!r}; use 'given' (as listed) or 'speed'.")
        if order == "given":
            return
        if self.hetero_meshes is None:
            raise ValueError("hetero_mesh_order='speed' orders hetero_meshes; give hetero_meshes or leave it 'given'.")
        if self.hetero_layers is not None:
            raise ValueError(
                f"hetero_mesh_order='speed' chooses the split with the order, but hetero_layers={self.hetero_layers}"
                " fixes it mesh by mesh as listed; leave hetero_layers at None (and give hetero_device_speed) or use"
                " hetero_mesh_order='given'."
            )
        if self.hetero_device_speed is None:
            raise ValueError(
                "hetero_mesh_order='speed' needs hetero_device_speed: the order is chosen before the meshes' process"
                " groups exist, and without speeds the split comes from a profiling pass on those groups; give"
                " hetero_device_speed (e.g. {'fast': 2.0, 'slow': 1.0}) or use hetero_mesh_order='given'."
            )

    def _check_auto_shares(self) -> None:
        shares, speed = self.hetero_dp_batch_sizes, self.hetero_device_speed
        if isinstance(shares, str) and shares != "auto":
            raise ValueError(f"hetero_dp_batch_sizes={shares!r}: give a list of per-rank batch sizes or 'auto'.")
        if speed is not None and (not isinstance(speed, dict) or not speed or any(
            not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 for v in speed.values()
        )):  # fmt: skip
            raise ValueError(f"hetero_device_speed={speed!r} must map each device type to a positive speed.")


@dataclass(kw_only=True)
class ParallelConfig(HeteroConfig, PipelineConfig, DataParallelConfig, ParallelSizes):
    """The parallel layout: :class:`ParallelSizes`, :class:`DataParallelConfig`, :class:`PipelineConfig` and
    :class:`HeteroConfig` in one validated object (their fields are the strategy's keywords). ``sizes``, ``data``,
    ``pipeline`` and ``hetero`` give each group on its own.

    World = pp x dp x cp x tp, with tp fastest-varying in rank order (see ``parallel/mesh.py``). Experts fold
    over the dp x cp x tp ranks of a stage as edp x ep x etp (Megatron's MoE parallel folding).
    """

    def __post_init__(self) -> None:
        # Each group's own rules, then the rules that tie groups together.
        self._check_hetero_fields()
        self._check_sizes()
        self._check_data_parallel()
        self._check_pipeline()
        if self.hetero_meshes is not None:
            self._check_hetero()
        auto_vpp = default_virtual_size(self.pipeline_schedule, self.pipeline_parallel_size)  # rejects unknown names
        if self.virtual_pipeline_parallel_size is None and self.hetero_enabled:
            auto_vpp = hetero_virtual_size(self.pipeline_schedule, None)  # always >= 2 stages: V schedules take 2
        if self.virtual_pipeline_parallel_size is None:
            self.virtual_pipeline_parallel_size = auto_vpp
        self._check_zero3_impl()
        self._check_expert_tensor_parallel()
        self._check_moe_comm_overlap()
        cap = self.pipeline_max_activations
        ranks = self._hetero_stage_count() if self.hetero_enabled else self.pipeline_parallel_size
        if self.pipeline_schedule == "dualpipev" and cap is not None and ranks > 1 and cap < 2 * ranks + 1:
            raise ValueError(
                f"pipeline_max_activations={cap}: DualPipeV's order over {ranks} pipeline ranks holds {2 * ranks + 1}"
                f" activations on a rank before its first backward (p + 1 forwards of the first chunk, p of the"
                f" second); give at least {2 * ranks + 1} or None."
            )
        if self.pipeline_chunk_costs == "auto" and self.hetero_meshes is not None:
            raise ValueError(
                "pipeline_chunk_costs='auto' is not measured across hetero_meshes (each mesh's stages run at their own"
                " speed); give the costs, e.g. pipeline_chunk_costs=[1, 2, 1], or leave it at None."
            )
        if self.sequence_parallel and self.tensor_parallel_size == 1 and self.hetero_meshes is None:
            raise ValueError(
                "sequence_parallel=True needs tensor_parallel_size > 1 (it shards activations over the TP group);"
                " set tensor_parallel_size >= 2 or sequence_parallel=False."
            )
        if self.virtual_pipeline_parallel_size > 1 and self.pipeline_parallel_size == 1 and not self.hetero_enabled:
            raise ValueError(
                "virtual_pipeline_parallel_size > 1 needs pipeline_parallel_size > 1; raise the pipeline size or set"
                " virtual_pipeline_parallel_size=1."
            )
        if self.pp_enabled:
            # Every schedule rule that needs only the layout (chunks per rank, V placement); the micro-batch count is
            # checked by the pipeline runner once the batch size is known. Without PP the schedule is never run.
            validate_schedule(self.pipeline_schedule, self.pipeline_parallel_size, self.virtual_pipeline_parallel_size)
        if self.torch_compile and self.hetero_enabled:
            raise ValueError(
                "torch_compile=True is not supported with hetero_meshes yet (each stage group's blocks are built by"
                " the hetero pipeline, which does not compile them). Set torch_compile=False."
            )
        if self.torch_compile and self.pp_enabled and SCHEDULE_SPECS[self.pipeline_schedule].split_backward:
            raise ValueError(
                f"torch_compile=True with pipeline_schedule={self.pipeline_schedule!r} is not supported: a compiled"
                " block's backward computes input and weight gradients in one graph, which a split-backward schedule"
                " would run twice. Use 'gpipe', '1f1b' or 'interleaved_1f1b' with compile, or torch_compile=False."
            )
        modes = [self.recompute] if isinstance(self.recompute, str) else list(self.recompute)
        stages = self.num_stages if not self.hetero_enabled else self._hetero_stage_count()
        if not isinstance(self.recompute, str) and len(modes) != stages:
            raise ValueError(
                f"recompute has {len(modes)} entries but there are {stages} pipeline stages; give one mode"
                " per stage (pipeline_parallel_size x virtual_pipeline_parallel_size, or one per hetero stage group) or a"
                " single mode."
            )
        if self.pipeline_layers is not None and len(self.pipeline_layers) != self.num_stages:
            raise ValueError(
                f"pipeline_layers has {len(self.pipeline_layers)} entries but there are {self.num_stages} stages"
                f" (pipeline_parallel_size x virtual_pipeline_parallel_size); give one layer count per stage."
            )

    def _check_moe_comm_overlap(self) -> None:
        if not self.overlap_moe_expert_parallel_comm:
            return
        # Two threads run a forward and a backward at once; only the MoE layers get a process group per model chunk,
        # so every other collective inside a stage's forward or backward must be absent.
        clash = [
            name for name, on in (
                (f"pipeline_schedule={self.pipeline_schedule!r} (only 'dualpipev' pairs a forward with a backward)",
                 self.pipeline_schedule != "dualpipev"),
                ("pipeline_parallel_size=1", self.pipeline_parallel_size == 1 and not self.hetero_enabled),
                ("expert_parallel_size=1 (no expert all-to-all to overlap)", self.expert_parallel_size == 1),
                ("tensor_parallel_size > 1", self.tensor_parallel_size > 1),
                ("expert_tensor_parallel_size > 1", self.expert_tensor_parallel_size > 1),
                ("context_parallel_size > 1", self.context_parallel_size > 1),
                ("zero_stage=3 (its all-gathers run inside forward and backward)", self.zero_stage == 3),
                ("hetero_meshes", self.hetero_enabled),
            ) if on
        ]  # fmt: skip
        if clash:
            raise ValueError(
                f"overlap_moe_expert_parallel_comm=True does not run with {'; '.join(clash)}: it overlaps DualPipeV's"
                " paired forward and backward on expert-parallel layouts whose only collectives inside a stage are the"
                " MoE layers'. Change those settings or set overlap_moe_expert_parallel_comm=False."
            )

    def _flat_zero3_refusals(self) -> list[str]:
        """Why flat ZeRO-3 cannot run this layout (empty: it can)."""
        spec = SCHEDULE_SPECS.get(self.pipeline_schedule)
        split = self.pipeline_parallel_size > 1 and spec is not None and spec.split_backward
        return [
            name for name, on in (
                # Their weight-gradient passes differentiate the modules' parameters, which flat ZeRO-3 swaps out.
                (f"pipeline_schedule={self.pipeline_schedule!r} (split backward)", split),
                # Each mesh group would need its own flat units and gradient reduction across groups.
                ("hetero_meshes", self.hetero_meshes is not None),
            ) if on
        ]  # fmt: skip

    @property
    def resolved_zero3_impl(self) -> Literal["fsdp2", "flat"]:
        """The ZeRO-3 engine of this layout: ``zero3_impl``, with ``"auto"`` resolved to flat unless the layout needs
        FSDP2 (the model may still send ``"auto"`` to FSDP2 when it is parallelised, see ``zero3_impl``)."""
        if self.zero3_impl == "auto":
            return "fsdp2" if self._flat_zero3_refusals() else "flat"
        return self.zero3_impl

    def _check_zero3_impl(self) -> None:
        if self.zero3_impl not in ("auto", "fsdp2", "flat"):
            raise ValueError(f"zero3_impl={self.zero3_impl!r}; use 'auto', 'fsdp2' or 'flat'.")
        if self.zero3_impl != "flat" or self.zero_stage != 3:
            return

        whole = " / ".join(name for name, sp in SCHEDULE_SPECS.items() if not sp.split_backward)
        unsupported = self._flat_zero3_refusals()
        if unsupported:
            raise ValueError(
                f"zero3_impl='flat' with {', '.join(unsupported)} is not supported (flat ZeRO-3 composes with DP, CP,"
                f" TP, EP, recompute and the {whole} pipeline schedules); use zero3_impl='fsdp2' or 'auto' for this"
                " layout."
            )

    def _check_hetero(self) -> None:
        meshes = parse_hetero_meshes(self.hetero_meshes)
        per_mesh = {
            "tensor_parallel_size": self.tensor_parallel_size, "pipeline_parallel_size": self.pipeline_parallel_size,
            "context_parallel_size": self.context_parallel_size, "expert_parallel_size": self.expert_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size, "data_parallel_size": self.data_parallel_size or 1,
        }  # fmt: skip
        clash = [k for k, v in per_mesh.items() if v != 1]
        if clash:
            raise ValueError(
                f"With hetero_meshes, {', '.join(clash)} belong inside each mesh's dict; leave the global value(s)"
                " at their default."
            )
        if self.hetero_dp_batch_sizes is not None:
            raise ValueError("hetero_dp_batch_sizes and hetero_meshes cannot be combined; give each mesh its own DP.")
        if self.hetero_device_speed is not None and self.hetero_layers is not None:
            raise ValueError("Give hetero_layers or hetero_device_speed, not both (the speeds only choose the split).")
        check_hetero_layout(
            meshes, self.hetero_layers, schedule=self.pipeline_schedule, sequence_parallel=self.sequence_parallel,
            virtual=self.virtual_pipeline_parallel_size,
        )  # fmt: skip
        if self.hetero_mesh_order == "speed":
            check_orderable(meshes)
        if self.hetero_mesh_order == "speed" and not isinstance(self.recompute, str):
            raise ValueError(
                f"recompute={self.recompute} gives one mode per stage group in pipeline order, which"
                " hetero_mesh_order='speed' chooses only at setup; give one mode for all stages or use"
                " hetero_mesh_order='given'."
            )

    def _hetero_stage_count(self) -> int:
        """Stage groups of ``hetero_meshes`` (a per-stage ``recompute`` list gives one mode per group)."""
        return sum(m.pipeline_parallel_size for m in parse_hetero_meshes(self.hetero_meshes))

    def _group(self, cls: type) -> Any:
        values = {f.name: getattr(self, f.name) for f in fields(cls)}
        group = cls.__new__(cls)  # a view of resolved values: the group's own checks already ran on this config
        group.__dict__.update(values)
        return group

    @property
    def sizes(self) -> ParallelSizes:
        """The degrees of every parallelism (after ``resolve``, ``data_parallel_size`` is set)."""
        return self._group(ParallelSizes)

    @property
    def data(self) -> DataParallelConfig:
        """ZeRO stage and engine, gradient buckets and overlap settings."""
        return self._group(DataParallelConfig)

    @property
    def pipeline(self) -> PipelineConfig:
        """Micro-batching, schedule, split and recompute."""
        return self._group(PipelineConfig)

    @property
    def hetero(self) -> HeteroConfig:
        """Heterogeneous meshes or data-parallel shares."""
        return self._group(HeteroConfig)

    @property
    def hetero_enabled(self) -> bool:
        return self.hetero_meshes is not None

    def hetero_extra_blocks(self, model: TransformerConfig | None) -> list[float] | None:
        """Per stage group, the embedding and LM head in blocks (:func:`edge_extra_blocks`, at ``model.max_seq_len``)
        when ``hetero_device_speed`` chooses the split; ``None`` otherwise (``hetero_layers`` fixes it, and the
        profiling pass counts them itself) or without a decoder config."""
        if self.hetero_meshes is None or self.hetero_layers is not None or self.hetero_device_speed is None:
            return None
        if not isinstance(model, TransformerConfig):
            return None
        return edge_extra_blocks(
            model, model.max_seq_len, self._hetero_stage_count(), virtual=self.virtual_pipeline_parallel_size,
            schedule=self.pipeline_schedule,
        )  # fmt: skip

    def check_user_layout(self) -> None:
        """Rules for a layout a user gives, not for the per-stage-group configs built from it (those run one
        pipeline stage group each, pp = 1, and carry the order knobs of the hetero pipeline they belong to)."""
        knobs = [n for n in ("pipeline_chunk_costs", "pipeline_max_activations") if getattr(self, n) is not None]
        if knobs and not self.pp_enabled and not self.hetero_enabled:
            named = " and ".join(knobs)
            raise ValueError(
                f"{named} shape a pipeline schedule's order, but pipeline_parallel_size=1 runs none; set"
                f" pipeline_parallel_size > 1 or leave {named} at None."
            )

    def stage_groups(
        self, num_layers: int, model: TransformerConfig | None = None, rank_order: list[int] | None = None
    ) -> list[StageGroup]:
        """With ``hetero_meshes``: the stage groups in pipeline order, as the runtime builds them (before a profiling
        pass replaces an open split). ``model``: the decoder whose embedding and LM head a ``hetero_device_speed``
        split counts (:meth:`hetero_extra_blocks`); ``rank_order``: see :func:`plan_stage_groups`."""
        return plan_stage_groups(
            parse_hetero_meshes(self.hetero_meshes), self.hetero_layers, num_layers, self.hetero_device_speed,
            rank_order, virtual=self.virtual_pipeline_parallel_size, sequence_parallel=self.sequence_parallel,
            schedule=self.pipeline_schedule, extra_blocks=self.hetero_extra_blocks(model),
            mesh_order=self.hetero_mesh_order, warmup=self.hetero_warmup,
        )  # fmt: skip

    def stage_group_configs(self, num_layers: int, model: TransformerConfig | None = None) -> list[ParallelConfig]:
        """With ``hetero_meshes``: one resolved homogeneous config (pp = 1) per pipeline stage group
        (:meth:`stage_groups`)."""
        groups = self.stage_groups(num_layers, model)
        first = parse_hetero_meshes(self.hetero_meshes)[0]  # as listed, whatever hetero_mesh_order makes it
        samples = self.micro_batch_size * first.data_parallel_size  # one micro-batch, over the first mesh's DP ranks
        configs = []
        for g in groups:
            if samples % g.data_parallel_size:
                raise ValueError(
                    f"A micro-batch of {samples} samples (micro_batch_size={self.micro_batch_size} x the first mesh's"
                    f" data_parallel_size={first.data_parallel_size}) cannot be split over mesh {g.mesh}'s"
                    f" data_parallel_size={g.data_parallel_size}; raise micro_batch_size."
                )
            configs.append(
                ParallelConfig(
                    tensor_parallel_size=g.tensor_parallel_size, data_parallel_size=g.data_parallel_size,
                    context_parallel_size=g.context_parallel_size, expert_parallel_size=g.expert_parallel_size,
                    expert_tensor_parallel_size=g.expert_tensor_parallel_size, sequence_parallel=g.sequence_parallel,
                    zero_stage=self.zero_stage, zero3_impl=self.resolved_zero3_impl,
                    micro_batch_size=samples // g.data_parallel_size,
                    gradient_accumulation_steps=self.gradient_accumulation_steps, pipeline_schedule=self.pipeline_schedule,
                    recompute=self.recompute if isinstance(self.recompute, str) else self.recompute[g.index],
                    context_parallel_mode=self.context_parallel_mode, pipeline_chunk_costs=self.pipeline_chunk_costs,
                    pipeline_max_activations=self.pipeline_max_activations,
                ).resolve(g.size)
            )  # fmt: skip
        return configs

    # ---- derived sizes ----
    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.virtual_pipeline_parallel_size

    @property
    def stage_recompute(self) -> list[str]:
        """One recompute mode per pipeline stage (``recompute`` given once applies to every stage)."""
        return [self.recompute] * self.num_stages if isinstance(self.recompute, str) else list(self.recompute)

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
        """Whether the routed experts are sharded: over EP ranks, inside each expert over ETP ranks, or both."""
        return self.expert_parallel_size > 1 or self.expert_tensor_parallel_size > 1

    @property
    def expert_shards(self) -> int:
        """Ranks that split one MoE layer's routed expert weights: ep x etp."""
        return self.expert_parallel_size * self.expert_tensor_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same expert shard (their gradients are reduced, ZeRO shards their states): a stage's
        dp x cp x tp ranks over ep x etp."""
        return self.dp * self.context_parallel_size * self.tensor_parallel_size // self.expert_shards

    @property
    def etp_tokens_replicated(self) -> bool:
        """Whether each ETP group lies inside a TP group (ETP divides TP; both are the fastest rank dims), whose ranks
        feed the MoE blocks the same tokens: the ETP ranks then split the same rows (no token all-gather) and sum their
        partial outputs. Otherwise the ETP ranks all-gather their tokens and reduce-scatter the outputs."""
        return self.tensor_parallel_size % self.expert_tensor_parallel_size == 0

    @property
    def etp_sequence_parallel(self) -> bool:
        """ETP > 1 inside the TP group (Megatron-Core's default ETP = TP, or ETP dividing TP) under sequence
        parallelism: the MoE block reduce-scatters the partial expert outputs over the ETP group, each rank its own
        sequence chunk (and the input's partial gradients over TP in backward) instead of all-reducing every routed
        row and keeping its chunk (``MoELayer.forward``, issue 39)."""
        etp = self.expert_tensor_parallel_size
        return self.sequence_parallel and etp > 1 and self.etp_tokens_replicated

    @property
    def moe_routes_sequence_chunks(self) -> bool:
        """Whether MoE blocks route and dispatch only their own sequence-parallel chunk (TP with SP and whole experts
        per EP rank, ETP = 1; Megatron's layout): each token reaches its experts once per TP group. Their token group
        then holds the TP ranks, and router and shared-expert gradients are summed over TP, once per step by the
        gradient reduction (``parallel.expert_parallel.tag_chunk_routed_params``)."""
        return self.tp_enabled and self.sequence_parallel and self.expert_tensor_parallel_size == 1

    @property
    def expert_grad_divisor(self) -> int:
        """What expert gradients summed over the expert-data-parallel ranks are divided by: how many times each
        token of the step reached every expert shard. Routing its own sequence chunk (``moe_routes_sequence_chunks``)
        each TP rank dispatches other tokens: once per (dp, cp) token shard. Otherwise MoE blocks run on the whole
        sequence on every TP rank, so each (dp, cp) token shard is dispatched by its tp ranks; ETP ranks that split
        the same rows (``etp_tokens_replicated``) see each of those copies once per ETP group instead of once per
        rank."""
        if self.moe_routes_sequence_chunks:
            return self.dp * self.context_parallel_size
        copies = self.dp * self.context_parallel_size * self.tensor_parallel_size
        return copies // self.expert_tensor_parallel_size if self.etp_tokens_replicated else copies

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def world_size(self) -> int:
        return self.dp * self.model_parallel_size

    # ---- validation against the outside world ----
    def resolve(self, world_size: int) -> ParallelConfig:
        """Derive ``data_parallel_size`` from ``world_size`` and check the product; returns ``self``."""
        if self.hetero_meshes is not None:
            sizes = [m.size for m in parse_hetero_meshes(self.hetero_meshes)]
            if sum(sizes) != world_size:
                raise ValueError(
                    f"hetero_meshes describe {' + '.join(map(str, sizes))} = {sum(sizes)} ranks but the world size is"
                    f" {world_size}; change the meshes' sizes or the number of devices."
                )
            self.data_parallel_size = 1
            return self
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
        if self.hetero_dp_batch_sizes not in (None, "auto"):
            check_hetero_batch_sizes(
                self.hetero_dp_batch_sizes, self.dp, micro_batch_size=self.micro_batch_size, pipeline=self.pp_enabled
            )
        folded = self.dp * self.context_parallel_size * self.tensor_parallel_size
        ep_etp = self.expert_parallel_size * self.expert_tensor_parallel_size
        if folded % ep_etp:
            raise ValueError(
                f"expert_parallel_size x expert_tensor_parallel_size = {ep_etp} must divide data x context x tensor"
                f" = {folded} (experts fold over the ranks of one pipeline stage); change expert_parallel_size."
            )
        return self

    def _check_expert_tensor_parallel(self) -> None:
        """ETP combinations that are not implemented are refused here, before any process group exists."""
        etp = self.expert_tensor_parallel_size
        if self.hetero_meshes is not None:  # the meshes' own sizes, each checked by its stage groups' configs
            etp = max(m.expert_tensor_parallel_size for m in parse_hetero_meshes(self.hetero_meshes))
        if etp == 1:
            return
        if self.zero_stage == 3:
            raise ValueError(
                f"expert_tensor_parallel_size={etp} is not supported with zero_stage=3 yet (ZeRO-3 shards experts"
                " over the expert-data-parallel ranks of a 1-D expert shard); use zero_stage 0, 1 or 2, or"
                " expert_tensor_parallel_size=1."
            )

    def validate_model(self, config: TransformerConfig) -> None:
        """Check that ``config`` can be split the way this layout asks."""
        if self.hetero_meshes is not None:
            for group in self.stage_group_configs(config.num_layers, config):
                group.validate_model(config)
            return
        if self.torch_compile and config.is_moe:  # parallel/compile.py refuses it too, for models built otherwise
            raise ValueError(
                f"torch_compile=True is not supported for MoE models yet ({config.name!r} has"
                f" {config.num_experts} experts: per-expert token counts change every step); set torch_compile=False."
            )
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
        if self.pp_enabled and self.pipeline_layers is None and self.pipeline_balance == "even":
            # the even split pads to equal layer slots per pipeline rank, which the virtual size must divide
            even_layer_counts(config.num_layers, self.pipeline_parallel_size, self.virtual_pipeline_parallel_size)
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
        if "selective_mm" in self.stage_recompute and config.is_moe:
            raise ValueError(SELECTIVE_MM_ON_MOE)
        if self.ep_enabled:
            if not config.is_moe:
                raise ValueError(
                    "expert_parallel_size > 1 or expert_tensor_parallel_size > 1 needs an MoE model (num_experts > 0)."
                )
            self._check_expert_split(config)
            if config.num_experts % self.expert_parallel_size:
                raise ValueError(
                    f"num_experts={config.num_experts} is not divisible by expert_parallel_size="
                    f"{self.expert_parallel_size}."
                )

    def _check_expert_split(self, config: TransformerConfig) -> None:
        """Each expert's FFN must split evenly over ETP; hot-expert replicas are whole experts (not ETP shards)."""
        etp = self.expert_tensor_parallel_size
        if etp == 1:
            return
        inter = config.moe_intermediate_size or config.intermediate_size
        if inter % etp:
            raise ValueError(
                f"The expert intermediate size {inter} (moe_intermediate_size) is not divisible by"
                f" expert_tensor_parallel_size={etp}; choose an ETP size that divides it."
            )
        if config.moe_hot_expert_replicas:
            raise ValueError(
                f"moe_hot_expert_replicas={config.moe_hot_expert_replicas} is not supported with"
                f" expert_tensor_parallel_size={etp} (replicas are whole experts); set moe_hot_expert_replicas=0."
            )
