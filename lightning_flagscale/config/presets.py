"""The preset registry: name -> ``TransformerConfig`` fields (plain data), filled by the model families.

Each family folder holds its presets as data (``models/<family>/presets.py``, each preset with the Hugging Face
model it mirrors) and registers them when it is imported; ``import lightning_flagscale`` (which any import of the
package runs first) imports every built-in family. Load one with ``TransformerConfig.from_preset(name,
**overrides)``. Nothing here imports torch or a model: the registry is a dict, and the families write into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PRESETS", "register_presets"]

PRESETS: dict[str, dict[str, Any]] = {}
"""Name -> ``TransformerConfig`` fields, of every registered family."""


def register_presets(presets: Mapping[str, dict[str, Any]]) -> None:
    """Add a family's presets; a name that is already registered raises (two families would claim it)."""
    taken = sorted(set(presets) & set(PRESETS))
    if taken:
        raise ValueError(f"Presets registered twice: {', '.join(taken)}; each preset name belongs to one family.")
    PRESETS.update(presets)
