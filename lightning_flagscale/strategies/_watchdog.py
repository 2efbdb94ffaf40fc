"""A per-rank watchdog thread: dead ranks, hung collectives and a SIGTERM the main thread cannot hear.

gloo/NCCL collectives block in C++ for the process group's timeout (30 minutes by default) and then report
"Connection reset by peer" at best, naming neither the rank that died nor the collective that hung. Each rank's
watchdog therefore:

- publishes a heartbeat counter with the rank's current phase and step in the rendezvous store (its own client
  connection, so it never shares a socket with the training thread) every ``interval`` seconds;
- exits the process (``os._exit``), after printing which rank and which phase, when another rank's heartbeat has not
  moved for ``timeout`` seconds (a dead or frozen process), when its own rank has been in one phase for ``timeout``
  seconds (a hung collective: the phase names it), or when the store is unreachable (its host, rank 0, died);
- wakes on SIGTERM through ``signal.set_wakeup_fd`` (written by the C-level handler even while the main thread is
  stuck inside a collective) and exits if the process is still alive ``grace`` seconds later; Lightning's own handler
  stops a healthy run at the next step before that.

Only heartbeat counters are compared (no clocks), so the checks hold across nodes without synchronised time.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Watchdog"]

EXIT_CODE = 75  # EX_TEMPFAIL: a restartable failure (the job can be re-run with resume="auto")
_CONNECT_S = 60.0  # the store connection's timeout (see ``start``)


class Watchdog:
    """Start with :meth:`start` after the process group exists; call :meth:`mark` at each phase; :meth:`stop`."""

    def __init__(self, *, rank: int, world_size: int, host: str, port: int, run_id: str, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"watchdog_timeout={timeout} must be > 0 seconds (or None to disable the watchdog).")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.interval = min(timeout / 4, 5.0)
        self.grace = max(2 * self.interval, 5.0)
        self._address = (host, port)
        self._prefix = f"flagscale_watchdog/{run_id}/"
        self.phase, self.step = "setup", 0
        self._phase_since = time.monotonic()
        self._stop = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}
        self._sigterm_at: float | None = None
        self._wakeup_r: int | None = None
        self._wakeup_w: int | None = None
        self._old_wakeup: int | None = None
        self._thread = threading.Thread(target=self._run, name="flagscale-watchdog", daemon=True)

    def mark(self, phase: str, step: int | None = None) -> None:
        """The training thread enters ``phase`` (a name that says which collectives run in it)."""
        self.phase = phase
        if step is not None:
            self.step = step
        self._phase_since = time.monotonic()

    def start(self) -> None:
        # Connecting may wait behind a busy rank 0 (many short runs in one process); the heartbeat never waits on a
        # missing key (``check`` before ``get``) and a dead rank 0 refuses at once, so a long timeout delays nothing.
        store = dist.TCPStore(
            *self._address, is_master=False, timeout=timedelta(seconds=max(self.interval, _CONNECT_S))
        )
        self._store = dist.PrefixStore(self._prefix, store)
        self._install_sigterm_wakeup()
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._wakeup_w is not None:  # the thread sleeps in select() on the wakeup pipe: wake it now, not in 5 s
            with contextlib.suppress(OSError):
                os.write(self._wakeup_w, b"\0")
        self._thread.join(timeout=2 * self.interval + 1)
        with contextlib.suppress(Exception):
            self._store.set(f"hb{self.rank}", "done")
        if not self._thread.is_alive():
            self._store = None  # close this run's connection to rank 0's store now, not whenever gc runs
        if self._old_wakeup is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old_wakeup)
            if not self._thread.is_alive():
                for fd in (self._wakeup_r, self._wakeup_w):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._wakeup_r = self._wakeup_w = None

    def diagnose(self) -> str:
        """After a failed collective: which ranks' heartbeats stopped (waits 1.5 heartbeat intervals)."""
        try:
            before = self._read_others()
            time.sleep(1.5 * self.interval + 0.2)  # a live rank beats once per interval
            after = self._read_others()
        except Exception:
            return "the rendezvous store (hosted by rank 0) is unreachable: rank 0 has probably died."
        dead = [r for r in sorted(after) if after[r] != "done" and after[r] == before[r]]
        if not dead:
            return "every other rank is still alive."
        return f"rank(s) {dead} stopped responding ({'; '.join(self._phase_of(after[r]) for r in dead)})."

    # ---- the thread -----------------------------------------------------------------------------------------
    def _install_sigterm_wakeup(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old != -1:  # someone else (e.g. asyncio) owns the wakeup fd: leave it to them
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._wakeup_r, self._wakeup_w, self._old_wakeup = r, w, old

    def _run(self) -> None:
        beat = 0
        while not self._stop.is_set():
            self._wait_for_signal()
            if self._stop.is_set():
                return
            beat += 1
            try:
                self._store.set(f"hb{self.rank}", f"{beat}|{self.step}|{self.phase}")
                others = self._read_others()
            except Exception as err:
                self._fail(
                    f"the rendezvous store at {self._address[0]}:{self._address[1]} (hosted by rank 0) is unreachable"
                    f" ({type(err).__name__}): rank 0 has probably died."
                )
            self._check(others)

    def _wait_for_signal(self) -> None:
        if self._wakeup_r is None:
            self._stop.wait(self.interval)
            return
        ready, _, _ = select.select([self._wakeup_r], [], [], self.interval)
        if ready:
            data = os.read(self._wakeup_r, 64)
            if signal.SIGTERM in data and self._sigterm_at is None:
                self._sigterm_at = time.monotonic()

    def _read_others(self) -> dict[int, str | None]:
        keys = {r: f"hb{r}" for r in range(self.world_size) if r != self.rank}
        return {r: (self._store.get(k).decode() if self._store.check([k]) else None) for r, k in keys.items()}

    def _check(self, others: dict[int, str | None]) -> None:
        now = time.monotonic()
        for r, value in others.items():
            if value == "done":
                self._seen.pop(r, None)
                continue
            last = self._seen.get(r)
            if last is None or last[0] != value:
                self._seen[r] = (value or "", now)
            elif now - max(last[1], self._started) > self.timeout:
                _, step, phase = (value or "?|?|?").split("|", 2) if value else ("?", "?", "never started")
                self._fail(
                    f"rank {r} stopped responding {now - last[1]:.0f} s ago (last seen in {phase!r}, step {step})."
                )
        stuck = now - self._phase_since
        if stuck > self.timeout:
            where = ", ".join(f"rank {r}: {self._phase_of(v)}" for r, v in sorted(others.items()))
            self._fail(f"rank {self.rank} hung for {stuck:.0f} s in {self.phase!r} (step {self.step}); {where}.")
        if self._sigterm_at is not None and now - self._sigterm_at > self.grace:
            self._fail(
                f"SIGTERM received {now - self._sigterm_at:.0f} s ago; rank {self.rank} is stuck in {self.phase!r}."
            )

    @staticmethod
    def _phase_of(value: str | None) -> str:
        if value is None or value == "done":
            return "not running" if value is None else "finished"
        _, step, phase = value.split("|", 2)
        return f"{phase!r} at step {step}"

    def _fail(self, message: str) -> None:
        print(f"[FlagScale watchdog, rank {self.rank}] {message} Exiting.", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)
