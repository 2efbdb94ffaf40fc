"""``CausalLMModule`` under Lightning's own ``DDPStrategy`` (issue 37 item 2): the module is a plain ``LightningModule``
and trains like one process. (Lightning refuses ``FSDPStrategy`` on CPU; under ``ModelParallelStrategy`` the module
does not yet shard itself over the mesh Lightning hands it, so those two are not claimed.) Labels are not ragged here: those strategies average each rank's own token mean, which equals the global
token mean only when every rank holds as many label tokens (the exact ragged mean is ``FlagScaleStrategy``'s job)."""

from __future__ import annotations

import pytest
import torch

from tests.strategies._lm import (
    GLOBAL_BATCH,
    TokenDataset,
    assert_matches_reference,
    make_module,
    reference_run,
    tiny_config,
)

STEPS = 3


def _lightning_run(strategy_name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    world = dist.get_world_size()
    strategy = {"ddp": DDPStrategy}[strategy_name]()
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone() if isinstance(outputs, dict) else outputs.detach().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)

    config = tiny_config()
    torch.manual_seed(0)
    module = make_module(config)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Record()],
    )  # fmt: skip
    data = TokenDataset(config.vocab_size, ragged=False)
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // world))
    return losses, {name: p.detach().clone() for name, p in module.model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(), STEPS, ragged=False)


@pytest.mark.parametrize("strategy_name", ["ddp"])
def test_causal_lm_module_trains_under_lightnings_strategies(launcher, reference, strategy_name):
    results = launcher(2, _lightning_run, strategy_name)
    assert_matches_reference(results, reference, strategy_name, every_rank_holds_all=True)
