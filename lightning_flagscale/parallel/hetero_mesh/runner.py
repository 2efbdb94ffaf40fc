"""The pipeline schedule across heterogeneous meshes: GPipe, 1F1B, interleaved 1F1B and zero-bubble over stage groups.

``torch.distributed.pipelining`` assumes one peer rank per neighbouring stage, while here a stage with data-parallel
size 1 may feed a stage with data-parallel size 2; this runner therefore drives its own schedule and moves
activations (and, backwards, their gradients) with the resliced P2P of ``hetero_boundary.py``.

* **Stages.** ``G`` stage groups (every pipeline stage of every mesh) times ``v`` model chunks
  (``virtual_pipeline_parallel_size``): global stage ``s`` runs on group ``s mod G`` (looped placement), so with
  ``v > 1`` the last mesh feeds the first one again between chunks.
* **Orders.** Per group, a list of (forward | backward, stage, micro-batch) actions: GPipe, 1F1B (``G - g - 1``
  warm-up forwards) or Megatron's interleaved 1F1B (micro-batches in rounds of ``G``, chunks in turn). Sends are
  asynchronous and receives blocking, so any order consistent with the data dependencies is deadlock-free;
  ``simulate`` checks it (and the tests run it for many layouts).
* **Zero bubble** (ZB-H1, Qi et al. 2023): the 1F1B (or, with ``v > 1``, interleaved) order with every backward
  split into ``I`` (input gradient, sent upstream at once) and ``W`` (weight gradient, no communication). Group
  ``g`` runs each ``W`` ``G - g - 1`` backward passes late and the rest after its last ``I``, so the input
  gradients reach upstream meshes sooner and the weight passes fill the cool-down bubble; the activations kept
  alive stay those of 1F1B. The split reuses torch's ``stage_backward_input`` / ``stage_backward_weight`` (the
  weight pass starts from the saved intermediate gradients, it does not run the backward twice). The first stage
  has no upstream to unblock and runs its whole backward at ``I``.
* **Gradient scale.** Every group averages its gradients over its own data x context ranks ``R`` while the loss is a
  global token mean multiplied by ``R`` of the group that holds the last stage; a gradient crossing from group ``r``
  back to group ``s`` is multiplied by ``R_s / R_r`` so that every group's average is exactly the single-process
  gradient (FlagScale's dp_recv / dp_send correction, derived from the token mean).
* **V-shaped schedules** (``zbv``, ``dualpipev``): two chunks per group, stage ``g`` going down the groups and stage
  ``2G - 1 - g`` coming back up, in torch's per-rank orders for ZB-V and DualPipeV (computed for ``G`` groups; a
  DualPipeV overlapped forward+backward runs as its forward then its backward); with ``pipeline_chunk_costs`` or
  ``pipeline_max_activations``, ZB-V / DualPipeV run the order ``orders.zbv_order`` / ``orders.dualpipev_order``
  generates for them instead (as without hetero meshes; the same costs on every group). The turn of the V (stage ``G - 1`` to
  ``G``) stays on the last group: the activation and its gradient are handed over in memory, no P2P. The last stage,
  hence the loss and the loss scale, is on the first group.
* **Tied weights** between the first and the last stage: ``hetero_tied.py`` (the same group under a V: both copies
  on the same ranks, summed in place).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_flagscale.config.hetero import StageGroup
from lightning_flagscale.config.schedules import SCHEDULE_SPECS, min_microbatches, stage_placement
from lightning_flagscale.parallel.hetero_mesh.boundary import BoundaryComm, boundary_transfers, gradient_transfers
from lightning_flagscale.parallel.hetero_mesh.tied import TiedAcrossMeshes
from lightning_flagscale.parallel.pipeline_parallel.orders import dualpipev_order, zbv_order
from lightning_flagscale.parallel.pipeline_parallel.plan import StagePlan
from lightning_flagscale.parallel.pipeline_parallel.runner import merge_param_groups, param_groups_overlap

__all__ = ["Action", "HeteroPipelineRunner", "schedule_order", "simulate"]

Action = tuple[str, int, int]
"""("F", "B", "I" or "W"; global stage; micro-batch). ``I`` and ``W`` are the two halves of a zero-bubble ``B``."""


def schedule_order(
    schedule: str,
    num_groups: int,
    group: int,
    virtual: int,
    n: int,
    *,
    train: bool,
    costs: tuple[float, float, float] | None = None,
    cap: int | None = None,
    warmup: int | None = None,
) -> list[Action]:
    """The actions group ``group`` runs, in order (module docstring); ``costs`` and ``cap``: ``zbv`` and
    ``dualpipev`` only, the chunk costs and activation cap the training order is generated for (``ParallelConfig.pipeline_chunk_costs``,
    ``pipeline_max_activations``); ``warmup``: ``1f1b`` only, the group's warm-up forwards instead of ``G - group -
    1`` (``StageGroup.warmup``, ``hetero_warmup="speed"``), at most ``n``."""
    G, v = num_groups, virtual
    if warmup is not None and (schedule != "1f1b" or v != 1 or warmup < G - group - 1):
        raise ValueError(
            f"A warm-up of {warmup} forwards needs pipeline_schedule='1f1b' without virtual stages and at least the"
            f" {G - group - 1} of 1F1B for group {group} of {G}; got {schedule!r} with {v} chunk(s) per group."
        )
    if SCHEDULE_SPECS[schedule].placement == "v":
        return _v_order(schedule, G, group, n, train=train, costs=costs, cap=cap)
    if schedule == "interleaved_1f1b" or (schedule == "zero_bubble" and v > 1):
        if n % G:
            raise ValueError(
                f"pipeline_schedule={schedule!r} with virtual stages across {G} heterogeneous stages needs the"
                f" micro-batch count to be a multiple of {G}, got {n}; change the batch size or micro_batch_size."
            )

        def stage(k: int, forward: bool) -> tuple[int, int]:
            chunk = (k // G) % v
            return (chunk if forward else v - 1 - chunk) * G + group, (k // (G * v)) * G + k % G

        total = n * v
        fwd = [("F", *stage(k, True)) for k in range(total)]
        if not train:
            return fwd
        bwd = [("B", *stage(k, False)) for k in range(total)]
        warmup = min((G - group - 1) * 2 + (v - 1) * G, total)
    else:
        fwd = [("F", group, m) for m in range(n)]
        if not train:
            return fwd
        bwd = [("B", group, m) for m in range(n)]
        warmup = n if schedule == "gpipe" else min(G - group - 1 if warmup is None else warmup, n)
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    order += bwd[len(fwd) - warmup :]
    return _split_backward(order, lag=G - group - 1) if schedule == "zero_bubble" else order


def _v_order(
    schedule: str, num_groups: int, group: int, n: int, *, train: bool, costs: Any = None, cap: int | None = None
) -> list[Action]:
    """ZB-V or DualPipeV over ``num_groups`` stage groups: torch's order for pipeline rank ``group`` (the schedule
    classes compute every rank's order from the rank count, stage count and micro-batch count alone), or with
    ``costs`` or ``cap`` the order ``orders.zbv_order`` / ``orders.dualpipev_order`` generates; forward-only, each
    chunk's forwards in turn
    (the first chunk's go down the groups, then the second's come back up)."""
    G = num_groups
    if not train:
        return [("F", s, m) for s in (group, 2 * G - 1 - group) for m in range(n)]
    need = min_microbatches(schedule, G, 2)
    if n < need:
        raise ValueError(
            f"pipeline_schedule={schedule!r} across {G} heterogeneous stage groups needs at least {need} micro-batches"
            f" per step, got {n}; raise the batch size or lower micro_batch_size."
        )
    if costs is not None or cap is not None:
        generate = zbv_order if schedule == "zbv" else dualpipev_order
        actions = generate(G, n, costs or (1.0, 1.0, 1.0), cap)[group]
        # OVERLAP_F_B: its forward, then its backward
        subs = [s for a in actions for s in (a.sub_actions or (a,))]
        return [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in subs]
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, SCHEDULE_SPECS[schedule].torch_class)
    layout = SimpleNamespace(pp_group_size=G, num_stages=2 * G, _n_microbatches=n)
    order: list[Action] = []
    for action in cls._calculate_single_rank_operations(layout, group):
        if action is None:
            continue
        for a in action.sub_actions or (action,):  # OVERLAP_F_B: its forward, then its backward
            order.append((a.computation_type.value, a.stage_index, a.microbatch_index))
    return order


def _split_backward(order: list[Action], lag: int) -> list[Action]:
    """ZB-H1: each ``B`` becomes ``I`` now and ``W`` ``lag`` backward passes later; the rest after the last ``I``."""
    out: list[Action] = []
    pending: list[Action] = []
    for kind, s, m in order:
        if kind != "B":
            out.append((kind, s, m))
            continue
        out.append(("I", s, m))
        pending.append(("W", s, m))
        if len(pending) > lag:
            out.append(pending.pop(0))
    return out + pending


def simulate(orders: list[list[Action]], num_stages: int) -> None:
    """Run every group's order with asynchronous sends and blocking receives; raise if it deadlocks."""
    done: set[Action] = set()
    pos = [0] * len(orders)
    while any(p < len(o) for p, o in zip(pos, orders)):
        progressed = False
        for g, order in enumerate(orders):
            while pos[g] < len(order):
                kind, s, m = order[pos[g]]
                ready = (s == 0 or ("F", s - 1, m) in done) if kind == "F" else ("F", s, m) in done
                if kind in ("B", "I") and s < num_stages - 1:  # the gradient from downstream
                    ready = ready and (("B", s + 1, m) in done or ("I", s + 1, m) in done)
                if kind == "W":
                    ready = ("I", s, m) in done
                if not ready:
                    break
                done.add(order[pos[g]])
                pos[g] += 1
                progressed = True
        if not progressed:
            stuck = {g: orders[g][pos[g]] for g in range(len(orders)) if pos[g] < len(orders[g])}
            raise RuntimeError(f"Pipeline order deadlocks; waiting actions: {stuck}")


def _split(value: Any, n: int) -> list[Any]:
    if isinstance(value, Tensor):
        return list(value.tensor_split(n, dim=0))
    return [value] * n


class HeteroPipelineRunner:
    """This rank's stages of a heterogeneous pipeline; the interface of ``parallel.pipeline.PipelineRunner``."""

    def __init__(
        self,
        *,
        groups: list[StageGroup],
        group: StageGroup,
        plan: StagePlan,
        stage_ids: list[int],
        stage_modules: list[nn.Module],
        schedule_name: str,
        micro_batch_size: int,
        loss_fn: Callable[..., Tensor],
        device: torch.device,
        token_group: dist.ProcessGroup | None,
        tied: tuple[str, str] | None = None,
        order_costs: tuple[float, float, float] | None = None,
        order_max_activations: int | None = None,
    ) -> None:
        self.groups, self.group, self.plan = groups, group, plan
        # ZB-V's / DualPipeV's generated order (PipelineRunner.order_costs / order_max_activations), per
        # (micro-batches, train)
        self.order_costs, self.order_max_activations = order_costs, order_max_activations
        self._orders: dict[tuple[int, bool], list[Action]] = {}
        self.virtual = plan.num_stages // len(groups)
        self.stage_ids = stage_ids
        self.stage_modules = stage_modules
        self.schedule_name = schedule_name
        self.micro_batch_size = micro_batch_size
        self.num_microbatches: int | None = None
        self.device = device
        self.tied = tied
        last = self._neighbour(plan.num_stages - 1)
        self._tied_sync = TiedAcrossMeshes(groups[0], last) if tied is not None else None
        self._loss_fn = loss_fn
        self._token_group = token_group  # this group's data x context ranks (sums the last group's losses)
        self.has_first_stage = 0 in self.stage_ids
        self.has_last_stage = plan.num_stages - 1 in self.stage_ids
        self._comm = BoundaryComm(device)
        self._local: dict[tuple[int, int, bool], Tensor] = {}  # the turn of a V: (stage, micro-batch, backward)
        self._one_weight_pass: dict[int, bool] = {}  # per stage: its weight groups overlap (param_groups_overlap)
        self.loss_stat: Callable[[], Any] | None = None  # see PipelineRunner.loss_stat
        self.stat: Tensor | None = None

    # ---- the PipelineRunner interface ----
    def count_microbatches(self, batch_size: int) -> int:
        return max(batch_size // self.micro_batch_size, 1)

    def _tied_params(self) -> list[nn.Parameter]:
        """This rank's copies of the tied weight: the first stage's, the last stage's, or both (V placement)."""
        if self.tied is None or self._tied_sync is None or not self._tied_sync.member:
            return []
        params = [self._module(0).get_parameter(self.tied[0])] if self.has_first_stage else []
        if self.has_last_stage:
            params.append(self._module(self.plan.num_stages - 1).get_parameter(self.tied[1]))
        return params

    def sync_tied_params(self) -> None:
        """The last stage's copy of a tied weight takes the first stage's values (after initialisation)."""
        params = self._tied_params()
        if params:
            self._tied_sync.sync_params(params)

    def release_buffers(self) -> None:
        """Drop the tensors the last step left (after ``fit``: issue 37 item 1): an evaluation step's forward
        activations and outputs (kept for a backward that does not come), the turn of the V's hand-overs, the loss
        scale and statistic (``PipelineRunner.release_buffers``)."""
        self._saved, self._weight_work = {}, {}
        self._local.clear()
        self._num_items = None
        self.stat = None

    def sync_tied_grads(self) -> None:
        """Sum the tied weight's gradient over both copies (once per optimizer step, before the DP reduction)."""
        params = self._tied_params()
        if params:
            self._tied_sync.sync_grads(params)

    def step(self, args: tuple, kwargs: Mapping[str, Any], target: Tensor, num_items: Tensor | int | None = None):
        return self._run(args, kwargs, target, num_items, train=True)

    @torch.no_grad()
    def eval_step(self, args: tuple, kwargs: Mapping[str, Any], target: Tensor, num_items=None):
        return self._run(args, kwargs, target, num_items, train=False)

    # ---- schedule ----
    def _run(self, args: tuple, kwargs: Mapping[str, Any], target: Tensor, num_items: Any, *, train: bool) -> Tensor:
        rows = target.shape[0]
        if rows % self.micro_batch_size:
            raise ValueError(
                f"Batch of {rows} samples on rank {dist.get_rank()} is not a multiple of its micro-batch size"
                f" {self.micro_batch_size}."
            )
        n = rows // self.micro_batch_size
        order = self._order(n, train)
        if num_items is None:  # evaluation without a step normaliser: the token mean of the whole global batch
            num_items = (target != -100).sum().to(self.device)
            if self._token_group is not None:
                dist.all_reduce(num_items, group=self._token_group)
        self._num_items, self._n = num_items, n
        move = lambda t: t.to(self.device) if isinstance(t, Tensor) else t  # noqa: E731
        arg_mbs = list(zip(*(_split(move(a), n) for a in args))) if self.has_first_stage else [()] * n
        kw_mbs = [dict(zip(kwargs, vals)) for vals in zip(*(_split(move(v), n) for v in kwargs.values()))] or [{}] * n
        targets = _split(move(target), n)
        self._saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self._weight_work: dict[tuple[int, int], list[dict[str, Any]]] = {}
        losses: list[Tensor] = []
        deferred = train and SCHEDULE_SPECS[self.schedule_name].split_backward
        if deferred:  # FSDP2 reduces at the end of the step (its autograd hooks do not see the weight passes)
            for module in self.stage_modules:
                _hold_fsdp_grads(module)
        for kind, s, m in order:
            if kind == "F":
                self._forward(s, m, arg_mbs[m], kw_mbs[m], targets[m], losses, train)
            elif kind == "W":
                work = self._weight_work.pop((s, m), None)  # None: the first stage ran its whole backward at I
                if work is not None:
                    stage_backward_weight(self._module(s).parameters(), work)
            else:
                self._backward(s, m, split=kind == "I" and s > 0, hold=deferred)
        self._comm.wait()
        assert not self._local, f"unconsumed V-turn hand-overs {sorted(self._local)}"
        if deferred:
            for module in self.stage_modules:
                _reduce_fsdp_grads(module)
        return self._reduce_losses(losses, train)

    def _order(self, n: int, train: bool) -> list[Action]:
        """This group's actions for ``n`` micro-batches (with its ``StageGroup.warmup`` when training)."""
        if (n, train) not in self._orders:  # a generated V order takes a search: once per micro-batch count
            self._orders[(n, train)] = schedule_order(
                self.schedule_name, len(self.groups), self.group.index, self.virtual, n, train=train,
                costs=self.order_costs, cap=self.order_max_activations, warmup=self.group.warmup if train else None,
            )  # fmt: skip
        return self._orders[(n, train)]

    def _neighbour(self, stage: int) -> StageGroup:
        """The stage group that runs global ``stage``."""
        return self.groups[stage_placement(stage, len(self.groups), self.schedule_name)[0]]

    def _local_turn(self, stage: int) -> bool:
        """Stages ``stage`` and ``stage + 1`` run on this same group (the turn of a V): no P2P between them."""
        return self._neighbour(stage) is self._neighbour(stage + 1)

    def _module(self, stage: int) -> nn.Module:
        return self.stage_modules[self.stage_ids.index(stage)]

    def _tag(self, stage: int, m: int, backward: bool) -> int:
        """One tag per boundary (stage -> stage + 1), micro-batch and direction."""
        return 2 * (stage * self._n + m) + int(backward)

    def _forward(self, s: int, m: int, args: tuple, kwargs: dict, target: Tensor, losses: list, train: bool) -> None:
        x = None
        if s > 0:
            if self._local_turn(s - 1):
                x = self._local.pop((s - 1, m, False))
            else:
                prev = self._neighbour(s - 1)
                x = self._comm.recv(boundary_transfers(prev, self.group, self._rows()), self._tag(s - 1, m, False))
            x.requires_grad_(train)
            args = (x,)
        out = self._module(s)(*args, **kwargs)
        if s == self.plan.num_stages - 1:
            loss = self._loss_fn(out, target, self._num_items)
            losses.append(loss.detach().float())
            self._saved[(s, m)] = (x, loss)
        else:
            if self._local_turn(s):
                self._local[(s, m, False)] = out.detach()
            else:
                transfers = boundary_transfers(self.group, self._neighbour(s + 1), self._rows())
                self._comm.send(out.detach(), transfers, self._tag(s, m, False))
            self._saved[(s, m)] = (x, out)

    def _backward(self, s: int, m: int, *, split: bool = False, hold: bool = False) -> None:
        """``B`` (or, with ``split``, the ``I`` half of it: the weight half waits in ``_weight_work`` for ``W``).
        ``hold``: FSDP2 gradients stay unsharded until ``_reduce_fsdp_grads`` (zero-bubble)."""
        x, out = self._saved.pop((s, m))
        if not hold:
            self._set_grad_sync(self._module(s), m == self._n - 1)
        grad = None
        if s < self.plan.num_stages - 1 and self._local_turn(s):
            grad = self._local.pop((s, m, True))
        elif s < self.plan.num_stages - 1:
            transfers = gradient_transfers(self.group, self._neighbour(s + 1), self._rows())
            grad = self._comm.recv(transfers, self._tag(s, m, True)).to(out.dtype)
        if split:
            assert x is not None
            _, groups = stage_backward_input([out], None if grad is None else [grad], [x], self._module(s).parameters())
            # one weight pass where the groups share nodes (chained MTP modules), torch's per-group passes otherwise
            # (merged, a chain of blocks would run its input gradients again); the graph's shape is the same every
            # micro-batch, so each stage decides once
            if s not in self._one_weight_pass:
                self._one_weight_pass[s] = param_groups_overlap(groups)
            self._weight_work[(s, m)] = merge_param_groups(groups) if self._one_weight_pass[s] else groups
        else:
            torch.autograd.backward(out, grad)
        if x is not None and self._local_turn(s - 1):
            self._local[(s - 1, m, True)] = x.grad
        elif x is not None:
            # Group r's gradients carry the last group's R; the group upstream averages over its own (docstring).
            prev = self._neighbour(s - 1)
            scale = prev.token_shards / self.group.token_shards
            transfers = gradient_transfers(prev, self.group, self._rows())
            self._comm.send(x.grad * scale, transfers, self._tag(s - 1, m, True))

    @staticmethod
    def _set_grad_sync(module: nn.Module, enabled: bool) -> None:
        for sub in module.modules():
            fn = getattr(sub, "set_requires_gradient_sync", None)
            if fn is not None:  # FSDP2 units: reduce-scatter only after the chunk's last micro-batch backward
                fn(enabled, recurse=False)

    def _rows(self) -> int:
        """Samples of one micro-batch over the whole group (every rank holds its data-parallel slice of them)."""
        return self.micro_batch_size * self.group.data_parallel_size

    def _reduce_losses(self, losses: list[Tensor], train: bool) -> Tensor:
        """The global token mean on every rank: times the loss scale when training (the micro-batch losses of the
        last stage's group carry ``loss scale x R_last``; the strategy divides by this rank's own ``R``), plain when
        evaluating."""
        stat = self.loss_stat if train else None  # as PipelineRunner's: in the same broadcast, in ``self.stat``
        out = torch.full((1 + (stat is not None),), float("nan"), dtype=torch.float32, device=self.device)
        last = self._neighbour(self.plan.num_stages - 1)
        if self.has_last_stage:
            loss = torch.stack(losses).sum()
            if self._token_group is not None:
                dist.all_reduce(loss, group=self._token_group)
            out[0] = loss / last.token_shards if train else loss
            if stat is not None and (value := stat()) is not None:
                out[1] = value
        dist.broadcast(out, src=last.ranks[0])
        self.stat = out[1] if stat is not None else None
        return out[0]


def _hold_fsdp_grads(module: nn.Module) -> None:
    """Keep FSDP2's parameters unsharded and its gradients unreduced through the step's backward passes.

    A deferred weight pass (``stage_backward_weight``) writes gradients after FSDP2's post-backward hooks have
    fired for the input pass, so the reduce-scatter must wait for the end of the step, as torch's own pipeline
    stages do for zero-bubble (``perform_reduce_grad``). The units also stay gathered between forwards (torch's
    schedules unshard a stage once per step for the same reason): resharding after each forward dropped the
    gradients held for later weight passes (measured: 17% of the last mesh's gradient lost). The cost is the
    stage's full parameters held through the step, as under ZeRO-2."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.set_reshard_after_forward(False)
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def _reduce_fsdp_grads(module: nn.Module) -> None:
    """The deferred FSDP2 post-backward: reduce-scatter every unit's accumulated gradient, reshard, finalize."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for unit in state._state_ctx.all_states:
        for param_group in unit._fsdp_param_groups:
            param_group.post_backward()
    state._root_post_backward_final_callback()
    for sub in module.modules():  # back to resharding the units (blocks) after forward; the root keeps its parameters
        if isinstance(sub, FSDPModule) and sub is not module:
            sub.set_reshard_after_forward(True, recurse=False)
    module.reshard()
