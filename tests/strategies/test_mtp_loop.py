"""DeepSeek-V3 multi-token prediction inside Trainer.fit matches the single-process fp32 SGD run (ragged labels,
3 steps, weights, updates, router biases, the MTP weight switching at step 2, and the logged mtp_loss on every rank,
rank 0's logger included) under ZeRO-3 on FSDP2, EP 2 x PP 2 and a two-mesh hetero layout (TP 2 -> DP 2); the FSDP2
and hetero runs give the switch in tokens (2 global batches' worth), EP 2 x PP 2 in steps; DualPipeV
(with EP 2 and overlapped pairs) in ``test_dualpipe_overlap.py``. Under pipelines the MTP modules run on the last stage
with a synchronised copy of the first stage's embedding: on another rank (EP 2 x PP 2), on the same rank (DualPipeV's
V puts the last stage on rank 0) or on another mesh (hetero). TP 2 (+SP), flat ZeRO-3 and CP 2 (ring, Ulysses) with
MTP: ``test_deepseek_v3_loop.py`` (issue 39 items 2 and 5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_flagscale.models.decoder import CausalLM, mtp_labels
from lightning_flagscale.parallel.context_parallel.attention import load_balanced_indices, shard_batch_for_cp
from lightning_flagscale.parallel.pipeline_parallel.runner import merge_param_groups
from tests.moe._trainer import assert_sgd_parity, sgd_reference, sgd_trainer_run
from tests.strategies._lm import GLOBAL_BATCH, SEQ
from tests.strategies.test_deepseek_v3_loop import mla_config

STEPS = 3


def mtp_config(**overrides: Any):
    # DeepSeek-V3's weight switch (0.3 -> 0.1) scaled to 3 steps: 0.5 for steps 0 and 1, 0.1 for step 2 on every
    # rank of every layout below (the oracle switches at the same step; the MTP weights' last update shows it)
    return mla_config(
        **{"num_nextn_predict_layers": 2, "mtp_loss_weight": 0.5, "mtp_loss_weight_schedule": [[2, 0.1]], **overrides}
    )


def mtp_token_config():
    """``mtp_config``'s switch given in tokens (issue 39): 2 global batches of GLOBAL_BATCH x SEQ tokens, so the same
    step 2 on every rank as the oracle's step switch, if each rank counts the global batch's tokens."""
    return mtp_config(mtp_loss_weight_schedule=[[2 * GLOBAL_BATCH * SEQ, 0.1]], mtp_loss_weight_schedule_unit="tokens")


@pytest.fixture(scope="module")
def mtp_ref():
    return sgd_reference(mtp_config(), STEPS)


def _with_last_stage_copy(ref: dict[str, Any]) -> dict[str, Any]:
    """The oracle with the last stage's copy of the shared embedding, which must train exactly like the embedding."""
    ref = {**ref, "params": dict(ref["params"]), "init": dict(ref["init"])}
    for key in ("params", "init"):
        ref[key]["mtp.embed_tokens.weight"] = ref[key]["embed_tokens.weight"]
    return ref


def _assert_logged_mtp_loss(results: list[dict[str, Any]], ref: dict[str, Any], what: str) -> None:
    """The logged mtp_loss is the global token mean one process logs (data ranks hold ragged label counts: a mean of
    per-rank means differs) on every rank, pipeline ranks without the MTP modules included (the last stage's value
    travels in the loss's broadcast); with a logger, what rank 0's logger wrote each step is that value too."""
    assert len(ref["mtp_losses"]) == STEPS
    want = torch.tensor(ref["mtp_losses"])
    for rank, res in enumerate(results):
        got = torch.tensor(res["mtp_losses"])
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=0), f"{what} rank {rank}: {got}"
    if results[0]["logged"]:
        got = torch.tensor([m["mtp_loss"] for m in results[0]["logged"] if "mtp_loss" in m])
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=0), f"{what} rank 0 logger: {got}"


def test_mtp_under_fsdp2_zero3(launcher, mtp_ref):
    results = launcher(2, sgd_trainer_run, dict(zero_stage=3, zero3_impl="fsdp2"), mtp_token_config(), STEPS)
    assert_sgd_parity(results, mtp_ref, "deepseek-v3 mtp zero3 fsdp2")
    _assert_logged_mtp_loss(results, mtp_ref, "deepseek-v3 mtp zero3 fsdp2 (dp 2)")
    moved = mtp_ref["params"]["mtp.layers.1.eh_proj.weight"] - mtp_ref["init"]["mtp.layers.1.eh_proj.weight"]
    assert moved.abs().max() > 0  # the MTP modules really train


def test_mtp_under_expert_x_pipeline_parallel(launcher, mtp_ref):
    # One micro-batch per step (GPipe) keeps the routing statistics those of the whole batch, as in the oracle.
    kwargs = dict(expert_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="gpipe", micro_batch_size=2)
    results = launcher(4, sgd_trainer_run, kwargs, mtp_config(), STEPS, logger=True)
    assert [("mtp.embed_tokens.weight" in r["params"]) for r in results] == [False, False, True, True]
    assert_sgd_parity(results, _with_last_stage_copy(mtp_ref), "deepseek-v3 mtp ep2 x pp2", pipeline=True)
    # rank 0 (first stage, no MTP modules) logs the last stage's dp 2 global token mean, and the scheduled weight
    assert [m["mtp_loss_weight"] for m in results[0]["logged"]] == pytest.approx([0.5, 0.5, 0.1])
    _assert_logged_mtp_loss(results, mtp_ref, "deepseek-v3 mtp ep2 x pp2 (last stage dp 2)")
    assert any(b.abs().max() > 0 for b in mtp_ref["buffers"].values())  # the router biases really moved


def test_mtp_under_hetero_meshes(launcher, mtp_ref):
    # TP 2 (2 blocks, the embedding) -> DP 2 (1 block, the head and the MTP modules with their embedding copy); one
    # micro-batch per step, so the routing statistics are the whole batch's as in the oracle.
    meshes = [dict(tensor_parallel_size=2, data_parallel_size=1), dict(data_parallel_size=2)]
    kwargs = dict(hetero_meshes=meshes, hetero_layers=[2, 1], micro_batch_size=4)
    results = launcher(4, sgd_trainer_run, kwargs, mtp_token_config(), STEPS, batch_size=4, logger=True)
    assert [("mtp.embed_tokens.weight" in r["params"]) for r in results] == [False, False, True, True]
    assert_sgd_parity(results, _with_last_stage_copy(mtp_ref), "deepseek-v3 mtp hetero tp2 -> dp2", pipeline=True)
    assert [m["mtp_loss_weight"] for m in results[0]["logged"]] == pytest.approx([0.5, 0.5, 0.1])  # by tokens
    _assert_logged_mtp_loss(results, mtp_ref, "deepseek-v3 mtp hetero tp2 -> dp2 (last mesh dp 2)")


# DualPipeV (DeepSeek-V3's own schedule) with MTP runs with expert parallelism and overlapped pairs, 4 ranks:
# tests/strategies/test_dualpipe_overlap.py


def test_split_backward_of_chained_mtp_modules_equals_one_backward():
    # A last stage with three chained MTP modules: torch's per-group weight passes walk common nodes (the second one
    # hit a freed graph); merged into one pass, input and weight gradients equal a plain backward.
    torch.manual_seed(0)
    stage = CausalLM(mtp_config(num_nextn_predict_layers=3, num_layers=1))
    stage.init_weights(0)
    stage.embed_tokens = None
    ids, labels = torch.randint(0, stage.vocab_size, (2, 2, 16)).unbind(0)
    hidden = torch.randn(2, 16, stage.config.hidden_size)

    def grads(split: bool) -> dict[str, torch.Tensor]:
        stage.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_(True)
        loss = stage.loss_fn(stage(x, mtp_input_ids=ids), labels)
        if split:
            _, groups = stage_backward_input([loss], None, [x], stage.parameters())
            stage_backward_weight(stage.parameters(), merge_param_groups(groups))
        else:
            loss.backward()
        return {"input": x.grad, **{n: p.grad for n, p in stage.named_parameters() if p.grad is not None}}

    plain, split = grads(False), grads(True)
    assert plain.keys() == split.keys() and "mtp.embed_tokens.weight" in plain
    for name, grad in plain.items():
        assert torch.allclose(split[name], grad, rtol=1e-6, atol=1e-9), name


def test_mtp_inputs_shifted_before_context_parallel_sharding():
    # Packed documents: each CP rank's shifted ids and targets are the whole sequence's at its load-balanced positions
    # (the tail of a chunk looks ahead into another rank's chunk), and the pre-shifted forward is the unsharded one.
    torch.manual_seed(0)
    model = CausalLM(mtp_config(num_layers=1))
    model.init_weights(0)
    ids = torch.randint(0, model.vocab_size, (2, 16))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    segments = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    batch = model.prepare_batch({"input_ids": ids, "labels": labels, "segment_ids": segments})
    for rank in range(2):
        shard = shard_batch_for_cp(batch, (rank, 2), sequence_keys=model.cp_sequence_keys)
        index = load_balanced_indices(16, 2, rank)
        for k in (1, 2):
            ahead = (index + k).clamp(max=15)
            assert torch.equal(shard["mtp_input_ids"][..., k - 1][:, index < 16 - k], ids[:, ahead][:, index < 16 - k])
            assert torch.equal(shard["mtp_labels"][..., k - 1], mtp_labels(labels, k, segments)[:, index])
    plain = model.loss_fn(model(ids, segment_ids=segments), labels)
    mtp_plain = model.pop_mtp_loss()
    extra = {k: batch[k] for k in ("mtp_input_ids", "mtp_labels")}
    shifted = model.loss_fn(model(ids, segment_ids=segments, **extra), labels)
    assert torch.equal(plain, shifted) and torch.equal(mtp_plain, model.pop_mtp_loss())
