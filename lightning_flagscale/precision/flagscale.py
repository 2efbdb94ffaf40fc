"""FlagScalePrecision: Megatron-style mixed precision for the FlagScale strategy.

``bf16-mixed`` / ``16-mixed`` here mean what Megatron means: the model's parameters and activations are held in
bf16/fp16 (half the memory of Lightning's autocast, which keeps fp32 parameters), while the optimizer steps fp32
master weights and gradients are reduced into fp32 main gradients (``parallel/data.py`` for DDP/ZeRO-1/2, FSDP2's
``MixedPrecisionPolicy`` for ZeRO-3). ``16-mixed`` adds a dynamic loss scale whose inf/nan check is agreed by every
rank, so a step is skipped everywhere or nowhere. ``fp8`` runs the linear layers through transformer-engine.

| precision   | params  | master weights | grads reduced in | loss scale |
|-------------|---------|----------------|------------------|------------|
| 32-true     | fp32    | -              | fp32             | -          |
| bf16-mixed  | bf16    | fp32           | fp32             | -          |
| bf16-true   | bf16    | -              | fp32 (then bf16) | -          |
| 16-mixed    | fp16    | fp32           | fp32             | dynamic    |
| fp8         | bf16 (+fp8 GEMMs in TE) | fp32 | fp32         | -          |
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from typing_extensions import override

from lightning_flagscale.parallel.data import clip_grad_norm_, found_inf, local_tensor

__all__ = ["DynamicLossScaler", "FlagScalePrecision", "PrecisionName", "as_flagscale_precision"]

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "fp8"]
_DTYPES = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "fp8": torch.bfloat16,
}
_ALIASES = {"32": "32-true", "32-true": "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
            "bf16-true": "bf16-true", "16": "16-mixed", "16-mixed": "16-mixed", "fp8": "fp8",
            "transformer-engine": "fp8"}  # fmt: skip


class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after ``growth_interval`` clean steps (Megatron's rule)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = state["scale"]
        self.good_steps = state["good_steps"]
        self.skipped_steps = state.get("skipped_steps", 0)


class FlagScalePrecision(Precision):
    """Precision plugin for ``FlagScaleStrategy``; also selected by ``Trainer(precision=...)``.

    Args:
        precision: one of ``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed``, ``fp8``.
        loss_scale: initial dynamic loss scale for ``16-mixed``.
        loss_scale_window: clean steps before the scale grows.
    """

    def __init__(
        self, precision: PrecisionName = "32-true", *, loss_scale: float = 2.0**16, loss_scale_window: int = 1000
    ) -> None:
        name = _ALIASES.get(str(precision))
        if name is None:
            raise ValueError(
                f"FlagScalePrecision does not support precision={precision!r}; use one of {sorted(set(_ALIASES.values()))}."
            )
        if name == "fp8":
            _require_transformer_engine()
        self.precision = name  # type: ignore[assignment]
        self.param_dtype: torch.dtype = _DTYPES[name]
        self.master_weights: bool = name in ("bf16-mixed", "16-mixed", "fp8")
        self.reduce_dtype = torch.float32
        self.scaler = DynamicLossScaler(loss_scale, growth_interval=loss_scale_window) if name == "16-mixed" else None
        # Set by the strategy: how to measure the global norm of its (possibly sharded) gradients.
        self.grad_norm_fn: Callable[[Iterable[Tensor], float], Tensor] = clip_grad_norm_
        self.last_grad_norm: Tensor | None = None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "fp8":
            module = _swap_linear_for_te(module)
        if self.param_dtype != torch.float32:
            module = module.to(dtype=self.param_dtype)
        return module

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp8":
            import transformer_engine.pytorch as te
            from transformer_engine.common.recipe import DelayedScaling, Format

            return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID))
        return contextlib.nullcontext()

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        tensor = super().pre_backward(tensor, module)
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return tensor

    def unscale_and_check(self, params: list[Tensor]) -> bool:
        """Unscale main gradients; returns True when the step must be skipped (an inf/nan on any rank)."""
        if self.scaler is None:
            return False
        overflow = found_inf(params)
        if not overflow:
            inv = 1.0 / self.scaler.scale
            for p in params:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(inv)
        self.scaler.update(overflow)
        return overflow

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self.last_grad_norm = self.grad_norm_fn(list(self.main_params(optimizer)), float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        for p in self.main_params(optimizer):
            if p.grad is not None:
                local_tensor(p.grad).clamp_(-clip_val, clip_val)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])

    @contextlib.contextmanager
    @override
    def train_step_context(self) -> Generator[None, None, None]:
        with self.forward_context():
            yield

    @contextlib.contextmanager
    @override
    def val_step_context(self) -> Generator[None, None, None]:
        with self.forward_context():
            yield


def as_flagscale_precision(plugin: Precision) -> FlagScalePrecision:
    """Map Lightning's own precision plugins (``Trainer(precision=...)``) onto ``FlagScalePrecision``."""
    if isinstance(plugin, FlagScalePrecision):
        return plugin
    name = getattr(plugin, "precision", None)
    if type(plugin) is Precision:
        name = "32-true"
    if name in ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "transformer-engine"):
        return FlagScalePrecision("fp8" if name == "transformer-engine" else name)
    raise TypeError(
        f"FlagScaleStrategy cannot use the precision plugin {type(plugin).__name__} (precision={name!r}); pass"
        " plugins=[FlagScalePrecision(...)] or Trainer(precision='32-true'|'bf16-mixed'|'bf16-true'|'16-mixed')."
    )


def _require_transformer_engine() -> None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as err:
        raise ValueError(
            "precision='fp8' runs through transformer-engine, which is not installed here. Install the `gpu` extra"
            " (pip install 'lightning-flagscale[gpu]') on a machine with an FP8-capable NVIDIA GPU (Hopper or newer),"
            " or choose precision='bf16-mixed'."
        ) from err
    if not torch.cuda.is_available():
        raise ValueError("precision='fp8' needs a CUDA GPU with FP8 support; choose 'bf16-mixed' on this machine.")


def _swap_linear_for_te(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` by ``transformer_engine.pytorch.Linear`` holding the same weights."""
    import transformer_engine.pytorch as te

    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            params_dtype=child.weight.dtype, device=child.weight.device)  # fmt: skip
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(module, name, new)
        else:
            _swap_linear_for_te(child)
    return module
