"""Pipeline parallelism inside Trainer.fit: the unchanged training_step matches the single-process run."""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_matches_reference, assert_rel_close, reference_run, tiny_config, trainer_run

STEPS = 3


def _check(results, reference, what):
    assert_matches_reference(results, reference, what)


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(num_layers=4), STEPS, clip=1.0)


@pytest.fixture(scope="module")
def tied_reference():
    return reference_run(tiny_config(num_layers=4, tie_word_embeddings=True), STEPS, clip=1.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"])
def test_schedules_in_the_lightning_loop(launcher, reference, schedule):
    # zbv and dualpipev get no virtual size: V-shaped schedules pick 2 chunks per rank by themselves (issue 10).
    vpp = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}.get(schedule)
    kwargs = dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=vpp, pipeline_schedule=schedule,
                  micro_batch_size=1)  # fmt: skip
    _check(launcher(2, trainer_run, kwargs, tiny_config(num_layers=4), STEPS, clip=1.0), reference, schedule)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pipeline_parallel_size=2, tensor_parallel_size=2, micro_batch_size=2),
        dict(pipeline_parallel_size=2, zero_stage=1, micro_batch_size=1),
    ],
    ids=["pp2xtp2", "pp2xdp2-zero1"],
)
def test_pipeline_composes_with_tp_and_zero(launcher, reference, kwargs):
    _check(launcher(4, trainer_run, kwargs, tiny_config(num_layers=4), STEPS, clip=1.0), reference, str(kwargs))


def test_tied_embeddings_across_first_and_last_stage(launcher, tied_reference):
    kwargs = dict(pipeline_parallel_size=2, micro_batch_size=1, pipeline_layers=[3, 1])
    results = launcher(2, trainer_run, kwargs, tiny_config(num_layers=4, tie_word_embeddings=True), STEPS, clip=1.0)
    # The last stage's LM head is the tied embedding: compare it against the reference embedding.
    assert_matches_reference(results, tied_reference, "tied", rename={"lm_head.weight": "embed_tokens.weight"})


NUM_SAMPLES = 12  # 3 steps per epoch: the checkpoint sits on an epoch boundary


@pytest.fixture(scope="module")
def pp2_checkpoint(launcher, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "pp2.ckpt")
    kwargs = dict(pipeline_parallel_size=2, micro_batch_size=2)
    launcher(
        2, trainer_run, kwargs, tiny_config(num_layers=4), 3, max_epochs=1, num_samples=NUM_SAMPLES, save_path=path
    )
    return path


@pytest.mark.parametrize(
    "world,kwargs",
    [(2, dict(pipeline_parallel_size=1)), (4, dict(pipeline_parallel_size=4, micro_batch_size=1))],
    ids=["pp1xdp2", "pp4"],
)
def test_checkpoint_reshards_across_pipeline_sizes(launcher, pp2_checkpoint, world, kwargs):
    ref_losses, ref_params = reference_run(tiny_config(num_layers=4), 6, num_samples=NUM_SAMPLES)
    results = launcher(world, trainer_run, kwargs, tiny_config(num_layers=4), 6, max_epochs=2,
                       num_samples=NUM_SAMPLES, ckpt_path=pp2_checkpoint)  # fmt: skip
    for losses, params in results:
        assert len(losses) == 3
        for got, want in zip(losses, ref_losses[3:]):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses[3:])
        for name, value in params.items():
            assert_rel_close(value, ref_params[name], 1e-5, name)


def _auto_costs_run(kwargs, steps: int, **run_kw):
    """``trainer_run`` recording, at the start of each training step, whether the runner still profiles
    (``pipeline_chunk_costs="auto"``) and the costs it runs the order for."""
    from lightning.pytorch.callbacks import Callback

    seen = []

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            runner = trainer.strategy._pipeline.runner
            seen.append((runner.order_auto, runner.measured_costs))

    losses, params = trainer_run(kwargs, tiny_config(num_layers=4), steps, callbacks=[Watch()], **run_kw)
    return losses, params, seen


def test_measured_chunk_costs_are_kept_by_a_checkpoint(launcher, tmp_path):
    """DualPipeV with ``pipeline_chunk_costs="auto"`` in the Lightning loop: torch's order for two steps, then the order
    generated for the costs measured on the second; the checkpoint keeps those costs, so the resumed run runs that
    order from its first step (no new measurement: other costs could give another order, another summation order)
    and both match the single-process run."""
    from lightning_flagscale.checkpoint import read_meta
    from lightning_flagscale.strategies._checkpoint import MEASURED_CHUNK_COSTS

    kwargs = dict(pipeline_parallel_size=2, pipeline_schedule="dualpipev", micro_batch_size=1,
                  pipeline_chunk_costs="auto")  # fmt: skip
    path = str(tmp_path / "auto.ckpt")
    first = launcher(2, _auto_costs_run, kwargs, 3, max_epochs=1, num_samples=NUM_SAMPLES, save_path=path)
    measured = tuple(read_meta(path)[MEASURED_CHUNK_COSTS])
    assert measured[0] == 1.0 and min(measured) > 0
    for _, _, seen in first:  # profiling before steps 1 and 2, the measured costs from step 3
        assert seen == [(True, None), (True, None), (False, measured)], seen
    second = launcher(2, _auto_costs_run, kwargs, 6, max_epochs=2, num_samples=NUM_SAMPLES, ckpt_path=path)
    ref_losses, ref_params = reference_run(tiny_config(num_layers=4), 6, num_samples=NUM_SAMPLES)
    for (losses, params, seen), (first_losses, _, _) in zip(second, first):
        assert seen == [(False, measured)] * 3, seen
        for got, want in zip(first_losses + losses, ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (first_losses + losses, ref_losses)
        for name, value in params.items():
            assert_rel_close(value, ref_params[name], 1e-5, name)


def _validate(strategy_kwargs):
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_flagscale import FlagScaleStrategy
    from tests.strategies._lm import TokenDataset, make_module

    torch.manual_seed(0)
    module = make_module(tiny_config(num_layers=4))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), logger=False, enable_progress_bar=False,
                        strategy=FlagScaleStrategy(**strategy_kwargs))  # fmt: skip
    (metrics,) = trainer.validate(module, DataLoader(TokenDataset(256, 8), batch_size=4))
    return metrics["val_loss"]


def _validate_set(strategy_kwargs, num_samples: int, batch_size: int):
    """``trainer.validate`` of a set of ``num_samples`` in batches of ``batch_size``; returns val_loss."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_flagscale import FlagScaleStrategy
    from tests.strategies._lm import TokenDataset, make_module

    torch.manual_seed(0)
    module = make_module(tiny_config(num_layers=4))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), logger=False, enable_progress_bar=False,
                        strategy=FlagScaleStrategy(**strategy_kwargs))  # fmt: skip
    (metrics,) = trainer.validate(module, DataLoader(TokenDataset(256, num_samples), batch_size=batch_size))
    return metrics["val_loss"]


def test_validation_of_a_set_that_does_not_divide_is_its_token_mean(launcher):
    """7 samples over 2 data-parallel ranks, one a batch: Lightning's sampler gives the second rank a fourth batch by
    repeating sample 0, which counted twice; the padding's labels are now ignored (a batch of padding alone weighs
    nothing), so val_loss is the token mean over the 7 samples."""
    import torch

    from tests.strategies._lm import TokenDataset, make_module

    torch.manual_seed(0)
    module = make_module(tiny_config(num_layers=4))
    module.configure_model()
    data = TokenDataset(256, 7)
    with torch.no_grad():
        want = module._loss(data.batch(torch.arange(7))).item()
        repeated = module._loss(data.batch(torch.tensor([0, 1, 2, 3, 4, 5, 6, 0]))).item()
    assert abs(repeated - want) > 1e-4 * want  # what the repeated sample did to it
    for got in launcher(2, _validate_set, dict(zero_stage=1), 7, 1):
        assert abs(got - want) <= 1e-6 * want, (got, want, repeated)


@pytest.mark.parametrize(
    "strategy_kwargs",
    [dict(pipeline_parallel_size=2, micro_batch_size=2), dict(tensor_parallel_size=2), dict(zero_stage=3)],
    ids=["pp2-forward-only", "tp2", "zero3"],
)
def test_validation_matches_single_process(launcher, strategy_kwargs):
    import torch

    from tests.strategies._lm import TokenDataset, make_module

    torch.manual_seed(0)
    module = make_module(tiny_config(num_layers=4))
    module.configure_model()
    data = TokenDataset(256, 8)
    # val_loss is the token-weighted mean over the validation set (CausalLMModule.val_loss_mean), not the mean of
    # the batches' losses: the two batches hold 42 and 41 labelled tokens, a 6e-6 difference a plain mean would hide.
    batches = [data.batch(torch.arange(i, i + 4)) for i in (0, 4)]
    with torch.no_grad():
        sums = [module._loss(b).item() * int((b["labels"] != -100).sum()) for b in batches]
    want = sum(sums) / sum(int((b["labels"] != -100).sum()) for b in batches)
    for got in launcher(2, _validate, strategy_kwargs):
        assert abs(got - want) <= 1e-6 * want, (got, want)
