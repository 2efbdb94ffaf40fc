"""The memory LoRA saves, measured (issue 40 item 6): state bytes per rank (parameters, gradients, master copies,
Adam states) at the optimizer step of Trainer runs with LoRA rank 8, 16 and 64 under DDP and ZeRO-3 equal
``expected_state_bytes`` with the frozen base counted as parameters only (no gradient, master copy or optimizer
state), the formula ``tune`` and ``bench/`` use; full fine-tuning is the same formula with nothing frozen
(``tests/strategies/test_state_bytes.py``)."""

from __future__ import annotations

import pytest

from lightning_flagscale.accounting.state_bytes import expected_state_bytes
from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.tune.memory_model import memory_breakdown
from tests.moe._trainer import shrink
from tests.strategies._lm import SEQ, tiny_config
from tests.strategies._lora import lora_config, lora_trainer_run

RANKS = (8, 16, 64)
LAYOUTS = {0: dict(zero_stage=0), 3: dict(zero_stage=3, zero3_impl="fsdp2")}


def _measure() -> dict:
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.accounting.state_bytes import state_bytes
    from lightning_flagscale.models.lora import is_adapter_name
    from lightning_flagscale.parallel.data_parallel.zero3_flat import find_flat_zero3, summon_full_params

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.measured: dict = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:  # Adam states exist from the second step on
                self.measured.update(vars(state_bytes(pl_module, [optimizer])))
                with summon_full_params(pl_module.model):
                    named = {id(p): (n, p) for n, p in pl_module.model.named_parameters()}.values()
                    numel = {n: p.shape.numel() if isinstance(p, DTensor) else p.numel() for n, p in named}
                self.measured["adapters"] = sum(v for n, v in numel.items() if is_adapter_name(n))
                self.measured["frozen"] = sum(v for n, v in numel.items() if not is_adapter_name(n))
                parts = find_flat_zero3(pl_module.model)
                held = sum(s.hi - s.lo for part in parts for u in part.units for s in u.slots)
                total = self.measured["adapters"] + self.measured["frozen"]
                self.measured["row_slack"] = abs(held - total / trainer.world_size) if parts else 0.0

    out = {}
    for stage, layout in LAYOUTS.items():
        for rank in RANKS:
            measure = Measure()
            lora_trainer_run(layout, tiny_config(), lora_config(rank=rank, alpha=2.0 * rank), 2,
                             module_kwargs={"optimizer": "adamw"}, callbacks=[measure])  # fmt: skip
            out[stage, rank] = measure.measured
    return out


def test_lora_state_bytes_match_the_formula(launcher):
    """Byte-exact: parameters (adapters + frozen base), gradients (adapters only) and Adam states (adapters only,
    plus Adam's 4-byte step counter per adapter tensor, which the formula leaves out). ZeRO-3 under FSDP2; flat
    ZeRO-3 is not held to it (it keeps gradient buffers for the frozen weights of a unit holding adapters, and
    splits the adapter elements of a unit unevenly over ranks; see docs/lora.md)."""
    adapter_tensors = 2 * 7 * tiny_config().num_layers
    for rank_results in launcher(2, _measure):
        for (stage, rank), m in rank_results.items():
            want = expected_state_bytes(m["adapters"], 2, stage, "32-true", frozen_params=m["frozen"])
            full = expected_state_bytes(m["adapters"] + m["frozen"], 2, stage, "32-true")
            assert (m["params"], m["grads"], m["master_params"]) == (want.params, want.grads, want.master_params), (
                stage, rank, m, want,
            )  # fmt: skip
            assert m["optimizer_states"] == want.optimizer_states + 4 * adapter_tensors, (stage, rank, m, want)
            assert want.total < full.total or rank == 64  # the tiny model's rank-64 adapters outgrow its base
            # the tuner's memory model, from the configs alone: the same bytes (its adapter count from the layer shapes)
            c = ParallelConfig(**LAYOUTS[stage]).resolve(2)
            lora = lora_config(rank=rank, alpha=2.0 * rank)
            planned = memory_breakdown(tiny_config(), c, SEQ, 1, precision="32-true", lora=lora).ranks[0]
            got = (planned.params, planned.grads, planned.master_params, planned.optimizer_states)
            assert got == (want.params, want.grads, want.master_params, want.optimizer_states), (stage, rank, got)


def test_the_memory_model_refuses_lora_where_it_does_not_price_it():
    with pytest.raises(ValueError, match="prices LoRA on dense decoders with standard attention"):
        memory_breakdown(shrink("mixtral-tiny"), ParallelConfig().resolve(1), SEQ, 1, lora=lora_config())
