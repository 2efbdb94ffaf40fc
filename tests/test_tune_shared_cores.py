"""Pipeline schedules and optimizer phases on ranks that share compute units (``tune/shared_cores.py``): the closed
forms at the limits, the schedules torch runs in between."""

from __future__ import annotations

import pytest

from lightning_flagscale.tune.inflight import schedule_actions
from lightning_flagscale.tune.shared_cores import pipeline_seconds, processor_sharing_seconds


def test_processor_sharing():
    assert processor_sharing_seconds([1.0, 1.0], 2.0) == pytest.approx(1.0)  # a unit each
    assert processor_sharing_seconds([1.0] * 4, 2.0) == pytest.approx(2.0)  # half a unit each
    assert processor_sharing_seconds([1.0, 3.0], 1.0) == pytest.approx(4.0)  # one unit: the sum
    # 3 jobs on 2 units: all at 2/3 until the short one ends (1.5 s), then a unit each for the last 2 s
    assert processor_sharing_seconds([1.0, 3.0, 3.0], 2.0) == pytest.approx(1.5 + 2.0)
    assert processor_sharing_seconds([1.0, 3.0], 4.0) == pytest.approx(3.0)  # spare units do not help a job
    assert processor_sharing_seconds([], 2.0) == 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_unit_per_rank_gives_the_critical_path(schedule):
    p, m, f, b, hop = 4, 8, 1.0, 2.0, 0.25
    actions = schedule_actions(schedule, p, 1, m)
    times = dict.fromkeys(range(p), (f, b, 0.0))
    assert pipeline_seconds(actions, times, 0.0, p) == pytest.approx((m + p - 1) * (f + b))
    with_hops = pipeline_seconds(actions, times, hop, p) - (m + p - 1) * (f + b)
    if schedule == "gpipe":  # each hop of the fill and of the drain is on the critical path, once
        assert with_hops == pytest.approx(2 * (p - 1) * hop)
    else:  # 1F1B's steady state waits on a round trip per micro-batch too: more hops, at most two per slot
        assert 2 * (p - 1) * hop < with_hops <= 2 * (m + p - 1) * hop + 1e-9


def test_one_shared_unit_is_always_busy():
    # a single unit for all ranks: whichever rank runs uses all of it, so the run is the summed work, bubbles or not
    p, m = 4, 4
    times = {0: (1.0, 2.0, 0.0), 1: (0.5, 1.0, 0.0), 2: (0.5, 1.0, 0.0), 3: (1.5, 3.0, 0.0)}
    total = m * sum(f + b for f, b, _ in times.values())
    for schedule in ("gpipe", "1f1b"):
        assert pipeline_seconds(schedule_actions(schedule, p, 1, m), times, 0.0, 1.0) == pytest.approx(total)


def test_shared_units_lie_between_the_two_limits():
    # 4 ranks on 2 units, heavy first and last stages (embedding, head): more than the summed work over the units
    # (the fill and drain run on few ranks), less than each rank on its own unit slowed by the sharing throughout.
    p, m = 4, 4
    times = {0: (1.0, 2.0, 0.0), 1: (0.3, 0.6, 0.0), 2: (0.3, 0.6, 0.0), 3: (1.0, 2.0, 0.0)}
    actions = schedule_actions("gpipe", p, 1, m)
    got = pipeline_seconds(actions, times, 0.0, 2.0)
    work_bound = m * sum(f + b for f, b, _ in times.values()) / 2.0
    alone = pipeline_seconds(actions, times, 0.0, float(p))
    assert max(work_bound, alone) < got < 2 * alone


def test_zero_bubble_fills_the_drain_with_weight_gradients():
    p, m, f, b, w = 4, 8, 1.0, 2.0, 1.0
    times = dict.fromkeys(range(2 * p), (f / 2, b / 2, w / 2))  # zero_bubble: 2 chunks a rank
    one_f_one_b = pipeline_seconds(schedule_actions("1f1b", p, 1, m), dict.fromkeys(range(p), (f, b, w)), 0.0, p)
    zb = pipeline_seconds(schedule_actions("zero_bubble", p, 2, m), times, 0.0, p)
    assert m * (f + b) < zb < one_f_one_b


def test_a_deadlock_names_the_waiting_ranks():
    actions = [[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]]  # rank 0 waits on its own later forward
    with pytest.raises(ValueError, match="deadlock"):
        pipeline_seconds(actions, dict.fromkeys(range(2), (1.0, 1.0, 0.0)), 0.0, 2.0)
    with pytest.raises(ValueError, match="units"):
        pipeline_seconds(actions, dict.fromkeys(range(2), (1.0, 1.0, 0.0)), 0.0, 0.0)


def test_the_calibrated_action_overhead_reproduces_the_measured_run():
    # tune --calibrate times a GPipe run of trivial stages and fits the host time per action through this simulation
    from lightning_flagscale.tune.calibrate import pipeline_action_overhead

    p, m, hop, units = 4, 8, 1e-4, 2.0
    actions = schedule_actions("gpipe", p, 1, m)
    measured = pipeline_seconds(actions, dict.fromkeys(range(p), (1e-3, 1e-3, 0.0)), hop, units)
    assert pipeline_action_overhead(measured, p, m, hop, units) == pytest.approx(1e-3, rel=1e-6)
    hops_only = pipeline_seconds(actions, dict.fromkeys(range(p), (0.0, 0.0, 0.0)), hop, units)
    assert hops_only == pytest.approx(2 * (p - 1) * hop)
    assert pipeline_action_overhead(0.5 * hops_only, p, m, hop, units) == 0.0
