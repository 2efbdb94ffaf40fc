"""``CausalLMModule`` and ``VLMModule`` under Lightning's own strategies (issue 37 item 2) train like one process:
``DDPStrategy``, and ``ModelParallelStrategy``, whose mesh the module parallelises itself over in ``configure_model``
(FSDP2 over its data-parallel dimension, Megatron TP with the model's plan over its tensor-parallel one).

Those strategies average each data-parallel rank's own token mean (the exact ragged mean over the global batch is
``FlagScaleStrategy``'s job), so the oracle is that objective computed in one process: the mean over the DP ranks'
shares of the global batch of each share's token mean. ``CausalLMModule`` runs on labels of the same count per rank,
``VLMModule`` on ragged labels, text-only rows and rows with two images (``tests/multimodal/test_parallel.py``'s data).

Lightning refuses ``FSDPStrategy`` without a GPU (``accelerator_connector``: "requires a GPU accelerator"); it and
``accelerator="gpu"`` runs of the default strategy, ``DDPStrategy`` and ``ModelParallelStrategy`` are the
``@pytest.mark.gpu`` tests at the end, one process on one GPU against the same oracle."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_flagscale.multimodal import VLMModule
from tests._oracle import global_batch_indices
from tests.multimodal.test_parallel import CFG as VLM_CONFIG
from tests.multimodal.test_parallel import COLLATE, RaggedShapes
from tests.strategies._lm import (
    GLOBAL_BATCH,
    TokenDataset,
    assert_matches_reference,
    make_module,
    reference_run,
    tiny_config,
)

STEPS = 3
VLM_LR = 0.2


def _vlm_module() -> VLMModule:
    torch.manual_seed(0)
    return VLMModule(VLM_CONFIG, optimizer="sgd", learning_rate=VLM_LR, warmup_steps=0, min_lr_ratio=1.0)


def vlm_reference_run(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, SGD: each step's loss is the mean over ``dp`` ranks' shares of the global batch (rank r holds
    positions r, r + dp, ... of it under Lightning's ``DistributedSampler``) of each share's token mean."""
    module = _vlm_module()
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    data = RaggedShapes()
    losses = []
    for step in range(STEPS):
        indices = global_batch_indices(len(data), GLOBAL_BATCH, step)
        shares = [COLLATE([data[int(i)] for i in indices[r::dp]]) for r in range(dp)]
        loss = sum(module._loss(share) for share in shares) / dp
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in module.model.named_parameters()}


def _strategy(name: str, world: int):
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    return {
        "auto": lambda: "auto",
        "ddp": DDPStrategy,
        "fsdp": FSDPStrategy,
        "model_parallel-dp2": lambda: ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        "model_parallel-tp2": lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world),
    }[name]()


def _lightning_run(
    module_name: str, strategy_name: str, accelerator: str = "cpu"
) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size() if dist.is_initialized() else 1
    strategy = _strategy(strategy_name, world)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone() if isinstance(outputs, dict) else outputs.detach().clone()
            if dist.is_initialized():
                dist.all_reduce(loss)
            losses.append(loss.item() / world)

    from torch.utils.data import DistributedSampler

    dp = 1 if strategy_name.endswith("tp2") else world  # every TP rank reads the whole batch
    if module_name == "vlm":
        module, data, collate = _vlm_module(), RaggedShapes(), COLLATE
    else:
        config = tiny_config()
        torch.manual_seed(0)
        module, data, collate = make_module(config), TokenDataset(config.vocab_size, ragged=False), None
    # A single-device strategy injects no DistributedSampler: the order of the one it would inject, as the oracle's.
    sampler = (
        DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if strategy_name == "auto" else None
    )
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp, collate_fn=collate, sampler=sampler)
    trainer = L.Trainer(
        accelerator=accelerator, devices=world, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(module, loader)
    if strategy_name.startswith("model_parallel") and world > 1:  # the module sharded itself over Lightning's mesh
        assert all(isinstance(p, DTensor) for p in module.model.parameters()), "configure_model did not parallelise"
    full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in module.model.named_parameters()}
    return losses, {name: p.detach().float().cpu().clone() for name, p in full.items()}


@pytest.fixture(scope="module")
def causal_lm_reference():
    return reference_run(tiny_config(), STEPS, ragged=False)


@pytest.mark.parametrize("strategy_name", ["ddp", "model_parallel-dp2", "model_parallel-tp2"])
def test_causal_lm_module_trains_under_lightnings_strategies(launcher, causal_lm_reference, strategy_name):
    results = launcher(2, _lightning_run, "causal_lm", strategy_name)
    assert_matches_reference(results, causal_lm_reference, strategy_name, every_rank_holds_all=True)


@pytest.mark.parametrize("strategy_name", ["ddp", "model_parallel-dp2", "model_parallel-tp2"])
def test_vlm_module_trains_under_lightnings_strategies(launcher, strategy_name):
    dp = 1 if strategy_name.endswith("tp2") else 2
    results = launcher(2, _lightning_run, "vlm", strategy_name)
    assert_matches_reference(results, vlm_reference_run(dp), f"vlm {strategy_name}", every_rank_holds_all=True)


GPU_STRATEGIES = ["auto", "ddp", "fsdp", "model_parallel-dp2"]  # one GPU: a mesh of 1 x 1, FSDP over one rank


@pytest.mark.gpu
@pytest.mark.parametrize("strategy_name", GPU_STRATEGIES)
@pytest.mark.parametrize("module_name", ["causal_lm", "vlm"])
def test_modules_train_under_lightnings_strategies_on_a_gpu(module_name, strategy_name):
    """One process on one GPU, fp32, against the CPU oracle. Lightning's default strategy is its single-device one
    here, which crashed in the GPU report (weight init drawn on the default CUDA device; fixed and guarded on the CPU
    by ``tests/models/test_decoder.py::test_init_does_not_depend_on_the_default_device``)."""
    reference = (
        reference_run(tiny_config(), STEPS, ragged=False) if module_name == "causal_lm" else vlm_reference_run(1)
    )
    result = _lightning_run(module_name, strategy_name, accelerator="gpu")
    assert_matches_reference([result], reference, f"{module_name} {strategy_name} (gpu)", every_rank_holds_all=True)
