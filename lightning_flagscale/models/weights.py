"""Where a module's initial weights come from when they are not drawn by ``init_weights``: registered sources.

Model code never imports converter code (converters import models, and the layering must stay one-way). A
converter package registers itself here when it is imported: ``lightning_flagscale.convert`` registers ``"hf"``
(Hugging Face safetensors folders) and ``"peft"``, and ``lightning_flagscale.models`` imports it (through the families'
converters), so ``CausalLMModule.from_hf`` works wherever the models are imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["WeightSource", "register_weight_source", "weight_source"]


@dataclass(frozen=True)
class WeightSource:
    """A registered way to build a module from, and stream weights out of, an external checkpoint."""

    build_module: Callable[..., Any]
    """``build_module(module_cls, location, **module_kwargs)``: a module whose config comes from ``location``."""
    load_weights: Callable[[nn.Module, str], Any]
    """``load_weights(model_or_stage, location)``: fill a materialised (possibly sharded) model in place."""


_SOURCES: dict[str, WeightSource] = {}


def register_weight_source(name: str, source: WeightSource) -> None:
    """Make ``source`` available as ``name`` (registering a name again replaces it)."""
    _SOURCES[name] = source


def weight_source(name: str) -> WeightSource:
    """The source registered as ``name``; raises naming the package to import when there is none."""
    if name not in _SOURCES:
        raise RuntimeError(
            f"No weight source {name!r} is registered; `import lightning_flagscale.convert` registers 'hf'"
            f" (registered: {sorted(_SOURCES) or 'none'})."
        )
    return _SOURCES[name]
