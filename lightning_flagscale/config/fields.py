"""Helpers shared by the config dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

__all__ = ["check_known_fields"]


def check_known_fields(cls: type, kwargs: dict[str, Any]) -> None:
    """Raise a ``TypeError`` naming unknown fields of dataclass ``cls`` and the closest valid name."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{cls.__name__} got an unknown field {key!r}.{hint} Valid fields: {', '.join(names)}.")
