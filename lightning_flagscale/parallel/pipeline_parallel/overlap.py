"""DualPipeV's point: one micro-batch's forward computes while another's backward communicates (issue 42 item 3).

In its steady state DualPipeV pairs the forward of one micro-batch on one of a rank's two model chunks with the
backward of another micro-batch on the other chunk (torch's ``OVERLAP_F_B`` action); torch's runtime runs the pair
one after the other, so every expert all-to-all of either waits in full. With
``ParallelConfig.overlap_moe_expert_parallel_comm`` the forward runs on a helper thread while the backward runs on the
schedule's thread: when one waits for its all-to-all (gloo and NCCL release the GIL) the other computes. DeepSeek-V3
(report, section 3.2.1) gets the same overlap by cutting each chunk into attention, dispatch, MLP and combine and
interleaving the pieces by hand; two threads give it without touching the model.

Two threads must not share a process group: its collectives are matched across ranks by the order they are issued
in. So each model chunk's MoE layers talk over their own groups (:func:`separate_chunk_groups`): the rank's second
chunk (the V's way back) gets a twin of each of its expert, token and sequence groups. Every pair is one chunk's
forward with the other chunk's backward (checked when the schedule is built), so each group's collectives come from
one chunk's actions, in schedule order, the same order on every rank of the group. The layout check
(``ParallelConfig._check_moe_comm_overlap``) keeps out every other collective inside a stage's forward or backward
(TP, CP, ZeRO-3).

On a GPU the two threads issue their kernels on the same (thread-default) stream, so they stay correct but overlap
only host time and NCCL's own stream; this file is measured on CPU (``bench/dualpipe_overlap.py``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import (
    _Action,
    _batch_p2p,
    _ComputationType,
    _PipelineContext,
    _wait_batch_p2p,
)

from lightning_flagscale.moe.balance import moe_layers

__all__ = ["OverlappedPairs", "check_pairs_cross_chunks", "separate_chunk_groups"]

_BACKWARDS = (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT)
_DEFAULT = "default"  # MoELayer.token_group's "the default process group" marker (moe/layer.py DEFAULT_GROUP)


def _ranks(group: Any) -> tuple[int, ...] | None:
    if group is None:
        return None
    if isinstance(group, str):  # the default group marker
        group = dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def _layer_groups(layer: nn.Module) -> list[Any]:
    dispatcher = layer.dispatcher
    return [
        getattr(dispatcher, "group", None),
        getattr(dispatcher, "etp_group", None),
        layer.token_group,
        layer.sequence_group,
    ]


def separate_chunk_groups(stage_modules: list[nn.Module]) -> list[dist.ProcessGroup]:
    """Give the MoE layers of this rank's second model chunk twins of their process groups; returns the new groups.

    Collective over the world: every rank gathers the rank lists its second chunk needs, and every rank creates the
    union's groups in one order (``new_group`` must be called by all ranks alike)."""
    layers = [layer for _, layer in moe_layers(stage_modules[1])] if len(stage_modules) == 2 else []
    needed = sorted({r for layer in layers for g in _layer_groups(layer) if (r := _ranks(g)) is not None})
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, needed)
    union = sorted({tuple(r) for ranks in everyone for r in ranks})
    twins = {ranks: dist.new_group(list(ranks)) for ranks in union}  # the same calls, in the same order, everywhere
    rank = dist.get_rank()

    def twin(group: Any) -> Any:
        ranks = _ranks(group)
        return group if ranks is None else twins[ranks]

    for layer in layers:
        dispatcher = copy.copy(layer.dispatcher)  # a dispatcher may be shared by both chunks' layers
        if hasattr(dispatcher, "group"):
            dispatcher.group = twin(dispatcher.group)
        if getattr(dispatcher, "etp_group", None) is not None:
            dispatcher.etp_group = twin(dispatcher.etp_group)
        layer.dispatcher = dispatcher
        layer.token_group = twin(layer.token_group)
        layer.sequence_group = twin(layer.sequence_group)
    return [g for ranks, g in twins.items() if rank in ranks]


def check_pairs_cross_chunks(pipeline_order: dict[int, list[_Action | None]], stage_to_rank: dict[int, int]) -> None:
    """Every ``OVERLAP_F_B`` action pairs a forward and a backward (full, or its input gradient in an order generated
    for chunk costs: ``orders.dualpipev_order``) of the rank's two different chunks (what lets each chunk keep its own
    process groups)."""
    for rank, actions in pipeline_order.items():
        for action in actions:
            if action is None or action.computation_type != _ComputationType.OVERLAP_F_B:
                continue
            kinds = [(a.computation_type, a.stage_index) for a in action.sub_actions or ()]
            forward = [s for k, s in kinds if k == _ComputationType.FORWARD]
            backward = [s for k, s in kinds if k in _BACKWARDS]
            if len(kinds) != 2 or len(forward) != 1 or len(backward) != 1 or forward[0] == backward[0]:
                raise ValueError(
                    f"overlap_moe_expert_parallel_comm: rank {rank}'s {action} is not a forward and a backward of the"
                    " rank's two different chunks; this schedule cannot overlap them."
                )
            if {stage_to_rank[forward[0]], stage_to_rank[backward[0]]} != {rank}:
                raise ValueError(
                    f"overlap_moe_expert_parallel_comm: rank {rank}'s {action} names another rank's stage."
                )


def _thread_state() -> Callable[[], ExitStack]:
    """The calling thread's grad mode and autocast settings, to enter on another thread (both are thread-local)."""
    grad = torch.is_grad_enabled()
    autocast = [
        (device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
    ]

    def enter() -> ExitStack:
        stack = ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, dtype in autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        return stack

    return enter


def _stages(schedule: Any) -> dict[int, Any]:
    return {stage.stage_index: stage for stage in schedule._stages}


def _forward(schedule: Any, action: _Action, ctx: _PipelineContext) -> None:
    """torch's ``FORWARD`` action (``_PipelineScheduleRuntime._step_microbatches``), for a paired forward."""
    stages = _stages(schedule)
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    if not stage.is_first and index - 1 not in stages:  # a co-located previous stage hands its output over locally
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((index, mb)))
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
    if index + 1 in stages:
        stages[index + 1].set_local_fwd_input(output, mb)


def _backward(schedule: Any, action: _Action) -> None:
    """torch's ``FULL_BACKWARD`` or ``BACKWARD_INPUT`` action, for a paired backward (the input gradient leaves its
    weight gradient to a later ``BACKWARD_WEIGHT``, which counts the stage's backwards then)."""
    stages = _stages(schedule)
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    if not stage.is_last and index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((index, mb)))
    loss = schedule._maybe_get_loss(stage, mb)
    full = action.computation_type == _ComputationType.FULL_BACKWARD
    last = False
    if full:
        schedule.backward_counter[index] += 1
        last = schedule.backward_counter[index] == schedule._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last)
    if index - 1 in stages:
        stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


class OverlappedPairs:
    """The ``OVERLAP_F_B`` function to register on a DualPipeV schedule: the forward on a helper thread (grad mode and
    autocast as on the caller's), the backward on the schedule's thread; a call returns once both are done,
    re-raising the forward's error.

    The paired forward's output is sent from the helper thread as soon as the forward ends. torch lowers a pair's
    sends after the whole pair (``_add_send_recv``), so the next rank's forward would also wait for this rank's
    backward; this takes those ``SEND_F`` actions out of the rank's lowered order. Only the helper thread posts on the
    pipeline group during a pair (the backward only waits for receives posted before it), and each send keeps its
    place before the pair's own backward sends, so the messages reach every peer in the order they did. Call
    :meth:`finish` after the schedule's step: it waits for these sends, as torch waits for its own at the step's end.
    """

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        self.early_sends = _take_paired_forward_sends(schedule)
        """``(stage, micro-batch)`` of every paired forward this rank sends from the helper thread."""
        self._pending: list[list[dist.Work]] = []

    def __call__(self, action: _Action, ctx: _PipelineContext) -> None:
        subs = action.sub_actions or ()
        forward = next(a for a in subs if a.computation_type == _ComputationType.FORWARD)
        backward = next(a for a in subs if a.computation_type in _BACKWARDS)
        enter, error = _thread_state(), []

        def side() -> None:
            try:
                with enter():
                    _forward(self.schedule, forward, ctx)
                key = (forward.stage_index, forward.microbatch_index)
                if key in self.early_sends:
                    stage = _stages(self.schedule)[key[0]]
                    self._pending.append(_batch_p2p(stage.get_fwd_send_ops(key[1])))
            except BaseException as exc:  # re-raised on the schedule's thread
                error.append(exc)

        # the two halves share the rank: not a cost of either (pipeline_chunk_costs="auto" times the other actions)
        stages = _stages(self.schedule)
        timed = [(stage, stage.__dict__.pop("action_seconds", None)) for stage in
                 {id(s): s for s in (stages[forward.stage_index], stages[backward.stage_index])}.values()]  # fmt: skip
        thread = threading.Thread(target=side, name="flagscale-overlap-forward", daemon=True)
        thread.start()
        try:
            _backward(self.schedule, backward)
        finally:
            thread.join()
            for stage, record in timed:
                if record is not None:
                    stage.action_seconds = record
        if error:
            raise error[0]

    def finish(self) -> None:
        """Wait for the forward outputs sent from the helper thread during the step."""
        while self._pending:
            _wait_batch_p2p(self._pending.pop(0))


def _take_paired_forward_sends(schedule: Any) -> set[tuple[int, int]]:
    """Remove from this rank's lowered order the ``SEND_F`` of each paired forward; returns their (stage, mb)."""
    order = schedule.pipeline_order_with_comms[schedule.rank]
    paired = {
        (sub.stage_index, sub.microbatch_index)
        for a in order
        if a.computation_type == _ComputationType.OVERLAP_F_B
        for sub in a.sub_actions or ()
        if sub.computation_type == _ComputationType.FORWARD
    }
    taken = {
        (a.stage_index, a.microbatch_index)
        for a in order
        if a.computation_type == _ComputationType.SEND_F and (a.stage_index, a.microbatch_index) in paired
    }
    schedule.pipeline_order_with_comms[schedule.rank] = [
        a
        for a in order
        if not (a.computation_type == _ComputationType.SEND_F and (a.stage_index, a.microbatch_index) in taken)
    ]
    return taken
