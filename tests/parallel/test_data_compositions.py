"""Issue 15: overlapped bucket reduction composed with expert parallelism (expert buckets over the expert
data-parallel group) and with pipeline parallelism (buckets filled and reduced at the optimizer step), ZeRO-2, also
with the parameter all-gather in flight into the next forward (``overlap_param_gather``: the pipeline's stage modules
and the expert modules wait for their buckets), against one fp32 process with SGD, ragged labels and clipping
(relative error <= 1e-5)."""

from __future__ import annotations

import pytest

from tests.parallel.test_data_overlap import BUCKET, STEPS, _run_with_stats
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config
from tests.strategies.test_expert_loop import moe_config


def test_expert_parallel_with_zero2_overlap(launcher):
    """World 4, EP=2: expert buckets reduce-scatter over an expert data-parallel group of 2, dense ones over 4; the
    parameter all-gathers (over those same groups) complete in the next forward."""
    reference = reference_run(moe_config(), STEPS, clip=1.0)
    kwargs = dict(expert_parallel_size=2, zero_stage=2, grad_bucket_numel=BUCKET, overlap_param_gather=True)
    results = launcher(4, _run_with_stats, kwargs, moe_config())
    assert_matches_reference([r[:2] for r in results], reference, "ep2-zero2")
    for _, _, stats in results:
        assert stats["launched_in_backward"] > 0, stats


@pytest.mark.parametrize("param_gather", [False, True])
def test_pipeline_with_zero2(launcher, param_gather):
    reference = reference_run(tiny_config(num_layers=4), STEPS, clip=1.0)
    kwargs = dict(pipeline_parallel_size=2, zero_stage=2, micro_batch_size=1, grad_bucket_numel=BUCKET,
                  overlap_param_gather=param_gather)  # fmt: skip
    results = launcher(4, _run_with_stats, kwargs, tiny_config(num_layers=4))
    assert_matches_reference([r[:2] for r in results], reference, "pp2xdp2-zero2")
    for _, _, stats in results:  # under PP every bucket is reduced at the optimizer step
        assert stats["launched_in_backward"] == 0, stats
        assert stats["pending_after_step"] == [stats["num_buckets"] if param_gather else 0] * STEPS, stats


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("tp2xdp2-zero1", dict(tensor_parallel_size=2, zero_stage=1)),
        ("cp2xdp2-zero2", dict(context_parallel_size=2, zero_stage=2)),
    ],
)
def test_param_gather_under_tensor_and_context_parallel(launcher, name, kwargs):
    """The parameter all-gather in flight into the next forward with DTensor (TP) parameters, whose buckets hold the
    local shards, and over data x context ranks (CP): every bucket still pending when the step returns, a
    ``state_dict()`` then reads the stepped weights, and the run matches one process."""
    reference = reference_run(tiny_config(), STEPS, clip=1.0)
    results = launcher(4, _run_with_stats, dict(kwargs, grad_bucket_numel=BUCKET, overlap_param_gather=True),
                       tiny_config())  # fmt: skip
    assert_matches_reference([r[:2] for r in results], reference, name)
    for _, _, stats in results:
        assert stats["pending_after_step"] == [stats["num_buckets"]] * STEPS, stats
        assert stats["pending_after_state_dict"] == 0 and stats["state_dict_current"], stats
