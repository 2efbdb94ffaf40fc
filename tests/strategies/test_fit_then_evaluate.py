"""Lightning's usual sequence on one module: ``fit``, then ``validate``, ``test`` and ``predict``, then ``fit`` again
by a new Trainer with the same layout and once more by that Trainer, under every layout.

The module is parallelised once, by the first stage; a later stage brings it back from the CPU where ``teardown``
left it and reuses it (issue 37 item 1: the second stage used to apply TP again and fail). Each validation loss is
the one-process model's after the same SGD steps on the same batches, and so is ``test_loss``; ``predict`` returns the
one-process logits of each rank's samples (gathered over TP), and is refused under a layout whose ranks hold part of
a sample's output (PP, CP, hetero meshes) before anything runs; a module parallelised with one layout is
refused, naming both layouts, by a stage with another (a ZeRO-3 one by a stage with other FSDP dtypes). All layouts
run one after the other in one launch.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_flagscale.config import ParallelConfig
from tests._oracle import global_batch_indices
from tests.strategies._lm import GLOBAL_BATCH, TokenDataset, make_module, tiny_config

STEPS = 2
VAL_SAMPLES = 8

LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "zero3-flat": dict(zero_stage=3, zero3_impl="flat"),
    "zero3-fsdp2": dict(zero_stage=3, zero3_impl="fsdp2"),
    "tp2-sp": dict(tensor_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_parallel_size=2, micro_batch_size=1),
    "cp2": dict(context_parallel_size=2),
    "ep2": dict(expert_parallel_size=2),
    # one block on each of two one-rank meshes: a later stage set-up sees the rank's group's layout in `parallel`
    "hetero": dict(hetero_meshes=[dict(data_parallel_size=1)] * 2, hetero_layers=[1, 1], micro_batch_size=2),
}


def _config(name: str):
    if name == "ep2":  # aux loss off: its per-rank statistics are not the whole batch's (test_expert_loop.py)
        return tiny_config(num_experts=4, num_experts_per_tok=2, moe_aux_loss_coeff=0.0)
    return tiny_config()


# The global batches of each fit: the first Trainer's, a new Trainer's (its data starts at the first batch again), the
# same Trainer fitting on with a higher max_steps (Lightning's fit loop starts its next epoch: 8 steps an epoch).
ROUNDS = ((0, 1), (0, 1), (8, 9))


def _oracle(config) -> tuple[list[float], torch.Tensor]:
    """One process: the validation loss (token mean over the whole set) after each round of SGD steps, and the
    validation set's logits after the first round."""
    torch.manual_seed(0)
    module = make_module(config)
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    data, val = TokenDataset(config.vocab_size), TokenDataset(config.vocab_size, VAL_SAMPLES)
    losses, logits = [], None
    for steps in ROUNDS:
        for step in steps:
            module._loss(data.batch(global_batch_indices(len(data), GLOBAL_BATCH, step))).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            losses.append(module._loss(val.batch(torch.arange(VAL_SAMPLES))).item())
            if logits is None:
                logits = module.predict_step(val.batch(torch.arange(VAL_SAMPLES)), 0)
    return losses, logits


def _trainer(kwargs: dict[str, Any], precision: str = "32-true"):
    import lightning as L
    import torch.distributed as dist

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy

    return L.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=FlagScaleStrategy(**kwargs), max_steps=STEPS,
        plugins=[FlagScalePrecision(precision)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip


def _stages(layouts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per layout, the validation loss after fit, again, after a new Trainer's fit and after the same Trainer's next
    fit; then the messages refusing a module under another layout and a ZeRO-3 module under another precision."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_flagscale.config import ParallelConfig

    results: dict[str, Any] = {}
    modules = {}
    for name, kwargs in layouts.items():
        config = _config(name)
        torch.manual_seed(0)
        module = modules[name] = make_module(config)
        trainer = _trainer(kwargs)
        parallel = ParallelConfig(**kwargs)
        dp = 1 if parallel.hetero_enabled else dist.get_world_size() // parallel.model_parallel_size
        train = DataLoader(TokenDataset(config.vocab_size), batch_size=GLOBAL_BATCH // dp)
        val = DataLoader(TokenDataset(config.vocab_size, VAL_SAMPLES), batch_size=VAL_SAMPLES // dp)
        trainer.fit(module, train)
        losses = [trainer.validate(module, val, verbose=False)[0]["val_loss"]]
        losses.append(trainer.test(module, val, verbose=False)[0]["test_loss"])
        if parallel.pipeline_parallel_size == parallel.context_parallel_size == 1 and not parallel.hetero_enabled:
            results[f"{name} logits"] = torch.cat(trainer.predict(module, val))
        again = _trainer(kwargs)
        again.fit(module, train)
        losses.append(again.validate(module, val, verbose=False)[0]["val_loss"])
        again.fit_loop.epoch_loop.max_steps = 2 * STEPS  # the same Trainer fits on
        again.fit(module, train)
        losses.append(again.validate(module, val, verbose=False)[0]["val_loss"])
        results[name] = losses
    for what, kwargs, module, precision in (
        ("refusal", dict(tensor_parallel_size=2), modules["ep2"], "32-true"),  # another layout
        ("dtype refusal", layouts["zero3-fsdp2"], modules["zero3-fsdp2"], "bf16-true"),  # FSDP2 keeps fp32 compute
        ("predict refusal", layouts["pp2"], modules["pp2"], "32-true"),  # predict: whole logits per rank
    ):
        try:
            trainer = _trainer(kwargs, precision)
            if what == "predict refusal":
                trainer.predict(module, val)
            else:
                trainer.validate(module, val, verbose=False)
        except ValueError as err:
            results[what] = str(err)
    return results


def test_fit_validate_fit_again_under_every_layout(launcher):
    stages = ("after fit", "tested", "after a new Trainer's fit", "after the same Trainer's next fit")
    oracles = {name: _oracle(_config(name)) for name in LAYOUTS}
    predicted = 0
    for rank, results in enumerate(launcher(2, _stages, LAYOUTS, timeout=600.0)):
        for name in LAYOUTS:
            (first, second, third), logits = oracles[name]
            for got, want, what in zip(results[name], (first, first, second, third), stages, strict=True):
                assert abs(got - want) <= 1e-5 * want, f"{name} rank {rank} {what}: val_loss {got} != {want}"
            got = results.get(f"{name} logits")
            if got is not None:  # each data-parallel rank predicts its samples (DistributedSampler: every dp-th)
                dp = 2 // ParallelConfig(**LAYOUTS[name]).model_parallel_size
                want = logits[rank % dp :: dp] if dp > 1 else logits
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name} rank {rank} predict")
                predicted += 1
        refusal = results.get("predict refusal", "")
        assert "trainer.predict with pipeline_parallel_size > 1" in refusal, refusal
        refusal = results.get("refusal", "")
        assert "already parallelised" in refusal, refusal
        assert "expert_parallel_size=2" in refusal and "tensor_parallel_size=2" in refusal, refusal
        refusal = results.get("dtype refusal", "")
        assert "already parallelised" in refusal and "torch.bfloat16" in refusal, refusal
    assert predicted == 2 * 6  # ddp, zero1, both ZeRO-3s, tp2-sp and ep2, on both ranks
