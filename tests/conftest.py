"""Shared fixtures: one multi-process launcher for the whole session (see ``tests/_launcher.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests._launcher import Launcher

_LAUNCHER = Launcher()


@pytest.fixture(scope="session")
def launcher():
    """``launcher(world_size, fn, *args, **kwargs) -> [result of rank 0, rank 1, ...]`` on gloo/CPU workers."""
    yield _LAUNCHER
    _LAUNCHER.close()


@pytest.fixture(autouse=True)
def _no_idle_workers_under_own_processes(request):
    """Tests that start their own multi-process jobs get both cores: the shared workers are closed first (idle gloo
    workers still use CPU, and those jobs run under timeouts)."""
    if request.node.get_closest_marker("own_processes") is not None:
        _LAUNCHER.close()
    yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it. A CLI run in this process (``seed_everything``) sets
    ``PL_GLOBAL_SEED``, which workers spawned later inherit and Lightning's distributed sampler reads: every later
    parity test then trained another data order than its oracle."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    # Tests that start their own multi-process jobs run last (stable order otherwise): a job left behind by one of them
    # cannot starve the shared-worker tests.
    items.sort(key=lambda item: item.get_closest_marker("own_processes") is not None)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
