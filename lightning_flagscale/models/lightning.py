"""``CausalLMModule``: the LightningModule around ``CausalLM`` that runs unchanged under every parallel layout.

The module only builds the model (``configure_model``) and computes the loss; parallelisation, materialisation
and initialisation are the strategy's job. Under ``FlagScaleStrategy`` ``configure_model`` runs inside a
meta-device context, the strategy then applies TP/PP/CP/EP/ZeRO, materialises with ``to_empty`` and calls
``init_weights()``; under a plain single-device Trainer the model is built and initialised eagerly.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from lightning_flagscale.accounting.flops import device_peak_flops, flops_per_token, model_flops_utilization
from lightning_flagscale.config import TransformerConfig, check_known_fields
from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.models.decoder import CausalLM
from lightning_flagscale.models.layers import RMSNorm
from lightning_flagscale.models.lora import apply_lora, base_weights_reference, init_adapters
from lightning_flagscale.models.weights import weight_source
from lightning_flagscale.moe.balance import update_moe_state
from lightning_flagscale.parallel.data_parallel.optimizer import apply_fsdp
from lightning_flagscale.parallel.tensor_parallel.apply import apply_tp

TOKENS_TRAINED_KEY = "tokens_trained"
"""The checkpoint key of ``CausalLMModule.tokens_trained`` (a Python int, restored exactly on resume)."""

__all__ = [
    "TOKENS_TRAINED_KEY",
    "CausalLMModule",
    "adamw_impl",
    "global_tokens",
    "log_token_rate",
    "log_window_loss",
    "parallelize_for_lightning",
    "param_groups",
    "warmup_cosine_lambda",
]


def parallelize_for_lightning(module: L.LightningModule, model: nn.Module) -> None:
    """Under Lightning's ``ModelParallelStrategy``, which expects the module to parallelise itself in
    ``configure_model`` over the ``(data_parallel, tensor_parallel)`` mesh it hands over (``FlagScaleStrategy``
    parallelises the model itself instead): Megatron TP over ``tensor_parallel`` with the model's own plan, then FSDP2
    per block over ``data_parallel`` (torchtitan's order). The weights are already initialised, the same on every rank,
    so sharding them keeps one model. Elsewhere a no-op."""
    trainer = module._trainer
    if trainer is None or not isinstance(trainer.strategy, ModelParallelStrategy):
        return
    mesh = module.device_mesh
    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    if tp.size() > 1:
        apply_tp(model, tp, sequence_parallel=False)
    if dp.size() > 1:
        apply_fsdp(model, dp, param_dtype=None, reduce_dtype=None)


def _resolve_config(config: TransformerConfig | str | dict[str, Any]) -> TransformerConfig:
    if isinstance(config, TransformerConfig):
        return config
    if isinstance(config, str):
        return TransformerConfig.from_preset(config)
    if isinstance(config, dict):
        fields = dict(config)
        preset = fields.pop("preset", None)
        if preset is not None:  # {"preset": "llama-tiny", "num_layers": 2}: a preset with overrides
            return TransformerConfig.from_preset(preset, **fields)
        check_known_fields(TransformerConfig, fields)
        return TransformerConfig(**fields)
    raise TypeError(
        f"config must be a TransformerConfig, a preset name or a dict of TransformerConfig fields, got {type(config)}."
    )


def set_mtp_loss_weight(model: nn.Module, weight: float) -> None:
    """The MTP loss weight the next losses use (``CausalLM.mtp_loss_weight``), on every CausalLM of ``model``:
    under PP on each of this rank's stage modules (a ``PipelinedModel`` holds them outside its module tree)."""
    for part in getattr(model, "stage_modules", None) or [model]:
        for module in part.modules():
            if isinstance(module, CausalLM):
                module.mtp_loss_weight = float(weight)


def initialize_model_weights(model: nn.Module, hf_dir: str | None, seed: int, lora: LoRAConfig | None) -> None:
    """A materialised (possibly parallelised or pipelined) model's weights: read from ``hf_dir``, else the
    layout-independent ``init_weights(seed)``; then the LoRA adapters' init, if any (both modules' ``initialize_weights``)."""
    parts = getattr(model, "stage_modules", None) or [model]
    if not hf_dir:
        model.init_weights(seed)
    else:
        for part in parts:
            weight_source("hf").load_weights(part, hf_dir)
    for part in parts if lora is not None else ():
        init_adapters(part, lora, seed)


def adamw_impl(groups: list[dict[str, Any]]) -> dict[str, bool]:
    """``fused=True`` when every parameter is on a CUDA device: one kernel for the whole update instead of torch's
    default ``foreach`` path (a kernel per arithmetic step over all parameters; 26.5 ms against 10 ms of a 1.2B model's
    step on one H200, ``docs/gpu.md``), as the plain ``transformers`` loop and torchtitan use. Elsewhere torch's
    default. The choice is made here, on the model's parameters; the masters that our ZeRO / mixed precision put in
    the groups later are on the same device."""
    devices = {p.device.type for g in groups for p in g["params"]}
    return {"fused": True} if devices == {"cuda"} else {}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay matrices only; norms, biases and embeddings (and a head tied to them) are exempt.

    Follows GPT-2/nanoGPT/litgpt practice: decaying gains and biases only shrinks scale parameters, and decaying
    embeddings penalises rare tokens whose rows rarely receive gradient.
    """
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, (RMSNorm, nn.LayerNorm, nn.Embedding)):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # A tied head is the embedding; on the last pipeline stage it is a separate copy that must update alike.
        no_decay_ids.add(id(head.weight))
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # shared (tied) parameters are listed once
        if not p.requires_grad:
            continue
        if id(p) in no_decay_ids or p.ndim < 2 or name.endswith("bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine_lambda(warmup_steps: int, total_steps: float, min_lr_ratio: float):
    """LR multiplier per optimizer step: linear warmup to 1, then cosine down to ``min_lr_ratio`` at ``total_steps``.

    An infinite ``total_steps`` (a Trainer without ``max_steps``/``max_epochs``) keeps the peak LR after warmup.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        decay_steps = max(total_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / decay_steps, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def global_tokens(module: L.LightningModule, local_tokens: int) -> int:
    """Tokens processed by all ranks this step (TP/PP ranks share a batch; DP/CP ranks hold disjoint tokens): the
    strategy's ``global_tokens`` under ``FlagScaleStrategy``, else this rank's times the sampler's replicas; a module
    not attached to a ``Trainer`` (a step called by hand, as ``bench/vlm.py`` does) counts its own."""
    if module._trainer is None:
        return local_tokens
    strategy = module.trainer.strategy
    if hasattr(strategy, "global_tokens"):
        return int(strategy.global_tokens(local_tokens))
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return local_tokens * int(kwargs.get("num_replicas", 1))


def log_token_rate(module: L.LightningModule, tokens: int, last: float | None) -> tuple[float | None, float]:
    """Log ``tokens_per_s``: ``tokens`` (every rank's, this batch) over the time since the previous training batch
    (``last``, ``None`` at the first batch of an epoch: nothing logged; nothing either without a ``Trainer`` to log
    to). Returns (the rate or None, now)."""
    now = time.perf_counter()
    if last is None or module._trainer is None:
        return None, now
    rate = tokens / max(now - last, 1e-9)
    module.log("tokens_per_s", rate, prog_bar=True)
    return rate, now


def log_window_loss(module: L.LightningModule, outputs: Any, batch_idx: int, window: Tensor | None) -> Tensor | None:
    """Log ``train_loss`` as the step's loss: the sum of Lightning's per-batch losses over an accumulation window.

    Lightning's ``outputs["loss"]`` is what it backpropagated (already divided by the accumulation count). Under
    ``FlagScaleStrategy`` its window sum is this rank's share of the global token mean scaled by the number of data x
    context ranks, so the mean over ranks (``sync_dist``) is the global token mean (see ``strategies/_tokens.py``);
    under other strategies it is Lightning's usual mean of per-batch means. Returns the running window sum.
    """
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs
    if not isinstance(loss, Tensor):
        return window
    if window is None or batch_idx % module.trainer.accumulate_grad_batches == 0:
        window = torch.zeros((), device=loss.device)
    window = window + loss.detach().float()
    module.log("train_loss", window, prog_bar=True, sync_dist=True)
    return window


class CausalLMModule(L.LightningModule):
    """Next-token LM training of :class:`CausalLM` on HF-style batches (``input_ids``, ``labels``, optional
    ``position_ids``, ``segment_ids``, ``attention_mask``).

    The training loss is one token mean per optimizer step: when the batch carries ``num_items_in_batch`` (the
    global label count of the step, set by ``FlagScaleStrategy``) each micro-batch returns its token-loss sum over
    it, and ``train_loss`` is logged as the sum of the window's contributions, averaged over ranks like Lightning's
    own loss. Without it (any other strategy) every batch is a local token mean, as in plain Lightning.
    """

    global_token_loss = True
    """Model protocol: the loss divides by ``batch["num_items_in_batch"]`` (see ``models/protocol.py``)."""

    # Runs with bf16/fp16 weights and no autocast (fp32 master weights in the optimizer): Megatron's layout, half
    # the parameter memory of autocast. Modules without this attribute get Lightning's autocast semantics.
    precision_layout: ClassVar[str] = "megatron"

    def __init__(
        self,
        config: TransformerConfig | str | dict[str, Any] = "llama-tiny",
        *,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        init_seed: int = 0,
        hf_dir: str | None = None,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        vocab_multiple: int = 64,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.hf_dir = hf_dir
        self.config = _resolve_config(config)
        # LoRA (issue 40): adapters on the targeted linear layers, everything else frozen (models/lora.py).
        self.lora = LoRAConfig.from_value(lora)
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={optimizer!r} is unknown; use 'adamw' or 'sgd'.")
        self.model: CausalLM | None = None
        # Token-weighted means of the validation and test losses; perplexity is exp of them at epoch end.
        self.val_loss_mean = MeanMetric()
        self.test_loss_mean = MeanMetric()
        self._last_step_time: float | None = None
        self._window_loss: Tensor | None = None
        self._peak_flops: float | None = None  # per device, for `mfu` (accounting/flops.py)
        self._seq_len = 0
        # Input tokens of the optimizer steps done and of the current accumulation window (tokens_trained).
        self._tokens_trained: int | None = 0  # None: resumed from a checkpoint that does not carry the count
        self._window_tokens = 0
        self._base_reference: dict[str, Any] | None = None  # LoRA: the base's source and hash, once

    # ---- model construction ----------------------------------------------------------------------------------
    @property
    def init_seed(self) -> int:
        """Seed the strategy passes to ``init_weights`` after meta-device materialisation."""
        return int(self.hparams.init_seed)

    @property
    def vocab_multiple(self) -> int:
        """Rows of the embedding / LM head are padded to a multiple of this (``vocab_multiple`` argument).

        Tensor parallelism needs its size to divide the padded vocabulary; the default 64 serves every TP size
        dividing 64, so a checkpoint reshards across them. Padded rows are zero and never reach the loss or logits.
        """
        return int(self.hparams.get("vocab_multiple", 64))

    def configure_model(self) -> None:
        """Build ``self.model`` once; initialise it here unless it was created on the meta device.

        On meta the strategy parallelises, materialises and then calls :meth:`init_weights` itself.
        """
        if self.model is not None:
            return
        self.model = CausalLM(self.config, vocab_multiple=self.vocab_multiple)
        if self.lora is not None:  # before the strategy's plan, which then shards and places the adapters too
            apply_lora(self.model, self.lora)
        if not next(self.model.parameters()).is_meta:
            self.initialize_weights()
        parallelize_for_lightning(self, self.model)

    @classmethod
    def from_hf(cls, hf_dir: str, **kwargs: Any) -> CausalLMModule:
        """A module whose config and weights come from a local Hugging Face folder (safetensors).

        Weights stream in after the strategy has parallelised and materialised the model, each rank reading only
        its shard. ``config_overrides={...}`` changes config fields (e.g. ``max_seq_len``).
        """
        return weight_source("hf").build_module(cls, hf_dir, **kwargs)

    def initialize_weights(self) -> None:
        """Called by the strategy once the (parallelised) model is materialised: HF weights or ``init_weights``."""
        initialize_model_weights(self.model, self.hf_dir, self.init_seed, self.lora)

    @property
    def checkpoint_frozen_weights(self) -> bool:
        """Checkpoint protocol (``models/protocol.py``): a LoRA run's checkpoints hold the adapters, their optimizer
        state and the buffers, not the frozen base, which a resume rebuilds from ``hf_dir`` or ``init_seed``."""
        return self.lora is None

    def base_weights_reference(self) -> dict[str, Any]:
        """Where the base weights come from and their SHA-256 (``models/lora.py``), computed on first use."""
        if self._base_reference is None:
            self._base_reference = base_weights_reference(self.config, self.hf_dir, self.init_seed, self.vocab_multiple)
        return self._base_reference

    def init_weights(self, seed: int | None = None) -> None:
        """Layout-independent deterministic init of the (possibly parallelised) model; default seed ``init_seed``."""
        self.model.init_weights(self.hparams.init_seed if seed is None else seed)

    def _require_model(self) -> CausalLM:
        if self.model is None:
            self.configure_model()
        return self.model

    # ---- steps ---------------------------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, segment_ids: Tensor | None = None):
        return self._require_model()(input_ids, position_ids, segment_ids)

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        model = self._require_model()
        segment_ids = batch.get("segment_ids")
        mask = batch.get("attention_mask")
        if segment_ids is None and mask is not None and not bool(mask.all()):
            # Padding as a segment of its own: real tokens never attend to pad tokens (any padding side).
            segment_ids = mask.long()
        # MTP inputs shifted on the whole sequence before context parallelism sharded it (CausalLM.prepare_batch).
        mtp = {k: batch[k] for k in ("mtp_input_ids", "mtp_labels") if batch.get(k) is not None}
        out = model(batch["input_ids"], batch.get("position_ids"), segment_ids, **mtp)
        return model.loss_fn(out, batch["labels"], batch.get("num_items_in_batch"))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tokens = self._global_tokens(batch["input_ids"].numel())
        if self.config.mtp_loss_weight_schedule:  # DeepSeek-V3's MTP weight switch: the same point on every rank
            weight = self.config.mtp_loss_weight_at(self._mtp_schedule_point())
            set_mtp_loss_weight(self._require_model(), weight)
            self.log("mtp_loss_weight", weight)
        self._window_tokens += tokens  # added to tokens_trained by optimizer_step, once per accumulation window
        loss = self._loss(batch)
        # MoE aux losses are already in the backward (AttachAuxLoss); logged here, never added to the loss.
        for name, value in self.model.moe_aux_losses().items():
            self.log(f"train_moe_{name}", value)
        # Multi-token prediction (DeepSeek-V3): trained through the loss's backward, not part of train_loss, logged
        # apart as the global token mean on every rank (under PP the last stage's, broadcast with the loss): see
        # _mtp_group.
        group = self._mtp_group()
        mtp = self._pop_mtp_loss(group)
        if mtp is not None:
            # Under Lightning's own strategies each rank holds its own token mean: their mean over ranks (sync_dist,
            # as train_loss there) is the MTP term of the objective those strategies train (issue 39).
            self.log("mtp_loss", mtp, prog_bar=True, sync_dist=group is None)
        rate, self._last_step_time = log_token_rate(self, tokens, self._last_step_time)
        if rate is not None and self._peak_flops:
            flops = flops_per_token(self.config, self._seq_len)
            self.log("mfu", model_flops_utilization(rate, flops, self.trainer.world_size, self._peak_flops))
        return loss

    def on_fit_start(self) -> None:
        self._peak_flops = device_peak_flops(self.device)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The whole sequence, before a context-parallel strategy hands each rank its slice of it.
        self._seq_len = batch["input_ids"].shape[-1]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._window_loss = log_window_loss(self, outputs, batch_idx, self._window_loss)

    def on_train_epoch_start(self) -> None:
        self._last_step_time = None  # do not count validation / epoch-boundary time as step time

    @property
    def tokens_trained(self) -> int:
        """Input tokens of the optimizer steps done (the count a ``tokens`` MTP weight schedule switches at): per
        step the global batch's samples x sequence length over every data (and context) rank and accumulation step,
        padding and ignored labels included, read from each rank's batch shape (``_global_tokens``: every data rank
        must batch the same shape, as fixed-length or packed batches do). Saved in checkpoints under
        ``TOKENS_TRAINED_KEY`` and restored on resume; steps a nan/spike policy skipped count (their tokens were
        read)."""
        if self._tokens_trained is None:
            raise ValueError(
                f"tokens_trained is unknown: the run resumed from a checkpoint without {TOKENS_TRAINED_KEY!r} (written"
                " before the count existed). Resume from a newer checkpoint, or give mtp_loss_weight_schedule in steps"
                " (mtp_loss_weight_schedule_unit='steps', the switch at its tokens / tokens per step)."
            )
        return self._tokens_trained

    def _mtp_schedule_point(self) -> int:
        """Where this step starts on the MTP weight schedule: optimizer steps or tokens done (config's unit)."""
        if self.config.mtp_loss_weight_schedule_unit == "tokens":
            return self.tokens_trained
        return self.trainer.global_step

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._tokens_trained is not None:
            checkpoint[TOKENS_TRAINED_KEY] = self._tokens_trained

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of step 0 or one without the count (older ones) at step 0 starts from 0 tokens; past step 0
        # without it the count is unknown, which only a ``tokens`` schedule needs (it raises then, see tokens_trained).
        saved = checkpoint.get(TOKENS_TRAINED_KEY)
        self._tokens_trained = int(saved) if saved is not None else (0 if not checkpoint.get("global_step") else None)
        self._window_tokens = 0

    def _global_tokens(self, local_tokens: int) -> int:
        return global_tokens(self, local_tokens)

    def _mtp_group(self) -> Any:
        """The ranks whose MTP loss sums and label counts make the logged ``mtp_loss`` the global token mean: under
        FlagScaleStrategy the data x context group of this rank's stage (its ranks hold disjoint tokens of the same
        stages; on hetero meshes the stage group's). Under PP the last stage's ranks reduce over theirs inside the
        step and the pipeline's loss broadcast brings the result to the other stages (``PipelinedModel.pop_mtp_loss``
        runs no collective then). Under other strategies None: the logged value is this rank's own token mean."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if not hasattr(strategy, "global_tokens"):  # not FlagScaleStrategy (see _global_tokens)
            return None
        return strategy.meshes.group("dp_cp")

    def _pop_mtp_loss(self, group: Any = None) -> Tensor | None:
        pop = getattr(self.model, "pop_mtp_loss", None)
        return pop(group) if pop is not None else None

    def _eval_step(self, batch: dict[str, Tensor], metric: MeanMetric) -> Tensor:
        loss = self._loss(batch)
        self._pop_mtp_loss()  # not a training statistic
        tokens = (batch["labels"] != -100).sum()
        # a batch with no label (the padding that evens evaluation ranks out, strategies/_data.py) has a 0/0 loss
        metric.update(torch.where(tokens > 0, loss.detach().float(), 0.0), weight=tokens.float())
        return loss

    def _log_eval_loss(self, stage: str, metric: MeanMetric) -> None:
        mean = metric.compute()  # synchronised (token-weighted) over processes
        metric.reset()
        # Already equal on every rank; sync_dist=True costs one scalar all-reduce and keeps Lightning from warning
        # that an epoch-level metric is not synchronised.
        self.log(f"{stage}_loss", mean, prog_bar=True, sync_dist=True)
        self.log(f"{stage}_ppl", torch.exp(mean), sync_dist=True)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, self.val_loss_mean)

    def on_validation_epoch_end(self) -> None:
        self._log_eval_loss("val", self.val_loss_mean)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """``trainer.test``: ``test_loss`` (token mean over the whole set) and ``test_ppl``, as validation."""
        return self._eval_step(batch, self.test_loss_mean)

    def on_test_epoch_end(self) -> None:
        self._log_eval_loss("test", self.test_loss_mean)

    def predict_step(self, batch: dict[str, Tensor] | Tensor, batch_idx: int) -> Tensor:
        """``trainer.predict``: the full logits [B, S, vocab_size] of ``batch["input_ids"]`` (or a tensor of ids),
        gathered over tensor parallel ranks. Under ``FlagScaleStrategy`` a layout whose ranks hold parts of the
        sequence or of the model's depth (context or pipeline parallel, hetero meshes) is refused before the first
        batch."""
        model = self._require_model()
        if isinstance(batch, Tensor):
            batch = {"input_ids": batch}
        out = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
        if getattr(model, "_mtp_pending", None) is not None:
            model._mtp_pending = None  # the MTP modules' outputs are for their loss only
        return model.logits(out)

    # ---- optimisation --------------------------------------------------------------------------------------------
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self._tokens_trained is not None:
            self._tokens_trained += self._window_tokens
        self._window_tokens = 0
        if self.config.is_moe:
            # DeepSeek-V3 bias balancing and hot-expert choice, once per optimizer step, under any strategy.

            update_moe_state(self)

    def configure_optimizers(self):
        hp = self.hparams
        groups = param_groups(self._require_model(), hp.weight_decay)
        if hp.get("optimizer", "adamw") == "sgd":  # plain SGD: parity tests that see the gradient scale
            optimizer = torch.optim.SGD(groups, lr=hp.learning_rate)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), **adamw_impl(groups))
        total = float(self.trainer.estimated_stepping_batches) if self._trainer is not None else math.inf
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine_lambda(hp.warmup_steps, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
