"""Jobs a test module starts together in the background, each test waiting for its own.

Most of a multi-process job's time on 2 cores is one process at a time: the launching rank imports torch and
Lightning (about 4 s of CPU), then starts the next rank, which imports them again while the first waits; a watchdog
test mostly sleeps. Two such jobs side by side fill both cores in about the time one takes. A module starts the jobs of
its selected tests (:func:`selected`) in a :class:`Background` as soon as its first test asks for them, at most
``workers`` at a time in test order; each test then calls ``result()`` and asserts exactly what it asserted when it ran
its job itself. A job's failure is raised by its own test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest


def selected(request: pytest.FixtureRequest, test: str) -> list[pytest.Item]:
    """The items of ``test`` (a test function of the requesting module) that this session runs, in run order."""
    return [
        item for item in request.session.items
        if item.path == request.path and getattr(item, "originalname", item.name) == test
    ]  # fmt: skip


class Background:
    """``submit(key, fn, *args)`` runs ``fn(*args)`` on one of ``workers`` threads; ``result(key)`` waits for it."""

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="test-job")
        self._jobs: dict[Any, Future] = {}

    def submit(self, key: Any, fn: Callable[..., Any], *args: Any) -> None:
        self._jobs[key] = self._pool.submit(fn, *args)

    def result(self, key: Any) -> Any:
        return self._jobs[key].result()

    def close(self) -> None:
        """Jobs not started yet are dropped (the tests that wanted them did not run); running ones are waited for:
        each ends within its own timeout."""
        self._pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def background(workers: int) -> Iterator[Background]:
    jobs = Background(workers)
    try:
        yield jobs
    finally:
        jobs.close()
