"""Pipeline parallelism: stage planning, stage modules, schedules by name, and one runner the strategy drives.

Built on ``torch.distributed.pipelining`` (``PipelineStage`` + its schedules, which run on CPU/gloo). What torch
lacks and this file adds (issue 3):

* **Stage planning** from the model protocol's ``pipeline_units()`` (embedding, blocks, final norm, head): even
  split, explicit ``pipeline_layers``, or cost balancing that counts the embedding and LM head; and **empty-layer
  padding** (61 layers, p=8, v=2 -> 64 slots): placeholder slots exist only in the plan, so they cost nothing,
  hold no weights and can never reach a state dict.
* **Stage modules** cut from one (meta) model by deleting what a stage does not run, keeping every FQN, so a
  checkpoint written with PP=2 loads with PP=1 or PP=4.
* **Schedules by name** with the placement each needs (looped for 1F1B-family, V-shaped for ZBV/DualPipeV) and
  clear errors for layouts torch would reject late or hang on.
* **Tied embeddings** across the first and last stage: both hold a copy; :meth:`PipelineRunner.sync_tied_grads`
  sums their gradients over a 2-rank group.
* **Per-stage recompute** (none / selective / full), see ``pipeline_parallel/recompute.py``.

``position_ids`` and ``segment_ids`` reach every stage as keyword inputs of the schedule: torch splits keyword
arguments into micro-batches and hands each stage its chunk together with the activations it receives (only
positional arguments travel between stages), so every stage's ``forward(x, position_ids=..., segment_ids=...)``
sees the same per-micro-batch ids. Every pipeline rank therefore calls :meth:`PipelineRunner.step` with the full
batch dict (as Lightning does anyway: all ranks of a pipeline read the same data-parallel shard).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
)
from torch.distributed.tensor import DTensor

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.config.schedules import SCHEDULE_SPECS, min_microbatches, validate_schedule
from lightning_flagscale.parallel.compile import apply_compile
from lightning_flagscale.parallel.data_parallel.zero3_flat import find_flat_zero3
from lightning_flagscale.parallel.pipeline_parallel.orders import dualpipev_order, zbv_order
from lightning_flagscale.parallel.pipeline_parallel.overlap import OverlappedPairs, check_pairs_cross_chunks
from lightning_flagscale.parallel.pipeline_parallel.plan import (
    StagePlan,
    build_stage_module,
    check_units_cover_parameters,
    is_layer_unit,
    pipeline_unit_costs,
    plan_stages,
    stage_ids_for_rank,
    tied_parameters,
    unit_param_costs,
)
from lightning_flagscale.parallel.pipeline_parallel.recompute import apply_recompute, resolve_recompute

__all__ = [
    "SCHEDULES",
    "PipelineRunner",
    "StagePlan",
    "StatelessInferenceStage",
    "build_pipeline",
    "build_stage_module",
    "check_units_cover_parameters",
    "is_layer_unit",
    "merge_param_groups",
    "min_microbatches",
    "param_groups_overlap",
    "pipeline_unit_costs",
    "plan_stages",
    "stage_ids_for_rank",
    "tied_across_stages",
    "tied_parameters",
    "unit_param_costs",
    "validate_schedule",
]

# name -> (torch schedule class, stage placement), from the one list of names in ``schedules.py``.
SCHEDULES: dict[str, tuple[type, str]] = {
    name: (getattr(_torch_schedules, spec.torch_class), spec.placement) for name, spec in SCHEDULE_SPECS.items()
}
# Schedules kept per runner (one per micro-batch count, train/eval and batch shape), least recently used dropped.
_MAX_SCHEDULES = 8
log = logging.getLogger(__name__)
# Run input- and weight-gradients as two autograd passes (the first stage does one full pass in the W step).
_SPLIT_BACKWARD_SCHEDULES = tuple(name for name, spec in SCHEDULE_SPECS.items() if spec.split_backward)


# --------------------------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------------------------


def _make_forward_only(schedule: PipelineScheduleMulti) -> None:
    """Keep only the forward actions of a multi-stage schedule and re-lower its communication.

    torch's ``schedule.eval()`` replays the training order with backward switched off, which breaks for V
    placements (a stage hands its input gradient to the co-located previous stage, and there is none). The forward
    actions of a deadlock-free schedule, in the same per-rank order, are deadlock-free too: backward actions never
    feed a forward. The lowering reuses torch's own passes (unshard/reshard for FSDP stages, then send/recv);
    ``_prepare_schedule_with_comms`` itself cannot be used because it insists on one backward per micro-batch.
    Private torch helpers: pinned by the forward-only parity tests of every multi-stage schedule.
    """
    order: dict[int, list[Any]] = {}
    for rank, actions in schedule.pipeline_order.items():
        # DualPipeV fuses a forward and a backward into one OVERLAP_F_B action: keep its forward part.
        flat = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]
        order[rank] = [a for a in flat if a.computation_type == _ComputationType.FORWARD]
    lowered = {rank: _add_unshard_reshard(actions) for rank, actions in order.items()}
    schedule.pipeline_order = order
    schedule.pipeline_order_with_comms = _add_send_recv(
        lowered, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=schedule._num_stages
    )


def _use_generated_order(
    schedule: PipelineScheduleMulti,
    name: str,
    p: int,
    m: int,
    costs: tuple[float, float, float],
    cap: int | None,
) -> None:
    """Give torch's ZB-V or DualPipeV schedule the order generated for ``costs`` under ``cap``
    (``orders.zbv_order`` / ``orders.dualpipev_order``).

    Both keep torch's own order unless another is strictly better for these costs (ZB-V: never at equal costs and
    1F1B's memory; then this changes nothing). ``_prepare_schedule_with_comms`` is the lowering torch runs on its own
    order (send/recv, reduce-grad); private torch API, pinned by the ZB-V and DualPipeV parity tests."""
    order = (zbv_order if name == "zbv" else dualpipev_order)(p, m, costs, cap)
    if order != {r: [a for a in acts if a is not None] for r, acts in schedule.pipeline_order.items()}:
        schedule.pipeline_order = dict(order)
        schedule._prepare_schedule_with_comms(schedule.pipeline_order)


def _run_pairs_apart(schedule: PipelineScheduleMulti) -> None:
    """Lower DualPipeV's forward-backward pairs (``OVERLAP_F_B``) as their two actions when they run one after the
    other, so the forward's output is sent as soon as the forward ends.

    torch's lowering (``_add_send_recv``) sends a pair's outputs after the whole pair: the next rank's forward waits
    for this rank's backward too. Replayed with F = I = W that raises DualPipeV's bubble at p = 4, m = 8 from 5.9% to
    11.1% (``orders.simulate``; measured 12.6%, issue 42 item 2). Same actions in the same order, so the numerics do
    not change. A schedule with a function registered for the pairs (``overlap.py``) keeps them."""
    if _ComputationType.OVERLAP_F_B in schedule._comp_type_to_function_map:
        return
    order = schedule.pipeline_order
    if not any(a is not None and a.sub_actions for actions in order.values() for a in actions):
        return
    flat = {
        r: [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))] for r, actions in order.items()
    }
    schedule.pipeline_order = flat
    schedule._prepare_schedule_with_comms(flat)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def merge_param_groups(groups: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """torch's ``stage_backward_input`` parameter groups as one group, so that the weight pass is one autograd pass.

    torch (``pipelining/_backward.py``) runs one pass per group, each freeing the graph it walked. The groups of a
    chain of DeepSeek-V3 MTP modules (module k + 1 takes module k's output and all share the embedding; issue 39)
    walk common nodes, and the second pass backpropagates through a graph the first one freed. One group walks each
    node once; torch's own hooks for a group of several intermediates keep a gradient from counting twice through an
    intermediate that descends from another. Each intermediate keeps the gradient its hook captured."""
    if not groups or len(groups) == 1:
        return groups
    params: set[Any] = set()
    captured: dict[Any, Any] = {}
    for group in groups:
        grads = group.get("grads")
        if grads is None:  # no gradient reached this group's intermediates: torch's pass would skip it too
            continue
        params |= group["params"]
        for node, node_grads in zip(group["intermediates"], grads):
            captured.setdefault(node, node_grads)
    return [{"params": params, "intermediates": list(captured), "grads": list(captured.values())}]


def param_groups_overlap(groups: list[dict[str, Any]] | None) -> bool:
    """Whether torch's per-group weight passes would walk a common autograd node (and so must be one pass).

    A group's pass runs every node between its intermediates and its parameters. Groups of a chain of layers are
    disjoint, and merged into one pass they are not: the pass from a later layer's intermediates walks down through
    the earlier layers' input-gradient nodes to reach their weights, running every input gradient of the stage but
    its first layer's a second time (issue 42 item 2: ZB-H1 ranks slept one input gradient more per micro-batch in
    ``bench/pipeline.py``). Chained MTP modules sharing the embedding do overlap (issue 39)."""
    groups = [g for g in groups or () if g.get("grads") is not None]
    if len(groups) < 2:
        return False
    owner: dict[Any, int] = {}
    for k, group in enumerate(groups):
        for param in group["params"]:
            if owner.setdefault(param, k) != k:
                return True  # one parameter reached from two groups
    reach: dict[Any, int] = {}  # node -> bit set of the groups whose parameters it leads to
    stack = [(node, False) for group in groups for node in group["intermediates"]]
    while stack:
        node, children_done = stack.pop()
        if node in reach:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if children_done:
            bits = 1 << owner[node] if node in owner else 0
            for child in children:
                bits |= reach.get(child, 0)
            reach[node] = bits
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in reach)
    walked: set[Any] = set()
    for k, group in enumerate(groups):
        todo, mine = [n for n in group["intermediates"] if reach[n] >> k & 1], set()
        while todo:
            node = todo.pop()
            if node in mine:
                continue
            if node in walked:
                return True
            mine.add(node)
            todo.extend(c for c, _ in node.next_functions if c is not None and reach.get(c, 0) >> k & 1)
        walked |= mine
    return False


class StatelessInferenceStage(PipelineStage):
    """``PipelineStage`` whose first-step metadata inference leaves the stage module's buffers as they were.

    Without static input/output metadata, torch runs each stage's forward once on the first step to learn the shapes
    it sends (``_forward_metadata_inference``): on the first stage with the real micro-batch, on the others with
    uninitialised tensors. That forward is not part of training, but modules that accumulate statistics in buffers
    during forward (a MoE layer's per-expert load for aux-free bias balancing, BatchNorm's running statistics)
    would count it. The buffers are restored afterwards, so the first step equals every other step.
    """

    _one_weight_pass: bool | None = None
    """Whether this stage's weight gradients need one merged pass (:func:`param_groups_overlap`); set on first use."""
    action_seconds: dict[str, list[float]] | None = None
    """When set, the seconds each forward (``F``), input gradient (``I``), weight gradient (``W``) and full backward
    (``B``) of this stage take are appended here (``pipeline_chunk_costs="auto"``; the device is synchronised around
    each, so only the profiled step pays for it)."""

    def _timed(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        record = self.action_seconds
        if record is None:
            return fn(*args, **kwargs)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        record.setdefault(kind, []).append(time.perf_counter() - start)
        return out

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return self._timed("F", super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> Any:
        fn = super().backward_one_chunk
        kind = "B" if full_backward else "I"
        return self._timed(kind, fn, bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        return self._timed("W", super().backward_weight_one_chunk, bwd_chunk_id, last_backward)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        saved = [(buf, buf.detach().clone()) for buf in self.submod.buffers() if not buf.is_meta]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buf, value in saved:
                    buf.copy_(value)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        for part in find_flat_zero3(self.submod):  # that backward is not training: drop its (summed) gradients
            part.discard_grads()
        # and its loss on uninitialised tensors is no training statistic: drop the MTP log (no collective without a group)
        if (pop := getattr(self.submod, "pop_mtp_loss", None)) is not None:
            pop()

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        grads, groups = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "input" or not groups or len(groups) < 2:
            return grads, groups
        # the graph has the same shape every micro-batch: decide once per stage (the check walks the stage's graph)
        if self._one_weight_pass is None:
            self._one_weight_pass = param_groups_overlap(groups)
        return grads, merge_param_groups(groups) if self._one_weight_pass else groups

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        for part in find_flat_zero3(self.submod):  # flat ZeRO-3: one reduce-scatter per unit after the last backward
            part.reduce_deferred()
        super().perform_reduce_grad(grad_scale_factor)


class PipelineRunner:
    """The stages this rank holds, the training schedule and the forward-only path, behind two calls.

    Integration order for the strategy (PP outermost): ``build_pipeline`` -> TP/CP on each of ``stage_modules``
    -> ZeRO/FSDP on each -> optimizer over their parameters. Per training step: ``loss = runner.step(args, kwargs,
    labels, num_items)``
    (forward + backward of all micro-batches; grads left in ``.grad``, already averaged over micro-batches), then,
    once per optimizer step and before clipping / the DP reduction, ``runner.sync_tied_grads()``.
    """

    stage_cls: type[PipelineStage] = StatelessInferenceStage
    """Stage wrapper; a subclass can instrument the stages (``bench/pipeline.py`` times every action)."""
    order_costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """Relative F, I, W cost of one ``zbv`` / ``dualpipev`` chunk that its action order is generated for
    (``orders.zbv_order`` / ``orders.dualpipev_order``); ``build_pipeline`` sets it from
    ``ParallelConfig.pipeline_chunk_costs``."""
    order_max_activations: int | None = None
    """Activations a ``zbv`` / ``dualpipev`` rank may hold (forwards whose W has not run); None: 2p for ZB-V (a 1F1B
    rank's), torch's own 2p+1 for DualPipeV. With I > W, more lets the order idle less (issue 42 item 2,
    ``docs/pipeline.md``); ``build_pipeline`` sets it from ``ParallelConfig.pipeline_max_activations``."""
    order_knobs_set: bool = False
    """Whether either knob was set (``ParallelConfig``): ZB-V runs torch's order unless the generated one is strictly
    faster for the costs; DualPipeV runs torch's order unless a knob is set."""
    order_auto: bool = False
    """``pipeline_chunk_costs="auto"``: the first two training steps run torch's order, the second timed on every
    rank; :attr:`order_costs` becomes the mean F, I, W of a chunk over every rank (one all-reduce), and the following
    steps run the order generated for them (:meth:`_measure_costs`)."""
    measured_costs: tuple[float, float, float] | None = None
    """The costs ``"auto"`` measured (None before, or without ``"auto"``); a checkpoint keeps them, so a resumed run
    runs the same order from its first step (:meth:`use_measured_costs`), as the uninterrupted run does."""
    eval_micro_batch_size: int | None = None
    """Micro-batch size of evaluation batches (``ParallelConfig.micro_batch_size``; ``None``: ``micro_batch_size``):
    heterogeneous data-parallel shares set a per-rank training micro-batch size that evaluation does not use."""
    overlap_moe_comm: bool = False
    """``ParallelConfig.overlap_moe_expert_parallel_comm``: DualPipeV's paired forward and backward run at once."""
    loss_stat: Callable[[], Any] | None = None
    """A scalar of the training step that the last stage's ranks compute after it (they may run a collective among
    themselves) and that travels in the loss's broadcast: ``stat`` on every pipeline rank (the MTP loss for logging)."""
    stat: torch.Tensor | None = None

    def __init__(
        self,
        *,
        plan: StagePlan,
        stage_ids: list[int],
        stage_modules: list[nn.Module],
        pp_mesh: DeviceMesh,
        schedule_name: str,
        micro_batch_size: int,
        loss_fn: Callable[..., torch.Tensor] | None,
        tied: tuple[str, str] | None,
        device: torch.device,
        num_microbatches: int | None = None,
    ) -> None:
        self.plan = plan
        self.num_microbatches = num_microbatches
        self._num_items: torch.Tensor | int | None = None
        self.stage_ids = stage_ids
        self.stage_modules = stage_modules
        self.pp_mesh = pp_mesh
        self.schedule_name = schedule_name
        self.micro_batch_size = micro_batch_size
        self.device = device
        self._user_loss_fn = loss_fn
        self._group = pp_mesh.get_group()
        self._pp = pp_mesh.size()
        self._rank = pp_mesh.get_local_rank()
        style = SCHEDULES[schedule_name][1]
        self._stage_to_rank = {
            s: r for r in range(self._pp) for s in stage_ids_for_rank(r, self._pp, plan.num_stages, style)
        }
        self._schedules: dict[tuple[int, bool, tuple[int, ...]], Any] = {}
        self._auto_steps = 0  # training steps run towards pipeline_chunk_costs="auto"'s measurement
        self.has_first_stage = 0 in stage_ids
        self.has_last_stage = plan.num_stages - 1 in stage_ids
        self._tied_group: dist.ProcessGroup | None = None
        self._tied = tied
        if tied is not None:
            ends = {self._stage_to_rank[0], self._stage_to_rank[plan.num_stages - 1]}
            if len(ends) == 2 and self._rank in ends:
                ranks = sorted(dist.get_global_rank(self._group, r) for r in ends)
                # Only the two ranks join: use_local_synchronization lets every other rank skip the call.
                self._tied_group = dist.new_group(ranks, use_local_synchronization=True)

    @property
    def tied(self) -> tuple[str, str] | None:
        """FQNs of the first stage's and the last stage's copies of one tied weight (embedding and LM head)."""
        return self._tied

    # ---- loss ----
    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._user_loss_fn is not None:
            return self._user_loss_fn(output, target, self._num_items)
        # The last stage module's own loss: after TP it knows its vocab shard (vocab-parallel cross-entropy).
        last = self.stage_modules[self.stage_ids.index(self.plan.num_stages - 1)]
        return last.loss_fn(output, target, self._num_items)

    # ---- schedules ----
    def _schedule(self, n_microbatches: int, train: bool, shape: tuple[int, ...] = ()) -> Any:
        # Stages infer the shapes they send and receive on their first step, so a batch of a new shape (another
        # sequence length: image-text rows vary) needs a schedule of its own; the least recently used one goes.
        key = (n_microbatches, train, shape)
        if key in self._schedules:
            self._schedules[key] = self._schedules.pop(key)
        else:
            while len(self._schedules) >= _MAX_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
            validate_schedule(self.schedule_name, self._pp, len(self.stage_ids), n_microbatches)
            stages = [
                self.stage_cls(m, s, self.plan.num_stages, self.device, group=self._group)
                for s, m in zip(self.stage_ids, self.stage_modules)
            ]
            cls = SCHEDULES[self.schedule_name][0]
            if issubclass(cls, PipelineScheduleSingle):
                sched = cls(stages[0], n_microbatches, loss_fn=self._loss, scale_grads=False)
            else:
                assert issubclass(cls, PipelineScheduleMulti)
                sched = cls(stages, n_microbatches, loss_fn=self._loss, scale_grads=False)
                if self.schedule_name in ("zbv", "dualpipev") and self.order_knobs_set and not self._profiling_left:
                    _use_generated_order(
                        sched, self.schedule_name, self._pp, n_microbatches, self.order_costs,
                        self.order_max_activations,
                    )  # fmt: skip
            if not train and isinstance(sched, PipelineScheduleMulti):
                _make_forward_only(sched)
            elif self.overlap_moe_comm:  # DualPipeV's pairs run their forward and backward at once (overlap.py)
                check_pairs_cross_chunks(sched.pipeline_order, self._stage_to_rank)
                sched.register_custom_function(_ComputationType.OVERLAP_F_B, OverlappedPairs(sched))
            if train and isinstance(sched, PipelineScheduleMulti):
                _run_pairs_apart(sched)
            self._schedules[key] = sched
        return self._schedules[key]

    def count_microbatches(self, batch_size: int) -> int:
        """Micro-batches a batch of ``batch_size`` rows is split into on this rank."""
        return self.num_microbatches or max(batch_size // self.micro_batch_size, 1)

    def _inputs(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], target: torch.Tensor | None, train: bool = True
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any, int]:
        """Place the batch on the device and count micro-batches; only the first stage takes ``args``.

        Heterogeneous data-parallel shares give training its own per-rank micro-batch size and pinned count; the
        evaluation loaders are not shared out by speed (every rank reads the same batch size), so evaluation splits
        them by the config's ``micro_batch_size`` (``eval_micro_batch_size``)."""
        size = target.shape[0]
        mbs = self.micro_batch_size if train else (self.eval_micro_batch_size or self.micro_batch_size)
        if size % mbs:
            raise ValueError(
                f"Batch size {size} per data-parallel rank is not a multiple of micro_batch_size="
                f"{mbs}; make the DataLoader batch size a multiple of it."
            )
        n = size // mbs
        if train and self.num_microbatches is not None and n != self.num_microbatches:
            raise ValueError(
                f"This rank's batch of {size} gives {n} micro-batches of {mbs}, but every data-"
                f"parallel rank must run {self.num_microbatches}; check hetero_dp_batch_sizes and micro_batch_size."
            )
        move = lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        stage_args = tuple(move(a) for a in args) if self.has_first_stage else ()
        # Keyword inputs reach every stage, split into the same micro-batches as the tokens (module docstring).
        stage_kwargs = {k: move(v) for k, v in kwargs.items() if v is not None}
        stage_target = move(target) if self.has_last_stage else None
        return stage_args, stage_kwargs, stage_target, n

    def _reduce_losses(self, losses: list[torch.Tensor] | None, stat: Callable[[], Any] | None = None) -> torch.Tensor:
        # Each micro-batch loss is its token-loss sum over the step's normaliser (times the strategy's grad scale),
        # so their sum is the step's loss; it lives on the last stage and is broadcast for logging, with ``stat()``
        # (a last-stage scalar, see ``loss_stat``) in the same broadcast: every rank finds it in ``self.stat``.
        out = torch.full((1 + (stat is not None),), float("nan"), device=self.device, dtype=torch.float32)
        if self.has_last_stage:
            assert losses
            out[0] = torch.stack([_local(x).detach().float() for x in losses]).sum()
            if stat is not None and (value := stat()) is not None:
                out[1] = value
        src = self._stage_to_rank[self.plan.num_stages - 1]
        dist.broadcast(out, group=self._group, group_src=src)
        self.stat = out[1] if stat is not None else None
        return out[0]

    def step(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        target: torch.Tensor,
        num_items: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward + backward of every micro-batch; returns the sum of the micro-batch losses on every PP rank.

        ``args`` feed the first stage (split into micro-batches along dim 0), ``kwargs`` reach every stage (split
        alike), ``target`` the loss on the last stage (every rank passes it: it also gives the batch size). The loss
        of a micro-batch is its token-loss sum over ``num_items`` (default: the label tokens of this whole batch,
        so the step's loss is the batch's token mean); gradients are not divided by the micro-batch count.
        """
        self._num_items = (target != -100).sum() if num_items is None else num_items
        shape = tuple(target.shape)  # every pipeline rank gets the labels: the same key everywhere
        args, kwargs, target, n = self._inputs(args, kwargs, target)
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        sched = self._schedule(n, train=True, shape=shape)
        profile = self._profiling_left == 1  # the second step: the first one builds and warms up
        if profile:
            for stage in sched._stages:
                stage.action_seconds = {}
        sched.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        pairs = getattr(sched, "_comp_type_to_function_map", {}).get(_ComputationType.OVERLAP_F_B)
        if isinstance(pairs, OverlappedPairs):
            pairs.finish()  # the paired forwards' outputs it sent itself
        if self._profiling_left:
            self._auto_steps += 1
            if profile:
                self._measure_costs(sched._stages)
        return self._reduce_losses(losses, self.loss_stat)

    @property
    def _profiling_left(self) -> int:
        """Training steps before ``pipeline_chunk_costs="auto"`` has its costs (0: measured, or not asked for)."""
        return max(0, 2 - self._auto_steps) if self.order_auto else 0

    def _measure_costs(self, stages: list[Any]) -> None:
        """Set :attr:`order_costs` from the profiled step: per kind, the seconds summed over every stage of every
        rank (one all-reduce over the world, so every rank generates the same order), over their count. The first
        stage's input gradient is empty and its weight gradient the whole backward (torch's stage), so I and W come
        from the other stages; actions of overlapped pairs are not timed (they share the rank). Without both in the
        profiled step, torch's order stays (or the one generated for equal costs under a given cap). Training
        schedules are rebuilt on the next step with the generated order."""
        totals = torch.zeros(8, dtype=torch.float64)
        for stage in stages:
            for k, kind in enumerate("FIWB"):
                seconds = (stage.action_seconds or {}).get(kind, [])
                if kind != "F" and stage.stage_index == 0:
                    continue
                totals[2 * k] += sum(seconds)
                totals[2 * k + 1] += len(seconds)
            stage.action_seconds = None
        if dist.is_initialized():
            totals = totals.to(self.device)
            dist.all_reduce(totals)
            totals = totals.cpu()
        f, i, w, b = (float(totals[2 * k] / totals[2 * k + 1]) if totals[2 * k + 1] else 0.0 for k in range(4))
        if f <= 0 or i <= 0 or w <= 0:
            log.warning(
                "pipeline_chunk_costs='auto': the profiled %s step ran no separate input and weight gradient on the"
                " stages after the first (F %.4g s, I %.4g s, W %.4g s, B %.4g s per chunk); torch's order stays.",
                self.schedule_name, f, i, w, b,
            )  # fmt: skip
            self.order_auto = False
            self.order_knobs_set = self.order_max_activations is not None  # a cap alone still generates an order
            if self.order_knobs_set:
                self._drop_training_schedules()
            return
        self.use_measured_costs((1.0, i / f, w / f))
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info(
                "pipeline_chunk_costs='auto': measured F : I : W = 1 : %.3g : %.3g per chunk (%.4g s forward); the"
                " %s order generated for them runs from the next step.",
                i / f, w / f, f, self.schedule_name,
            )  # fmt: skip

    @torch.no_grad()
    def eval_step(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        target: torch.Tensor,
        num_items: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward-only pipeline over the micro-batches; returns the sum of the micro-batch losses on every PP rank."""
        self._num_items = (target != -100).sum() if num_items is None else num_items
        shape = tuple(target.shape)  # every pipeline rank gets the labels: the same key everywhere
        args, kwargs, target, n = self._inputs(args, kwargs, target, train=False)
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        self._schedule(n, train=False, shape=shape).eval(*args, target=target, losses=losses, **kwargs)
        return self._reduce_losses(losses)

    # ---- tied embeddings ----
    def _tied_params(self) -> list[nn.Parameter]:
        assert self._tied is not None
        params = []
        if self.has_first_stage:
            params.append(self.stage_modules[self.stage_ids.index(0)].get_parameter(self._tied[0]))
        if self.has_last_stage:
            last = self.stage_modules[self.stage_ids.index(self.plan.num_stages - 1)]
            params.append(last.get_parameter(self._tied[1]))
        return params

    @torch.no_grad()
    def sync_tied_params(self) -> None:
        """Copy the first stage's embedding into the last stage's tied LM head (call once after materialising).

        Per-FQN initialisation may seed the two names differently on split stages; this makes the two copies the
        same tensor values, as in the unsplit (tied) model.
        """
        if self._tied is None:
            return
        params = self._tied_params()
        if len(params) == 2:
            _local(params[1]).copy_(_local(params[0]))
        elif self._tied_group is not None:
            first = dist.get_global_rank(self._group, self._stage_to_rank[0])
            dist.broadcast(_local(params[0]), src=first, group=self._tied_group)

    def use_measured_costs(self, costs: tuple[float, float, float]) -> None:
        """Run the order generated for ``costs`` from the next training step on (``"auto"``'s measurement, or the one
        a checkpoint kept); rebuilds the training schedules."""
        self.order_costs = self.measured_costs = tuple(float(c) for c in costs)
        self.order_auto = False
        self._drop_training_schedules()

    def _drop_training_schedules(self) -> None:
        """Forget the training schedules: the next step builds one on the order the knobs now give."""
        self._schedules = {key: sched for key, sched in self._schedules.items() if not key[1]}

    def release_buffers(self) -> None:
        """Drop what the cached schedules hold on the device between steps (after ``fit``: issue 37 item 1): each
        stage's receive buffers for every micro-batch (activations and their gradients), its forward cache and
        output chunks, and the last step's loss tensors. The next step or evaluation rebuilds its schedule (one
        metadata forward per stage, as on the first step)."""
        self._schedules.clear()
        self._num_items = None
        self.stat = None

    def sync_tied_grads(self) -> None:
        """Sum the gradients of the tied embedding / LM-head copies on the first and last stage.

        Call exactly once per optimizer step, after the last ``step`` of the accumulation window and before
        gradient clipping and the optimizer (calling it per micro-step would double-count earlier micro-steps).
        The two copies start identical and get identical gradients, so they stay identical. No-op when untied
        or on ranks that hold neither end.
        """
        if self._tied is None:
            return
        params = [p for p in self._tied_params() if p.grad is not None]
        if not params:
            return
        for p in params:
            # Under TP torch's embedding backward yields a Replicate grad for a vocab-sharded (Shard(0)) weight,
            # while the LM head's grad is Shard(0): bring both to the parameter's layout (a local slice) first.
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if len(self._tied_params()) == 2:  # both ends on this rank (V placement, or PP=1 through this path)
            first, last = self._tied_params()
            total = _local(first.grad) + _local(last.grad)
            _local(first.grad).copy_(total)
            _local(last.grad).copy_(total)
            return
        if self._tied_group is not None:
            dist.all_reduce(_local(params[0].grad), group=self._tied_group)


def tied_across_stages(model: nn.Module, plan: StagePlan) -> tuple[str, str] | None:
    pair = tied_parameters(model, [u for stage in plan.units for u in stage])
    if pair is None:
        return None
    stage_of = {f"{u}.": s for s, stage in enumerate(plan.units) for u in stage}
    stages = {fqn: next(s for prefix, s in stage_of.items() if fqn.startswith(prefix)) for fqn in pair}
    first, last = sorted(pair, key=stages.__getitem__)
    if stages[first] == stages[last]:
        return None  # one stage holds both: the Parameter stays shared inside it
    if (stages[first], stages[last]) != (0, plan.num_stages - 1):
        raise ValueError(
            f"{first} and {last} are one tied weight on stages {stages[first]} and {stages[last]}; only a weight tied"
            " between the first and the last stage can be kept in sync. Untie it or change the split."
        )
    return first, last


def build_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    config: ParallelConfig,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    balance: str = "even",
    unit_costs: Mapping[str, float] | None = None,
    device: torch.device | str | None = None,
    micro_batch_size: int | None = None,
    num_microbatches: int | None = None,
) -> PipelineRunner:
    """Split ``model`` into this rank's pipeline stages and return the runner the strategy drives.

    ``model`` (usually on the meta device) implements the pipeline part of the model protocol
    (``models/protocol.py``): ``pipeline_units()`` covering every parameter, blocks in ``nn.ModuleDict``s, and a
    ``forward(x, **kwargs)`` that skips absent units. ``loss_fn`` defaults to the last stage module's ``loss_fn``.
    Recompute from ``config.recompute`` is applied per stage here. ``micro_batch_size`` overrides the config's for
    this rank and ``num_microbatches`` pins the count every rank must run (heterogeneous data-parallel shares).
    """
    p, v = config.pipeline_parallel_size, config.virtual_pipeline_parallel_size
    if pp_mesh.size() != p:
        raise ValueError(f"pp_mesh has {pp_mesh.size()} ranks but pipeline_parallel_size={p}.")
    validate_schedule(config.pipeline_schedule, p, v)
    units = list(model.pipeline_units())
    check_units_cover_parameters(model, units)
    if balance == "cost" and unit_costs is None:
        unit_costs = pipeline_unit_costs(model, units)
    plan = plan_stages(units, p, v, pipeline_layers=config.pipeline_layers, balance=balance, unit_costs=unit_costs)
    style = SCHEDULES[config.pipeline_schedule][1]
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), p, plan.num_stages, style)
    recompute = resolve_recompute(config.recompute, plan.num_stages)
    split_backward = config.pipeline_schedule in _SPLIT_BACKWARD_SCHEDULES
    modules = []
    for s in stage_ids:
        module = build_stage_module(model, plan.units[s])
        blocks = [module.get_submodule(u) for u in plan.units[s] if is_layer_unit(u)]
        apply_recompute(module, recompute[s], replayable=split_backward, blocks=blocks)
        if config.torch_compile:  # split-backward schedules are refused with it (ParallelConfig)
            apply_compile(module, blocks)
        modules.append(module)
    tied = tied_across_stages(model, plan)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    runner = PipelineRunner(
        plan=plan,
        stage_ids=stage_ids,
        stage_modules=modules,
        pp_mesh=pp_mesh,
        schedule_name=config.pipeline_schedule,
        micro_batch_size=micro_batch_size or config.micro_batch_size,
        loss_fn=loss_fn,
        tied=tied,
        device=torch.device(device),
        num_microbatches=num_microbatches,
    )
    runner.overlap_moe_comm = config.overlap_moe_expert_parallel_comm
    runner.eval_micro_batch_size = config.micro_batch_size
    runner.order_auto = config.pipeline_chunk_costs == "auto"
    if config.pipeline_chunk_costs is not None and not runner.order_auto:
        runner.order_costs = config.pipeline_chunk_costs
    runner.order_max_activations = config.pipeline_max_activations
    runner.order_knobs_set = config.pipeline_chunk_costs is not None or config.pipeline_max_activations is not None
    return runner
