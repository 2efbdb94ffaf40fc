"""Teardown gives everything back (issue 37 item 1): after ``Trainer.fit`` returns and the caller drops the trainer
and the module, nothing of the run stays alive, under every layout; and fits that follow in the same process train as
they would in a fresh one.

Before the fix the gradient hooks ZeRO-0/1/2 register on every parameter held their reducer, which held the
parameters: a cycle through C++ tensor hooks that ``gc`` cannot see, so module, parameters and optimizer survived
``del trainer, module`` and ``gc.collect()`` (on a GPU, every fit's weights and states stayed allocated)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader

from tests.strategies._lm import GLOBAL_BATCH, TokenDataset, make_module, tiny_config


def _fit_and_drop(strategy_kwargs: dict[str, Any], config_overrides: dict[str, Any], steps: int) -> list[str]:
    """Fit, drop every reference the caller holds, collect; returns what is still alive."""
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScaleStrategy

    world = dist.get_world_size()
    config = tiny_config(**config_overrides)
    torch.manual_seed(0)
    module = make_module(config)
    strategy = FlagScaleStrategy(**strategy_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    dp = strategy.parallel.data_parallel_size or world // strategy.parallel.model_parallel_size
    batch = GLOBAL_BATCH if strategy.parallel.hetero_enabled else GLOBAL_BATCH // dp  # hetero: the first mesh's DP is 1
    trainer.fit(module, DataLoader(TokenDataset(config.vocab_size), batch_size=batch))
    refs = {"module": weakref.ref(module), "strategy": weakref.ref(strategy)}
    refs.update({f"optimizer {i}": weakref.ref(o) for i, o in enumerate(trainer.optimizers)})
    refs.update({f"parameter {n}": weakref.ref(p) for n, p in module.named_parameters()})
    del trainer, module, strategy
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


LAYOUTS_2 = {
    "ddp": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3-flat": dict(zero_stage=3, zero3_impl="flat"),
    "zero3-fsdp2": dict(zero_stage=3, zero3_impl="fsdp2"),
    "tp2": dict(tensor_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", micro_batch_size=1),
    "cp2": dict(context_parallel_size=2),
    "hetero-dp": dict(hetero_dp_batch_sizes=[3, 1]),
    "ep2": (dict(expert_parallel_size=2), dict(num_experts=4, num_experts_per_tok=2)),
}


def _all_layouts(layouts: dict[str, tuple[dict[str, Any], dict[str, Any]]], steps: int) -> dict[str, list[str]]:
    # One after the other in the same processes: each fit also starts after the previous one's teardown.
    return {name: _fit_and_drop(kwargs, overrides, steps) for name, (kwargs, overrides) in layouts.items()}


def test_fit_leaves_nothing_alive_under_every_layout(launcher):
    layouts = {name: v if isinstance(v, tuple) else (v, {}) for name, v in LAYOUTS_2.items()}
    results = launcher(2, _all_layouts, layouts, 2)
    for rank, alive in enumerate(results):
        assert alive == {name: [] for name in layouts}, f"rank {rank}"


def test_fit_leaves_nothing_alive_with_hetero_meshes(launcher):
    meshes = [dict(tensor_parallel_size=2, data_parallel_size=1), dict(data_parallel_size=2)]
    layouts = {"hetero-meshes": (dict(hetero_meshes=meshes, hetero_layers=[1, 1], micro_batch_size=2), {})}
    results = launcher(4, _all_layouts, layouts, 2)
    for rank, alive in enumerate(results):
        assert alive == {"hetero-meshes": []}, f"rank {rank}"
