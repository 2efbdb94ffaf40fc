"""Pipeline parallelism behind an unchanged ``training_step``.

The strategy replaces the LightningModule's model by a ``PipelinedModel``: it holds this rank's stage modules under
the unsplit model's unit names (so parameter names are those of the unsplit model and checkpoints reshard across
pipeline sizes) and speaks the model protocol lazily. ``model(*args, **kwargs)`` only records the call: the first
argument of the model's ``forward`` feeds the first stage, every other argument reaches every stage as a keyword
(token ids and positions for a decoder; ``pixel_values`` and ``image_grid_thw`` for a vision-language model), and
only activations travel between stages. ``model.loss_fn(out, labels, num_items_in_batch)`` runs the whole schedule
for the batch (forward and backward of every micro-batch when training, forward only otherwise) and returns the
loss, known on every pipeline rank. The strategy then skips Lightning's own backward for that step.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_flagscale.config import ParallelConfig
from lightning_flagscale.config.hetero import hetero_micro_batch_sizes
from lightning_flagscale.models.protocol import ConfiguredModel, MoEModel, PipelineInputs
from lightning_flagscale.parallel.mesh import MeshDim, ParallelMeshes
from lightning_flagscale.parallel.pipeline_parallel.runner import PipelineRunner, build_pipeline

__all__ = [
    "PipelinedModel",
    "apply_hetero_shares",
    "build_pipelined_model",
    "defer_zero_grad",
    "deferred_zero_grad",
    "exclude_tied_copy_from_norm",
    "zero_grad_now",
]


@dataclass
class _PendingCall:
    """What ``PipelinedModel.forward`` saw; consumed by ``loss_fn``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root``, creating empty containers on the way."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.ModuleDict()
            node.add_module(part, child)
        node = child
    node.add_module(name, module)


class PipelinedModel(nn.Module):
    """This rank's pipeline stages, addressable under the unsplit model's parameter names."""

    def __init__(self, runner: PipelineRunner, model: nn.Module, mtp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = model.config if isinstance(model, ConfiguredModel) else None
        self._runner = [runner]  # a list: the runner is not an nn.Module attribute (no double registration)
        if getattr(self.config, "num_nextn_predict_layers", 0):
            # The last stage's MTP loss, reduced over its data x context ranks (``mtp_group``), rides in the training
            # loss's broadcast to every pipeline rank: rank 0 logs it too, whatever the schedule.
            runner.loss_stat = lambda: self._pop_stage_mtp_loss(mtp_group)
        self._signature = inspect.signature(model.forward)
        self._prepare = model.pipeline_inputs if isinstance(model, PipelineInputs) else None
        for stage_id, stage in zip(runner.stage_ids, runner.stage_modules):
            for unit in runner.plan.units[stage_id]:
                _attach(self, unit, stage.get_submodule(unit))
        # Multiplies every micro-batch loss inside the schedule (token factor, fp16 loss scale): Lightning's own
        # scaling acts on the returned loss, whose backward the strategy skips.
        self.grad_scale = 1.0

    @property
    def runner(self) -> PipelineRunner:
        return self._runner[0]

    @property
    def stage_modules(self) -> list[nn.Module]:
        return self.runner.stage_modules

    def forward(self, *args: Any, **kwargs: Any) -> _PendingCall:
        bound = self._signature.bind(*args, **kwargs)
        names = list(bound.arguments)
        first, rest = bound.arguments[names[0]], {k: bound.arguments[k] for k in names[1:]}
        if self._prepare is not None:  # the model may complete the inputs later stages need (e.g. positions)
            first, rest = self._prepare(first, **rest)
        return _PendingCall((first,), {k: v for k, v in rest.items() if v is not None})

    def loss_fn(self, pending: _PendingCall, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
        if not isinstance(pending, _PendingCall):
            raise TypeError("Under pipeline parallelism, pass the output of `model(...)` straight to `model.loss_fn`.")
        # Without the step's normaliser the loss is this batch's token mean (not a mean of micro-batch means).
        if self.training and torch.is_grad_enabled():
            loss = self.runner.step(pending.args, pending.kwargs, labels, num_items_in_batch)
            return loss / self.grad_scale
        return self.runner.eval_step(pending.args, pending.kwargs, labels, num_items_in_batch)

    def scaled_stage_loss(self, output: Tensor, target: Tensor, num_items: Tensor | int | None) -> Tensor:
        """The loss each micro-batch backpropagates: the last stage's token-loss sum over the step's normaliser."""
        last = self.stage_modules[self.runner.stage_ids.index(self.runner.plan.num_stages - 1)]
        scale = self.grad_scale if self.training and torch.is_grad_enabled() else 1.0
        return last.loss_fn(output, target, num_items) * scale

    def moe_aux_losses(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for stage in self.stage_modules:
            if isinstance(stage, MoEModel):
                out.update(stage.moe_aux_losses())
        return out

    def pop_mtp_loss(self, group: dist.ProcessGroup | None = None) -> Tensor | None:
        """The MTP loss of the last training step for logging, on every pipeline rank: the last stage's global token
        mean over its data x context ranks, which the runner broadcast with the loss (``runner.stat``; no collective
        here). Without a training step since the last call (evaluation), the stages' own, over ``group`` (see
        ``CausalLM.pop_mtp_loss``; None on ranks without the last stage)."""
        stat, self.runner.stat = self.runner.stat, None
        local = self._pop_stage_mtp_loss(group if stat is None else None)  # drains what evaluation left
        return stat if stat is not None else local

    def _pop_stage_mtp_loss(self, group: dist.ProcessGroup | None) -> Tensor | None:
        values = [
            v
            for stage in self.stage_modules
            if (pop := getattr(stage, "pop_mtp_loss", None)) is not None and (v := pop(group)) is not None
        ]
        return values[0] if values else None

    def init_weights(self, seed: int = 0) -> None:
        for stage in self.stage_modules:
            stage.init_weights(seed)
        self.runner.sync_tied_params()

    def logits(self, head_output: Tensor) -> Tensor:
        raise RuntimeError("Full logits are not materialised under pipeline parallelism; use the loss.")


def deferred_zero_grad(set_to_none: bool = True) -> None:
    """Lightning's zero_grad under pipeline parallelism: a no-op (the strategy zeroes before the schedule runs)."""


def defer_zero_grad(optimizers: Iterable[Any]) -> None:
    """Lightning zeroes gradients between ``training_step`` and ``backward``; under PP that would wipe what the
    schedule computed inside ``training_step``. Keep each optimizer's real ``zero_grad`` for :func:`zero_grad_now`."""
    for opt in optimizers:
        opt._flagscale_zero_grad = opt.zero_grad
        opt.zero_grad = deferred_zero_grad


def zero_grad_now(optimizers: Iterable[Any], module: nn.Module) -> None:
    """Zero before the schedule runs, at the start of each accumulation window (see :func:`defer_zero_grad`)."""
    for opt in optimizers:
        opt._flagscale_zero_grad(set_to_none=True)
    for param in module.parameters():
        param.grad = None


def build_pipelined_model(
    inner: nn.Module, meshes: ParallelMeshes, config: ParallelConfig, device: torch.device
) -> PipelinedModel:
    """Cut ``inner`` into this rank's stages; the caller puts the result in place of the module's model."""
    holder: list[PipelinedModel] = []
    runner = build_pipeline(
        inner, meshes["pp"], config, loss_fn=lambda out, target, n: holder[0].scaled_stage_loss(out, target, n),
        balance=config.pipeline_balance, device=device,
    )  # fmt: skip
    apply_hetero_shares(runner, config, meshes.local_rank("dp"))  # "auto": once the first training loader sets them
    pipelined = PipelinedModel(runner, inner, mtp_group=meshes.group(MeshDim.DP_CP))
    holder.append(pipelined)
    return pipelined


def apply_hetero_shares(runner: PipelineRunner, config: ParallelConfig, dp_rank: int) -> None:
    """Heterogeneous data-parallel shares under PP: every rank runs the same number of micro-batches, each of its own
    size (:func:`hetero_micro_batch_sizes`). Nothing to do without shares or while they are still ``"auto"``."""
    shares = config.hetero_dp_batch_sizes
    if not isinstance(shares, list):
        return
    runner.micro_batch_size = hetero_micro_batch_sizes(shares, config.micro_batch_size)[dp_rank]
    runner.num_microbatches = min(shares) // config.micro_batch_size


def exclude_tied_copy_from_norm(pipelined: PipelinedModel) -> None:
    """The last stage's copy of a tied weight (LM head = embedding) counts once in the gradient norm."""
    tied = pipelined.runner.tied
    if tied is None:
        return
    runner = pipelined.runner
    if runner.has_last_stage:
        last = runner.stage_modules[runner.stage_ids.index(runner.plan.num_stages - 1)]
        first = runner.stage_modules[runner.stage_ids.index(0)] if runner.has_first_stage else None
        head = last.get_parameter(tied[1])
        if first is None or head is not first.get_parameter(tied[0]):
            head._fs_norm_scale = 0.0
