"""Shared fixtures: one multi-process launcher for the whole session (see ``tests/_launcher.py``)."""

from __future__ import annotations

import pytest
import torch

from tests._launcher import Launcher


@pytest.fixture(scope="session")
def launcher():
    """``launcher(world_size, fn, *args, **kwargs) -> [result of rank 0, rank 1, ...]`` on gloo/CPU workers."""
    pool = Launcher()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
