"""One token mean per optimizer step (issue 10): pipeline micro-batches, gradient accumulation (Trainer's flag and the
strategy's), PP x DP x ZeRO-1, packed documents under CP and PP, hetero-DP shares under PP, all with ragged labels and plain SGD, so that a wrongly
weighted micro-batch or a gradient off by a constant factor fails the weight and gradient-norm comparison."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.models import CausalLM
from lightning_flagscale.strategies._tokens import TokenCountingLoader, count_label_tokens
from tests.strategies._lm import GRAD_NORMS, assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3


def _pp_config():
    return tiny_config(num_layers=4)


@pytest.mark.parametrize(
    ("world", "kwargs", "accumulate"),
    [
        (2, dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", micro_batch_size=1), 1),
        (2, dict(zero_stage=1), 2),  # Trainer(accumulate_grad_batches=2)
        (2, dict(pipeline_parallel_size=2, micro_batch_size=1), 2),
        (4, dict(pipeline_parallel_size=2, zero_stage=1, micro_batch_size=1), 1),
        (4, dict(pipeline_parallel_size=2, zero_stage=1, micro_batch_size=1, gradient_accumulation_steps=2), 1),
    ],
    ids=["pp2-1f1b", "dp2-zero1-trainer-accumulate2", "pp2-accumulate2", "pp2xdp2-zero1", "pp2xdp2-zero1-gas2"],
)
def test_ragged_labels_give_one_token_mean_per_step(launcher, world, kwargs, accumulate):
    steps_batches = accumulate * kwargs.get("gradient_accumulation_steps", 1)
    reference = reference_run(_pp_config(), STEPS, clip=1.0, global_batch=4 * steps_batches)
    results = launcher(world, trainer_run, kwargs, _pp_config(), STEPS, clip=1.0, accumulate=accumulate)
    assert_matches_reference(results, reference, str(kwargs), losses_per_step=steps_batches)


@pytest.mark.parametrize(
    ("world", "kwargs"),
    [
        (4, dict(context_parallel_size=2, zero_stage=1)),
        (4, dict(pipeline_parallel_size=2, micro_batch_size=1)),
    ],
    ids=["dp2xcp2-zero1", "pp2xdp2"],
)
def test_packed_documents_give_one_token_mean_per_step(launcher, world, kwargs):
    # 1-3 documents per sample (segment_ids, restarted position_ids, no target across a document end) on top of the
    # ragged labels: the token count and the attention masks travel with the batch through CP sharding and the
    # pipeline's micro-batches.
    reference = reference_run(_pp_config(), STEPS, clip=1.0, packed=True)
    results = launcher(world, trainer_run, kwargs, _pp_config(), STEPS, clip=1.0, packed=True)
    assert_matches_reference(results, reference, f"packed {kwargs}")


def test_hetero_shares_under_pipeline_run_equal_microbatch_counts(launcher):
    # dp=2 x pp=2, shares [6, 2]: both ranks run 2 micro-batches (of 3 and 1 samples), no collective mismatch.
    kwargs = dict(pipeline_parallel_size=2, micro_batch_size=1, hetero_dp_batch_sizes=[6, 2], zero_stage=1)
    reference = reference_run(_pp_config(), STEPS, clip=1.0, global_batch=8)
    results = launcher(4, trainer_run, kwargs, _pp_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, "hetero-dp x pp")


def test_hetero_shares_that_cannot_split_into_equal_microbatch_counts_are_rejected():
    with pytest.raises(ValueError, match=r"must divide the smallest hetero_dp_batch_sizes entry"):
        ParallelConfig(pipeline_parallel_size=2, micro_batch_size=2, hetero_dp_batch_sizes=[3, 1]).resolve(4)
    with pytest.raises(ValueError, match=r"make every share a multiple of 2"):
        ParallelConfig(pipeline_parallel_size=2, micro_batch_size=1, hetero_dp_batch_sizes=[5, 2]).resolve(4)


def test_gradient_norm_comparison_sees_a_doubled_gradient():
    """The oracle check itself: a gradient off by 2x (what AdamW would hide) fails on the recorded norms."""
    reference = reference_run(tiny_config(), 1, clip=1.0)
    doubled = {**reference[1], GRAD_NORMS: reference[1][GRAD_NORMS] * 2}
    with pytest.raises(AssertionError, match="gradient norms"):
        assert_matches_reference([(reference[0], doubled)], reference, "doubled")


def test_loss_with_the_step_normaliser_sums_to_the_token_mean():
    torch.manual_seed(0)
    model = CausalLM(tiny_config())
    model.init_weights(0)
    ids = torch.randint(0, 256, (4, 8))
    labels = ids.clone()
    labels[0, :6] = -100
    labels[2, :3] = -100
    whole = model.loss_fn(model(ids), labels)
    total = (labels != -100).sum()
    parts = sum(model.loss_fn(model(ids[i : i + 1]), labels[i : i + 1], total) for i in range(4))
    torch.testing.assert_close(parts, whole)
    assert not torch.allclose(sum(model.loss_fn(model(ids[i : i + 1]), labels[i : i + 1]) for i in range(4)) / 4, whole)


def test_token_counting_loader_attaches_the_window_count():
    batches = [{"labels": torch.tensor([[1, -100, 2]])}, {"labels": torch.tensor([[-100, -100, 3]])}]
    batches.append({"labels": torch.tensor([[4, 5, 6]])})
    out = list(TokenCountingLoader(batches, accumulate=2, group=None))
    assert [b["num_items_in_batch"] for b in out] == [3, 3, 3]  # windows [2 + 1], then a short last window [3]
    assert [count_label_tokens(b) for b in out] == [2, 1, 3]


def test_pending_count_waits_once_and_resolves_in_place():
    """Across ranks the window's count arrives as a ``PendingCount`` (its all-reduce in flight); the strategy's
    ``batch_to_device`` replaces it by the int, waiting for the reduction once per window."""
    from lightning_flagscale.strategies._tokens import NUM_ITEMS_KEY, PendingCount, resolve_token_count

    class Work:
        waits = 0

        def wait(self):
            Work.waits += 1
            total.add_(5)  # what the other ranks contribute lands when the reduction completes

    total = torch.tensor(3)
    count = PendingCount(total, Work())
    window = [{"labels": torch.ones(1, 2), NUM_ITEMS_KEY: count} for _ in range(2)]
    assert not hasattr(count, "to")  # Lightning's device moves leave it alone
    for batch in window:
        resolve_token_count(batch)
    assert [b[NUM_ITEMS_KEY] for b in window] == [8, 8] and Work.waits == 1
    plain = {"labels": torch.ones(1, 2), NUM_ITEMS_KEY: 4}
    resolve_token_count(plain)
    assert plain[NUM_ITEMS_KEY] == 4
