"""``tune --run K``: train the top candidates for a few steps, prune by history, write the winner as a recipe.

Each candidate becomes a LightningCLI recipe (:func:`write_recipe`) and runs as ``python -m lightning_flagscale.cli
fit --config <yaml>`` in a subprocess (Lightning spawns the ranks), with :class:`StepTimer` recording rank 0's step
times and every rank's peak RSS. Before a candidate runs, :class:`HistoryPruner` skips it when a layout already run
says it cannot win, FlagScale's history rules (``flagscale/runner/auto_tuner/prune/history.py``): a layout that
differs from one that ran out of memory only by holding more (larger micro-batch, less recompute, lower ZeRO stage,
no SP) is skipped as OOM; one that differs from a layout that ran only by doing more work (more recompute, higher
ZeRO stage, or without PP a smaller micro-batch) is skipped as slower.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

from lightning_flagscale.accounting.state_bytes import peak_rss_bytes
from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.presets import PRESETS
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.parallel.pipeline_parallel.recompute import RECOMPUTE_MODES
from lightning_flagscale.tune.search import Candidate, describe_layout

__all__ = ["HistoryPruner", "RunResult", "StepTimer", "recipe_dict", "run_candidates", "write_recipe"]

_RECOMPUTE_LEVEL = {mode: i for i, mode in enumerate(RECOMPUTE_MODES)}  # from the least recomputation


class StepTimer(L.Callback):
    """Writes ``{rank}.json`` under ``out_dir`` at the end of fit: rank 0's step end times, each rank's peak RSS and,
    on a CUDA device, its peak allocated device memory (what the memory model predicts). On a GPU each step's end
    waits for the device (kernels run asynchronously: the host would otherwise time its own launches)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.times: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.times.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        device = pl_module.device
        peak_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        data = {"times": self.times, "peak_rss": peak_rss_bytes(), "peak_device": peak_device}
        (Path(self.out_dir) / f"{trainer.global_rank}.json").write_text(json.dumps(data))


def _strategy_args(c: ParallelConfig, grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> dict[str, Any]:
    """ParallelConfig fields that differ from the defaults (DP is left to the world size), and the gradient bucket
    size when it is not the strategy's default."""
    default = ParallelConfig()
    out: dict[str, Any] = {} if grad_bucket_numel == DEFAULT_BUCKET_NUMEL else {"grad_bucket_numel": grad_bucket_numel}
    for f in dataclasses.fields(ParallelConfig):
        value = getattr(c, f.name)
        if f.name == "data_parallel_size" or value == getattr(default, f.name):
            continue
        if f.name == "virtual_pipeline_parallel_size" and value == 1:
            continue
        out[f.name] = value
    return out


def recipe_dict(
    model: TransformerConfig,
    c: ParallelConfig,
    *,
    seq_len: int,
    global_batch: int,
    devices: int,
    max_steps: int,
    accelerator: str = "cpu",
    devices_per_node: int | None = None,
    callbacks: Sequence[dict[str, Any]] = (),
    grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> dict[str, Any]:
    """A LightningCLI recipe (the shape of ``lightning_flagscale/recipes/*.yaml``) that trains ``model`` under ``c``."""
    per_node = devices_per_node or devices
    trainer: dict[str, Any] = {
        "accelerator": accelerator, "devices": min(devices, per_node), "max_steps": max_steps,
        "num_sanity_val_steps": 0, "limit_val_batches": 0, "enable_checkpointing": False, "logger": False,
        "enable_progress_bar": False, "enable_model_summary": False,
        "strategy": {"class_path": "lightning_flagscale.FlagScaleStrategy", "init_args": _strategy_args(c, grad_bucket_numel)},
    }  # fmt: skip
    if devices > per_node:
        trainer["num_nodes"] = devices // per_node
    if callbacks:
        trainer["callbacks"] = list(callbacks)
    preset = model.name if model.name in PRESETS and TransformerConfig.from_preset(model.name) == model else None
    model_cfg = preset or {k: v for k, v in model.to_dict().items() if v is not None}
    return {
        "seed_everything": 1234,
        "trainer": trainer,
        "model": {"config": model_cfg, "learning_rate": 3e-4, "warmup_steps": 0},
        "data": {
            "source": "synthetic",
            "seq_len": seq_len,
            "batch_size": global_batch // c.dp,
            "num_train_samples": global_batch * (max_steps + 2),
            "num_val_samples": global_batch,
        },
    }


def write_recipe(path: str | Path, recipe: dict[str, Any], header: str = "") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(recipe, sort_keys=False)
    path.write_text(text)
    return path


def _beside(a: ParallelConfig, b: ParallelConfig, knob: str) -> bool:
    """Same layout except ``knob``."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return all(da[k] == db[k] for k in da if k != knob) and da[knob] != db[knob]


def _more_memory(knob: str, y: Any, x: Any) -> bool:
    """Does value ``y`` of ``knob`` hold more memory than ``x``?"""
    if knob == "micro_batch_size":
        return y > x
    if knob == "recompute":
        return _RECOMPUTE_LEVEL[y] < _RECOMPUTE_LEVEL[x]
    if knob == "zero_stage":
        return y < x
    return (not y) and x  # sequence_parallel: off holds more


def _more_work(knob: str, y: Any, x: Any, pipelined: bool) -> bool:
    """Does value ``y`` of ``knob`` do more work (never run faster) than ``x``?"""
    if knob == "recompute":
        return _RECOMPUTE_LEVEL[y] > _RECOMPUTE_LEVEL[x]
    if knob == "zero_stage":
        return y > x
    if knob == "micro_batch_size":
        return not pipelined and y < x  # under PP smaller micro-batches shrink the bubble: no rule
    return False


@dataclass
class HistoryPruner:
    """Remembers what ran and skips layouts a finished run shows cannot win (module docstring)."""

    history: list[tuple[ParallelConfig, str]] = dataclasses.field(default_factory=list)
    """(layout, ``ok`` | ``oom`` | ``error``)."""

    def record(self, c: ParallelConfig, status: str) -> None:
        self.history.append((c, status))

    def prune_reason(self, c: ParallelConfig) -> str | None:
        for past, status in self.history:
            for knob in ("micro_batch_size", "recompute", "zero_stage", "sequence_parallel"):
                if not _beside(c, past, knob):
                    continue
                y, x = getattr(c, knob), getattr(past, knob)
                if status == "oom" and (_more_memory(knob, y, x) or y == x):
                    return f"memory: {describe_layout(past)} ran out of memory and this holds more ({knob})"
                if status == "ok" and _more_work(knob, y, x, c.pp_enabled):
                    return f"slower: {describe_layout(past)} ran and this does more work ({knob})"
        return None


@dataclass
class RunResult:
    """One candidate's run."""

    candidate: Candidate
    status: str
    """``ok``, ``oom``, ``error`` or ``pruned: ...``."""
    measured_step_seconds: float | None = None
    peak_rss_bytes: float | None = None
    peak_device_bytes: float | None = None
    """The most device memory any rank allocated (CUDA runs; None on CPU ranks, whose RSS holds the runtime too)."""
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.candidate.describe(), "status": self.status,
            "predicted_step_seconds": self.candidate.step_seconds, "measured_step_seconds": self.measured_step_seconds,
            "predicted_memory_bytes": self.candidate.memory_bytes, "peak_rss_bytes": self.peak_rss_bytes,
            "peak_device_bytes": self.peak_device_bytes, "message": self.message,
        }  # fmt: skip


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _run_one(recipe: dict[str, Any], workdir: Path, timeout: float) -> tuple[str, float | None, dict[str, Any], str]:
    """``(status, median step seconds, peak memory {"rss", "device"} over the ranks, message)``."""
    times_dir = workdir / "timer"
    recipe["trainer"].setdefault("callbacks", []).append(
        {"class_path": "lightning_flagscale.tune.runner.StepTimer", "init_args": {"out_dir": str(times_dir)}}
    )
    path = write_recipe(workdir / "recipe.yaml", recipe)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_flagscale.cli", "fit", "--config", str(path)]
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "error", None, {}, f"timed out after {timeout:.0f}s"
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        oom = "out of memory" in proc.stderr.lower() or "outofmemory" in proc.stderr.lower()
        return ("oom" if oom else "error"), None, {}, " | ".join(tail)
    ranks = [json.loads(p.read_text()) for p in sorted(times_dir.glob("*.json"))]
    times = next((r["times"] for r in ranks if r["times"]), [])
    steps = [b - a for a, b in itertools.pairwise(times)][1:]  # the first steps warm up
    seconds = statistics.median(steps) if steps else None
    device = [r["peak_device"] for r in ranks if r.get("peak_device") is not None]
    return "ok", seconds, {"rss": max(r["peak_rss"] for r in ranks), "device": max(device, default=None)}, ""


def run_candidates(
    model: TransformerConfig,
    candidates: Sequence[Candidate],
    *,
    k: int,
    seq_len: int,
    global_batch: int,
    devices: int,
    workdir: str | Path,
    steps: int = 5,
    timeout: float = 300.0,
    grad_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    accelerator: str = "cpu",
) -> list[RunResult]:
    """Run up to ``k`` of ``candidates`` (in order) for ``steps`` steps each on this machine's ``accelerator``
    (``cpu`` processes or ``gpu`` devices), skipping those history prunes."""
    pruner, results = HistoryPruner(), []
    ran = 0
    for i, cand in enumerate(candidates):
        if ran >= k:
            break
        reason = pruner.prune_reason(cand.config)
        if reason:
            results.append(RunResult(cand, f"pruned: {reason}"))
            continue
        recipe = recipe_dict(model, cand.config, seq_len=seq_len, global_batch=global_batch, devices=devices,
                             max_steps=steps, grad_bucket_numel=grad_bucket_numel, accelerator=accelerator)  # fmt: skip
        status, seconds, peak, message = _run_one(recipe, Path(workdir).resolve() / f"cand{i}", timeout)
        pruner.record(cand.config, status)
        results.append(RunResult(cand, status, seconds, peak.get("rss"), peak.get("device"), message))
        ran += 1
    return results
