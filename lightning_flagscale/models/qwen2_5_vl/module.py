"""``VLMModule``: the LightningModule around :class:`VisionLanguageModel`, unchanged under every supported layout.

Like ``CausalLMModule`` it only builds the model and computes the loss; ``FlagScaleStrategy`` parallelises,
materialises and initialises. Training options vision-language users ask for:

- ``freeze_vision`` / ``freeze_merger`` / ``freeze_llm``: frozen parts get ``requires_grad=False`` when the
  optimizer is built (after the strategy's parallelisation, which may replace Parameter objects) and are left out
  of it, so neither gradients nor optimizer state are kept for them.
- ``vision_lr_multiplier``: the vision encoder's learning rate relative to the LLM's (FlagScale's
  ``vision_ration``); the merger (projector) trains at the LLM's rate. The scheduler scales both alike.
- ``vision_recompute="full"`` with ``vision_recompute_step``: activation recompute of the tower's blocks, separate
  from the LLM's policy (``FlagScaleStrategy(recompute=...)``).
- ``preallocate``: first-batch memory pre-allocation (``prealloc.py``).
- packing: batches may carry ``segment_ids`` (several image-text documents per row, see ``data.py``).
- ``image_token_share``: the expected fraction of image tokens per row; weighs the vision tower against the LLM
  blocks in ``FlagScaleStrategy(pipeline_balance="cost")`` (see ``VisionLanguageModel.pipeline_unit_costs``).

HF weights: the converter package attaches its constructor and loader through :meth:`VLMModule.attach_hf` when it
is imported (``lightning_flagscale.convert``), so this file never imports converter code.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import lightning as L
import torch
from torch import Tensor, nn

from lightning_flagscale.config.lora import LoRAConfig
from lightning_flagscale.models.lightning import (
    adamw_impl,
    global_tokens,
    initialize_model_weights,
    log_token_rate,
    log_window_loss,
    parallelize_for_lightning,
    param_groups,
    warmup_cosine_lambda,
)
from lightning_flagscale.models.lora import apply_lora, base_weights_reference, freeze_base
from lightning_flagscale.models.qwen2_5_vl.batching import batch_segment_ids
from lightning_flagscale.models.qwen2_5_vl.config import VLMConfig
from lightning_flagscale.models.qwen2_5_vl.model import VisionLanguageModel
from lightning_flagscale.models.qwen2_5_vl.prealloc import PreallocState
from lightning_flagscale.models.qwen2_5_vl.presets import VLM_PRESETS
from lightning_flagscale.models.qwen2_5_vl.vision import apply_vision_recompute
from lightning_flagscale.models.weights import weight_source

__all__ = ["VLMModule", "vlm_param_groups"]

_VISION_ENCODER = ("visual.patch_embed.", "visual.blocks.")
_MERGER = ("visual.merger.",)


def _resolve_config(config: VLMConfig | str | dict[str, Any]) -> VLMConfig:
    if isinstance(config, VLMConfig):
        return config
    if isinstance(config, str):
        return VLMConfig.from_preset(config)
    if isinstance(config, dict):
        return VLMConfig.from_dict(config)
    raise TypeError(
        f"config must be a VLMConfig, a preset name ({', '.join(VLM_PRESETS)}) or a dict of its fields, got "
        f"{type(config).__name__}."
    )


def _canonical(name: str) -> str:
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def vlm_param_groups(model: nn.Module, weight_decay: float, lr: float, vision_lr_multiplier: float) -> list[dict]:
    """AdamW/SGD groups: (vision encoder | rest) x (decay | no decay); the encoder's groups at ``lr * multiplier``."""
    encoder_ids = {id(p) for n, p in model.named_parameters() if _canonical(n).startswith(_VISION_ENCODER)}
    groups = []
    for group in param_groups(model, weight_decay):
        encoder = [p for p in group["params"] if id(p) in encoder_ids]
        rest = [p for p in group["params"] if id(p) not in encoder_ids]
        groups.append({**group, "params": rest, "lr": lr})
        groups.append({**group, "params": encoder, "lr": lr * vision_lr_multiplier})
    return [g for g in groups if g["params"]]


class VLMModule(L.LightningModule):
    """Image-text training of :class:`VisionLanguageModel` on HF-style batches (``input_ids``, ``labels``,
    ``pixel_values``, ``image_grid_thw``, optional ``attention_mask`` / ``segment_ids``)."""

    global_token_loss = True
    """Model protocol: the loss divides by ``batch["num_items_in_batch"]`` (see ``models/protocol.py``)."""
    precision_layout: ClassVar[str] = "megatron"
    """Half-precision weights with fp32 masters (the decoder and vision tower compute in the parameter dtype)."""

    def __init__(
        self,
        config: VLMConfig | str | dict[str, Any] = "qwen2.5-vl-tiny",
        *,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        optimizer: Literal["adamw", "sgd"] = "adamw",
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        init_seed: int = 0,
        hf_dir: str | None = None,
        freeze_vision: bool = False,
        freeze_merger: bool = False,
        freeze_llm: bool = False,
        vision_lr_multiplier: float = 1.0,
        vision_recompute: Literal["none", "full"] = "none",
        vision_recompute_step: int = 1,
        preallocate: bool = False,
        max_image_tokens: int | None = None,
        max_seq_len: int | None = None,
        vocab_multiple: int = 64,
        image_token_share: float = 0.5,
        lora: LoRAConfig | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = _resolve_config(config)
        self.hf_dir = hf_dir
        # LoRA (issue 40): adapters on the targeted linear layers of the decoder and/or the vision tower (by name or
        # regex, e.g. ``visual.blocks.N.attn.qkv``), everything else frozen (models/lora.py); freeze_* do not apply.
        self.lora = LoRAConfig.from_value(lora)
        self._base_reference: dict[str, Any] | None = None  # LoRA: the base's source and hash, once
        _check_options(self.hparams)
        self.model: VisionLanguageModel | None = None
        self._last_step_time: float | None = None  # the previous training batch's end, for tokens_per_s
        self.prealloc: PreallocState | None = None
        if preallocate:
            self.prealloc = PreallocState(
                max_seq_len=max_seq_len or self.config.max_seq_len, max_image_tokens=int(max_image_tokens)
            )

    # ---- HF ----------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_dir: str, **kwargs: Any) -> VLMModule:
        """A module whose config and weights come from a local HF ``qwen2_5_vl`` folder (streamed per rank)."""
        return weight_source("hf").build_module(cls, hf_dir, **kwargs)

    # ---- model construction ---------------------------------------------------------------------------------
    @property
    def init_seed(self) -> int:
        return int(self.hparams.init_seed)

    @property
    def vocab_multiple(self) -> int:
        """Embedding / LM-head rows are padded to a multiple of this (see ``CausalLMModule.vocab_multiple``)."""
        return int(self.hparams.get("vocab_multiple", 64))

    def _build_model(self) -> VisionLanguageModel:
        return VisionLanguageModel(
            self.config, vocab_multiple=self.vocab_multiple,
            image_token_share=float(self.hparams.get("image_token_share", 0.5)),
        )  # fmt: skip

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = self._build_model()
        if self.lora is not None:  # before recompute wrappers and the strategy's plan, which place the adapters too
            apply_lora(self.model, self.lora)
        hp = self.hparams
        apply_vision_recompute(self.model.visual, hp.vision_recompute, hp.vision_recompute_step)
        if not next(self.model.parameters()).is_meta:
            self.initialize_weights()
        parallelize_for_lightning(self, self.model)  # ModelParallelStrategy: the module shards itself (issue 37)

    def initialize_weights(self) -> None:
        """HF weights when built from an HF folder, else the layout-independent ``init_weights``."""
        initialize_model_weights(self.model, self.hf_dir, self.init_seed, self.lora)

    # ---- checkpoints (models/protocol.py's FrozenBaseModule, as CausalLMModule) -------------------------------
    @property
    def checkpoint_frozen_weights(self) -> bool:
        """A LoRA run's checkpoints hold the adapters, their optimizer state and the buffers, not the frozen decoder
        and tower, which a resume rebuilds from ``hf_dir`` or ``init_seed`` (and checks against the reference)."""
        return self.lora is None

    def base_weights_reference(self) -> dict[str, Any]:
        """Where the base weights come from and their SHA-256 (``models/lora.py``): the HF folder's safetensors, or
        the whole model (decoder and tower) initialised from ``init_seed`` on this process's CPU; computed once."""
        if self._base_reference is None:
            self._base_reference = base_weights_reference(
                self.config, self.hf_dir, self.init_seed, self.vocab_multiple, build=self._build_model
            )
        return self._base_reference

    def _require_model(self) -> VisionLanguageModel:
        if self.model is None:
            self.configure_model()
        return self.model

    # ---- steps -----------------------------------------------------------------------------------------------
    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Head output of a batch dict (see :meth:`VisionLanguageModel.forward`)."""
        model = self._require_model()
        return model(
            batch["input_ids"], batch.get("position_ids"), batch_segment_ids(batch),
            pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
            padding_grid_thw=batch.get("padding_grid_thw"), mrope_position_ids=batch.get("mrope_position_ids"),
            image_token_index=batch.get("image_token_index"),
        )  # fmt: skip

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        out = self(batch)
        return self.model.loss_fn(out, batch["labels"], batch.get("num_items_in_batch"))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # The batch's text sequence (image placeholder tokens included) over every data rank, before the first-batch
        # pre-allocation pads it: ``tokens_per_s`` on the progress bar and in the logs, as CausalLMModule's.
        tokens = global_tokens(self, batch["input_ids"].numel())
        if self.prealloc is not None:
            batch = self.prealloc.maybe_pad(batch, self.config)
        loss = self._loss(batch)
        _, self._last_step_time = log_token_rate(self, tokens, self._last_step_time)
        return loss

    def on_train_epoch_start(self) -> None:
        self._last_step_time = None  # do not count validation / epoch-boundary time as step time

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._window_loss = log_window_loss(self, outputs, batch_idx, getattr(self, "_window_loss", None))

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        # The batch holds images and tokens (first dimensions differ): name the batch size, Lightning cannot infer it.
        self.log("val_loss", loss.detach(), prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss

    # ---- optimisation ----------------------------------------------------------------------------------------
    def trainable_parameters(self) -> None:
        """Apply the freeze options (``requires_grad``) to the current (possibly parallelised) parameters."""
        if self.lora is not None:  # only the adapters train
            freeze_base(self._require_model())
            return
        hp = self.hparams
        for name, p in self._require_model().named_parameters():
            name = _canonical(name)
            frozen = (
                (hp.freeze_vision and name.startswith(_VISION_ENCODER))
                or (hp.freeze_merger and name.startswith(_MERGER))
                or (hp.freeze_llm and not name.startswith("visual."))
            )
            p.requires_grad_(not frozen)

    def configure_optimizers(self):
        hp = self.hparams
        self.trainable_parameters()
        groups = vlm_param_groups(self._require_model(), hp.weight_decay, hp.learning_rate, hp.vision_lr_multiplier)
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(groups, lr=hp.learning_rate)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), **adamw_impl(groups))
        total = float(self.trainer.estimated_stepping_batches) if self._trainer is not None else math.inf
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine_lambda(hp.warmup_steps, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def _check_options(hp: Any) -> None:
    """Reject option values that cannot work, naming the fix (before any process group exists)."""
    if hp.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={hp.optimizer!r} is unknown; use 'adamw' or 'sgd'.")
    if hp.vision_recompute not in ("none", "full"):
        raise ValueError(f"vision_recompute={hp.vision_recompute!r} is unknown; use 'none' or 'full'.")
    if hp.vision_recompute_step < 1:
        raise ValueError(f"vision_recompute_step must be >= 1, got {hp.vision_recompute_step}.")
    if not hp.vision_lr_multiplier > 0:
        raise ValueError(f"vision_lr_multiplier must be > 0, got {hp.vision_lr_multiplier}; use freeze_vision instead.")
    if hp.get("lora") is not None and (hp.freeze_vision or hp.freeze_merger or hp.freeze_llm):
        raise ValueError(
            "lora= trains the adapters only (everything else is frozen): leave freeze_vision/freeze_merger/freeze_llm "
            "False and choose what adapts with LoRAConfig.target_modules."
        )
    if hp.freeze_vision and hp.freeze_merger and hp.freeze_llm:
        raise ValueError("freeze_vision, freeze_merger and freeze_llm are all set: nothing would train.")
    if hp.preallocate and (hp.max_image_tokens is None or hp.max_image_tokens < 0):
        raise ValueError("preallocate=True needs max_image_tokens (the largest image-token count of a batch).")
    if not 0.0 <= hp.get("image_token_share", 0.5) <= 1.0:
        raise ValueError(f"image_token_share must be in [0, 1], got {hp.image_token_share}.")
    if not 0.0 <= hp.min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {hp.min_lr_ratio}.")
