"""``ManualGC``: the collector off inside training steps, one collection every N optimizer steps at a step boundary,
the process's setting restored after ``fit`` (also when it raises)."""

from __future__ import annotations

import gc

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_flagscale.callbacks import ManualGC


class _Tiny(L.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at = fail_at
        self.enabled_in_steps: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.enabled_in_steps.append(gc.isenabled())
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: L.LightningModule, callback: ManualGC, steps: int, accumulate: int = 1) -> None:
    data = DataLoader(torch.randn(32, 4), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(module, data)


@pytest.fixture
def collections(monkeypatch):
    """Every gc.collect call: its generation (2 for a full collection)."""
    calls: list[int] = []
    real = gc.collect

    def collect(generation: int = 2) -> int:
        calls.append(generation)
        return real(generation)

    monkeypatch.setattr(gc, "collect", collect)
    return calls


@pytest.mark.parametrize("accumulate", [1, 2])
def test_collects_every_n_optimizer_steps_and_never_inside_a_step(collections, accumulate):
    assert gc.isenabled()
    module = _Tiny()
    _fit(module, ManualGC(every_n_steps=2), steps=5, accumulate=accumulate)
    assert module.enabled_in_steps == [False] * 5 * accumulate  # automatic collection off in every step
    assert collections == [2, 1, 1]  # a full one at the start, then after optimizer steps 2 and 4
    assert gc.isenabled()  # restored


def test_restores_the_collector_when_fit_raises(collections):
    module = _Tiny(fail_at=1)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(module, ManualGC(every_n_steps=1, generation=2), steps=5)
    assert module.enabled_in_steps == [False, False]
    assert collections == [2, 2]  # start, after step 1
    assert gc.isenabled()


def test_a_process_with_the_collector_off_keeps_it_off(collections):
    gc.disable()
    try:
        _fit(_Tiny(), ManualGC(every_n_steps=3), steps=3)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize(("kwargs", "match"), [(dict(every_n_steps=0), "positive number"),
                                               (dict(generation=3), "generations 0, 1 and 2")])  # fmt: skip
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ManualGC(**kwargs)
