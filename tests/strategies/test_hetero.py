"""Heterogeneous data parallelism: uneven per-rank batch shares train exactly like one process."""

from __future__ import annotations

import pytest

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.parallel.hetero_dp.batching import HeteroBatchSampler
from tests._oracle import global_batch_indices
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run


def test_ranks_take_their_shares_of_the_same_global_batch():
    shares = [list(HeteroBatchSampler(32, [3, 1], rank, seed=0)) for rank in (0, 1)]
    assert [len(b) for b in shares[0]] == [3] * 8 and [len(b) for b in shares[1]] == [1] * 8
    for k in range(8):
        assert sorted(shares[0][k] + shares[1][k]) == sorted(global_batch_indices(32, 4, k).tolist())


def test_invalid_shares_are_rejected_early():
    with pytest.raises(ValueError, match=r"hetero_dp_batch_sizes has 3 entries but there are 2 data-parallel ranks"):
        ParallelConfig(hetero_dp_batch_sizes=[2, 1, 1]).resolve(2)
    with pytest.raises(ValueError, match=r"must hold positive integers"):
        ParallelConfig(hetero_dp_batch_sizes=[4, 0]).resolve(2)


def _run_recording_batch_sizes(kwargs):
    import lightning as L

    sizes: list[int] = []

    class Sizes(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sizes.append(batch["input_ids"].shape[0])

    losses, params = trainer_run(kwargs, tiny_config(), 3, clip=1.0, ragged=True, callbacks=[Sizes()])
    return (losses, params), sizes


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_uneven_shares_match_single_process(launcher, zero_stage):
    # Rank 0 (the "strong device") takes 3 of every 4 samples; labels are ragged, so the token weighting matters.
    reference = reference_run(tiny_config(), 3, clip=1.0, ragged=True)
    outputs = launcher(2, _run_recording_batch_sizes, dict(zero_stage=zero_stage, hetero_dp_batch_sizes=[3, 1]))
    assert [sizes for _, sizes in outputs] == [[3, 3, 3], [1, 1, 1]]
    assert_matches_reference(
        [r for r, _ in outputs], reference, f"hetero-dp zero{zero_stage}", every_rank_holds_all=True
    )


def test_a_tuner_hetero_dp_plan_trains_as_the_single_process_run(launcher):
    """``tune --hetero``'s hetero-DP plan is what the strategy runs: for a 3x faster and a slower device, the shares
    it plans (``HeteroPlan.parallel``, passed as it comes out) are the batches each rank trains, and the run matches
    the single-process fp32 run (SGD, ragged labels, clipping)."""
    from lightning_flagscale.tune import HardwareProfile
    from lightning_flagscale.tune.hardware import COLLECTIVES, LinkPoint
    from lightning_flagscale.tune.hetero import DeviceGroup, plan_hetero_dp

    link = [LinkPoint(group_size=2, latency=1e-5, bus_bandwidth=1e10)]
    fast = HardwareProfile(name="fast", device_type="fast", peak_flops=3e10, hbm_bandwidth=3e10, memory_bytes=1e9,
                           links={k: {"intra": link, "inter": link} for k in COLLECTIVES})  # fmt: skip
    slow = fast.replace(name="slow", device_type="slow", peak_flops=1e10, hbm_bandwidth=1e10)
    groups = [DeviceGroup(device_type=p.device_type, count=1, profile=p) for p in (fast, slow)]
    plan = plan_hetero_dp(tiny_config(), groups, seq_len=16, global_batch=4)
    sizes = plan.parallel["hetero_dp_batch_sizes"]
    assert sizes == [3, 1]  # in proportion to speed, in whole micro-batches
    reference = reference_run(tiny_config(), 3, clip=1.0, ragged=True)
    outputs = launcher(2, _run_recording_batch_sizes, plan.parallel)
    assert [seen for _, seen in outputs] == [[sizes[0]] * 3, [sizes[1]] * 3]
    assert_matches_reference([r for r, _ in outputs], reference, str(plan.parallel), every_rank_holds_all=True)


def test_lightning_reseeds_the_batch_samplers_every_epoch():
    """Lightning calls set_epoch on `loader.batch_sampler.sampler` only: both hetero batch samplers must follow it."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from torch.utils.data import DataLoader

    from lightning_flagscale.parallel.hetero_dp.batching import MicroBatchSliceSampler

    for batches in (HeteroBatchSampler(32, [3, 1], 0, seed=0), MicroBatchSliceSampler(32, 4, 2, 1, 0, shuffle=True)):
        loader = DataLoader(range(32), batch_sampler=batches)
        first = list(loader.batch_sampler)
        _set_sampler_epoch(loader, 1)
        assert batches.epoch == 1 and list(loader.batch_sampler) != first


def _data_module_run(kwargs):
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScaleStrategy
    from lightning_flagscale.data import LMDataModule
    from tests.strategies._lm import make_module

    seen: list[tuple[int, int | None]] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((batch["input_ids"].shape[0], batch.get("num_items_in_batch")))

    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=FlagScaleStrategy(**kwargs), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Record()],
    )  # fmt: skip
    data = LMDataModule(seq_len=16, batch_size=2, num_train_samples=64, num_val_samples=8)
    trainer.fit(make_module(tiny_config(vocab_size=512)), data)
    return seen


def test_data_module_loaders_get_shares_and_the_token_count(launcher):
    """LMDataModule shuffles with its own sampler, which Lightning wraps with shuffle=False: the strategy still
    treats it as the training loader (hetero shares applied, the step's token count attached)."""
    results = launcher(2, _data_module_run, dict(zero_stage=1, hetero_dp_batch_sizes=[3, 1]))
    assert [size for size, _ in results[0]] == [3, 3] and [size for size, _ in results[1]] == [1, 1]
    for r0, r1 in zip(results[0], results[1]):
        assert r0[1] is not None and r0[1] == r1[1]  # one global count per step, on every rank
