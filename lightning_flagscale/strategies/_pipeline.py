"""Pipeline parallelism behind an unchanged ``training_step``.

The strategy replaces ``LightningModule.model`` by a ``PipelinedModel``: it holds this rank's stage modules
(sharing their sub-modules, so parameter names stay those of the unsplit model and checkpoints reshard across
pipeline sizes) and speaks the model protocol lazily. ``model(input_ids, position_ids, segment_ids)`` only records
the inputs; ``model.loss_fn(out, labels)`` runs the whole schedule for the batch (forward and backward of every
micro-batch when training, forward only otherwise) and returns the mean loss, known on every pipeline rank. The
strategy then skips Lightning's own backward for that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.parallel.mesh import ParallelMeshes
from lightning_flagscale.parallel.pipeline import PipelineRunner, build_pipeline

__all__ = ["PipelinedModel", "build_pipelined_model", "deferred_zero_grad", "exclude_tied_copy_from_norm"]


@dataclass
class _PendingBatch:
    """What ``PipelinedModel.forward`` saw; consumed by ``loss_fn``."""

    input_ids: Tensor
    position_ids: Tensor | None
    segment_ids: Tensor | None


class PipelinedModel(nn.Module):
    """This rank's pipeline stages, addressable under the unsplit model's parameter names."""

    def __init__(self, runner: PipelineRunner, config: Any) -> None:
        super().__init__()
        self.config = config
        self._runner = [runner]  # a list: the runner is not an nn.Module attribute (no double registration)
        self.layers = nn.ModuleDict()
        for stage in runner.stage_modules:
            for name in ("embed_tokens", "norm", "lm_head"):
                part = getattr(stage, name, None)
                if part is not None:
                    setattr(self, name, part)
            for key, layer in stage.layers.items():
                self.layers[key] = layer
        # Multiplies every micro-batch loss inside the schedule (1 / gradient accumulation, x fp16 loss scale):
        # Lightning's own scaling acts on the returned loss, whose backward the strategy skips.
        self.grad_scale = 1.0

    @property
    def runner(self) -> PipelineRunner:
        return self._runner[0]

    @property
    def stage_modules(self) -> list[nn.Module]:
        return self.runner.stage_modules

    def forward(self, x: Tensor, position_ids: Tensor | None = None, segment_ids: Tensor | None = None):
        return _PendingBatch(x, position_ids, segment_ids)

    def loss_fn(self, pending: _PendingBatch, labels: Tensor) -> Tensor:
        if not isinstance(pending, _PendingBatch):
            raise TypeError("Under pipeline parallelism, pass the output of `model(...)` straight to `model.loss_fn`.")
        batch = {"input_ids": pending.input_ids, "labels": labels}
        if pending.position_ids is not None:
            batch["position_ids"] = pending.position_ids
        if pending.segment_ids is not None:
            batch["segment_ids"] = pending.segment_ids
        if self.training and torch.is_grad_enabled():
            loss = self.runner.step(batch)
        else:
            loss = self.runner.eval_step(batch)
        return loss / self.grad_scale if self.training and torch.is_grad_enabled() else loss

    def scaled_stage_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss each micro-batch backpropagates: the last stage's own loss times ``grad_scale``."""
        last = self.stage_modules[self.runner.stage_ids.index(self.runner.plan.num_stages - 1)]
        return last.loss_fn(output, target) * self.grad_scale

    def moe_aux_losses(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for stage in self.stage_modules:
            fn = getattr(stage, "moe_aux_losses", None)
            if fn is not None:
                out.update(fn())
        return out

    def init_weights(self, seed: int = 0) -> None:
        for stage in self.stage_modules:
            stage.init_weights(seed)
        self.runner.sync_tied_params()

    def logits(self, head_output: Tensor) -> Tensor:
        raise RuntimeError("Full logits are not materialised under pipeline parallelism; use the loss.")


def deferred_zero_grad(set_to_none: bool = True) -> None:
    """Lightning's zero_grad under pipeline parallelism: a no-op (the strategy zeroes before the schedule runs)."""


def build_pipelined_model(
    module: nn.Module, inner: nn.Module, meshes: ParallelMeshes, config: ParallelConfig, device: torch.device
) -> PipelinedModel:
    """Cut ``inner`` into this rank's stages and put them in place of ``module.model``."""
    holder: list[PipelinedModel] = []
    runner = build_pipeline(
        inner, meshes["pp"], config, loss_fn=lambda out, target: holder[0].scaled_stage_loss(out, target),
        balance=config.pipeline_balance, device=device,
    )  # fmt: skip
    pipelined = PipelinedModel(runner, inner.config)
    holder.append(pipelined)
    module.model = pipelined
    return pipelined


def exclude_tied_copy_from_norm(pipelined: PipelinedModel) -> None:
    """The last stage's LM head is a second copy of a tied embedding: count it once in the gradient norm."""
    if not pipelined.runner.tied:
        return
    for stage in pipelined.stage_modules:
        head, embed = stage.lm_head, stage.embed_tokens
        if head is not None and (embed is None or head.weight is not embed.weight):
            head.weight._fs_norm_scale = 0.0
