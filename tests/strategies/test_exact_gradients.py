"""One token mean per optimizer step (issue 10): pipeline micro-batches, gradient accumulation (Trainer's flag and the
strategy's), PP x DP x ZeRO-1 with accumulation, packed documents under CP and PP, hetero-DP shares under PP, all with
ragged labels and plain SGD, so that a wrongly weighted micro-batch or a gradient off by a constant factor fails the
weight and gradient-norm comparison (shown on a really doubled gradient below).

PP=2 with 1F1B and PP=2 x DP=2 x ZeRO-1 without accumulation run once, in ``test_pipeline_loop.py``
(``test_schedules_in_the_lightning_loop[1f1b]``, ``test_pipeline_composes_with_tp_and_zero[pp2xdp2-zero1]``): same
oracle (ragged labels, SGD, clipped at 1.0), same check (``assert_matches_reference``: per-step token-mean losses,
weights and pre-clip gradient norms)."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.models import CausalLM
from lightning_flagscale.strategies._tokens import TokenCountingLoader, count_label_tokens
from tests.strategies._lm import (
    GRAD_NORMS,
    assert_matches_reference,
    assert_rel_close,
    reference_run,
    tiny_config,
    trainer_run,
)

STEPS = 3


def _pp_config():
    return tiny_config(num_layers=4)


@pytest.mark.parametrize(
    ("world", "kwargs", "accumulate"),
    [
        (2, dict(zero_stage=1), 2),  # Trainer(accumulate_grad_batches=2)
        (2, dict(pipeline_parallel_size=2, micro_batch_size=1), 2),
        (4, dict(pipeline_parallel_size=2, zero_stage=1, micro_batch_size=1, gradient_accumulation_steps=2), 1),
    ],
    ids=["dp2-zero1-trainer-accumulate2", "pp2-accumulate2", "pp2xdp2-zero1-gas2"],
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


def _doubled_gradient_run(kwargs: dict, steps: int):
    """``trainer_run`` with the DP gradient reduction broken to sum where it averages: every gradient the optimizer
    sees is twice the right one, the losses unchanged (restored after: the pool workers live on)."""
    from lightning_flagscale.parallel.data_parallel import grad_buckets

    init = grad_buckets.GradBucket.__init__

    def doubled(self, *args, **kw):
        init(self, *args, **kw)
        self._scale *= 2

    grad_buckets.GradBucket.__init__ = doubled
    try:
        return trainer_run(kwargs, tiny_config(), steps, clip=1.0)
    finally:
        grad_buckets.GradBucket.__init__ = init


def test_gradient_norm_comparison_sees_a_doubled_gradient(launcher):
    """The oracle check itself, on a really doubled gradient (DDP's reduction summing over DP=2 instead of averaging):
    the norms fail, while the weights alone would pass, since the norm exceeds the clip (1.0) at every step and
    clipping removes the factor from the update (as AdamW would)."""
    reference = reference_run(tiny_config(), STEPS, clip=1.0)
    assert (reference[1][GRAD_NORMS] > 1.0).all()  # clipping active on every step: the premise
    results = launcher(2, _doubled_gradient_run, dict(zero_stage=0), STEPS)
    with pytest.raises(AssertionError, match="gradient norms"):
        assert_matches_reference(results, reference, "doubled")
    for rank, (_, params) in enumerate(results):
        assert_rel_close(params.pop(GRAD_NORMS), 2 * reference[1][GRAD_NORMS], 1e-5, f"rank {rank}: twice the norm")
    weights_only = {k: v for k, v in reference[1].items() if k != GRAD_NORMS}
    assert_matches_reference(results, (reference[0], weights_only), "doubled, weights and losses only")


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
