"""The in-memory snapshot folder and ZeRO-slice chunks (``checkpoint/in_memory.py``), the restore choice
(``strategies/_snapshots.py``) and the ``MemoryCheckpoint`` arguments, in one process. Taking and restoring snapshots under every layout is tested in
``tests/strategies/test_memory_checkpoint.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_flagscale.callbacks import MemoryCheckpoint
from lightning_flagscale.checkpoint.in_memory import (
    ChunkStager,
    LocalChunks,
    flat_blocks,
    list_snapshots,
    remove_snapshots,
    run_folder,
    snapshot_path,
)
from lightning_flagscale.checkpoint.layout import COMPLETE_MARKER
from lightning_flagscale.strategies._checkpoint import CheckpointHooks
from lightning_flagscale.strategies._snapshots import choose


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


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_blocks_cover_a_flat_range_with_contiguous_rectangles(shape):
    numel = max(1, math.prod(shape))
    values = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            covered = torch.zeros(shape, dtype=torch.long)
            for offsets, sizes, flat in flat_blocks(shape, start, stop):
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                covered[index] += 1
                assert torch.equal(values[index].reshape(-1), torch.arange(flat, flat + math.prod(sizes)))
            want = torch.zeros(numel, dtype=torch.long)
            want[start:stop] = 1
            assert torch.equal(covered.reshape(-1), want), (start, stop)


def test_local_chunks_save_with_dcp_and_load_into_a_whole_tensor(tmp_path):
    """A (3, 5) weight saved as the blocks of two ZeRO slices, [0, 7) and [7, 15), loads back whole (DCP, 1 process)."""
    import torch.distributed.checkpoint as dcp

    weight = torch.randn(3, 5)
    flat = weight.reshape(-1)
    chunks = [(o, flat[f : f + math.prod(s)].view(s).clone()) for a, b in ((0, 7), (7, 15))
              for o, s, f in flat_blocks((3, 5), a, b)]  # fmt: skip
    assert len(chunks) == 4  # row 0 + 2 elements of row 1 | 3 elements of row 1 + row 2
    saved = {"w": LocalChunks((3, 5), torch.float32, chunks), "b": torch.ones(2)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    staged = ChunkStager().stage(saved)
    assert staged["w"] is saved["w"] and staged["b"] is not saved["b"] and torch.equal(staged["b"], saved["b"])
    loaded = {"w": torch.zeros(3, 5), "b": torch.zeros(2)}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(loaded["w"], weight) and torch.equal(loaded["b"], torch.ones(2))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # what `consolidate_checkpoint` uses

    dcp_to_torch_save(tmp_path, tmp_path / "whole.pt")
    assert torch.equal(torch.load(tmp_path / "whole.pt")["w"], weight)
