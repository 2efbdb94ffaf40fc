"""DeepSeek-V3 multi-token prediction inside Trainer.fit matches the single-process fp32 SGD run (ragged labels,
3 steps, weights, updates and router biases) under TP 2 + SP and EP 2 x PP 2, where the MTP modules run on the last
stage with a synchronised copy of the first stage's embedding (issue 39 items 2 and 5, part); CP is refused.
"""

from __future__ import annotations

import pytest

from tests.moe._trainer import assert_sgd_parity, sgd_reference, sgd_trainer_run
from tests.strategies.test_deepseek_v3_loop import mla_config

STEPS = 3


def mtp_config():
    return mla_config(num_nextn_predict_layers=2, mtp_loss_weight=0.5)


@pytest.fixture(scope="module")
def mtp_ref():
    return sgd_reference(mtp_config(), STEPS)


def test_mtp_under_tensor_parallel(launcher, mtp_ref):
    kwargs = dict(tensor_parallel_size=2, sequence_parallel=True)
    results = launcher(2, sgd_trainer_run, kwargs, mtp_config(), STEPS)
    assert_sgd_parity(results, mtp_ref, "deepseek-v3 mtp tp2-sp")
    moved = mtp_ref["params"]["mtp.layers.1.eh_proj.weight"] - mtp_ref["init"]["mtp.layers.1.eh_proj.weight"]
    assert moved.abs().max() > 0  # the MTP modules really train


def test_mtp_under_expert_x_pipeline_parallel(launcher, mtp_ref):
    kwargs = dict(expert_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="gpipe", micro_batch_size=2)
    results = launcher(4, sgd_trainer_run, kwargs, mtp_config(), STEPS)
    # The last stage holds its own copy of the shared embedding, which must train exactly like the embedding.
    assert any("mtp.embed_tokens.weight" in r["params"] for r in results)
    ref = {**mtp_ref, "params": dict(mtp_ref["params"]), "init": dict(mtp_ref["init"])}
    for key in ("params", "init"):
        ref[key]["mtp.embed_tokens.weight"] = ref[key]["embed_tokens.weight"]
    assert_sgd_parity(results, ref, "deepseek-v3 mtp ep2 x pp2", pipeline=True)


def test_mtp_refused_with_context_parallel(launcher):
    with pytest.raises(Exception, match="Multi-token prediction"):
        launcher(2, sgd_trainer_run, dict(context_parallel_size=2), mtp_config(), 1)
