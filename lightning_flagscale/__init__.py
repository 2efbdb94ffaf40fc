"""lightning-flagscale: FlagScale/Megatron-class hybrid parallelism behind the standard Lightning Trainer.

Importing the package is light (no torch, no Lightning): ``lightning-flagscale --help`` answers at once. The names
below load their module on first use (PEP 562), and so does any subpackage reached as an attribute
(``lightning_flagscale.convert.export_hf``). ``from lightning_flagscale import FlagScaleStrategy`` (or any import of
``lightning_flagscale.strategies``) registers ``Trainer(strategy="flagscale")``. The built-in model families register
their presets and HF converters when ``lightning_flagscale.models`` is imported: the preset registry imports it on
its first read (``config/presets.py``), and ``models`` imports ``convert``, whose ``"hf"`` weight source
``from_hf`` uses. Importing the package filters a few notices Lightning and torch print on every run that no user can
act on (``_notices.py``: by message and raising module, never a user's own warnings).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_flagscale._notices import filter_dependency_notices
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.presets import add_preset_loader

if TYPE_CHECKING:
    from lightning_flagscale.precision import FlagScalePrecision
    from lightning_flagscale.strategies import FlagScaleStrategy

__all__ = ["FlagScalePrecision", "FlagScaleStrategy", "ParallelConfig", "TransformerConfig"]
__version__ = "0.1.0"

BUILTIN_FAMILIES = "lightning_flagscale.models"
"""The package whose import registers every built-in family's presets and HF converter."""

_LAZY_IMPORTS = {
    "FlagScalePrecision": "lightning_flagscale.precision",
    "FlagScaleStrategy": "lightning_flagscale.strategies",
}
"""Public name -> the module that defines it, imported on first access."""

_SUBPACKAGES = frozenset({
    "accounting", "callbacks", "checkpoint", "config", "convert", "data", "distributed", "models", "moe",
    "multimodal", "parallel", "precision", "strategies", "tune",
})  # fmt: skip


def _load_builtin_families() -> None:
    importlib.import_module(BUILTIN_FAMILIES)


add_preset_loader(_load_builtin_families)
# Lightning's and torch's notices that no user can act on (their message and module only; see _notices.py).
filter_dependency_notices()


def __getattr__(name: str) -> Any:
    if name in _LAZY_IMPORTS:
        value = getattr(importlib.import_module(_LAZY_IMPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_IMPORTS, *_SUBPACKAGES})
