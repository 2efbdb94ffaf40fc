"""The in-memory snapshot folder (``checkpoint/memory.py``), the restore choice (``strategies/_memory.py``) and the
``MemoryCheckpoint`` arguments, in one process. Taking and restoring snapshots under every layout is tested in
``tests/strategies/test_memory_checkpoint.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_flagscale.callbacks import MemoryCheckpoint
from lightning_flagscale.checkpoint.memory import list_snapshots, remove_snapshots, run_folder, snapshot_path
from lightning_flagscale.checkpoint.sharded import COMPLETE_MARKER
from lightning_flagscale.strategies._checkpoint import CheckpointHooks
from lightning_flagscale.strategies._memory import choose


def _snapshot(folder, step: int, complete: bool = True):
    path = snapshot_path(folder, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    if complete:
        (path / COMPLETE_MARKER).write_text("ok\n")
    return path


def test_only_complete_snapshots_are_listed_and_removal_keeps_what_is_asked(tmp_path):
    folder = run_folder(tmp_path, "/some/run/ckpt")
    assert folder != run_folder(tmp_path, "/other/run/ckpt") and list_snapshots(folder) == []
    for step in (3, 12, 7):
        _snapshot(folder, step)
    _snapshot(folder, 13, complete=False)  # a save the crash interrupted before its marker
    (folder / "step-000000014.tmp-0123abcd").mkdir()  # a save interrupted before its rename
    assert list_snapshots(folder) == [3, 7, 12]
    remove_snapshots(folder, keep={7, 12})
    assert sorted(p.name for p in folder.iterdir()) == ["step-000000007", "step-000000012"]
    remove_snapshots(folder)
    assert not folder.exists()


@pytest.mark.parametrize(
    ("memory", "disk", "missing", "want", "warned"),
    [
        (7, 4, [], True, False),  # the snapshot is newer than the disk checkpoint
        (7, 7, [], False, False),  # as new as the disk: the disk (persistent) wins
        (7, None, [], True, False),  # killed before the first disk checkpoint
        (None, 4, [], False, False),  # no snapshot
        (7, 4, [2, 3], False, True),  # ranks 2 and 3 cannot see it (another node's /dev/shm): disk, and say so
    ],
)
def test_choose(memory, disk, missing, want, warned):
    use, warning = choose(memory, disk, missing)
    assert use is want
    assert bool(warning) is warned
    if warned:
        assert f"rank(s) {missing}" in warning


def test_memory_checkpoint_arguments_are_checked():
    with pytest.raises(ValueError, match="int >= 1"):
        MemoryCheckpoint(every_n_train_steps=0)
    trainer = SimpleNamespace(strategy=object(), num_nodes=1)
    with pytest.raises(TypeError, match="FlagScaleStrategy"):
        MemoryCheckpoint().setup(trainer, None, "fit")
    trainer = SimpleNamespace(strategy=CheckpointHooks(), num_nodes=2)
    with pytest.raises(ValueError, match="every node sees"):
        MemoryCheckpoint().setup(trainer, None, "fit")
    MemoryCheckpoint(dirpath="/shared/snapshots").setup(trainer, None, "fit")  # a shared folder is fine
