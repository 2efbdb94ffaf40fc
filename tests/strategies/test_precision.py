"""Precision: fp16 loss scaling agrees across ranks; bf16-mixed keeps fp32 master weights, which the module holds after
fit (fit -> fit continues from them); Lightning flags map."""

from __future__ import annotations

import pytest
import torch

from lightning_flagscale import FlagScalePrecision
from tests.strategies._lm import tiny_config, trainer_run


def _inject_inf_run(zero_stage: int):
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    snapshots: list[torch.Tensor] = []
    scales: list[float] = []

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[5] = float("inf")
        return grad

    class InjectInf(Callback):
        handle = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # Only rank 1, only at step 1: a single bad gradient element somewhere in that rank's replica. A tensor
            # hook, because gradients move into the reduction buckets while backward runs (issue 15).
            if trainer.global_step == 1 and dist.get_rank() == 1:
                self.handle = pl_module.model.layers["0"].mlp.down_proj.weight.register_hook(poison)

        def on_after_backward(self, trainer, pl_module):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append(pl_module.model.layers["1"].self_attn.q_proj.weight.detach().float().clone())
            scales.append(trainer.precision_plugin.scaler.scale)

    trainer_run(dict(zero_stage=zero_stage), tiny_config(), 3, precision="16-mixed", callbacks=[InjectInf()])
    return snapshots, scales


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(launcher, zero_stage):
    results = launcher(2, _inject_inf_run, zero_stage)
    for snapshots, scales in results:
        # step 0 changed the weights, step 1 was skipped (no change), step 2 changed them again
        assert torch.equal(snapshots[1], snapshots[0]), "the overflowing step must be skipped"
        assert not torch.equal(snapshots[2], snapshots[1]), "training must continue after the skip"
        assert scales == [2.0**16, 2.0**15, 2.0**15]
    torch.testing.assert_close(results[0][0][2], results[1][0][2], rtol=0, atol=0)  # ranks stay in sync


def _bf16_run():
    from lightning.pytorch.callbacks import Callback

    dtypes: dict[str, torch.dtype] = {}

    class Dtypes(Callback):
        def on_train_end(self, trainer, pl_module):
            dtypes["model"] = pl_module.model.layers["0"].mlp.up_proj.weight.dtype
            dtypes["optimizer"] = trainer.optimizers[0].param_groups[0]["params"][0].dtype

    losses, _ = trainer_run(dict(zero_stage=1), tiny_config(), 3, precision="bf16-mixed", callbacks=[Dtypes()])
    return losses, dtypes


def test_bf16_mixed_trains_close_to_fp32_with_fp32_masters(launcher):
    from tests.strategies._lm import reference_run

    ref_losses, _ = reference_run(tiny_config(), 3)
    for losses, dtypes in launcher(2, _bf16_run):
        assert dtypes == {"model": torch.bfloat16, "optimizer": torch.float32}
        assert all(abs(a - b) < 0.05 for a, b in zip(losses, ref_losses)), (losses, ref_losses)


def test_lightning_precision_flags_map_onto_flagscale_precision():
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from lightning_flagscale.precision import as_flagscale_precision

    assert as_flagscale_precision(Precision()).precision == "32-true"
    assert as_flagscale_precision(MixedPrecision("bf16-mixed", "cpu")).precision == "bf16-mixed"
    assert as_flagscale_precision(HalfPrecision("bf16-true")).precision == "bf16-true"
    assert FlagScalePrecision("bf16-mixed").master_weights and not FlagScalePrecision("bf16-true").master_weights


def test_fp8_backend_is_chosen_and_checked_before_start(monkeypatch):
    import lightning_flagscale.precision.flagscale as flagscale

    assert FlagScalePrecision("fp8").fp8_backend == "torchao"  # transformer-engine is not installed here
    assert FlagScalePrecision("bf16-mixed").fp8_backend is None
    with pytest.raises(ValueError, match=r"transformer-engine, which is not installed"):
        FlagScalePrecision("fp8", fp8_backend="transformer_engine")
    with pytest.raises(ValueError, match=r"fp8_backend='te'; use 'auto'"):
        FlagScalePrecision("fp8", fp8_backend="te")
    with pytest.raises(ValueError, match=r"does not support precision='64-true'"):
        FlagScalePrecision("64-true")
    monkeypatch.setattr(flagscale, "_has", lambda package: False)
    with pytest.raises(ValueError, match=r"torchao's float8 linears or transformer-engine, and neither is installed"):
        FlagScalePrecision("fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU without fp8 tensor cores
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100-SXM4-80GB has 8.0"):
        FlagScalePrecision("fp8", fp8_backend="torchao")


def test_fp8_through_torchao_swaps_every_linear_but_the_head_and_keeps_names():
    from torchao.float8.float8_linear import Float8Linear

    from lightning_flagscale.models import CausalLM
    from tests.strategies._lm import tiny_config

    model = CausalLM(tiny_config(intermediate_size=72))  # 72 is no multiple of 16: the MLP stays in bf16
    names = list(model.state_dict())
    FlagScalePrecision("fp8").convert_module(model)
    assert list(model.state_dict()) == names
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert fp8 == {n for n in linears if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))}, sorted(fp8)


def _registry_and_precision_flag():
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_flagscale import FlagScaleStrategy
    from tests.strategies._lm import TokenDataset, make_module

    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy="flagscale", precision="bf16-mixed",
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    module = make_module(tiny_config())
    trainer.fit(module, DataLoader(TokenDataset(), batch_size=2))
    return (
        type(trainer.strategy) is FlagScaleStrategy,
        trainer.precision_plugin.precision,
        module.model.norm.weight.dtype,
    )


def test_strategy_registry_name_and_lightning_precision_flag(launcher):
    for is_ours, precision, dtype in launcher(2, _registry_and_precision_flag):
        # bf16 weights during fit (test_bf16_mixed_trains_close_to_fp32_with_fp32_masters); after it the module is
        # back in fp32 and holds the masters (test_fit_again_continues_from_the_fp32_masters_under_every_layout)
        assert is_ours and precision == "bf16-mixed" and dtype == torch.float32


def _collectives_on_the_mesh():
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_flagscale import FlagScaleStrategy
    from tests.strategies._lm import TokenDataset, make_module

    strategy = FlagScaleStrategy(tensor_parallel_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.fit(make_module(tiny_config()), DataLoader(TokenDataset(), batch_size=2))
    rank = dist.get_rank()
    mean = strategy.reduce(torch.tensor(float(rank)), reduce_op="mean").item()
    total = strategy.reduce(torch.tensor(float(rank)), reduce_op="sum").item()
    strategy.barrier()
    return mean, total, strategy.broadcast({"from": rank}), strategy.distributed_sampler_kwargs


def test_reduce_broadcast_barrier_and_sampler_on_the_mesh(launcher):
    results = launcher(4, _collectives_on_the_mesh)
    for rank, (mean, total, obj, sampler) in enumerate(results):
        assert (mean, total, obj) == (1.5, 6.0, {"from": 0})
        assert sampler == {"num_replicas": 2, "rank": rank // 2}  # TP pairs (0,1), (2,3) share a data shard


# fit -> fit under Megatron's bf16 layout: DDP's whole-bucket masters, ZeRO-1/2 slices (TP's DTensor parameters with
# ZeRO-2, a pipeline stage's with ZeRO-1), flat ZeRO-3 (the default engine: fp32 shards, never cast), and an MoE model
# under EP x CP (expert masters reduced over their own group, router statistics buffers)
FIT_AGAIN_LAYOUTS: dict[str, dict] = {
    "ddp": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "tp2-zero2": dict(tensor_parallel_size=2, zero_stage=2),
    "pp2-zero1": dict(pipeline_parallel_size=2, micro_batch_size=1, zero_stage=1),
    "zero3-flat": dict(zero_stage=3, zero3_impl="flat"),
    "ep2-cp2": dict(expert_parallel_size=2, context_parallel_size=2),
}
FIT_STEPS = 3  # one epoch of 3 global batches; the Trainer fitting on starts its next epoch, as the longer fit does


def _full_params(module) -> dict[str, tuple[torch.dtype, torch.Tensor]]:
    """Each parameter's dtype and values: whole tensors, except flat ZeRO-3's fp32 row ranges (gathering them gives
    the bf16 compute copy)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.dtype, (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone())
        for name, p in module.named_parameters()
    }


def _bf16_trainer(kwargs: dict, steps: int, callbacks: list):
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScaleStrategy

    return L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=FlagScaleStrategy(**kwargs),
        plugins=[FlagScalePrecision("bf16-mixed")], max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip


def _fit_then_fit(layouts: dict[str, dict], folder: str) -> dict[str, dict]:
    from functools import partial

    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lightning_flagscale.config import ParallelConfig
    from tests.strategies._lm import GLOBAL_BATCH, TokenDataset, make_module

    class ComputeDtype(Callback):
        def __init__(self) -> None:
            self.seen: set[torch.dtype] = set()

        def on_validation_start(self, trainer, pl_module):
            self.seen |= {p.dtype for p in pl_module.parameters()}

    out: dict[str, dict] = {}
    for name, kwargs in layouts.items():
        moe = "expert_parallel_size" in kwargs
        config = tiny_config(num_experts=4, num_experts_per_tok=2) if moe else tiny_config()
        dp = dist.get_world_size() // ParallelConfig(**kwargs).model_parallel_size
        data = DataLoader(TokenDataset(config.vocab_size, FIT_STEPS * GLOBAL_BATCH), batch_size=GLOBAL_BATCH // dp)
        val = DataLoader(TokenDataset(config.vocab_size, 4), batch_size=4 // dp)
        dtypes = ComputeDtype()
        trainer = partial(_bf16_trainer, kwargs, callbacks=[dtypes])
        torch.manual_seed(0)
        split = make_module(config)
        first = trainer(FIT_STEPS)
        first.fit(split, data)
        after_fit = _full_params(split)
        # What `trainer.save_checkpoint` writes as the model: the masters, where the optimizers hold them.
        saved = first.strategy.lightning_module_state_dict()
        saved = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in saved.items()}
        first.save_checkpoint(f"{folder}/{name}")
        first.validate(split, val, verbose=False)
        after_validate = _full_params(split)
        first.fit_loop.epoch_loop.max_steps = 2 * FIT_STEPS  # the same Trainer fits on: its next epoch's batches
        first.fit(split, data)
        torch.manual_seed(0)
        whole = make_module(config)
        trainer(2 * FIT_STEPS).fit(whole, data)
        out[name] = dict(
            after_fit=after_fit, saved=saved, after_validate=after_validate, validated_in=dtypes.seen,
            split=_full_params(split), whole=_full_params(whole),
        )  # fmt: skip
        first.validate(split, val, ckpt_path=f"{folder}/{name}", verbose=False)  # the first fit's masters, in bf16
        out[name]["reloaded"] = _full_params(split)
    return out


def test_fit_again_continues_from_the_fp32_masters_under_every_layout(launcher, tmp_path):
    """bf16-mixed, Megatron's layout: after `fit` the module is back in fp32 and holds the masters (what the
    checkpoint saves), validate runs in bf16 and gives it back as it came, and fit(3), validate, fit on to 6 equals
    one fit of 6 steps on the same batches, bit for bit (plain SGD: no optimizer state to lose between fits); a
    later validate from the first fit's checkpoint leaves the module holding that checkpoint's masters. Before, the
    module stayed in bf16 and the second fit rebuilt its masters from that rounding."""
    for rank, results in enumerate(launcher(2, _fit_then_fit, FIT_AGAIN_LAYOUTS, str(tmp_path))):
        for name, r in results.items():
            where = f"{name} rank {rank}"
            assert {dtype for dtype, _ in r["after_fit"].values()} == {torch.float32}, f"{where}: not fp32 after fit"
            if not name.startswith("zero3"):  # ZeRO-3 holds fp32 shards and gathers bf16 copies for compute
                assert r["validated_in"] == {torch.bfloat16}, f"{where}: validate ran in {r['validated_in']}"
                for key, (_, value) in r["after_fit"].items():
                    torch.testing.assert_close(value, r["saved"][key], rtol=0, atol=0, msg=f"{where} {key}: saved")
            for key, (dtype, value) in r["after_validate"].items():
                assert dtype == torch.float32, f"{where} {key}: {dtype} after validate"
                torch.testing.assert_close(value, r["after_fit"][key][1], rtol=0, atol=0, msg=f"{where} {key}")
            assert r["split"].keys() == r["whole"].keys()
            for key, (_, value) in r["split"].items():
                torch.testing.assert_close(value, r["whole"][key][1], rtol=0, atol=0, msg=f"{where} {key}: 3+3 != 6")
            for key, (dtype, value) in r["reloaded"].items():
                assert dtype == torch.float32, f"{where} {key}: {dtype} after validate(ckpt_path)"
                torch.testing.assert_close(value, r["after_fit"][key][1], rtol=0, atol=0, msg=f"{where} {key}: ckpt")


def test_a_stage_gives_back_the_fp32_values_it_left_unchanged_and_casts_the_ones_it_changed():
    """``precision/fp32_weights.py`` on its own (one process, no optimizer): what a validate/test/predict does to a
    module under Megatron's half layout, and to the buffers a fit updates (MoE router statistics)."""
    from torch import nn

    from lightning_flagscale.precision.fp32_weights import keep_fp32_weights, restore_fp32_weights

    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    module.register_buffer("stat", torch.randn(3))
    module.register_buffer("count", torch.arange(3))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    kept = keep_fp32_weights(module)
    module.to(torch.bfloat16)  # the stage's cast (FlagScalePrecision.convert_module)
    with torch.no_grad():
        module.stat.add_(1.0)  # a buffer the stage updates
    restore_fp32_weights(module, kept)
    assert (module.weight.dtype, module.bias.dtype, module.stat.dtype, module.count.dtype) == (
        torch.float32, torch.float32, torch.float32, torch.int64,
    )  # fmt: skip
    assert torch.equal(module.weight, before["weight"]) and torch.equal(module.bias, before["bias"])
    assert torch.equal(module.stat, (before["stat"].bfloat16() + 1.0).float())  # the stage's value, in fp32
    assert torch.equal(module.count, before["count"])
