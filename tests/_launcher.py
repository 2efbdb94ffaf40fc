"""One persistent pool of gloo worker processes per world size, shared by every multi-process test.

Spawning and importing torch + Lightning costs seconds per process on a 2-core machine, so workers start once
per world size and stay alive. Each worker looks like a process launched by ``torchrun`` (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``), so ``Trainer(devices=N, strategy=...)`` inside a task
sees an externally created world; the default gloo process group is initialised once per worker.

A task is a module-level function, called as ``fn(*args)`` on every rank; its return values come back as a
list indexed by rank. An exception on any rank fails the test with that rank's traceback; a rank that does not
answer within the timeout (a hang in a collective) kills the pool, which is rebuilt for the next test.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import inspect
import multiprocessing as mp
import os
import socket
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parent.parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn: Connection, pg_timeout_s: float) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        OMP_NUM_THREADS="1", FLAGSCALE_TEST_WORKER="1",
    )  # fmt: skip
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import datetime
    import importlib

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
    conn.send(("ready", None, 1))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        module, name, args, kwargs = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            result = ("ok", fn(*args, **kwargs))
        except BaseException:
            result = ("error", traceback.format_exc())
        conn.send((*result, len(distributed_c10d._world.pg_map)))  # and the process groups it holds now
    # The pool is being closed: leave without tearing the process groups down. Destroying them (or letting their
    # destructors run at interpreter exit) took 2.8 s with the ~100 groups a worker holds when it is replaced, on each
    # rank at once: 3-4 s per close of a 4-rank pool, about 25 s a suite. Python's exit handlers still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerPool:
    """``world_size`` live worker processes sharing one gloo world."""

    def __init__(self, world_size: int, pg_timeout_s: float = 180.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = 0
        self.groups = 1  # the most process groups a worker holds after the last task (the default group: 1)
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child, pg_timeout_s), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._gather(timeout=300.0)

    def _gather(self, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self.conns))
        latest: dict[int, int] = {}
        import time

        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                if errors:
                    break
                dead = [r for r in pending if not self.procs[r].is_alive()]
                raise TimeoutError(f"ranks {sorted(pending)} did not answer within {timeout:.0f}s (dead: {dead})")
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        status, value, groups = conn.recv()
                    except EOFError as err:
                        raise RuntimeError(f"rank {rank} died (exit code {self.procs[rank].exitcode})") from err
                    del pending[rank]
                    latest[rank] = groups
                    if status == "error":
                        errors[rank] = value
                    else:
                        results[rank] = value
            if errors and pending:
                # Other ranks may be stuck in a collective the failed rank never joined: give them a short grace.
                deadline = min(deadline, time.monotonic() + 20.0)
        self.groups = max(latest.values(), default=self.groups)
        if errors:
            rank = min(errors)
            raise WorkerError(f"rank {rank} failed:\n{errors[rank]}", broken=bool(pending))
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        self.tasks += 1
        for conn in self.conns:
            conn.send((fn.__module__, fn.__qualname__, args, kwargs))
        return self._gather(timeout)

    def close(self) -> None:
        for conn in self.conns:  # every worker leaves at once: their exits overlap
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


class WorkerError(RuntimeError):
    def __init__(self, message: str, broken: bool) -> None:
        super().__init__(message)
        self.broken = broken


class Launcher:
    """Callable fixture: ``launcher(world_size, fn, *args)`` runs ``fn`` on every rank and returns the results."""

    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}
        self.results: dict[str, list[Any]] = {}

    # Every Trainer run creates process groups that live as long as the worker (destroying a task's groups when it
    # ends broke the next TP x ZeRO-1 run: torch still resolved one of them by name), each with a gloo thread that
    # wakes up periodically: a 2-rank pool idles at about 0.15 of a core with 100 groups per worker, 0.4 with 300.
    # Workers are replaced once one holds this many groups; tasks that create none (most that are not a Trainer
    # run) do not bring the replacement closer. A replacement costs 5-10 s on 2 cores (close, spawn, imports).
    max_groups_per_worker = 96
    # ... and after this many tasks in any case, bounding whatever else tasks leave behind in the workers.
    max_tasks_per_pool = 48

    def __call__(self, world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kw: Any):
        pool = self.pools.get(world_size)
        if pool is not None and (pool.tasks >= self.max_tasks_per_pool or pool.groups >= self.max_groups_per_worker):
            self.pools.pop(world_size).close()
        if world_size not in self.pools:
            self.pools[world_size] = WorkerPool(world_size)
        pool = self.pools[world_size]
        try:
            return pool.run(fn, *args, timeout=timeout, **kw)
        except WorkerError as err:
            if err.broken:
                self.pools.pop(world_size).close()
            raise
        except (TimeoutError, RuntimeError):
            self.pools.pop(world_size).close()
            raise

    def shared(self, world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kw: Any):
        """``launcher(world_size, fn, *args, **kw)``, run once per session for every call with the same arguments.

        Tests that need the same deterministic run (e.g. a layout's parity and a composition test that happens to
        use the same layout) each assert on its results, and it runs once: every caller gets its own deep copy.
        Arguments are compared with their defaults filled in; ``fn.run_key(world_size, *args, **kw)``, where ``fn``
        has one, maps spellings of the same run to one key (e.g. an explicit default). Only runs without side
        effects belong here (no checkpoint paths): a failed run is not remembered.
        """
        normalise = getattr(fn, "run_key", None)
        if normalise is not None:
            key = normalise(world_size, *args, **kw)
        else:
            bound = inspect.signature(fn).bind(*args, **kw)
            bound.apply_defaults()
            key = _canonical((world_size, bound.arguments))
        key = f"{fn.__module__}.{fn.__qualname__}:{key}"
        if key not in self.results:
            self.results[key] = self(world_size, fn, *args, timeout=timeout, **kw)
        return copy.deepcopy(self.results[key])

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def _canonical(value: Any) -> str:
    """A repr that does not depend on the order keywords were written in (dicts sorted, dataclasses as dicts)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return f"{type(value).__qualname__}({_canonical(fields)})"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        return "{" + ", ".join(f"{k!r}: {_canonical(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ", ".join(_canonical(v) for v in value) + ")"
    return repr(value)
