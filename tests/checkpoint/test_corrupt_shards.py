"""Truncated or corrupt checkpoint shards are reported by file name."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.checkpoint import load_sharded, save_sharded


def _saved(tmp_path):
    path = tmp_path / "ckpt"
    save_sharded(path, {"state_dict": {"w": torch.arange(4096.0), "b": torch.ones(16)}}, {"global_step": 1})
    shard = next(path.glob("*.distcp"))
    return path, shard


def _template():
    return {"state_dict": {"w": torch.zeros(4096), "b": torch.zeros(16)}}


def test_truncated_shard_is_named(tmp_path):
    path, shard = _saved(tmp_path)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match=rf"truncated or missing shard files: .*{shard.name} \(\d+ bytes"):
        load_sharded(path, _template())


def test_corrupt_shard_is_named(tmp_path):
    path, shard = _saved(tmp_path)
    data = bytearray(shard.read_bytes())
    data[:64] = b"\xff" * 64  # same length, garbage where the zip header is
    shard.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=rf"(?s)failed: .*corrupt: \['{shard.name}'\]"):
        load_sharded(path, _template())


def test_intact_checkpoint_loads(tmp_path):
    path, _ = _saved(tmp_path)
    state = _template()
    load_sharded(path, state)
    assert torch.equal(state["state_dict"]["w"], torch.arange(4096.0))


def test_truncated_meta_is_named(tmp_path):
    from lightning_flagscale.checkpoint import read_meta

    path, _ = _saved(tmp_path)
    meta = path / "meta.pt"
    meta.write_bytes(meta.read_bytes()[:10])
    with pytest.raises(RuntimeError, match=r"meta\.pt is corrupt or truncated"):
        read_meta(path)
