"""Slow-rank detection names the slow rank and phase; timing comes from an injected clock, never the real one."""

from __future__ import annotations

import pytest

from lightning_flagscale.callbacks.slow_rank import SlowRankDetector, find_slow_ranks


def test_find_slow_ranks_compares_each_phase_to_the_median():
    times = [
        {"forward": 0.10, "backward": 0.20},
        {"forward": 0.11, "backward": 0.61},
        {"forward": 0.09, "backward": 0.2},
    ]
    (finding,) = find_slow_ranks(times, threshold=1.5)
    assert (finding.rank, finding.phase) == (1, "backward")
    assert "rank 1 is slow in backward" in str(finding)
    assert find_slow_ranks([{"step": 1.0}, {"step": 1.0004}], threshold=1.0, min_seconds=1e-3) == []


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.01
        return self.t


def _run_with_a_slow_backward_on_rank_one(level: int):
    import lightning as L
    import torch.distributed as dist

    from tests.strategies._lm import tiny_config, trainer_run

    clock = _Clock()

    class SlowBackward(L.Callback):  # listed before the detector: its delay lands inside the backward phase
        def on_after_backward(self, trainer, pl_module):
            if dist.get_rank() == 1:
                clock.t += 1.0

    detector = SlowRankDetector(every_n_steps=2, level=level, clock=clock)
    trainer_run({}, tiny_config(), 2, callbacks=[SlowBackward(), detector])
    return [(f.rank, f.phase) for f in detector.findings]


@pytest.mark.parametrize("level,phase", [(1, "backward"), (0, "step")])
def test_detector_names_the_slow_rank_and_phase(launcher, level, phase):
    assert launcher(2, _run_with_a_slow_backward_on_rank_one, level) == [[(1, phase)], [(1, phase)]]
