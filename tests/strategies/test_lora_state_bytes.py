"""The memory LoRA saves, measured (issue 40 item 6): state bytes per rank (parameters, gradients, master copies,
Adam states) at the optimizer step of Trainer runs with LoRA rank 8, 16 and 64 under DDP and ZeRO-3 equal
``expected_state_bytes`` with the frozen base counted as parameters only (no gradient, master copy or optimizer
state), the formula ``tune`` and ``bench/`` use; full fine-tuning is the same formula with nothing frozen
(``tests/strategies/test_state_bytes.py``). In the same launch, the per-rank peak of ZeRO-3 on FSDP2 (full
fine-tuning and LoRA) against the tuner's ``memory_breakdown(..., backend="gloo")``."""

from __future__ import annotations

import pytest

from lightning_flagscale.accounting.state_bytes import expected_flat_zero3_state_bytes, expected_state_bytes
from lightning_flagscale.checkpoint.sharded import checkpoint_keys
from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.models.lora import is_adapter_name
from lightning_flagscale.tune.memory_model import memory_breakdown
from tests.moe._trainer import shrink
from tests.strategies._lm import SEQ, tiny_config
from tests.strategies._lora import lora_config, lora_trainer_run

RANKS = (8, 16, 64)
# the peak runs: units and activations large enough that FSDP2's gathers decide the peak (bench/lora.py's shape,
# scaled down), full fine-tuning (0) and LoRA; each read on both ranks of PEAK_RUNS runs (a reading can only be high)
PEAK_SHAPE = dict(hidden_size=128, intermediate_size=344, num_layers=3)
PEAK_BATCH, PEAK_RANKS, PEAK_RUNS = 16, (0, 8), 2
LAYOUTS = {
    "ddp": dict(zero_stage=0),
    "fsdp2": dict(zero_stage=3, zero3_impl="fsdp2"),
    "flat": dict(zero_stage=3, zero3_impl="flat"),
}


def _peak_callback():
    """A callback reading the step's peak bytes over a 2-step run: the state at step 0's start (parameters only)
    plus the most bytes allocated above it over both steps (``tune.measure.AllocationPeak``). Started before any
    gradient or Adam state exists, it sees every free of them (a block allocated before the profiler started is
    never seen freed, which made the bench's step-1 readings high by the gradients); only gloo's worker-thread
    frees are placed where the address comes back."""
    import lightning as L

    from lightning_flagscale.accounting.state_bytes import state_bytes
    from lightning_flagscale.tune.measure import AllocationPeak

    class Peak(L.Callback):
        bytes = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                self.start = state_bytes(pl_module, list(trainer.optimizers)).total
                self.alloc = AllocationPeak().__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.alloc.__exit__(None, None, None)
                self.bytes = self.start + self.alloc.peak_bytes

    return Peak()


def _measure(tmp: str) -> dict:
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_flagscale.accounting.state_bytes import state_bytes
    from lightning_flagscale.models.lora import is_adapter_name
    from lightning_flagscale.parallel.data_parallel.zero3_flat import find_flat_zero3, summon_full_params

    class Measure(L.Callback):
        def __init__(self, step: int = 1) -> None:
            self.measured: dict = {}
            self.step = step

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == self.step:  # Adam states exist from the second step on
                self.measured.update(vars(state_bytes(pl_module, [optimizer])))
                with summon_full_params(pl_module.model):
                    named = {id(p): (n, p) for n, p in pl_module.model.named_parameters()}.values()
                    numel = {n: p.shape.numel() if isinstance(p, DTensor) else p.numel() for n, p in named}
                self.measured["adapters"] = sum(v for n, v in numel.items() if is_adapter_name(n))
                self.measured["frozen"] = sum(v for n, v in numel.items() if not is_adapter_name(n))
                # flat ZeRO-3: each unit's parameters (shape, trainable), the input of its layout formula
                parts = find_flat_zero3(pl_module.model)
                units = [[(tuple(s.shape), s.shard.requires_grad) for s in u.slots] for p in parts for u in p.units]
                self.measured["units"], self.measured["rank"] = units, trainer.global_rank

    out = {}
    for name, layout in LAYOUTS.items():
        for rank in RANKS:
            measure = Measure()
            lora_trainer_run(layout, tiny_config(), lora_config(rank=rank, alpha=2.0 * rank), 2,
                             module_kwargs={"optimizer": "adamw"}, callbacks=[measure])  # fmt: skip
            out[name, rank] = measure.measured
    # the per-rank peak under ZeRO-3 on FSDP2, full fine-tuning and LoRA, on a wider shape and batch
    for rank in PEAK_RANKS:
        lora, readings = (lora_config(rank=rank, alpha=2.0 * rank) if rank else None), []
        for _ in range(PEAK_RUNS):
            peak = _peak_callback()
            lora_trainer_run(LAYOUTS["fsdp2"], tiny_config(**PEAK_SHAPE), lora, 2, batch_size=PEAK_BATCH,
                             num_samples=4 * PEAK_BATCH, module_kwargs={"optimizer": "adamw"}, callbacks=[peak])  # fmt: skip
            readings.append(peak.bytes)
        out["fsdp2-peak", rank] = {"peak": readings}
    # flat ZeRO-3's checkpoint of a LoRA run: saved (adapters and their moments only) and resumed under flat, the
    # loaded state measured again at the resumed run's first step
    saved = f"{tmp}/flat.ckpt"
    lora = lora_config(rank=RANKS[0], alpha=2.0 * RANKS[0])
    lora_trainer_run(LAYOUTS["flat"], tiny_config(), lora, 2, save_path=saved, module_kwargs={"optimizer": "adamw"})
    measure = Measure(step=2)
    lora_trainer_run(LAYOUTS["flat"], tiny_config(), lora, 3, ckpt_path=saved, module_kwargs={"optimizer": "adamw"},
                     callbacks=[measure])  # fmt: skip
    out["flat-resumed", RANKS[0]] = measure.measured
    return out


def test_lora_state_bytes_match_the_formula(launcher, tmp_path):
    """Byte-exact: parameters (adapters + frozen base), gradients (adapters only) and Adam states (adapters only,
    plus Adam's 4-byte step counter per adapter tensor, which the formula leaves out). ZeRO-3 under FSDP2, and flat
    ZeRO-3 with its padding (``expected_flat_zero3_state_bytes``: a unit's adapters and its frozen base sharded as
    two regions, so the frozen base has no gradient shard and the adapters split evenly), within that padding of
    the formula."""
    adapter_tensors = 2 * 7 * tiny_config().num_layers
    results = launcher(2, _measure, str(tmp_path))
    # the tuner's ZeRO-3 (FSDP2) peak: within 0.1% below the least reading (issue 40: low by 8-22% when it left out
    # FSDP2's gathered units, their all-gather buffers and the head's gradients)
    c = ParallelConfig(**LAYOUTS["fsdp2"], micro_batch_size=PEAK_BATCH).resolve(2)
    for rank in PEAK_RANKS:
        lora = lora_config(rank=rank, alpha=2.0 * rank) if rank else None
        planned = memory_breakdown(tiny_config(**PEAK_SHAPE), c, SEQ, 1, precision="32-true", backend="gloo",
                                   lora=lora).peak  # fmt: skip
        least = min(r for rank_results in results for r in rank_results.pop(("fsdp2-peak", rank))["peak"])
        assert 0 <= least - planned <= 1e-3 * planned, (rank, least, planned)
    for rank_results in results:
        for (name, rank), m in rank_results.items():
            name = name.removesuffix("-resumed")
            stage = LAYOUTS[name]["zero_stage"]
            want = expected_state_bytes(m["adapters"], 2, stage, "32-true", frozen_params=m["frozen"])
            full = expected_state_bytes(m["adapters"] + m["frozen"], 2, stage, "32-true")
            if name == "flat":
                flat = expected_flat_zero3_state_bytes(m["units"], 2, m["rank"])
                got = (m["params"], m["grads"], m["master_params"], m["optimizer_states"] - 4 * adapter_tensors)
                assert got == (flat.params, flat.grads, flat.master_params, flat.optimizer_states), (rank, m, flat)
                # The adapters split evenly (no padding at these shapes): gradients and Adam states are the formula's;
                # the parameters carry the frozen region's padding (below one row per parameter plus N x lcm).
                assert (flat.grads, flat.optimizer_states) == (want.grads, want.optimizer_states), (rank, flat, want)
                assert 0 <= flat.params - want.params <= 0.01 * want.params, (rank, flat, want)
                want = flat
            assert (m["params"], m["grads"], m["master_params"]) == (want.params, want.grads, want.master_params), (
                name, rank, m, want,
            )  # fmt: skip
            assert m["optimizer_states"] == want.optimizer_states + 4 * adapter_tensors, (name, rank, m, want)
            assert want.total < full.total or rank == 64  # the tiny model's rank-64 adapters outgrow its base
            # the tuner's memory model, from the configs alone: the same bytes (its adapter count from the layer shapes)
            if name == "flat":
                continue  # the memory model prices ZeRO-3 without flat's padding
            c = ParallelConfig(**LAYOUTS[name]).resolve(2)
            lora = lora_config(rank=rank, alpha=2.0 * rank)
            planned = memory_breakdown(tiny_config(), c, SEQ, 1, precision="32-true", lora=lora).ranks[0]
            got = (planned.params, planned.grads, planned.master_params, planned.optimizer_states)
            assert got == (want.params, want.grads, want.master_params, want.optimizer_states), (name, rank, got)
    keys = checkpoint_keys(str(tmp_path / "flat.ckpt"))
    moments = {k.removeprefix("optimizer_0.state.").rsplit(".", 1)[0] for k in keys if k.endswith(".exp_avg")}
    assert len(moments) == adapter_tensors and all(is_adapter_name(k) for k in moments), sorted(moments)


def test_the_memory_model_refuses_lora_where_it_does_not_price_it():
    with pytest.raises(ValueError, match="prices LoRA on dense decoders with standard attention"):
        memory_breakdown(shrink("mixtral-tiny"), ParallelConfig().resolve(1), SEQ, 1, lora=lora_config())
    selective = ParallelConfig(recompute="selective").resolve(1)  # its activations under LoRA are not modelled
    with pytest.raises(ValueError, match=r"LoRA with recompute 'none' or 'full'; recompute='selective'"):
        memory_breakdown(tiny_config(), selective, SEQ, 1, lora=lora_config())
    memory_breakdown(tiny_config(), ParallelConfig(recompute="full").resolve(1), SEQ, 1, lora=lora_config())
