"""Lightning callback for MoE models: logs routing telemetry and runs the between-step balancing updates."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_flagscale.moe.balance import moe_layers, update_moe_state

__all__ = ["MoETelemetry"]


class MoETelemetry(Callback):
    """Log per-layer MoE telemetry and, after every optimizer step, update router biases and hot-expert replicas.

    Logged per MoE layer ``moe/<layer name>/...``: ``imbalance`` (max/mean tokens per expert), ``dropped_fraction``,
    ``max_tokens_per_ep_rank``, ``a2a_bytes``, each aux loss (coefficient applied); with ``per_expert=True`` also
    ``tokens/<e>``. ``moe/aux_loss_total`` sums the aux losses of all layers.

    Args:
        update_state: call :func:`~lightning_flagscale.moe.balance.update_moe_state` after each optimizer step
            (DeepSeek-V3 bias balancing, hot-expert selection), for modules that do not do it themselves
            (``CausalLMModule`` does; the update consumes the step's load, so a second call changes nothing).
        process_group: the group over which the per-expert load is summed; ``None`` uses each layer's token group
            (``parallel.expert.set_moe_token_group``; the default process group unless a strategy set one).
        per_expert: also log the token count of every expert.
    """

    def __init__(
        self, *, update_state: bool = True, process_group: dist.ProcessGroup | None = None, per_expert: bool = False
    ) -> None:
        self.update_state, self.process_group, self.per_expert = update_state, process_group, per_expert
        self._last_step = -1

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        layers = moe_layers(pl_module)
        if not layers:
            return
        metrics: dict[str, float] = {}
        aux_total = 0.0
        for name, layer in layers:
            prefix = f"moe/{name}"
            metrics[f"{prefix}/imbalance"] = float(layer.imbalance)
            metrics[f"{prefix}/dropped_fraction"] = float(layer.dropped_fraction)
            metrics[f"{prefix}/max_tokens_per_ep_rank"] = float(torch.as_tensor(layer.tokens_per_ep_rank).max())
            metrics[f"{prefix}/a2a_bytes"] = float(layer.a2a_bytes)
            for key, value in layer.last_aux_losses.items():
                metrics[f"{prefix}/{key}"] = float(value)
                aux_total += float(value)
            if self.per_expert:
                for e, count in enumerate(layer.tokens_per_expert.tolist()):
                    metrics[f"{prefix}/tokens/{e}"] = count
        metrics["moe/aux_loss_total"] = aux_total
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)
        # global_step counts optimizer steps: update only when one happened (gradient accumulation safe).
        if self.update_state and trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            if self.process_group is None:
                update_moe_state(pl_module)
            else:
                update_moe_state(pl_module, self.process_group)
