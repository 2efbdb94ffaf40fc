"""Helpers of the kill/resume tests: launch ``_resume_run`` as a real multi-process run and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


_JOB_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK",
            "LOCAL_WORLD_SIZE", "FLAGSCALE_TEST_WORKER")  # fmt: skip


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh job (not a worker of the test launcher), plus ``extra``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in _JOB_ENV:
        env.pop(key, None)
    return {**env, **extra}


def run_together(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[tuple[int, str]]:
    """Start every ``(argv, env)`` at once (e.g. one launcher per "node"), each in a session of its own; return each
    one's ``(returncode, stdout + stderr)``. On a timeout every job and the ranks it started are killed."""
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
        for argv, env in commands
    ]  # fmt: skip
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out))
    except subprocess.TimeoutExpired:
        logs = []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            logs.append(proc.communicate()[0][-2000:])
        raise AssertionError(f"jobs did not finish within {timeout:.0f}s:\n" + "\n---\n".join(logs)) from None
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return results


def launch(spec: dict[str, Any], timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``python -m tests.strategies._resume_run spec`` (Lightning's launcher starts the other ranks)."""
    env = job_env()
    # A session of its own: on a timeout the whole job (Lightning's launcher and the ranks it started) is killed, so
    # no orphaned rank keeps running into the following tests.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.strategies._resume_run", json.dumps(spec)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"run did not finish within {timeout:.0f}s:\n{err[-4000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks a killed launcher left behind
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch_ok(spec: dict[str, Any]) -> None:
    proc = launch(spec)
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"


def launch_killed(spec: dict[str, Any]) -> None:
    proc = launch(spec)
    assert proc.returncode == -9, f"expected SIGKILL, got {proc.returncode}:\n{proc.stderr[-4000:]}"


def losses(out: Path) -> dict[int, dict[str, float]]:
    """Step -> {loss, lr}; a resumed run's rows replace the killed run's rows of the same steps."""
    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from lightning_flagscale.checkpoint import consolidate_checkpoint

    full = torch.load(consolidate_checkpoint(out / "final.ckpt", out / "final.pt"), weights_only=False)
    return full["state_dict"]
