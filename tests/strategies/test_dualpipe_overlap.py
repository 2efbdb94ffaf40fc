"""DualPipeV with ``overlap_moe_expert_parallel_comm``: each paired forward and backward run at once (the forward on a
helper thread), each model chunk's MoE layers on their own process groups, and training stays the single-process
fp32 SGD run (ragged labels, 3 steps; weights, updates, router biases and the logged MTP loss on every rank) under
EP 2 x PP 2 x ZeRO-1 with DeepSeek-V3's MLA, two chained MTP modules (weight switch at step 2) and routing (issue 42
item 3; the DualPipeV case of issue 39's MTP layouts, ``test_mtp_loop.py``). The exposed all-to-all it saves is measured in
``bench/dualpipe_overlap.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from lightning_flagscale.config import ParallelConfig
from tests.moe import _trainer
from tests.moe._trainer import assert_sgd_parity, sgd_reference, sgd_trainer_run
from tests.strategies.test_mtp_loop import STEPS, _assert_logged_mtp_loss, _with_last_stage_copy, mtp_config

BATCH = 8  # global batch
OVERLAP = dict(
    pipeline_parallel_size=2, expert_parallel_size=2, pipeline_schedule="dualpipev", micro_batch_size=1, zero_stage=1,
    overlap_moe_expert_parallel_comm=True,
)  # fmt: skip


def _overlap_run(kwargs: dict[str, Any], config: Any, steps: int) -> dict[str, Any]:
    """``sgd_trainer_run``, recording the thread of every paired forward and the groups of each chunk's MoE layers."""
    import torch.distributed as dist

    from lightning_flagscale.moe import moe_layers
    from lightning_flagscale.parallel.pipeline_parallel import overlap

    threads: list[str] = []
    original = overlap._forward

    def recording(schedule: Any, action: Any, ctx: Any) -> None:
        threads.append(threading.current_thread().name)
        original(schedule, action, ctx)

    overlap._forward = recording
    sends: list[str] = []  # the thread of every send posted from overlap.py (the paired forwards' outputs)
    original_send = overlap._batch_p2p

    def send(ops: list[Any], *args: Any, **kwargs: Any) -> Any:
        sends.append(threading.current_thread().name)
        return original_send(ops, *args, **kwargs)

    overlap._batch_p2p = send
    backwards: list[str] = []  # the kind of every paired backward: full, or an input gradient (generated orders)
    original_backward = overlap._backward

    def backward(schedule: Any, action: Any) -> None:
        backwards.append(action.computation_type.value)
        original_backward(schedule, action)

    overlap._backward = backward
    groups: list[list[tuple[int, ...]]] = []
    original_separate = overlap.separate_chunk_groups

    def separate(stage_modules: list[Any]) -> list[Any]:
        created = original_separate(stage_modules)
        for chunk in stage_modules:  # per chunk: the EP group's name and ranks of its MoE layers
            groups.append(sorted({(layer.dispatcher.group.group_name, *dist.get_process_group_ranks(
                layer.dispatcher.group)) for _, layer in moe_layers(chunk)}))  # fmt: skip
        return created

    from lightning_flagscale.parallel import plan

    plan.separate_chunk_groups = separate
    try:
        result = sgd_trainer_run(kwargs, config, steps, batch_size=BATCH // 2)  # data-parallel size 2
    finally:
        overlap._forward = original
        overlap._batch_p2p = original_send
        overlap._backward = original_backward
        plan.separate_chunk_groups = original_separate
    return {**result, "threads": threads, "groups": groups, "sends": sends, "backwards": backwards}


@pytest.mark.parametrize("generated", [False, True], ids=["torch-order", "generated-order"])
def test_overlapped_dualpipev_trains_as_one_process(launcher, monkeypatch, generated):
    # generated: the order orders.dualpipev_order generates for I = 2F = 2W, whose pairs run a forward beside an
    # input gradient (the weight gradient later, in a wait); torch's pairs run a full backward
    config = mtp_config(num_layers=4)
    kwargs = {**OVERLAP, "pipeline_chunk_costs": [1, 2, 1]} if generated else OVERLAP
    results = launcher(4, _overlap_run, kwargs, config, STEPS)
    # DualPipeV needs 2 x PP micro-batches: four of one row on each of the two data-parallel ranks, so global batches
    # of 8 in the oracle too, split into the same four micro-batches (micro-batch i = rows 2i and 2i + 1 of the
    # global batch: Lightning's sampler deals the batch's rows out to the ranks in turn)
    monkeypatch.setattr(_trainer, "GLOBAL_BATCH", BATCH)
    ref = sgd_reference(config, STEPS, micro_batches=4)
    assert_sgd_parity(results, _with_last_stage_copy(ref), "dualpipev ep2 x pp2 x zero1, overlapped", pipeline=True)
    # the V puts the first and the last stage (the embedding, and the head with the MTP modules and their embedding
    # copy) on pipeline rank 0, whose two copies sum their gradients locally; two chained MTP modules go through the
    # split (input / weight) backward of DualPipeV's zero-bubble phases; the MTP weight switches at step 2
    assert "mtp.embed_tokens.weight" in results[0]["params"] and "embed_tokens.weight" in results[0]["params"]
    _assert_logged_mtp_loss(results, ref, "deepseek-v3 mtp dualpipev ep2 x pp2, overlapped")
    for rank, res in enumerate(results):
        # the paired forwards really ran on the helper thread (DualPipeV's steady state has some on every rank)
        assert res["threads"] and set(res["threads"]) == {"flagscale-overlap-forward"}, (rank, res["threads"])
        # and each sent its output to the other pipeline rank from there, as soon as it ended (not after the pair's
        # backward, where torch's lowering puts the send): every rank pairs forwards of stage 0 or 2, whose next
        # stage is on the other rank
        assert res["sends"] and set(res["sends"]) == {"flagscale-overlap-forward"}, (rank, res["sends"])
        assert set(res["backwards"]) == ({"I"} if generated else {"B"}), (rank, res["backwards"])
        # chunks (V placement): pipeline rank 0 holds stages 0 (the dense first_k_dense_replace block: no experts)
        # and 3, rank 1 stages 1 and 2; the second chunk's EP group is a twin of the first's: same ranks, own group
        first, second = res["groups"]
        if rank < 2:
            assert first == [] and len(second) == 1, (rank, res["groups"])
        else:
            assert len(first) == len(second) == 1, (rank, res["groups"])
            assert first[0][1:] == second[0][1:] and first[0][0] != second[0][0], (rank, res["groups"])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(pipeline_schedule="zbv"), "pipeline_schedule='zbv'"),
        (dict(expert_parallel_size=1), "expert_parallel_size=1"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size > 1"),
        (dict(context_parallel_size=2), "context_parallel_size > 1"),
        (dict(zero_stage=3), "zero_stage=3"),
    ],
)
def test_layouts_it_cannot_overlap_are_refused(change, named):
    with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm=True does not run with") as err:
        ParallelConfig(**{**OVERLAP, **change})
    assert named in str(err.value)
