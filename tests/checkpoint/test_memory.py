"""The in-memory snapshot store (``checkpoint/memory.py``) and the restore choice (``strategies/_memory.py``), in one
process: atomic files, two kept, staging that is a copy (training may change the tensors right after), a failed write
reported, and which of memory / disk a restart picks."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from lightning_flagscale.checkpoint.memory import (
    SnapshotWriter,
    fill_state,
    list_snapshots,
    read_snapshot,
    remove_snapshots,
)
from lightning_flagscale.strategies._memory import choose_snapshot


def _state(value: float) -> dict:
    return {
        "state_dict": OrderedDict(w=torch.full((3, 2), value), b=torch.tensor([value])),
        "optimizer_states": [{"state": {"w": {"exp_avg": torch.full((3, 2), -value), "step": 4}}}],
        "loops": {"fit_loop": {"progress": [1, 2, value]}},
    }


def test_snapshots_are_copies_written_atomically_and_two_are_kept(tmp_path):
    writer = SnapshotWriter(tmp_path, tag="abc")
    for step in (1, 2, 3):
        state = _state(float(step))
        blocked = writer.snapshot(step, state)
        assert blocked >= 0.0
        state["state_dict"]["w"].add_(100.0)  # training goes on: the snapshot must hold the value at `snapshot`
        state["loops"]["fit_loop"]["progress"].append("later")
    writer.wait()
    assert list_snapshots(tmp_path, "abc") == [2, 3]
    assert list_snapshots(tmp_path, "other-layout") == []
    assert not list(tmp_path.glob("*.tmp"))
    got = read_snapshot(tmp_path, 3, "abc")
    assert isinstance(got["state_dict"], OrderedDict)
    assert torch.equal(got["state_dict"]["w"], torch.full((3, 2), 3.0))
    assert got["optimizer_states"][0]["state"]["w"]["step"] == 4
    assert got["loops"]["fit_loop"]["progress"] == [1, 2, 3.0]
    writer.close()
    remove_snapshots(tmp_path, keep={2}, tag="abc")
    assert list_snapshots(tmp_path, "abc") == [2]
    remove_snapshots(tmp_path)
    assert not tmp_path.exists()


def test_a_failed_write_is_raised_at_the_next_snapshot(tmp_path):
    writer = SnapshotWriter(tmp_path, tag="abc")
    writer.snapshot(1, {"x": torch.zeros(2), "bad": lambda: None})  # a lambda cannot be pickled: the write fails
    with pytest.raises(RuntimeError, match="in-memory snapshot"):
        writer.wait()
    writer.close()


def test_fill_state_copies_into_the_live_tensors():
    live = torch.zeros(3)
    template = {"state_dict": {"w": live}, "optimizer_0": {"state": {"w": {"step": torch.zeros(())}}}}
    saved = {"state_dict": {"w": torch.arange(3.0)}, "optimizer_0": {"state": {"w": {"step": torch.tensor(5.0)}},
                                                                        "param_groups": [{"lr": 0.1}]}}  # fmt: skip
    out = fill_state(template, saved)
    assert out["state_dict"]["w"] is live and torch.equal(live, torch.arange(3.0))
    assert float(out["optimizer_0"]["state"]["w"]["step"]) == 5.0
    assert out["optimizer_0"]["param_groups"] == [{"lr": 0.1}]
    with pytest.raises(ValueError, match="shape"):
        fill_state({"w": torch.zeros(2)}, {"w": torch.zeros(3)})


@pytest.mark.parametrize(
    ("steps", "disk", "want", "warned"),
    [
        ([[6, 7], [6, 7]], 4, 7, None),  # newest common snapshot, newer than disk
        ([[6, 7], [6]], 4, 6, [1]),  # rank 1's step-7 write was interrupted: step 6, and rank 1 named
        ([[6, 7], [6, 7]], 7, None, None),  # disk as new: disk (persistent) wins
        ([[8, 9], []], 8, None, [1]),  # rank 1 holds nothing (e.g. a replaced node): disk
        ([[], []], None, None, None),  # nothing anywhere: a fresh start
        ([[3, 4], [3, 4]], None, 4, None),  # killed before the first disk checkpoint
    ],
)
def test_choose_snapshot(steps, disk, want, warned):
    step, warning = choose_snapshot(steps, disk)
    assert step == want
    if warned is None:
        assert warning == ""
    else:
        assert f"rank(s) {warned}" in warning
