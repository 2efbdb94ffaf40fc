"""Shared pieces of the LM strategy tests: data, a single-process oracle and a Trainer run inside workers."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models import CausalLMModule
from tests._oracle import global_batch_indices

# Plain SGD: unlike Adam it keeps the gradient's scale, so a wrongly weighted gradient moves the weights (issue 10).
SEQ, NUM_SAMPLES, GLOBAL_BATCH, LR = 16, 32, 4, 0.5


def tiny_config(**overrides: Any) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    return TransformerConfig.from_preset("llama-tiny", **{**base, **overrides})


class TokenDataset(Dataset):
    """Random token sequences as HF-style dict samples (fixed by seed)."""

    def __init__(
        self, vocab: int = 256, num_samples: int = NUM_SAMPLES, seq: int = SEQ, seed: int = 3, ragged: bool = True,
        packed: bool = False,
    ) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (num_samples, seq + 1), generator=g)
        self.labels = self.tokens[:, 1:].clone()
        if ragged:  # ignore a random prefix of each sample's labels (-100), at a different rate per sample
            for i, k in enumerate(torch.randint(0, 3 * seq // 4 + 1, (num_samples,), generator=g).tolist()):
                self.labels[i, :k] = -100
        self.extra: dict[str, torch.Tensor] = {}
        if packed:  # 1-3 documents per sample at random cut points; the last token of a document predicts nothing
            segments = torch.zeros(num_samples, seq, dtype=torch.long)
            for i in range(num_samples):
                for cut in torch.randint(1, seq, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g):
                    segments[i, cut:] += 1
            ends = torch.cat([segments[:, 1:] != segments[:, :-1], torch.zeros(num_samples, 1, dtype=torch.bool)], 1)
            self.labels[ends] = -100
            position = torch.arange(seq).expand(num_samples, seq)
            starts = torch.where(segments != torch.cat([segments[:, :1], segments[:, :-1]], 1), position, 0)
            self.extra = {"segment_ids": segments, "position_ids": position - starts.cummax(1).values}

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.labels[i], **{k: v[i] for k, v in self.extra.items()}}

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        extra = {k: v[indices] for k, v in self.extra.items()}
        return {"input_ids": self.tokens[indices, :-1], "labels": self.labels[indices], **extra}


def make_module(config: TransformerConfig, optimizer: str = "sgd") -> CausalLMModule:
    # Constant LR (no warmup, no decay) so runs of different lengths see the same schedule.
    lr = LR if optimizer == "sgd" else 1e-3
    return CausalLMModule(
        config, learning_rate=lr, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.1, optimizer=optimizer
    )


def reference_run(
    config: TransformerConfig,
    steps: int,
    clip: float | None = None,
    num_samples: int = NUM_SAMPLES,
    global_batch: int = GLOBAL_BATCH,
    ragged: bool = True,
    skip_steps: tuple[int, ...] = (),
    packed: bool = False,
    optimizer: str = "sgd",
) -> tuple[list[float], dict]:
    """Single-process fp32 training: the oracle every layout must match (``skip_steps``: batches seen, not stepped).

    Returns the per-step losses (the token mean of each global batch), the parameters after the last step and, under
    the key ``"__grad_norms__"`` of the parameter dict, the gradient norm of every step before clipping.
    """
    torch.manual_seed(0)
    module = make_module(config, optimizer)
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    data = TokenDataset(config.vocab_size, num_samples, ragged=ragged, packed=packed)
    losses, norms = [], []
    for step in range(steps):
        loss = module._loss(data.batch(global_batch_indices(len(data), global_batch, step)))
        losses.append(loss.item())
        if step in skip_steps:
            continue
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    return losses, {**params, GRAD_NORMS: torch.tensor(norms)} if norms else params


GRAD_NORMS = "__grad_norms__"


class _LossRecorder:
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []


def trainer_run(
    strategy_kwargs: dict[str, Any],
    config: TransformerConfig,
    steps: int,
    *,
    clip: float | None = None,
    precision: str = "32-true",
    ckpt_path: str | None = None,
    save_path: str | None = None,
    max_epochs: int | None = None,
    num_samples: int = NUM_SAMPLES,
    callbacks: list | None = None,
    ragged: bool = True,
    accumulate: int = 1,
    optimizer: str = "sgd",
    batch_size: int | None = None,
    packed: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Run ``Trainer.fit`` on every worker; returns (global mean loss per step, full parameters) on each rank."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.distributed.tensor import DTensor

    from lightning_flagscale import FlagScalePrecision, FlagScaleStrategy

    world = dist.get_world_size()
    if strategy_kwargs.get("torch_compile"):
        from tests._dynamo import fresh_dynamo

        fresh_dynamo()
    strategy = FlagScaleStrategy(**strategy_kwargs)
    recorder = _LossRecorder()

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone() if isinstance(outputs, dict) else outputs.detach().clone()
            dist.all_reduce(loss)  # every rank holds its replica's mean; replicas x TP/CP copies average back
            recorder.losses.append(loss.item() / world)
            norm = trainer.strategy.precision_plugin.last_grad_norm
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and norm is not None:
                recorder.norms.append(float(norm))

    torch.manual_seed(0)
    module = make_module(config, optimizer)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, plugins=[FlagScalePrecision(precision)],
        max_steps=steps if max_epochs is None else -1, max_epochs=max_epochs, logger=False,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks or []), enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
        num_sanity_val_steps=0, callbacks=[Record(), *(callbacks or [])], accumulate_grad_batches=accumulate,
    )  # fmt: skip
    dp = strategy.parallel.data_parallel_size or world // strategy.parallel.model_parallel_size
    data = TokenDataset(config.vocab_size, num_samples, ragged=ragged, packed=packed)
    loader = DataLoader(data, batch_size=batch_size or GLOBAL_BATCH // dp)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if save_path is not None:
        trainer.save_checkpoint(save_path)
        strategy.wait_for_checkpoint()  # a no-op unless the save was asynchronous
    from lightning_flagscale.parallel.data_parallel.zero3_flat import summon_full_params

    params = {}
    with summon_full_params(module.model):  # flat ZeRO-3 holds row ranges; a no-op for every other layout
        for name, p in module.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            params[name] = full.detach().float().clone()
    if recorder.norms:
        params[GRAD_NORMS] = torch.tensor(recorder.norms)
    return recorder.losses, params


def _trainer_run_key(world: int, strategy_kwargs: dict[str, Any], config: TransformerConfig, steps: int, **kw) -> str:
    """``Launcher.shared``'s key of a ``trainer_run``: the strategy's keywords with their defaults, the parallel ones as
    the resolved ``ParallelConfig`` (an explicit default, an auto virtual size, the derived DP size all read the same),
    and the run's arguments with the DataLoader batch size it derives. ``zero3_impl="auto"`` is read as the engine it
    picks where that is certain from the configs alone: flat for a dense model without tied embeddings (a protocol
    model that flat ZeRO-3 cannot refuse, ``parallel/plan.py::_flat_zero3_refusal``)."""
    import copy
    import dataclasses
    import inspect

    from lightning_flagscale import FlagScaleStrategy
    from lightning_flagscale.config import ParallelConfig
    from tests._launcher import _canonical

    strategy = inspect.signature(FlagScaleStrategy).bind(**strategy_kwargs)
    strategy.apply_defaults()
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    parallel = strategy.arguments["parallel"]
    if parallel is None:
        parallel = ParallelConfig(**{k: v for k, v in strategy.arguments.items() if k in fields})
    parallel = copy.deepcopy(parallel)
    dp = parallel.data_parallel_size or world // parallel.model_parallel_size  # as trainer_run derives it
    parallel.resolve(world)
    dense_untied = not config.tie_word_embeddings and config.num_experts == 0
    if parallel.zero3_impl == "auto" and parallel.resolved_zero3_impl == "flat" and dense_untied:
        parallel.zero3_impl = "flat"
    rest = {k: v for k, v in strategy.arguments.items() if k not in fields and k != "parallel"}
    run = inspect.signature(trainer_run).bind(strategy_kwargs, config, steps, **kw)
    run.apply_defaults()
    args = {k: v for k, v in run.arguments.items() if k != "strategy_kwargs"}
    if args["batch_size"] is None:
        args["batch_size"] = GLOBAL_BATCH // dp
    return _canonical((world, parallel, rest, args))


trainer_run.run_key = _trainer_run_key  # type: ignore[attr-defined]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error of a whole tensor: ||a - e|| / ||e||."""
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """Relative error of a whole tensor: ||a - e|| / ||e|| <= rel."""
    err = rel_error(actual, expected)
    assert err <= rel, f"{what}: relative error {err:.3e} > {rel:.0e}"


def assert_matches_reference(
    results: list, reference: tuple[list[float], dict], what: str, *, losses_per_step: int = 1,
    rename: dict[str, str] | None = None, every_rank_holds_all: bool = False,
) -> None:  # fmt: skip
    """Each rank's per-step losses and the parameters it holds match the single-process run (rel. err <= 1e-5).

    With gradient accumulation Lightning reports every batch's loss already divided by the accumulation count, so
    a step's loss is the sum over its ``losses_per_step`` batches. Pipeline ranks hold only their stages' parameters;
    together they must hold every parameter.
    """
    ref_losses, ref_params = reference
    rename = rename or {}
    for rank, (losses, params) in enumerate(results):
        if GRAD_NORMS in params or GRAD_NORMS in ref_params:  # the gradient's scale, which clipping would hide
            norms, want = params.get(GRAD_NORMS), ref_params.get(GRAD_NORMS)
            assert norms is not None and want is not None, f"{what} rank {rank}: gradient norms not recorded"
            assert_rel_close(norms, want, 1e-5, f"{what} rank {rank} gradient norms")
        assert len(losses) == len(ref_losses) * losses_per_step, f"{what} rank {rank}: {len(losses)} losses"
        for step, want in enumerate(ref_losses):
            got = sum(losses[step * losses_per_step : (step + 1) * losses_per_step])
            assert abs(got - want) <= 1e-5 * abs(want), f"{what} rank {rank} step {step}: loss {got} != {want}"
        if every_rank_holds_all:
            assert {rename.get(n, n) for n in params} == set(ref_params), f"{what} rank {rank}: parameter names"
        for name, value in params.items():
            if name == GRAD_NORMS:
                continue
            assert_rel_close(value, ref_params[rename.get(name, name)], 1e-5, f"{what} rank {rank} {name}")
    held = {rename.get(n, n) for _, params in results for n in params} - {GRAD_NORMS}
    assert held == set(ref_params) - {GRAD_NORMS}, f"{what}: parameters held across ranks differ from the model's"
