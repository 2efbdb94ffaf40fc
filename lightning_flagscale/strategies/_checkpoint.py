"""Checkpoint helpers of ``FlagScaleStrategy``: optimizer-state templates and per-rank RNG state."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_flagscale.checkpoint.sharded import checkpoint_keys
from lightning_flagscale.parallel.data import DistributedOptimizer

__all__ = ["optimizer_template", "rng_state", "set_rng_state"]


def optimizer_template(dopt: DistributedOptimizer, path: Path, index: int) -> dict[str, Any]:
    """A template holding exactly the optimizer-state keys the checkpoint has, in this rank's layout."""
    prefix = f"optimizer_{index}.state."
    keys: set[str] = set()
    for key in checkpoint_keys(path):
        if key.startswith(prefix):
            keys.add(key.rsplit(".", 1)[-1])
    tensor_keys = sorted(k for k in keys if k != "step")
    template = dopt.state_dict_template(tensor_keys)
    if "step" not in keys:
        for s in template["state"].values():
            s.pop("step", None)
    return template


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
