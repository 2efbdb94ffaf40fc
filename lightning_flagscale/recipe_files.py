"""The recipes shipped in ``lightning_flagscale/recipes``: found by name (``--config zero1``) or listed."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import yaml

__all__ = ["RECIPES_DIR", "describe_recipe", "list_recipes", "recipe_path"]

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


_SHORT = {
    "tensor_parallel_size": "TP",
    "pipeline_parallel_size": "PP",
    "virtual_pipeline_parallel_size": "VPP",
    "context_parallel_size": "CP",
    "expert_parallel_size": "EP",
    "data_parallel_size": "DP",
}
_PRODUCT = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")


def _layout(strategy: dict[str, Any], devices: Any) -> list[str]:
    """What the strategy's ``init_args`` set, shortest first: ``TP=2``, ``DP=2`` (derived), ``ZeRO-1``, ``k=v``."""
    parts: list[str] = []
    for key, value in strategy.items():
        if key in _SHORT:
            parts.append(f"{_SHORT[key]}={value}")
        elif key == "zero_stage":
            parts.append("DDP" if value == 0 else f"ZeRO-{value}")
        elif key == "sequence_parallel" and value is True:
            parts.append("SP")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            parts.append(f"{key}={len(value)} meshes")
        else:
            parts.append(f"{key}={value}")
    if isinstance(devices, int) and "data_parallel_size" not in strategy and "hetero_meshes" not in strategy:
        model_parallel = math.prod(int(strategy.get(k, 1)) for k in _PRODUCT)
        if devices // model_parallel > 1:
            parts.insert(0, f"DP={devices // model_parallel}")
    return parts


def describe_recipe(path: str | os.PathLike) -> str:
    """One line generated from what the recipe sets (processes, layout, precision, model, data, steps): it cannot
    go stale the way a hand-written comment can."""
    recipe = yaml.safe_load(Path(path).read_text()) or {}
    trainer = recipe.get("trainer") or {}
    strategy = (trainer.get("strategy") or {}).get("init_args") or {}
    devices = trainer.get("devices", 1)
    parts = [f"{devices} {trainer.get('accelerator', 'auto')} process{'es' if devices != 1 else ''}"]
    parts += _layout(strategy, devices)
    if trainer.get("precision"):
        parts.append(str(trainer["precision"]))
    sections = {}
    for name in ("model", "data"):
        section = recipe.get(name) or {}
        args = section.get("init_args", section)
        sections[name] = (section.get("class_path", "").rpartition(".")[2], args)
    model_class, model_args = sections["model"]
    model = model_args.get("config") or f"model from --model.hf_dir {model_args.get('hf_dir') or 'DIR'}"
    if isinstance(model, dict):  # a preset with overrides: `config: {preset: NAME, FIELD: VALUE, ...}`
        overrides = [f"{k}={v}" for k, v in model.items() if k != "preset"]
        model = f"{model.get('preset', 'custom config')}" + (f" ({', '.join(overrides)})" if overrides else "")
    parts.append(f"{model_class} {model}" if model_class else str(model))
    data_args = sections["data"][1]
    source = data_args.get("source", "synthetic")
    parts.append("synthetic data" if source == "synthetic" else f"data {source}")
    if trainer.get("max_steps"):
        parts.append(f"{trainer['max_steps']} steps")
    return ", ".join(parts)


def list_recipes() -> None:
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        print(f"{path.stem:<20} {describe_recipe(path)}")  # CLI output
