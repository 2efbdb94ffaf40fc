"""Speed-aware hetero-DP shares, ``hetero_dp_batch_sizes="auto"`` (issue 12, item 6): proportional rounding in whole
micro-batches, speeds by device type or from the profiling pass, shares agreed by every rank, training equal to the
single-process run."""

from __future__ import annotations

import os

import pytest

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.parallel.hetero_dp.batching import proportional_shares
from lightning_flagscale.parallel.hetero_dp.shares import dp_speeds_from, pipeline_shares
from lightning_flagscale.parallel.hetero_mesh.ranks import DEVICE_TYPE_ENV, SLOWDOWN_ENV
from tests.strategies._clock import TICK, emulation_on_ticking_clock
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run


def test_shares_are_proportional_whole_units_summing_to_the_batch():
    assert proportional_shares([3.0, 1.0], 8) == [6, 2]
    assert proportional_shares([2.0, 1.0], 7) == [5, 2]  # 4.67 / 2.33: the left-over unit to who finishes it first
    assert proportional_shares([1.0, 1.0, 1.0], 4) == [2, 1, 1]
    assert proportional_shares([100.0, 1.0], 4) == [3, 1]  # every rank keeps at least one unit
    with pytest.raises(ValueError, match="at least one"):
        proportional_shares([1.0, 1.0, 1.0], 2)


def test_speeds_per_data_parallel_rank():
    # (dp rank, device type, block seconds) of 4 ranks: DP=2 x TP=2, the second DP rank's TP pair mixed.
    entries = [(0, "fast", 1.0), (0, "fast", 1.2), (1, "fast", 0.8), (1, "slow", 3.0)]
    speeds = dp_speeds_from(entries, 2)
    assert speeds == pytest.approx([1.0, 1 / 3.0])  # fast = 1 / median(1.0, 1.2, 0.8); the pair at its slower pace
    assert dp_speeds_from(entries, 2, {"fast": 4.0, "slow": 1.0}) == [4.0, 1.0]
    with pytest.raises(ValueError, match=r"no speed for the device type of rank 3: 'slow'.*FLAGSCALE_DEVICE_TYPE"):
        dp_speeds_from(entries, 2, {"fast": 4.0})
    untyped = [(0, None, 1.0), (1, None, 2.0)]  # no types: every rank is measured on its own
    assert dp_speeds_from(untyped, 2) == pytest.approx([1.0, 0.5])


def test_auto_shares_are_validated_before_spawn():
    ParallelConfig(hetero_dp_batch_sizes="auto", hetero_device_speed={"a": 2.0, "b": 1}).resolve(2)
    ParallelConfig(hetero_dp_batch_sizes="auto", pipeline_parallel_size=2).resolve(4)  # under PP too (below)
    with pytest.raises(ValueError, match=r"give a list of per-rank batch sizes or 'auto'"):
        ParallelConfig(hetero_dp_batch_sizes="fast")
    with pytest.raises(ValueError, match=r"must map each device type to a positive speed"):
        ParallelConfig(hetero_dp_batch_sizes="auto", hetero_device_speed={"a": 0.0})
    with pytest.raises(ValueError, match=r"hetero_device_speed needs hetero_meshes or hetero_dp_batch_sizes='auto'"):
        ParallelConfig(hetero_dp_batch_sizes=[3, 1], hetero_device_speed={"a": 2.0})


def _run_as_type(types: list[str], slowdown: str, strategy: dict, config, steps: int, **kw):
    """``trainer_run`` with this rank's device type and emulated slowdown set, and the emulation on the ticking
    clock of ``tests/strategies/_clock.py`` (all restored after: pool workers live on); also returns the shares the
    strategy chose and the batch size this rank saw at each step."""
    import lightning as L
    import torch.distributed as dist

    seen: dict = {"sizes": []}

    class Shares(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["sizes"].append(batch["input_ids"].shape[0])
            seen["shares"] = trainer.strategy.parallel.hetero_dp_batch_sizes
            seen["speeds"] = trainer.strategy._dp_speeds
            if trainer.strategy._pipeline is not None:  # micro-batches this rank's pipeline splits the batch into
                runner = trainer.strategy._pipeline.runner
                seen.setdefault("micro", []).append(runner.count_microbatches(batch["input_ids"].shape[0]))

    saved = {k: os.environ.get(k) for k in (DEVICE_TYPE_ENV, SLOWDOWN_ENV)}
    os.environ[DEVICE_TYPE_ENV], os.environ[SLOWDOWN_ENV] = types[dist.get_rank()], slowdown
    try:
        with emulation_on_ticking_clock():
            losses, params = trainer_run(strategy, config, steps, callbacks=[Shares()], **kw)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return losses, params, seen


def test_profiled_auto_shares_are_agreed_proportional_and_train_like_one_process(launcher):
    """Rank 1 is 3x slower by emulation; the profiling pass measures it (on the injected clock: a block's forward
    and backward take 2 ticks on the fast rank, 6 on the slow one), both ranks agree on shares of the global batch of
    8 in proportion to the measured speeds, and training with them equals the single-process run."""
    config = tiny_config()
    reference = reference_run(config, 3, clip=1.0, global_batch=8)
    strategy = dict(zero_stage=1, hetero_dp_batch_sizes="auto")
    out = launcher(2, _run_as_type, ["fast", "slow"], "slow=3", strategy, config, 3, clip=1.0, batch_size=4)
    assert_matches_reference([(losses, params) for losses, params, _ in out], reference, "auto shares")
    shares = [seen["shares"] for _, _, seen in out]
    speeds = out[0][2]["speeds"]
    assert shares[0] == shares[1] and out[1][2]["speeds"] == speeds  # agreed by every rank
    assert speeds == pytest.approx([1 / (2 * TICK), 1 / (6 * TICK)], rel=1e-9)  # exactly the emulated 3x
    assert shares[0] == proportional_shares(speeds, 8) == [6, 2]  # proportional to the measured speeds
    assert [seen["sizes"] for _, _, seen in out] == [[shares[0][0]] * 3, [shares[0][1]] * 3]


def test_resumed_auto_run_keeps_the_checkpoint_shares(launcher, tmp_path):
    """A run with ``"auto"`` shares from given speeds (fast 3x) saves after 2 steps; resumed with speeds that would
    give other shares (equal), it keeps the checkpoint's shares, so each rank reads the samples it would have read in
    the uninterrupted run (where in the epoch the resumed loader starts is the data module's part, tested with
    ``LMDataModule`` in the fault-injection tests)."""
    config = tiny_config()
    ckpt = str(tmp_path / "ckpt")
    first = dict(zero_stage=1, hetero_dp_batch_sizes="auto", hetero_device_speed={"fast": 3.0, "slow": 1.0})
    out = launcher(
        2, _run_as_type, ["fast", "slow"], "slow=1", first, config, 2, clip=1.0, batch_size=4, save_path=ckpt
    )
    saved = out[0][2]["shares"]
    assert saved == [6, 2], saved  # 8 samples in proportion 3 : 1
    second = dict(first, hetero_device_speed={"fast": 1.0, "slow": 1.0})  # alone, this would choose [4, 4]
    out = launcher(
        2, _run_as_type, ["fast", "slow"], "slow=1", second, config, 3, clip=1.0, batch_size=4, ckpt_path=ckpt
    )
    assert [seen["shares"] for _, _, seen in out] == [saved, saved]
    assert [seen["sizes"] for _, _, seen in out] == [[6], [2]]  # the third step only, with the saved shares
    assert out[0][2]["speeds"] == [1.0, 1.0]  # the new speeds were measured; the saved shares won


def test_pipeline_shares_give_every_rank_the_same_micro_batch_count():
    # the slowest rank's micro-batches are micro_batch_size samples; the count n divides the global batch, is at
    # least the schedule's minimum, and is the one with the shortest 1F1B step (n + pp - 1) x slowest micro-batch
    assert pipeline_shares([3.0, 1.0], 8, 1, 2, 2) == [6, 2]  # 2 micro-batches of 3 and of 1
    assert pipeline_shares([3.0, 1.0], 16, 1, 2, 2) == [12, 4]  # 4 of 3 and 1: 5 slots, not 8 of 1 and 1 (9)
    assert pipeline_shares([1.0, 1.0], 8, 1, 2, 2) == [4, 4]  # equal speeds: the even split
    assert pipeline_shares([1.5, 1.0], 20, 2, 2, 2) == [12, 8]  # 4 micro-batches of 3 and of 2 samples
    assert pipeline_shares([2.0, 1.0, 1.0], 24, 1, 2, 2) == [12, 6, 6]
    for shares, mbs in (([6, 2], 1), ([12, 8], 2)):  # what the pipeline runner reads them as
        ParallelConfig(pipeline_parallel_size=2, micro_batch_size=mbs, hetero_dp_batch_sizes=shares).resolve(4)
    with pytest.raises(ValueError, match=r"raise the DataLoader batch size or give hetero_dp_batch_sizes as a list"):
        pipeline_shares([3.0, 1.0], 4, 1, 4, 4)  # 4 micro-batches of the global 4 cannot be split 3 : 1


def test_auto_shares_under_pipeline_train_like_one_process(launcher):
    """DP 2 x PP 2, the first data-parallel rank (ranks 0 and 2) 3x faster: "auto" picks 2 micro-batches of 3 and of 1
    samples per step (shares [6, 2]), the pipeline runs them once the loader sets them, and training equals the
    single-process run (the given-shares case: ``test_exact_gradients.py``)."""
    config = tiny_config()
    reference = reference_run(config, 3, clip=1.0, global_batch=8)
    strategy = dict(zero_stage=1, pipeline_parallel_size=2, micro_batch_size=1, hetero_dp_batch_sizes="auto",
                    hetero_device_speed={"fast": 3.0, "slow": 1.0})  # fmt: skip
    types = ["fast", "slow", "fast", "slow"]  # rank = pp x 2 + dp
    out = launcher(4, _run_as_type, types, "slow=1", strategy, config, 3, clip=1.0, batch_size=4)
    assert_matches_reference([(losses, params) for losses, params, _ in out], reference, "auto shares x pp")
    assert [seen["shares"] for _, _, seen in out] == [[6, 2]] * 4
    assert [seen["sizes"] for _, _, seen in out] == [[6] * 3, [2] * 3, [6] * 3, [2] * 3]
    # the same number of micro-batches on every rank (what an expert all-to-all inside the schedule needs), of 3
    # samples on the fast data-parallel rank and 1 on the slow one
    assert [seen["micro"] for _, _, seen in out] == [[2] * 3] * 4


def test_validation_under_pipeline_with_hetero_shares(launcher):
    """Evaluation loaders are not shared out by speed: every rank splits its batch by micro_batch_size, not by its
    training micro-batch size (3 samples on the fast rank here, which failed on a batch of 4)."""
    import torch

    from tests.strategies._lm import TokenDataset, make_module
    from tests.strategies.test_pipeline_loop import _validate

    torch.manual_seed(0)
    module = make_module(tiny_config(num_layers=4))
    module.configure_model()
    with torch.no_grad():  # the token mean over the validation set: each data-parallel rank reads 4 of its 8 samples
        want = module._loss(TokenDataset(256, 8).batch(torch.arange(0, 8))).item()
    strategy = dict(pipeline_parallel_size=2, micro_batch_size=1, hetero_dp_batch_sizes=[6, 2])
    for got in launcher(4, _validate, strategy):
        assert abs(got - want) <= 1e-6 * want, (got, want)
