"""Rank processes of the benchmarks: a free port, and results collected so that a dead rank ends the run.

``queue.get()`` alone waits forever when a rank dies before it puts its result (the others then hang in their next
collective). :func:`collect` polls the queue and the processes: the first rank that exits with a non-zero code (or is
killed) terminates the others and raises with its exit code; its traceback is already on stderr.
"""

from __future__ import annotations

import os
import queue as _queue
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["collect", "context", "free_port", "start_method", "stop"]


def start_method() -> str:
    """``spawn`` (a fresh interpreter per rank, as on a cluster), or ``$BENCH_START_METHOD``: the smoke test
    (``tests/test_bench_smoke.py``) sets ``fork`` so its ranks skip re-importing torch and Lightning (~4 s of CPU
    each on 2 cores); the parent has started no process group and no thread pool when it forks."""
    return os.environ.get("BENCH_START_METHOD", "spawn")


def context() -> Any:
    """The (torch) multiprocessing context of :func:`start_method`."""
    import torch.multiprocessing as mp

    return mp.get_context(start_method())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs: list[Any], grace: float = 1.0) -> None:
    """Terminate the processes still alive, then reap them all."""
    for p in procs:
        if p.is_alive():
            p.join(timeout=grace)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _plain(result: Any, name: str) -> Any:
    """``result``, refused if it holds a tensor anywhere: torch sends a tensor through a queue as a shared-memory
    handle that the parent can only open while the sending rank is alive, so a rank that exits right after its
    ``put`` makes the parent's ``get`` fail now and then (``EOFError`` in ``rebuild_storage_fd``). Send numbers,
    lists or ``tensor.tolist()``, or compare the tensors in the rank."""
    import torch

    stack = [result]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            raise TypeError(f"{name}: a rank put a tensor on the result queue; send plain values (see _procs._plain)")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
    return result


def collect(
    procs: list[Any],
    queue: Any,
    count: int,
    timeout: float = 1800.0,
    name: str = "benchmark",
    failed: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """``count`` results from ``queue`` put by ``procs``, then every process joined.

    Raises ``RuntimeError`` (after terminating the rest) as soon as a process exits with a non-zero code, when all
    exit without ``count`` results, or after ``timeout`` seconds. A result for which ``failed`` is true (a rank that
    caught its own error and reported it) ends the collection early: the results so far are returned.
    """
    results: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < count:
            try:
                results.append(_plain(queue.get(timeout=0.2), name))
                if failed is not None and failed(results[-1]):
                    break
                continue
            except _queue.Empty:
                pass
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                rank, code = dead[0]
                raise RuntimeError(f"{name}: rank {rank} exited with code {code} (its traceback is above)")
            if all(p.exitcode is not None for p in procs):
                try:  # the last result may still be in the pipe
                    results.append(_plain(queue.get(timeout=2.0), name))
                    continue
                except _queue.Empty:
                    raise RuntimeError(f"{name}: every rank exited, {len(results)} of {count} results") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no result after {timeout:.0f} s, {len(results)} of {count}")
    finally:
        stop(procs, grace=30.0 if len(results) == count else 0.5)
    return results
