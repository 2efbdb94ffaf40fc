"""LMDataModule: datasets and batches, DP sharding through Lightning's sampler injection, and mid-epoch resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.data import _replace_dunder_methods, _set_sampler_epoch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader
from torch.utils.data import BatchSampler, DataLoader

from lightning_flagscale.data import IGNORE_INDEX, ByteTokenizer, LMDataModule


def _dm(**kwargs) -> LMDataModule:
    dm = LMDataModule(**{"seq_len": 32, "batch_size": 4, "num_train_samples": 64, "num_val_samples": 16, **kwargs})
    dm.setup("fit")
    return dm


def test_synthetic_batches_follow_the_model_contract():
    dm = _dm()
    assert (len(dm.train_dataset), len(dm.val_dataset), dm.vocab_size) == (64, 16, 256)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids"}
    assert all(v.shape == (4, 32) and v.dtype == torch.int64 for v in batch.values())
    assert batch["input_ids"].max() < 256
    # train and validation text differ but share the world of facts
    val_text = ByteTokenizer().decode(dm.val_dataset[0]["input_ids"])
    assert val_text and val_text not in ByteTokenizer().decode(dm.train_dataset[0]["input_ids"])
    # the same seed gives the same data; another seed other data
    assert torch.equal(_dm().train_dataset[5]["input_ids"], dm.train_dataset[5]["input_ids"])
    assert not torch.equal(_dm(seed=1).train_dataset[5]["input_ids"], dm.train_dataset[5]["input_ids"])


def test_unpacked_mode_has_attention_mask():
    dm = _dm(packing=False)
    assert len(dm.train_dataset) == 64
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"input_ids", "labels", "attention_mask", "position_ids"}
    real = batch["attention_mask"].bool()
    assert (batch["labels"][~real] == IGNORE_INDEX).all()


def test_file_source_split_is_document_disjoint(tmp_path):
    pytest.importorskip("datasets")
    docs = [f"document number {i} says {i * 7 % 13}." for i in range(200)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    dm = _dm(
        source=str(path), text_field="body", num_train_samples=-1, num_val_samples=4, cache_dir=str(tmp_path / "c")
    )
    tok = ByteTokenizer()

    def texts(ds):
        return set(tok.decode(torch.cat([s["input_ids"] for s in ds])).split("."))

    val, train = texts(dm.val_dataset), texts(dm.train_dataset)
    assert len(dm.val_dataset) == 4 and len(val & train - {""}) <= 2  # only the documents cut at block edges
    assert dm.val_dataset.num_documents_used + dm.train_dataset.num_documents_used == 200  # all used, once


def _global_order(dm: LMDataModule, epoch: int) -> list[int]:
    sampler = dm.train_dataloader().sampler
    sampler.set_epoch(epoch)
    return list(sampler)


def _rank_loader(dm: LMDataModule, rank: int, world: int, epoch: int):
    """What Lightning's data connector does to the training loader under a strategy with ``world`` DP ranks."""
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = dm.train_dataloader()  # created like in Lightning's ``_request_dataloader``
    shuffle = _is_dataloader_shuffled(loader)
    sampler = _get_distributed_sampler(loader, shuffle, overfit_batches=0, num_replicas=world, rank=rank)
    loader = _update_dataloader(loader, sampler)
    _set_sampler_epoch(loader, epoch)
    return loader


def _ids(batches) -> list[int]:
    """Identify samples by their tokens."""
    return [tuple(row.tolist()) for batch in batches for row in batch["input_ids"]]


def _fake_trainer(epoch: int, processed_batches: int, dp: dict | None) -> SimpleNamespace:
    """The trainer attributes LMDataModule reads, as Lightning has them mid-epoch ``epoch``."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed_batches))
    fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
    fit_loop.epoch_progress = SimpleNamespace(current=SimpleNamespace(processed=epoch))
    return SimpleNamespace(current_epoch=epoch, distributed_sampler_kwargs=dp, fit_loop=fit_loop)


def test_dp_ranks_share_one_global_order_and_resume_under_another_dp_size():
    dm = _dm()
    key = {tuple(dm.train_dataset[i]["input_ids"].tolist()): i for i in range(64)}
    assert len(key) == 64
    order = _global_order(dm, epoch=1)
    assert order != _global_order(dm, epoch=0) and sorted(order) == list(range(64))
    # two DP ranks interleave the same global permutation
    for rank in range(2):
        assert [key[k] for k in _ids(_rank_loader(dm, rank, 2, epoch=1))] == order[rank::2]

    # stop after 4 steps of epoch 1 on 1 rank (16 samples), resume on 2 ranks: together they continue at sample 16
    _rank_loader(dm, 0, 1, epoch=1)
    dm.trainer = _fake_trainer(epoch=1, processed_batches=4, dp=None)
    state = dm.state_dict()
    assert state == {
        "epoch": 1,
        "samples_in_epoch": 16,
        "samples_consumed": 64 + 16,
        "seed": 1234,
        "num_train_samples": 64,
    }
    resumed = []
    for rank in range(2):
        fresh = _dm()
        fresh.trainer = _fake_trainer(epoch=1, processed_batches=4, dp={"num_replicas": 2, "rank": rank})
        fresh.load_state_dict(state)
        resumed.append([key[k] for k in _ids(_rank_loader(fresh, rank, 2, epoch=1))])
    assert resumed[0] == order[16::2] and resumed[1] == order[17::2]


class _Recorder(L.LightningModule):
    """Records the samples it trains on; a single scalar parameter keeps the optimizer busy and cheap."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        self.seen += _ids([batch])
        return self.w * batch["input_ids"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(tmp_path, max_steps: int, ckpt_path=None, callbacks=()) -> list:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model = _Recorder()
    trainer.fit(model, datamodule=_dm(num_train_samples=40), ckpt_path=ckpt_path)  # 10 batches per epoch
    return model.seen, trainer


@pytest.mark.filterwarnings("ignore::lightning.pytorch.utilities.warnings.PossibleUserWarning")
def test_trainer_resume_continues_the_data_where_it_stopped(tmp_path):
    full, _ = _fit(tmp_path / "full", max_steps=24)  # crosses two epoch boundaries
    assert len(full) == 24 * 4 and full[:40] != full[40:80] and sorted(full[:40]) == sorted(full[40:80])

    # 1) a checkpoint written by ModelCheckpoint mid-epoch (inside on_train_batch_end), at step 14 = epoch 1 batch 4
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=7, save_top_k=-1)
    first, _ = _fit(tmp_path / "a", max_steps=16, callbacks=[every])
    assert first == full[: 16 * 4]
    rest, _ = _fit(tmp_path / "b", max_steps=24, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=14.ckpt"))
    assert rest == full[14 * 4 :]

    # 2) a checkpoint saved by hand after fit stopped mid-epoch
    part, trainer = _fit(tmp_path / "c", max_steps=5)
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    rest, _ = _fit(tmp_path / "d", max_steps=24, ckpt_path=str(tmp_path / "manual.ckpt"))
    assert part + rest == full


def test_test_split_is_the_held_out_split():
    """``trainer.test`` / ``lightning-flagscale test`` read the held-out split, batched as validation."""
    dm = _dm()
    for got, want in zip(dm.test_dataloader(), dm.val_dataloader(), strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])
