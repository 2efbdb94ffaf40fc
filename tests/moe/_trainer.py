"""Trainer-level MoE parity helpers: plain-SGD copies of the ``tests/strategies/_lm.py`` oracle and run.

SGD (no momentum, no weight decay) because Adam hides a gradient's scale; the comparison includes the router biases
(buffers) and the weight *updates* (not only the weights, whose initial values dominate), so a wrong aux-loss scale
cannot hide behind them. With ``clip`` the runs clip the global gradient norm and record each step's norm before
clipping, which the comparison includes (clipping would otherwise hide a gradient's scale from the updates).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models import CausalLMModule
from lightning_flagscale.moe import moe_layers, set_moe_aux_loss_scale, update_moe_state
from tests._oracle import global_batch_indices
from tests.strategies._lm import GLOBAL_BATCH, NUM_SAMPLES, TokenDataset, assert_rel_close

SGD_LR = 0.5
_FP32_FLOOR = 2e-7


class SGDModule(CausalLMModule):
    """``CausalLMModule`` trained with plain SGD (its bias balancing after each step is inherited)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self._require_model().parameters(), lr=SGD_LR)


def shrink(preset: str, **overrides: Any) -> TransformerConfig:
    """A preset at test size, keeping its routing and its default MoE coefficients."""
    base = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                num_key_value_heads=2, shared_expert_intermediate_size=None)  # fmt: skip
    if preset == "qwen2-moe-tiny":
        base["shared_expert_intermediate_size"] = 32
    return TransformerConfig.from_preset(preset, **{**base, **overrides})


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.gate.e_score_correction_bias": layer.gate.e_score_correction_bias.detach().clone()
            for name, layer in moe_layers(module) if layer.gate.e_score_correction_bias is not None}  # fmt: skip


def sgd_reference(
    config: TransformerConfig, steps: int, clip: float | None = None, micro_batches: int = 1
) -> dict[str, Any]:
    """Single-process fp32 run on the whole global batch: losses, initial and final weights, router biases (and each
    step's gradient norm before clipping at ``clip``). With ``micro_batches`` the batch runs as that many consecutive
    slices whose gradients add up (the token mean of the whole batch; MoE aux losses averaged over the slices), as a
    pipeline runs its micro-batches: the oracle of a per-micro-batch statistic."""
    torch.manual_seed(0)
    module = SGDModule(config, warmup_steps=0, min_lr_ratio=1.0)
    module.configure_model()
    init = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    opt = module.configure_optimizers()
    data = TokenDataset(config.vocab_size, NUM_SAMPLES, ragged=True)
    set_moe_aux_loss_scale(module.model, 1.0 / micro_batches)
    losses, norms, mtp_losses = [], [], []
    switches = dict(config.mtp_loss_weight_schedule or ())  # the MTP weight from each switch step on
    for step in range(steps):
        module.model.mtp_loss_weight = switches.get(step, module.model.mtp_loss_weight)
        indices = global_batch_indices(len(data), GLOBAL_BATCH, step)
        items = {"num_items_in_batch": (data.batch(indices)["labels"] != -100).sum()} if micro_batches > 1 else {}
        loss = torch.zeros(())
        for part in indices.tensor_split(micro_batches):
            part_loss = module._loss({**data.batch(part), **items})
            part_loss.backward()
            loss = loss + part_loss.detach()
        losses.append(loss.item())
        if (mtp := module._pop_mtp_loss()) is not None:  # what one process's training_step logs as mtp_loss
            mtp_losses.append(mtp.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), clip).item())
        opt.step()
        update_moe_state(module)  # what CausalLMModule.optimizer_step does under a Trainer
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    buffers = _buffers(module.model)
    return {
        "losses": losses, "init": init, "params": params, "buffers": buffers, "norms": norms, "mtp_losses": mtp_losses,
    }  # fmt: skip


def sgd_trainer_run(
    strategy_kwargs: dict[str, Any],
    config: TransformerConfig,
    steps: int,
    batch_size: int | None = None,
    clip: float | None = None,
    logger: bool = False,
) -> dict[str, Any]:
    """``Trainer.fit`` with FlagScaleStrategy on every worker (ragged labels, ``gradient_clip_val=clip``); full
    weights and biases per rank, and each step's gradient norm before clipping. With ``logger`` a logger records
    the metrics Lightning writes every step (``logged``: what a real logger gets, on rank 0 only)."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.utilities import rank_zero_only
    from torch.distributed.tensor import DTensor

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy

    world = dist.get_world_size()
    strategy = FlagScaleStrategy(**strategy_kwargs)
    losses: list[float] = []
    replicated: list[tuple[int, ...]] = []
    replica_bytes: list[int] = []
    norms: list[float] = []
    mtp_losses: list[float] = []  # the logged mtp_loss of each step (ranks that hold the MTP modules)
    dispatched: list[tuple[float, int]] = []  # per step and MoE layer: rows its EP group's experts got, tokens x k here

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone() if isinstance(outputs, dict) else outputs.detach().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
            if "mtp_loss" in trainer.callback_metrics:
                mtp_losses.append(trainer.callback_metrics["mtp_loss"].item())
            if clip is not None:
                norms.append(float(trainer.strategy.precision_plugin.last_grad_norm))
            for _, layer in moe_layers(pl_module):
                replicated.append(layer.replicated_experts)
                replica_bytes.append(getattr(layer.dispatcher, "replica_bytes", 0))
                dispatched.append((float(layer.tokens_per_expert.sum()), batch["input_ids"].numel() * layer.top_k))

    logged: list[dict[str, float]] = []

    class MemoryLogger(Logger):
        name, version = "memory", 0

        @rank_zero_only
        def log_metrics(self, metrics, step=None):
            logged.append(dict(metrics))

        @rank_zero_only
        def log_hyperparams(self, params, *args, **kwargs):
            pass

    torch.manual_seed(0)
    module = SGDModule(config, warmup_steps=0, min_lr_ratio=1.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, plugins=[FlagScalePrecision("32-true")],
        max_steps=steps, logger=MemoryLogger() if logger else False, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Record()], gradient_clip_val=clip,
    )  # fmt: skip
    dp = strategy.parallel.data_parallel_size or world // strategy.parallel.model_parallel_size
    data = TokenDataset(config.vocab_size, NUM_SAMPLES, ragged=True)
    trainer.fit(module, DataLoader(data, batch_size=batch_size or GLOBAL_BATCH // dp))
    params, local_shapes = {}, {}
    for name, p in module.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        params[name] = full.detach().float().clone()
        local_shapes[name] = tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
    return {
        "losses": losses,
        "params": params,
        "buffers": _buffers(module.model),
        "replicated": replicated,
        "replica_bytes": replica_bytes,
        "norms": norms,
        "mtp_losses": mtp_losses,
        "logged": logged,
        "local_shapes": local_shapes,  # what this rank holds of each parameter (its shard)
        "dispatched": dispatched,
    }


def assert_sgd_parity(
    results: list[dict[str, Any]], ref: dict[str, Any], what: str, rel: float = 1e-5, *, pipeline: bool = False
) -> None:
    """Every rank: per-step losses, weights, weight updates and router biases match the oracle (rel <= ``rel``).

    With ``pipeline`` each rank holds its stages' parameters only; together the ranks must hold all of them."""
    held: set[str] = set()
    for rank, res in enumerate(results):
        held |= set(res["params"])
        assert len(res["losses"]) == len(ref["losses"]), f"{what} rank {rank}: {len(res['losses'])} steps"
        # the gradient's scale, which clipping hides from the updates: both runs clipped, or neither
        assert len(res["norms"]) == len(ref["norms"]), f"{what} rank {rank}: {len(res['norms'])} gradient norms"
        if ref["norms"]:
            got, want = torch.tensor(res["norms"]), torch.tensor(ref["norms"])
            assert_rel_close(got, want, rel, f"{what} rank {rank} gradient norms")
        for step, (got, want) in enumerate(zip(res["losses"], ref["losses"])):
            assert abs(got - want) <= rel * abs(want), f"{what} rank {rank} step {step}: loss {got} != {want}"
        if not pipeline:
            assert set(res["params"]) == set(ref["params"]), f"{what} rank {rank}: parameter names"
        for name, value in res["params"].items():
            want = ref["params"][name]
            assert_rel_close(value, want, rel, f"{what} rank {rank} {name}")
            # Stricter on the update: rel on ||update|| plus the fp32 resolution of the weight itself (~eps * ||w||),
            # below which summation-order rounding of small updates (e.g. norm gains) is all one can see.
            update = want - ref["init"][name]
            err = (value - want).double().norm()
            bound = rel * update.double().norm() + _FP32_FLOOR * want.double().norm()
            assert err <= bound, f"{what} rank {rank} update of {name}: error {err:.3e} > {bound:.3e}"
        assert pipeline or set(res["buffers"]) == set(ref["buffers"]), f"{what} rank {rank}: router biases"
        for name, value in res["buffers"].items():
            # Sign steps of +-rate: equal up to the float rounding of the additions.
            assert torch.allclose(value, ref["buffers"][name], rtol=0, atol=1e-9), f"{what} rank {rank} {name}"
    assert held == set(ref["params"]), f"{what}: parameters held across ranks differ from the model's"
