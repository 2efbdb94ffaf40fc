"""The strategy hosts any model that implements the model protocol (issue 11): a two-tower token classifier, not a
decoder (float features in, no embedding, no attention, blocks in two differently named containers with a bridge
between them), trains under TP, PP and ZeRO-3 exactly like one process (SGD, ragged labels, 3 steps)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, Dataset

from lightning_flagscale.models.decoder import token_mean
from lightning_flagscale.models.init import canonical_fqn, copy_global_into, seed_for
from lightning_flagscale.models.protocol import ParallelizableModel, find_protocol_model
from tests._oracle import global_batch_indices
from tests.strategies._lm import assert_rel_close

FEATURES, WIDTH, CLASSES, SEQ, SAMPLES, GLOBAL_BATCH, STEPS, LR = 8, 16, 10, 6, 16, 4, 3, 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TwoTowers(nn.Module):
    """features [B, S, F] -> input projection -> tower_a -> bridge -> tower_b -> head -> class logits [B, S, C]."""

    def __init__(self) -> None:
        super().__init__()
        self.inp: nn.Module | None = nn.Linear(FEATURES, WIDTH)
        self.tower_a = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.bridge: nn.Module | None = nn.Linear(WIDTH, WIDTH)
        self.tower_b = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.head: nn.Module | None = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # absent units (other pipeline stages) are skipped
        x = self.inp(x) if self.inp is not None else x
        for block in self.tower_a.values():
            x = block(x)
        x = self.bridge(x) if self.bridge is not None else x
        for block in self.tower_b.values():
            x = block(x)
        return self.head(x) if self.head is not None else x

    # ---- the model protocol ----
    def pipeline_units(self) -> list[str]:
        return [
            "inp",
            *(f"tower_a.{k}" for k in self.tower_a),
            "bridge",
            *(f"tower_b.{k}" for k in self.tower_b),
            "head",
        ]

    def tp_plan(self, sequence_parallel: bool) -> dict:
        plan = {}
        for tower in ("tower_a", "tower_b"):
            for key in getattr(self, tower):
                plan[f"{tower}.{key}.up"] = ColwiseParallel()
                plan[f"{tower}.{key}.down"] = RowwiseParallel()
        return plan

    def loss_fn(self, logits: Tensor, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
        losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none")
        return token_mean(losses, labels, num_items_in_batch)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        for fqn, param in self.named_parameters():
            gen = torch.Generator().manual_seed(seed_for(seed, canonical_fqn(fqn)))
            full = torch.randn(tuple(param.shape), generator=gen) * 0.3
            copy_global_into(param, full)


class TwoTowerModule(L.LightningModule):
    global_token_loss = True

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = TwoTowers()
            if not next(self.model.parameters()).is_meta:
                self.model.init_weights(0)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(batch["features"])
        return self.model.loss_fn(out, batch["labels"], batch.get("num_items_in_batch"))

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=LR)


class FeatureDataset(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.features = torch.randn(SAMPLES, SEQ, FEATURES, generator=g)
        self.labels = torch.randint(0, CLASSES, (SAMPLES, SEQ), generator=g)
        for i, k in enumerate(torch.randint(0, SEQ, (SAMPLES,), generator=g).tolist()):
            self.labels[i, :k] = -100  # ragged: a different share of ignored labels per sample

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"features": self.features[i], "labels": self.labels[i]}


def _reference() -> dict[str, Tensor]:
    module = TwoTowerModule()
    module.configure_model()
    opt = module.configure_optimizers()
    data = FeatureDataset()
    for step in range(STEPS):
        idx = global_batch_indices(SAMPLES, GLOBAL_BATCH, step)
        loss = module.model.loss_fn(module.model(data.features[idx]), data.labels[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}


def _trainer_run(strategy_kwargs: dict[str, Any]) -> dict[str, Tensor]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_flagscale import FlagScaleStrategy

    world = dist.get_world_size()
    strategy = FlagScaleStrategy(**strategy_kwargs)
    module = TwoTowerModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    dp = strategy.parallel.data_parallel_size or world // strategy.parallel.model_parallel_size
    trainer.fit(module, DataLoader(FeatureDataset(), batch_size=GLOBAL_BATCH // dp))
    from lightning_flagscale.parallel.data_parallel.zero3_flat import summon_full_params

    with summon_full_params(module.model):  # flat ZeRO-3 (the default engine) holds shards: gather them
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.model.named_parameters()
        }


def test_two_towers_implement_the_protocol():
    model = TwoTowers()
    assert isinstance(model, ParallelizableModel)
    assert find_protocol_model(TwoTowerModule()) is None  # built later, in configure_model
    module = TwoTowerModule()
    module.configure_model()
    assert find_protocol_model(module) is module.model


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tensor_parallel_size=2),
        dict(pipeline_parallel_size=2, micro_batch_size=1, pipeline_schedule="1f1b"),
        dict(zero_stage=3),
    ],
    ids=["tp2", "pp2-1f1b", "zero3"],
)
def test_two_towers_match_single_process(launcher, kwargs):
    reference = _reference()
    results = launcher(2, _trainer_run, kwargs)
    held = set()
    for rank, params in enumerate(results):
        for name, value in params.items():
            assert_rel_close(value, reference[name], 1e-5, f"{kwargs} rank {rank} {name}")
        held |= set(params)
    assert held == set(reference)


def test_pipeline_split_of_two_towers_keeps_the_bridge_with_its_block():
    from lightning_flagscale.parallel.pipeline_parallel.runner import plan_stages

    plan = plan_stages(TwoTowers().pipeline_units(), 2)
    assert plan.units == (("inp", "tower_a.0", "tower_a.1", "bridge"), ("tower_b.0", "tower_b.1", "head"))
