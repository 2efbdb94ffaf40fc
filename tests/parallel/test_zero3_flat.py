"""Flat-buffer ZeRO-3 (``zero3_impl="flat"``): parity with one process, prefetch order, refused layouts.

Parity uses the Trainer-level oracle of ``tests/strategies/_lm.py`` (SGD lr 0.5, 3 steps, ragged labels): weights and
per-step gradient norms (before clipping) within 1e-5. Checkpoint resharding lives in ``test_zero3_flat_checkpoint.py``.
"""

from __future__ import annotations

import pytest

from lightning_flagscale.config import ParallelConfig
from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3
FLAT = dict(zero_stage=3, zero3_impl="flat")


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(), STEPS, clip=1.0)


@pytest.mark.parametrize(
    ("world", "kwargs", "accumulate"),
    [(2, FLAT, 1), (2, FLAT, 2), (4, dict(FLAT, tensor_parallel_size=2), 1)],
    ids=["flat", "flat-accumulate2", "tp2xflat"],
)
def test_flat_zero3_matches_single_process(launcher, reference, world, kwargs, accumulate):
    from tests.strategies._lm import GLOBAL_BATCH

    dp = world // kwargs.get("tensor_parallel_size", 1)
    results = launcher(
        world, trainer_run, kwargs, tiny_config(), STEPS, clip=1.0, accumulate=accumulate,
        batch_size=GLOBAL_BATCH // dp // accumulate,
    )  # fmt: skip
    assert_matches_reference(results, reference, "flat", every_rank_holds_all=True, losses_per_step=accumulate)


def test_flat_zero3_refuses_unsupported_layouts():
    with pytest.raises(ValueError, match="zero3_impl='flat' with pipeline_parallel_size > 1"):
        ParallelConfig(zero_stage=3, zero3_impl="flat", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="recompute"):
        ParallelConfig(zero_stage=3, zero3_impl="flat", recompute="full")
    with pytest.raises(ValueError, match="zero3_impl='bogus'"):
        ParallelConfig(zero3_impl="bogus")
