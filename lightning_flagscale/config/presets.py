"""The preset registry: name -> ``TransformerConfig`` fields (plain data), filled by the model families.

Each family folder holds its presets as data (``models/<family>/presets.py``, each preset with the Hugging Face
model it mirrors) and registers them when it is imported. Nothing here imports torch or a model: the registry is a
mapping the families write into. The package root names where the built-in families live
(``add_preset_loader``); the registry runs that loader once, on its first read, so ``from_preset`` finds the
built-in presets whichever part of the package was imported first, and ``import lightning_flagscale`` stays light.
Load one with ``TransformerConfig.from_preset(name, **overrides)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["PRESETS", "PresetRegistry", "add_preset_loader", "register_presets"]


class PresetRegistry(Mapping[str, dict[str, Any]]):
    """Name -> ``TransformerConfig`` fields. Reading it runs the registered loaders first (once)."""

    def __init__(self) -> None:
        self._presets: dict[str, dict[str, Any]] = {}
        self._loaders: list[Callable[[], object]] = []
        self._state = "pending"  # "pending" -> "loading" -> "done"; a failed load goes back to "pending"

    def add_loader(self, load: Callable[[], object]) -> None:
        """Run ``load`` (which imports families that call ``register_presets``) before the next read."""
        self._loaders.append(load)
        if self._state == "done":
            self._state = "pending"

    def load(self) -> None:
        """Run the pending loaders. A family registering while they run reads what is there (no recursion)."""
        if self._state != "pending":
            return
        self._state = "loading"
        try:
            while self._loaders:
                self._loaders[0]()
                self._loaders.pop(0)
        finally:
            self._state = "pending" if self._loaders else "done"

    def register(self, presets: Mapping[str, dict[str, Any]]) -> None:
        self.load()  # the built-ins first, so that a name taken by one of them is refused now, not at their import
        taken = sorted(set(presets) & set(self._presets))
        if taken:
            raise ValueError(f"Presets registered twice: {', '.join(taken)}; each preset name belongs to one family.")
        self._presets.update(presets)

    def __getitem__(self, name: str) -> dict[str, Any]:
        self.load()
        return self._presets[name]

    def __iter__(self) -> Iterator[str]:
        self.load()
        return iter(list(self._presets))

    def __len__(self) -> int:
        self.load()
        return len(self._presets)

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self._presets


PRESETS = PresetRegistry()
"""Name -> ``TransformerConfig`` fields, of every registered family."""


def register_presets(presets: Mapping[str, dict[str, Any]]) -> None:
    """Add a family's presets; a name that is already registered raises (two families would claim it)."""
    PRESETS.register(presets)


def add_preset_loader(load: Callable[[], object]) -> None:
    """Have ``load()`` run once before the registry is next read: it imports the families that register presets."""
    PRESETS.add_loader(load)
