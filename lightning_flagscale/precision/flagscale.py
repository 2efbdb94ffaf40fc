"""FlagScalePrecision: Lightning's precision flags on any module, Megatron's layout on modules built for it.

Two layouts, chosen per module when the strategy sets up (:meth:`FlagScalePrecision.select_layout`):

- ``"lightning"`` (any LightningModule, the default): what the same flag means under ``DDPStrategy``.
  ``bf16-mixed`` / ``16-mixed`` keep fp32 parameters and run the forward under ``torch.autocast``; ``bf16-true``
  casts the parameters to bf16 and runs the forward with bf16 as the default dtype (tensors a module creates
  lazily, e.g. positional tables, come out in bf16 too) and floating inputs cast to bf16.
- ``"megatron"``, for modules that declare ``precision_layout = "megatron"`` (our ``CausalLMModule``): the model's
  parameters and activations are held in bf16/fp16 (half the memory of autocast, which keeps fp32 parameters),
  no autocast, while the optimizer steps fp32 master weights and gradients are reduced into fp32 main gradients
  (``parallel/data_parallel/optimizer.py`` for DDP/ZeRO-1/2, FSDP2's ``MixedPrecisionPolicy`` for ZeRO-3). Such a module must run
  with half-precision weights throughout, which a module written for autocast does not (a lazily created fp32
  buffer meets a bf16 weight and the matmul fails), hence the opt-in.

In both layouts ``16-mixed`` adds a dynamic loss scale whose inf/nan check is agreed by every rank, so a step is
skipped everywhere or nowhere. ``fp8`` runs the linear layers' GEMMs in float8: through transformer-engine where it
is installed, else through torchao's ``Float8Linear`` (dynamic per-tensor scales, e4m3 forward, e5m2 gradients;
:attr:`FlagScalePrecision.fp8_backend`). The Megatron layout:

| precision   | params  | master weights | grads reduced in | loss scale |
|-------------|---------|----------------|------------------|------------|
| 32-true     | fp32    | -              | fp32             | -          |
| bf16-mixed  | bf16    | fp32           | fp32             | -          |
| bf16-true   | bf16    | -              | fp32 (then bf16) | -          |
| 16-mixed    | fp16    | fp32           | fp32             | dynamic    |
| fp8         | bf16 (+fp8 GEMMs)       | fp32 | fp32         | -          |

With fp32 masters the module is in bf16/fp16 only during a trainer stage: teardown casts it back to fp32 holding the
masters, and the next ``fit`` starts its masters from those fp32 weights (``precision/fp32_weights.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from lightning_flagscale.distributed.dtensor import local_tensor
from lightning_flagscale.models.protocol import PrecisionLayoutModule
from lightning_flagscale.parallel.data_parallel.optimizer import clip_grad_norm_, found_inf

__all__ = [
    "LAYOUT_ATTRIBUTE",
    "DynamicLossScaler",
    "FlagScalePrecision",
    "Fp8Backend",
    "PrecisionLayout",
    "PrecisionName",
    "as_flagscale_precision",
    "check_precision_layout",
]

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "fp8"]
Fp8Backend = Literal["auto", "transformer_engine", "torchao"]
PrecisionLayout = Literal["auto", "megatron", "lightning"]
LAYOUT_ATTRIBUTE = "precision_layout"  # class attribute by which a module declares its layout
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
        layout: ``"auto"`` takes the module's declaration (class attribute ``precision_layout``, ``"lightning"``
            when absent); ``"megatron"`` or ``"lightning"`` force one (see the module docstring).
        loss_scale: initial dynamic loss scale for ``16-mixed``.
        loss_scale_window: clean steps before the scale grows.
        fp8_backend: for ``fp8``: ``"transformer_engine"`` (TE's ``Linear`` with delayed scaling; a CUDA GPU),
            ``"torchao"`` (torchao's ``Float8Linear``: every ``nn.Linear`` whose sizes are multiples of 16, the LM
            head excepted, as torchtitan; runs wherever ``torch._scaled_mm`` does, the CPU included), or ``"auto"``:
            transformer-engine where it is installed and a GPU is present, else torchao. Either way a CUDA device
            older than compute capability 8.9 (no fp8 tensor cores) is refused.
    """

    def __init__(
        self,
        precision: PrecisionName = "32-true",
        *,
        layout: PrecisionLayout = "auto",
        loss_scale: float = 2.0**16,
        loss_scale_window: int = 1000,
        fp8_backend: Fp8Backend = "auto",
    ) -> None:
        name = _ALIASES.get(str(precision))
        if name is None:
            raise ValueError(
                f"FlagScalePrecision does not support precision={precision!r}; use one of {sorted(set(_ALIASES.values()))}."
            )
        _check_layout(layout, "FlagScalePrecision(layout=...)")
        self.fp8_backend: Fp8Backend | None = _resolve_fp8_backend(fp8_backend) if name == "fp8" else None
        self.precision = name  # type: ignore[assignment]
        self.layout: PrecisionLayout = layout
        # Until a module is attached (`select_layout`), "auto" answers as Megatron: the layout this plugin had before
        # layouts existed, so code that inspects a fresh plugin sees what it used to.
        self._resolved: PrecisionLayout = "megatron" if layout == "auto" else layout
        self._device_type = "cpu"
        self.reduce_dtype = torch.float32
        self.scaler = DynamicLossScaler(loss_scale, growth_interval=loss_scale_window) if name == "16-mixed" else None
        # Set by the strategy: how to measure the global norm of its (possibly sharded) gradients.
        self.grad_norm_fn: Callable[[Iterable[Tensor], float], Tensor] = clip_grad_norm_
        self.last_grad_norm: Tensor | None = None

    # ---- layout --------------------------------------------------------------------------------------------------
    def select_layout(self, module: nn.Module, device_type: str) -> PrecisionLayout:
        """Fix the layout for ``module`` (called by the strategy in ``setup``, before any dtype decision)."""
        self._device_type = device_type
        if self.layout != "auto":
            self._resolved = self.layout
        else:
            declared = module.precision_layout if isinstance(module, PrecisionLayoutModule) else "lightning"
            _check_layout(declared, f"{type(module).__name__}.{LAYOUT_ATTRIBUTE}", allow_auto=False)
            self._resolved = declared
        return self._resolved

    @property
    def resolved_layout(self) -> PrecisionLayout:
        return self._resolved

    @property
    def _autocast(self) -> bool:
        return self._resolved == "lightning" and self.precision in ("bf16-mixed", "16-mixed")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward's matmuls."""
        return _DTYPES[self.precision]

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the model's parameters are held in during the forward (fp32 under autocast)."""
        return torch.float32 if self._autocast else _DTYPES[self.precision]

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 copies of half-precision parameters (Megatron's mixed layout)."""
        return self._resolved == "megatron" and self.precision in ("bf16-mixed", "16-mixed", "fp8")

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.fp8_backend == "transformer_engine":
            module = _swap_linear_for_te(module)
        elif self.fp8_backend == "torchao":
            module = _convert_to_torchao_float8(module)
        if self.param_dtype != torch.float32:
            module = module.to(dtype=self.param_dtype)
        return module

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.fp8_backend == "transformer_engine":
            import transformer_engine.pytorch as te
            from transformer_engine.common.recipe import DelayedScaling, Format

            return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID))
        if self._autocast:
            # As Lightning's MixedPrecision: no weight-cast cache, whose entries would outlive an optimizer step.
            return torch.autocast(self._device_type, dtype=self.compute_dtype, cache_enabled=False)
        if self._resolved == "lightning" and self.precision == "bf16-true":
            return _default_dtype(torch.bfloat16)
        return contextlib.nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        if self._resolved == "lightning" and self.precision == "bf16-true":
            return apply_to_collection(data, Tensor, _to_bf16_if_floating)
        return data

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        tensor = super().pre_backward(tensor, module)
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return tensor

    def unscale_and_check(self, params: list[Tensor], step: int | None = None) -> bool:
        """Unscale main gradients; returns True when the step must be skipped (an inf/nan on any rank), which is
        announced with the new loss scale (``step``: the trainer's global step, for the message)."""
        if self.scaler is None:
            return False
        overflow = found_inf(params)
        if not overflow:
            inv = 1.0 / self.scaler.scale
            for p in params:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(inv)
        self.scaler.update(overflow)
        if overflow:
            rank_zero_warn(
                f"Step {step}: gradient overflow under {self.precision}; step skipped, loss scale lowered to"
                f" {self.scaler.scale:g} ({self.scaler.skipped_steps} skipped so far)."
            )
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
    scaler = getattr(plugin, "scaler", None)
    if name == "16-mixed" and isinstance(scaler, torch.amp.GradScaler):
        # Lightning's own scaler settings carry over; the scale itself is ours (its inf check agrees across ranks).
        return FlagScalePrecision(
            "16-mixed", loss_scale=float(scaler.get_scale()), loss_scale_window=scaler.get_growth_interval()
        )
    if name in ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "transformer-engine"):
        return FlagScalePrecision("fp8" if name == "transformer-engine" else name)
    raise TypeError(
        f"FlagScaleStrategy cannot use the precision plugin {type(plugin).__name__} (precision={name!r}); pass"
        " plugins=[FlagScalePrecision(...)] or Trainer(precision='32-true'|'bf16-mixed'|'bf16-true'|'16-mixed')."
    )


def _check_layout(layout: Any, what: str, allow_auto: bool = True) -> None:
    allowed = ("auto", "megatron", "lightning") if allow_auto else ("megatron", "lightning")
    if layout not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {layout!r}.")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """Lightning's ``bf16-true`` forward context: tensors created without a dtype come out in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _to_bf16_if_floating(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16) if torch.is_floating_point(t) else t


def check_precision_layout(precision: str, parallel: Any) -> None:
    """Refuse precision/layout combinations that are not implemented (called before any process group exists).

    fp8 swaps ``nn.Linear`` for transformer-engine's or torchao's after parallelisation: that is not written for TP's
    DTensor weights, pipeline stage copies or FSDP2's sharded parameters yet, so those layouts are refused, not
    ignored.
    """
    if precision != "fp8":
        return
    unsupported = [
        name for name, on in (
            ("tensor_parallel_size > 1", parallel.tensor_parallel_size > 1),
            ("pipeline_parallel_size > 1", parallel.pipeline_parallel_size > 1),
            ("zero_stage=3", parallel.zero_stage == 3),
            ("hetero_meshes", getattr(parallel, "hetero_meshes", None) is not None),
        ) if on
    ]  # fmt: skip
    if unsupported:
        raise ValueError(
            f"precision='fp8' with {', '.join(unsupported)} is not supported yet (fp8 linears are swapped in"
            " after parallelisation only for DP / ZeRO-1/2); use 'bf16-mixed' or a DP/ZeRO-1/2 layout."
        )


def _has(package: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _resolve_fp8_backend(choice: str) -> Fp8Backend:
    """The fp8 backend ``choice`` names (``"auto"``: transformer-engine where it can run, else torchao), checked
    here, before any process starts: installed, and a device with fp8 GEMMs."""
    if choice not in ("auto", "transformer_engine", "torchao"):
        raise ValueError(f"fp8_backend={choice!r}; use 'auto', 'transformer_engine' or 'torchao'.")
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise ValueError(
                f"precision='fp8' needs fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell);"
                f" this {torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}. Choose 'bf16-mixed'."
            )
    if choice == "transformer_engine" or (
        choice == "auto" and _has("transformer_engine") and torch.cuda.is_available()
    ):
        _require_transformer_engine()
        return "transformer_engine"
    if not _has("torchao"):
        raise ValueError(
            "precision='fp8' runs through torchao's float8 linears or transformer-engine, and neither is installed"
            " here. Install torchao (pip install 'lightning-flagscale[fp8]') or transformer-engine (the `gpu` extra),"
            " or choose precision='bf16-mixed'."
        )
    return "torchao"


def _fp8_linear(module: nn.Module, fqn: str) -> bool:
    """torchao's filter: every linear but the LM head (its 128k-wide output in fp8 costs accuracy for little time, as
    torchtitan leaves it out), and only sizes fp8 GEMMs take (multiples of 16)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _convert_to_torchao_float8(module: nn.Module) -> nn.Module:
    """Swap the linears ``_fp8_linear`` picks for torchao's ``Float8Linear`` (same parameters, same names)."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(module, module_filter_fn=_fp8_linear)


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
