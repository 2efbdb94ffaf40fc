"""DDP / ZeRO-1/2/3 on models WITHOUT the model protocol (a user's own LightningModule) match one process.

Plain SGD (it keeps the gradient's scale) with a clip below every step's gradient norm (the global norm is computed on
shards, and clipping is active at every step); each step's pre-clip global norm is compared with the oracle's, so a
gradient off by a constant factor fails even though clipping removes that factor from the update. Two modules:

- ``MeanNet``: the plain per-batch mean (MSE) on tuple batches of equal-sized samples: each rank's mean, averaged over
  the DP ranks, is the global batch's mean, as under Lightning's ``DDPStrategy``;
- ``TokenMeanNet``: a sequence classifier on dict batches with ragged labels (a different share of ``-100`` per
  sample) that opts into the token-mean protocol (``global_token_loss = True``: it divides its loss sum by
  ``batch["num_items_in_batch"]``), so that ranks holding different numbers of labels still give the global mean.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_flagscale import FlagScaleStrategy
from tests._oracle import global_batch_indices
from tests.strategies._lm import assert_rel_close

STEPS, GLOBAL_BATCH, LR, CLIP = 3, 8, 0.5, 0.05
SEQ, CLASSES = 6, 4


def _net(out: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, out))


class _Net(L.LightningModule):
    def __init__(self, out: int) -> None:
        super().__init__()
        self.net = _net(out)
        self.losses: list[float] = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class MeanNet(_Net):
    def __init__(self) -> None:
        super().__init__(4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss


def _token_loss_sum(net: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


class TokenMeanNet(_Net):
    global_token_loss = True

    def __init__(self) -> None:
        super().__init__(CLASSES)

    def training_step(self, batch, batch_idx):
        loss = _token_loss_sum(self.net, batch["x"], batch["labels"]) / batch["num_items_in_batch"]
        self.losses.append(loss.item())  # this rank's share of the step's token mean
        return loss


def _mean_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(STEPS * GLOBAL_BATCH, 8, generator=g), torch.randn(STEPS * GLOBAL_BATCH, 4, generator=g)
    )


class RaggedSequences(Dataset):
    """Sequences of ``SEQ`` vectors with a class each; sample ``i`` ignores a random prefix of 0-5 labels."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        n = STEPS * GLOBAL_BATCH
        self.x = torch.randn(n, SEQ, 8, generator=g)
        self.labels = torch.randint(0, CLASSES, (n, SEQ), generator=g)
        for i, k in enumerate(torch.randint(0, SEQ, (n,), generator=g).tolist()):
            self.labels[i, :k] = -100

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.labels[i]}


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Single-process SGD on each global batch: (losses, weights, pre-clip gradient norms)."""
    net = _net(4 if kind == "mean" else CLASSES)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        if kind == "mean":
            x, y = _mean_data().tensors
            sl = global_batch_indices(len(x), GLOBAL_BATCH, step)
            loss = F.mse_loss(net(x[sl]), y[sl])
        else:
            data = RaggedSequences()
            sl = global_batch_indices(len(data), GLOBAL_BATCH, step)
            labels = data.labels[sl]
            loss = _token_loss_sum(net, data.x[sl], labels) / (labels != -100).sum()
        losses.append(loss.item())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in net.named_parameters()}, norms


def _fit(kind: str, zero_stage: int):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.parallel.data_parallel.zero3_flat import summon_full_params

    world = dist.get_world_size()
    model = MeanNet() if kind == "mean" else TokenMeanNet()
    norms: list[float] = []

    class Norms(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            norms.append(float(trainer.strategy.precision_plugin.last_grad_norm))

    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=FlagScaleStrategy(zero_stage=zero_stage), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=CLIP, callbacks=[Norms()],
    )  # fmt: skip
    data = _mean_data() if kind == "mean" else RaggedSequences()
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // world))
    losses = torch.tensor(model.losses)
    dist.all_reduce(losses)
    if kind == "mean":
        losses /= world  # rank means of equal-sized shares; the token-mean module's shares already sum to the mean
    params = {}
    with summon_full_params(model.net):
        for name, p in model.net.named_parameters():
            params[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return losses.tolist(), params, norms


def _run(zero_stage: int):
    return {kind: _fit(kind, zero_stage) for kind in ("mean", "token_mean")}


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_data_parallel_matches_single_process(launcher, zero_stage):
    results = launcher(2, _run, zero_stage)
    for kind in ("mean", "token_mean"):
        ref_losses, ref_params, ref_norms = _reference(kind)
        assert min(ref_norms) > CLIP, ref_norms  # clipping active at every step: the premise
        for rank, result in enumerate(results):
            losses, params, norms = result[kind]
            what = f"{kind} zero_stage={zero_stage} rank {rank}"
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=what)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=what)
            assert set(params) == set(ref_params), what
            for name, ref in ref_params.items():
                assert_rel_close(params[name], ref, 1e-5, f"{what} {name}")


def test_ragged_ranks_hold_different_label_counts():
    """The premise of ``TokenMeanNet``'s case: at every step the two DP ranks' halves of the global batch hold
    different numbers of labels, so an average of rank means would not be the global mean."""
    data = RaggedSequences()
    for step in range(STEPS):
        labels = data.labels[global_batch_indices(len(data), GLOBAL_BATCH, step)]
        counts = [int((labels[rank::2] != -100).sum()) for rank in (0, 1)]  # rank r: positions r, r + 2, ...
        assert counts[0] != counts[1], (step, counts)
