"""Every data/tensor-parallel layout matches the single-process fp32 run: losses and parameters after 3 steps."""

from __future__ import annotations

import pytest

from tests.strategies._lm import assert_matches_reference, reference_run, tiny_config, trainer_run

STEPS = 3
LAYOUTS = {
    "ddp": (2, dict(zero_stage=0)),
    "zero1": (2, dict(zero_stage=1)),
    "zero2": (2, dict(zero_stage=2)),
    "zero3": (2, dict(zero_stage=3)),
    "tp2": (2, dict(tensor_parallel_size=2)),
    "tp2-sp": (2, dict(tensor_parallel_size=2, sequence_parallel=True)),
    "tp2xdp2-zero1": (4, dict(tensor_parallel_size=2, zero_stage=1)),
    "tp2xzero3": (4, dict(tensor_parallel_size=2, zero_stage=3)),
}


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(), STEPS, clip=1.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(launcher, reference, layout):
    world, kwargs = LAYOUTS[layout]
    results = launcher.shared(world, trainer_run, kwargs, tiny_config(), STEPS, clip=1.0)
    assert_matches_reference(results, reference, layout, every_rank_holds_all=True)
