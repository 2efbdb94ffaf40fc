"""``CausalLMModule`` under Lightning's own strategies (issue 37 item 2) trains like one process: ``DDPStrategy``, and
``ModelParallelStrategy``, whose mesh the module parallelises itself over in ``configure_model`` (FSDP2 over its
data-parallel dimension, Megatron TP with the model's plan over its tensor-parallel one). Lightning refuses
``FSDPStrategy`` on CPU, so that one is left to bench/gpu.py. Labels are not ragged here: those strategies average each rank's own token mean, which equals the global
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
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    world = dist.get_world_size()
    strategy = {
        "ddp": DDPStrategy,
        "model_parallel-dp2": lambda: ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        "model_parallel-tp2": lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world),
    }[strategy_name]()
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
    dp = 1 if strategy_name.endswith("tp2") else world  # every TP rank reads the whole batch
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // dp))
    if strategy_name.startswith("model_parallel"):  # the module sharded itself over Lightning's mesh
        assert all(isinstance(p, DTensor) for p in module.model.parameters()), "configure_model did not parallelise"
    full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in module.model.named_parameters()}
    return losses, {name: p.detach().clone() for name, p in full.items()}


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config(), STEPS, ragged=False)


@pytest.mark.parametrize("strategy_name", ["ddp", "model_parallel-dp2", "model_parallel-tp2"])
def test_causal_lm_module_trains_under_lightnings_strategies(launcher, reference, strategy_name):
    results = launcher(2, _lightning_run, strategy_name)
    assert_matches_reference(results, reference, strategy_name, every_rank_holds_all=True)
