"""Heterogeneous meshes by device type (issue 12, items 1, 6, 7): ranks assigned to meshes by their reported type,
the speed-aware split from a profiling pass, and the emulated slowdown; training matches the single-process run."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lightning_flagscale.config.hetero import parse_hetero_meshes
from lightning_flagscale.config.layer_split import plan_stage_groups, speed_aware_layers
from lightning_flagscale.parallel.hetero_mesh.build import boundary_transfers, group_of_rank
from lightning_flagscale.parallel.hetero_mesh.ranks import (
    COST_ENV,
    DEVICE_TYPE_ENV,
    SLOWDOWN_ENV,
    BusyTimer,
    attach_busy_timer,
    emulated_cost,
    emulated_slowdown,
    rank_order_by_type,
)
from tests.strategies._clock import TICK, emulation_on_ticking_clock, ticking_clock
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

FAST = dict(tensor_parallel_size=2, device_type="fast")
SLOW = dict(data_parallel_size=2, device_type="slow")
INTERLEAVED = ["slow", "fast", "slow", "fast"]  # ranks 0, 2 slow; 1, 3 fast


def test_ranks_fill_meshes_by_device_type():
    meshes = parse_hetero_meshes([FAST, SLOW])
    assert rank_order_by_type(meshes, INTERLEAVED) == [1, 3, 0, 2]
    assert rank_order_by_type(meshes, [None] * 4) == [0, 1, 2, 3]  # nobody reports a type: rank order
    assert rank_order_by_type(meshes, ["A100"] * 4) == [0, 1, 2, 3]  # one type: rank order
    groups = plan_stage_groups(meshes, [3, 1], 4, rank_order=[1, 3, 0, 2])
    assert [g.ranks for g in groups] == [[1, 3], [0, 2]]
    assert group_of_rank(groups, 2).index == 1 and groups[1].local_index(2) == 1
    # Rows of the fast mesh's micro-batch reach the slow mesh's data-parallel ranks 0 and 2 from the fast mesh's
    # global ranks 1 and 3 (its two TP replicas, taken in turn): addressed through the permuted rank lists.
    fwd = boundary_transfers(groups[0], groups[1], rows=4)
    assert sorted((t.src, t.dst, t.src_lo, t.src_hi) for t in fwd) == [(1, 0, 0, 2), (3, 2, 2, 4)]
    with pytest.raises(ValueError, match=r"\{'fast': 3, 'slow': 1\}.*\{'fast': 2, 'slow': 2\}"):
        rank_order_by_type(meshes, ["fast", "fast", "slow", "fast"])
    # the CUDA device's name reports the declared type it contains (no FLAGSCALE_DEVICE_TYPE needed on a real node)
    cuda = parse_hetero_meshes([dict(data_parallel_size=2, device_type="H100"), dict(data_parallel_size=2,
                                                                                      device_type="A100")])  # fmt: skip
    names = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"]
    assert rank_order_by_type(cuda, names) == [1, 3, 0, 2]
    nvl = parse_hetero_meshes([dict(data_parallel_size=2, device_type="H100"), dict(data_parallel_size=2,
                                                                                     device_type="H100 NVL")])  # fmt: skip
    names = ["NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3"]
    assert rank_order_by_type(nvl, names) == [1, 3, 0, 2]  # the longest declared type contained wins
    with pytest.raises(ValueError, match="declare none"):
        rank_order_by_type(parse_hetero_meshes([FAST, dict(data_parallel_size=2)]), INTERLEAVED)
    with pytest.raises(ValueError, match="not a permutation"):
        plan_stage_groups(meshes, [3, 1], 4, rank_order=[0, 0, 1, 2])


def test_emulated_slowdown_spec_and_timer():
    assert emulated_slowdown("slow", "") is None
    assert emulated_slowdown("slow", "slow=2.5, fast=1") == 2.5
    assert emulated_slowdown("other", "slow=2.5") == 1.0
    for bad in ("slow", "slow=0.5", "=2", "slow=x"):
        with pytest.raises(ValueError, match="device_type=factor"):
            emulated_slowdown("slow", bad)
    import torch

    timer = BusyTimer(3.0)
    timer._clock = ticking_clock()  # each region the hooks time lasts one tick, whatever the machine's load
    layer = torch.nn.Linear(8, 8)
    layer.register_forward_pre_hook(timer.pre_forward)
    layer.register_forward_hook(timer.post_forward)
    layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
    # Busy time is compute plus (factor - 1) x compute, for the forward and the backward (the sleep itself may last
    # longer than asked, which only the wall clock would see).
    assert timer.compute_s == pytest.approx(2 * TICK, rel=1e-9)  # the forward's tick and the backward's
    assert timer.busy_s == pytest.approx(3.0 * 2 * TICK, rel=1e-9)


@pytest.mark.parametrize("cost", ["measured", "least"])
def test_emulated_cost_least_stretches_the_fastest_call_of_a_shape(cost):
    """Under ``least`` a call's emulated device time is the factor times the least compute time of its module, direction
    and input shapes so far, so noise in one call's CPU time is not stretched (issue 42 item 5); ``measured`` stretches
    each call's own."""
    import torch

    assert emulated_cost("") == "measured" and emulated_cost(" least ") == "least"
    with pytest.raises(ValueError, match="measured, least"):
        emulated_cost("fixed")
    with pytest.raises(ValueError, match="measured, least"):
        BusyTimer(2.0, cost="fixed")
    from lightning_flagscale import FlagScaleStrategy

    for env, value in ((SLOWDOWN_ENV, "slow=0.5"), (COST_ENV, "fixed")):  # refused when the strategy is created
        os.environ[env] = value
        try:
            with pytest.raises(ValueError, match=env):
                FlagScaleStrategy()
        finally:
            del os.environ[env]
    timer = BusyTimer(3.0, cost=cost)
    lengths = iter([2, 1, 1, 1, 3, 2, 5, 5])  # ticks of each timed region: F, B of call 1, call 2, call 3, other shape
    state = {"t": 0.0, "open": False}

    def clock() -> float:  # readings alternate: a region's start, its end (after its given ticks)
        if state["open"]:
            state["t"] += next(lengths) * TICK
        state["open"] = not state["open"]
        return state["t"]

    timer._clock = clock
    layer = torch.nn.Linear(8, 8)
    attach_busy_timer([layer], timer)
    busy = []
    for rows in (4, 4, 4, 2):
        before = timer.busy_s
        layer(torch.randn(rows, 8, requires_grad=True)).sum().backward()
        busy.append(round((timer.busy_s - before) / TICK, 6))
    # compute per call (F + B): 3, 2, 5 ticks for 4 rows, then 10 ticks for 2 rows
    if cost == "measured":
        assert busy == [9.0, 6.0, 15.0, 30.0]
    else:  # F: least of 2, 1, 3 ticks; B: least of 1, 1, 2; the 2-row shape starts its own least
        assert busy == [9.0, 6.0, 6.0, 30.0]
    assert timer.compute_s == pytest.approx(20 * TICK, rel=1e-9)


_SEEN: dict[str, Any] = {}


def _run_as_type(
    types: list[str], slowdown: str | None, strategy: dict, config, steps: int, export_dir: str | None = None, **kw
):
    """``trainer_run`` with this rank's ``FLAGSCALE_DEVICE_TYPE`` (and slowdown) set and the emulation's clock
    replaced by ``ticking_clock`` (all restored afterwards: the pool workers live on); also returns the blocks per
    stage the strategy chose. ``export_dir``: HF export at fit end."""
    import lightning as L
    import torch.distributed as dist

    class Split(L.Callback):
        def on_train_start(self, trainer, pl_module):
            _SEEN["layers"] = [g.num_layers for g in trainer.strategy._hetero_groups]
            _SEEN["chunks"] = [g.chunk_layers for g in trainer.strategy._hetero_groups]
            _SEEN["ranks"] = [g.ranks for g in trainer.strategy._hetero_groups]
            stages = trainer.strategy._pipeline.stage_modules  # blocks this rank actually runs
            _SEEN["blocks"] = sum(len(getattr(m, "layers", None) or ()) for m in stages)

    saved = {k: os.environ.get(k) for k in (DEVICE_TYPE_ENV, SLOWDOWN_ENV)}
    os.environ[DEVICE_TYPE_ENV] = types[dist.get_rank()]
    if slowdown:
        os.environ[SLOWDOWN_ENV] = slowdown
    try:
        callbacks: list = [Split()]
        if export_dir is not None:
            from lightning_flagscale.callbacks.hf_export import HFExportCallback

            callbacks.append(HFExportCallback(export_dir))
        with emulation_on_ticking_clock():
            losses, params = trainer_run(strategy, config, steps, callbacks=callbacks, **kw)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return losses, params, dict(_SEEN)


def test_interleaved_device_types_train_like_one_process(launcher):
    config = tiny_config(num_layers=4)
    strategy = dict(hetero_meshes=[FAST, SLOW], hetero_layers=[3, 1], micro_batch_size=2, pipeline_schedule="1f1b")
    reference = reference_run(config, 3, clip=1.0)
    out = launcher(4, _run_as_type, INTERLEAVED, None, strategy, config, 3, clip=1.0, batch_size=4)
    assert_matches_reference([(losses, params) for losses, params, _ in out], reference, "interleaved types")
    assert out[0][2]["ranks"] == [[1, 3], [0, 2]]
    held = [set(params) for _, params, _ in out]
    assert all(any("embed_tokens" in n for n in held[r]) for r in (1, 3))  # the fast ranks run the first stage
    assert not any("embed_tokens" in n for n in held[0] | held[2])  # the slow ranks run the last stage only


@pytest.mark.parametrize(
    ("num_layers", "strategy"),
    [
        (4, dict(micro_batch_size=2, pipeline_schedule="gpipe")),
        # Two model chunks per mesh: the profiled split keeps them (at least one block each, split evenly).
        (6, dict(micro_batch_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_parallel_size=2)),
    ],
    ids=["gpipe", "interleaved"],
)
def test_profiled_split_under_emulated_slowdown(launcher, num_layers, strategy):
    """hetero_layers=None, no speeds: every rank times a block (the slow type 4x slower by emulation, on the
    injected clock: exactly 4x); the split is agreed on by all ranks, is the speed-aware split of those speeds, and
    training through it still equals the single-process run."""
    config = tiny_config(num_layers=num_layers)
    strategy = dict(hetero_meshes=[FAST, SLOW], **strategy)
    virtual = strategy.get("virtual_pipeline_parallel_size", 1)
    reference = reference_run(config, 3, clip=1.0)
    out = launcher(4, _run_as_type, INTERLEAVED, "slow=4", strategy, config, 3, clip=1.0, batch_size=4)
    assert_matches_reference([(losses, params) for losses, params, _ in out], reference, "profiled split")
    splits = [seen["layers"] for _, _, seen in out]
    assert all(s == splits[0] for s in splits), splits  # every rank chose the same split
    assert sum(splits[0]) == num_layers and min(splits[0]) >= virtual, splits
    want = speed_aware_layers(parse_hetero_meshes([FAST, SLOW]), num_layers, {"fast": 4.0, "slow": 1.0},
                              min_layers=virtual)  # fmt: skip
    assert splits[0] == want and want[0] > want[1], (splits, want)  # the fast group (first stage) takes more blocks
    chunks = out[0][2]["chunks"]
    assert [len(c) for c in chunks] == [virtual, virtual] and [sum(c) for c in chunks] == splits[0], chunks
    # ... and the pipeline is cut by it (slow ranks 0, 2 form the second group; fast ranks 1, 3 the first)
    assert [seen["blocks"] for _, _, seen in out] == [splits[0][1], splits[0][0]] * 2
