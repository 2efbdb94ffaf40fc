"""The recipes shipped in ``lightning_flagscale/recipes``: found by name (``--config zero1``) or listed."""

from __future__ import annotations

import os
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def recipe_path(name: str) -> str:
    """A recipe file: an existing path, or the name of a recipe shipped in ``lightning_flagscale/recipes``."""
    if os.path.exists(name):
        return name
    base = Path(name).name
    candidate = RECIPES_DIR / (base if base.endswith((".yaml", ".yml")) else f"{base}.yaml")
    if candidate.exists():
        return str(candidate)
    shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise SystemExit(f"Recipe {name!r} not found; give a path or one of: {', '.join(shipped)}.")


def list_recipes() -> None:
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip()
        print(f"{path.stem:<24} {first}")  # CLI output
