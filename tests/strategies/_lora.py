"""Shared pieces of the LoRA tests (issue 40): a LoRA module, its single-process oracle and a Trainer run in workers."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.distributed.dtensor import local_tensor
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.models.lora import EXPERT_WEIGHTS, expert_adapter_modules, is_adapter_name
from lightning_flagscale.moe import update_moe_state
from tests._oracle import global_batch_indices
from tests.strategies._lm import GLOBAL_BATCH, LR, NUM_SAMPLES, TokenDataset

# Every linear of the blocks (column- and row-parallel), B random so that A gets a gradient from the first step.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(**overrides: Any) -> LoRAConfig:
    return LoRAConfig(**{"rank": 4, "alpha": 8.0, "target_modules": TARGETS, "init_lora_weights": False, **overrides})


def lora_module(config: TransformerConfig, lora: LoRAConfig, **kwargs: Any) -> CausalLMModule:
    kw = {
        "learning_rate": LR,
        "warmup_steps": 0,
        "min_lr_ratio": 1.0,
        "weight_decay": 0.0,
        "optimizer": "sgd",
        **kwargs,
    }
    return CausalLMModule(config, lora=lora, **kw)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as a full fp32 tensor (DTensors gathered, flat ZeRO-3 summoned)."""
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.parallel.data_parallel.zero3_flat import summon_full_params

    params = {}
    with summon_full_params(model):
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            params[name] = full.detach().float().clone()
    return params


def lora_reference_run(
    config: TransformerConfig, lora: LoRAConfig, steps: int, num_samples: int = NUM_SAMPLES, **module_kwargs: Any
) -> tuple[list[float], dict, dict]:
    """Single-process fp32 LoRA training: (losses, parameters after ``steps``, parameters before)."""
    torch.manual_seed(0)
    module = lora_module(config, lora, **module_kwargs)
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    opt = module.configure_optimizers()["optimizer"]
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in module.model.named_parameters() if is_adapter_name(n)}, "optimizer params"
    data = TokenDataset(config.vocab_size, num_samples)
    losses = []
    for step in range(steps):
        loss = module._loss(data.batch(global_batch_indices(len(data), GLOBAL_BATCH, step)))
        losses.append(loss.item())
        loss.backward()
        opt.step()
        if config.is_moe:
            update_moe_state(module)  # what CausalLMModule.optimizer_step does under a Trainer
        opt.zero_grad()
    after = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    return losses, after, before


def lora_trainer_run(
    strategy_kwargs: dict[str, Any], config: TransformerConfig, lora: LoRAConfig, steps: int,
    precision: str = "32-true", save_path: str | None = None, ckpt_path: str | None = None,
    export_dir: str | None = None, max_epochs: int | None = None, num_samples: int = NUM_SAMPLES,
    module_kwargs: dict[str, Any] | None = None, batch_size: int | None = None, callbacks: list | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:  # fmt: skip
    """``Trainer.fit`` on every worker: (global mean loss per step, full parameters, what the optimizer state holds)."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy

    world = dist.get_world_size()
    strategy = FlagScaleStrategy(**strategy_kwargs)
    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone() if isinstance(outputs, dict) else outputs.detach().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)

    torch.manual_seed(0)
    module = lora_module(config, lora, **(module_kwargs or {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, plugins=[FlagScalePrecision(precision)],
        max_steps=steps if max_epochs is None else -1, max_epochs=max_epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[Record(), *(callbacks or [])],
    )  # fmt: skip
    dp = strategy.parallel.data_parallel_size or world // strategy.parallel.model_parallel_size
    loader = DataLoader(TokenDataset(config.vocab_size, num_samples), batch_size=batch_size or GLOBAL_BATCH // dp)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if save_path is not None:
        trainer.save_checkpoint(save_path)
        strategy.wait_for_checkpoint()
    if export_dir is not None:  # the adapters in peft's format and the merged HF model, from this layout
        from lightning_flagscale.convert import export_hf, save_peft_adapter

        save_peft_adapter(module, f"{export_dir}/adapter")
        export_hf(module, f"{export_dir}/merged")
    params = full_params(module.model)
    grads = sorted(n for n, p in module.model.named_parameters() if p.grad is not None or p.requires_grad)
    state_numel = sum(
        t.numel() for opt in trainer.optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    opt_numel = sum(p.numel() for opt in trainer.optimizers for g in opt.param_groups for p in g["params"])
    experts = [  # how many experts' adapters this rank holds, per adapter tensor (EP shards them on dim 0)
        local_tensor(getattr(getattr(m, key), w)).shape[0]
        for m in expert_adapter_modules(module.model).values()
        for key in ("lora_A", "lora_B", "lora_magnitude_vector")
        if getattr(m, key) is not None
        for w in EXPERT_WEIGHTS
    ]
    from torch.distributed.tensor import DTensor

    magnitudes = {  # DoRA: how each magnitude vector is placed
        n: str(p.placements) if isinstance(p, DTensor) else "plain"
        for n, p in module.model.named_parameters() if n.endswith("lora_magnitude_vector")
    }  # fmt: skip
    return losses, params, {
        "trainable": grads, "optimizer_numel": opt_numel, "state_numel": state_numel, "expert_adapter_experts": experts,
        "magnitudes": magnitudes,
    }  # fmt: skip


VLM_SAMPLES = 12
"""The VLM LoRA runs read the first 12 ragged samples: 3 steps of the global batch 4 make one epoch, so the
checkpoint at the end of it resumes on an epoch boundary (the sampler's next permutation, no skipped batches)."""


def _vlm_data():
    from torch.utils.data import Subset

    from tests.multimodal.test_parallel import RaggedShapes

    return Subset(RaggedShapes(), range(VLM_SAMPLES))


def vlm_lora_reference(lora: LoRAConfig, steps: int) -> tuple[dict, dict]:
    """Single-process fp32 LoRA on the tiny Qwen2.5-VL (SGD, ragged text-only and two-image rows): (parameters
    after ``steps``, before)."""
    from tests.multimodal.test_parallel import COLLATE, GLOBAL_BATCH, _module

    module = _module(lora=lora)
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    opt = module.configure_optimizers()["optimizer"]
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in module.model.named_parameters() if is_adapter_name(n)}, "optimizer params"
    data = _vlm_data()
    for step in range(steps):
        batch = COLLATE([data[int(i)] for i in global_batch_indices(len(data), GLOBAL_BATCH, step)])
        module._loss(batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}, before


def _vlm_fit(strategy_kwargs: dict[str, Any], lora: LoRAConfig, dp: int, epochs: int, ckpt_path: str | None = None,
             callbacks: list | None = None, **module_kwargs: Any) -> Any:  # fmt: skip
    import lightning as L

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy
    from tests.multimodal.test_parallel import COLLATE, GLOBAL_BATCH, _module

    module = _module(lora=lora, **module_kwargs)
    strategy = FlagScaleStrategy(**strategy_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=torch.distributed.get_world_size(), strategy=strategy,
        plugins=[FlagScalePrecision("32-true")], max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks or [],
    )  # fmt: skip
    trainer.fit(module, DataLoader(_vlm_data(), batch_size=GLOBAL_BATCH // dp, collate_fn=COLLATE), ckpt_path=ckpt_path)
    strategy.wait_for_checkpoint()
    return module


def vlm_lora_run(strategy_kwargs: dict[str, Any], lora: LoRAConfig, dp: int, ckpt: str) -> dict[str, Any]:
    """One launch, three ``Trainer.fit`` of the tiny Qwen2.5-VL with LoRA on every worker (item 4 for the VLM):

    - two epochs (6 steps) uninterrupted, saving a checkpoint at the end of the first (step 3) to ``ckpt``;
    - resumed from ``ckpt`` for the second epoch;
    - resumed from ``ckpt`` on another base (``init_seed=1``), which must be refused before any shard is read.

    Returns the full parameters at step 3 (``"epoch1"``) and at the end of both runs (``"uninterrupted"``,
    ``"resumed"``), and the refusal's message (``"refused"``)."""
    import lightning as L

    out: dict[str, Any] = {}

    class SaveAtFirstEpochEnd(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                out["epoch1"] = full_params(pl_module.model)
                trainer.save_checkpoint(ckpt)

    out["uninterrupted"] = full_params(_vlm_fit(strategy_kwargs, lora, dp, 2, callbacks=[SaveAtFirstEpochEnd()]).model)
    out["resumed"] = full_params(_vlm_fit(strategy_kwargs, lora, dp, 2, ckpt_path=ckpt).model)
    try:
        _vlm_fit(strategy_kwargs, lora, dp, 2, ckpt_path=ckpt, init_seed=1)
    except ValueError as err:
        out["refused"] = str(err)
    return out


def lora_trainer_runs(runs: list[tuple[tuple, dict[str, Any]]], snapshot_dir: str | None = None) -> list[Any]:
    """Several :func:`lora_trainer_run` calls ``(args, kwargs)`` in one launch, one after the other (a layout's plain
    LoRA and DoRA runs share the launch's round trip); with ``snapshot_dir``, then :func:`lora_snapshot_resume` of the
    first run's layout and LoRA config."""
    results: list[Any] = [lora_trainer_run(*args, **kwargs) for args, kwargs in runs]
    if snapshot_dir is not None:
        layout, config, lora = runs[0][0][:3]
        results.append(lora_snapshot_resume(layout, config, lora, snapshot_dir))
    return results


SNAPSHOT_STEPS, SNAPSHOT_AT, SNAPSHOT_SAMPLES = 4, 2, 8  # 2 steps an epoch: the snapshot lies on an epoch boundary


def lora_snapshot_resume(layout: dict[str, Any], config: TransformerConfig, lora: LoRAConfig, folder: str) -> dict:
    """In-memory snapshots of a LoRA run (``MemoryCheckpoint``): 4 steps uninterrupted, snapshots at steps 2 and 4
    left behind as a crash would; the step-4 one deleted, a fresh Trainer resumes from the step-2 one
    (``ckpt_path="last"``). Returns both runs and the snapshot's tensor keys (rank 0)."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from lightning_flagscale.callbacks import MemoryCheckpoint
    from lightning_flagscale.checkpoint.in_memory import snapshot_path
    from lightning_flagscale.checkpoint.sharded import checkpoint_keys

    class KeepSnapshots(MemoryCheckpoint):
        def on_fit_end(self, trainer, pl_module):  # a successful fit removes its snapshots; a crash leaves them
            self.wait()

    root, kw = Path(folder), dict(num_samples=SNAPSHOT_SAMPLES, module_kwargs={"optimizer": "adamw"})
    full = lora_trainer_run(layout, config, lora, SNAPSHOT_STEPS, callbacks=[KeepSnapshots(SNAPSHOT_AT, root)], **kw)
    keys = None
    if dist.get_rank() == 0:
        keys = sorted(checkpoint_keys(str(snapshot_path(root, SNAPSHOT_AT))))
        shutil.rmtree(snapshot_path(root, SNAPSHOT_STEPS))
    dist.barrier()
    memory = MemoryCheckpoint(SNAPSHOT_AT, root)
    resumed = lora_trainer_run(layout, config, lora, SNAPSHOT_STEPS, ckpt_path="last", callbacks=[memory], **kw)
    return {"full": full, "resumed": resumed, "keys": keys}
