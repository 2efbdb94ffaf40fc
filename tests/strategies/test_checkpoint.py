"""Sharded checkpoints: atomic, and resumable under a different TP / DP / ZeRO layout."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale.checkpoint import consolidate_checkpoint, is_sharded_checkpoint, read_meta
from lightning_flagscale.models.lightning import TOKENS_TRAINED_KEY
from tests.strategies._lm import GLOBAL_BATCH, SEQ, assert_rel_close, reference_run, tiny_config, trainer_run

# 12 samples, global batch 4: one epoch is 3 steps, so the checkpoint sits on an epoch boundary.
NUM_SAMPLES = 12
SAVE_LAYOUT = dict(tensor_parallel_size=2, zero_stage=1)


@pytest.fixture(scope="module")
def saved(launcher, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "tp2xdp2.ckpt")
    launcher(4, trainer_run, SAVE_LAYOUT, tiny_config(), 3, max_epochs=1, num_samples=NUM_SAMPLES, save_path=path)
    return path


@pytest.fixture(scope="module")
def uninterrupted():
    return reference_run(tiny_config(), 6, num_samples=NUM_SAMPLES)


def test_checkpoint_is_complete_and_consolidates(saved, tmp_path):
    assert is_sharded_checkpoint(saved)
    meta = read_meta(saved)
    assert meta["global_step"] == 3
    # the tokens of 3 global batches (TP 2 x DP 2: each rank's batch x its 2 data ranks), for a token MTP schedule
    assert meta[TOKENS_TRAINED_KEY] == 3 * GLOBAL_BATCH * SEQ
    assert meta["parallel_config"]["tensor_parallel_size"] == 2
    out = consolidate_checkpoint(saved, tmp_path / "full.pt")
    full = torch.load(out, weights_only=False)
    weights = full["state_dict"]
    assert weights["model.embed_tokens.weight"].shape == (256, 32)  # full, unsharded tensors
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (64, 32)
    _, ref_params = reference_run(tiny_config(), 3, num_samples=NUM_SAMPLES)
    for name, want in ref_params.items():
        assert_rel_close(weights[f"model.{name}"], want, 1e-5, name)


@pytest.mark.parametrize(
    "layout", [dict(tensor_parallel_size=1, zero_stage=0), dict(zero_stage=3)], ids=["tp1xdp4", "zero3"]
)
def test_resume_under_other_layout_matches_uninterrupted(launcher, saved, uninterrupted, layout, tmp_path):
    ref_losses, ref_params = uninterrupted
    end = str(tmp_path / "end.ckpt")
    results = launcher(
        4, trainer_run, layout, tiny_config(), 6, max_epochs=2, num_samples=NUM_SAMPLES, ckpt_path=saved, save_path=end
    )
    # the token count went on from the checkpoint's (issue 39: a token MTP schedule switches where it would have)
    assert read_meta(end)[TOKENS_TRAINED_KEY] == 6 * GLOBAL_BATCH * SEQ
    for losses, params in results:
        assert len(losses) == 3, "the resumed run must continue at step 4, not start over"
        for got, want in zip(losses, ref_losses[3:]):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses[3:])
        for name, want in ref_params.items():
            assert_rel_close(params[name], want, 1e-5, name)


def test_half_written_checkpoint_is_rejected(tmp_path):
    broken = tmp_path / "broken.ckpt"
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="not a complete FlagScale checkpoint"):
        read_meta(broken)
    assert not is_sharded_checkpoint(broken)


def _train_with_async_save_mid_run(path: str):
    import lightning as L

    class SaveAfterFirstEpoch(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(path)  # returns at once; training goes on while it is written

    kwargs = dict(SAVE_LAYOUT, async_checkpoint=True)
    return trainer_run(
        kwargs, tiny_config(), 6, max_epochs=2, num_samples=NUM_SAMPLES, callbacks=[SaveAfterFirstEpoch()]
    )


def test_async_checkpoint_in_flight_does_not_disturb_training_and_resumes(launcher, uninterrupted, tmp_path):
    path = str(tmp_path / "async.ckpt")
    ref_losses, ref_params = uninterrupted
    for losses, params in launcher(4, _train_with_async_save_mid_run, path):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, want in ref_params.items():
            assert_rel_close(params[name], want, 1e-5, name)
    assert is_sharded_checkpoint(path) and read_meta(path)["global_step"] == 3
    results = launcher(4, trainer_run, dict(zero_stage=3), tiny_config(), 6, max_epochs=2, num_samples=NUM_SAMPLES,
                       ckpt_path=path)  # fmt: skip
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses[3:], rel=1e-5)


def _fit_with_model_checkpoint(dirpath: str):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                               save_last=True)  # fmt: skip
    trainer_run(SAVE_LAYOUT, tiny_config(), 6, callbacks=[callback])
    return sorted(p.name for p in __import__("pathlib").Path(dirpath).iterdir())


def test_lightning_model_checkpoint_callback_writes_and_prunes_sharded_checkpoints(launcher, tmp_path):
    names = launcher(4, _fit_with_model_checkpoint, str(tmp_path))[0]
    kept = [n for n in names if n.startswith("epoch")]
    assert len(kept) == 2 and "last.ckpt" in names, names  # top-2 by step kept, the older one removed
    assert not [n for n in names if ".tmp-" in n or ".old-" in n], names
    for name in [*kept, "last.ckpt"]:
        assert is_sharded_checkpoint(tmp_path / name)
    assert read_meta(tmp_path / "last.ckpt")["global_step"] == 6
