"""Layout errors are raised once, in the launching process, before Lightning spawns any worker."""

from __future__ import annotations

import pytest

from lightning_flagscale import FlagScaleStrategy
from lightning_flagscale.data import LMDataModule
from lightning_flagscale.models import CausalLMModule
from tests.strategies._lm import tiny_config


def _fit(strategy: FlagScaleStrategy, data: LMDataModule, devices: int = 4):
    import lightning as L

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(CausalLMModule(tiny_config()), data)
    finally:
        assert trainer.strategy.launcher.procs == [], "no worker may have been started"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=3), "World size 4 is not divisible"),
        (dict(tensor_parallel_size=4), "num_key_value_heads=2 is not divisible by tensor_parallel_size=4"),
        (dict(context_parallel_size=2), r"LMDataModule\(seq_len=30\) is not divisible by 2 x context_parallel_size"),
    ],
    ids=["world", "model", "cp-seq-len"],
)
def test_layout_error_raised_before_any_worker_starts(monkeypatch, kwargs, message):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)  # a fresh command, as a user types it
    with pytest.raises(ValueError, match=message):
        _fit(FlagScaleStrategy(**kwargs), LMDataModule(seq_len=30, batch_size=2))


def test_resume_refuses_unknown_values_and_needs_a_checkpoint_folder(monkeypatch):
    with pytest.raises(ValueError, match="resume='last' is unknown"):
        FlagScaleStrategy(resume="last")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="dirpath` of a ModelCheckpoint"):
        _fit(FlagScaleStrategy(resume="auto"), LMDataModule(seq_len=32, batch_size=2))
