"""Every script in ``bench/`` runs (issue 42 item 1): each at its smallest setting, in a subprocess, exits 0 and writes
or prints its result, so an API change that breaks a benchmark breaks a test. The numbers are not checked: benchmarks
measure, they assert nothing.

The ranks are forked (``BENCH_START_METHOD=fork``, read by ``bench/_procs.py``) instead of spawned: a spawned rank
re-imports torch and Lightning, about 4 s of CPU each, which on 2 cores would be most of this file's time. Most
scripts then run on one core at a time (the parent's imports, one rank's work), so the scripts of the selected tests
run two at a time, started together when the first of them runs (``bench_runs``); each test waits for its own script.
A script added to ``bench/`` must get an entry here (``test_every_script_is_listed``).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._background import background, selected

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

# script -> (arguments, files it writes under {out} or text it prints); "{out}" is the test's temporary folder.
SMOKE: dict[str, tuple[str, list[str]]] = {
    "pipeline.py": ("--smoke --out {out}", ["pipeline.md", "pipeline.json", "pipeline_timeline.png"]),
    "moe.py": ("--tokens 64 --hidden 16 --inter 32 --experts 4 --world 2 --a2a-tokens 64", ["a2a bytes/step"]),
    "moe_sp_dispatch.py": ("--world 2 --seq 32 --batch 1 --hidden 16 --out {out}/sp.md", ["sp.md"]),
    "context.py": (
        "--seqs 64 128 --cps 2 --modes ring --heads 2 --kv-heads 1 --head-dim 8 --q-block 32",
        ["longest sequence within"],
    ),
    "zero.py": ("--world 2 --stages 1 --json {out}/zero.json", ["zero.json"]),
    "flash_checkpoint.py": (
        "--world 2 --rounds 1 --hidden 32 --layers 1 --out {out}",
        ["flash_checkpoint.md", "flash_checkpoint.json"],
    ),
    "zero3_flat.py": ("--world 2 --size smoke --rounds 1 --steps 1 --out {out}", ["zero3_flat_smoke_w2.md"]),
    "vlm.py": ("--smoke --out {out}/vlm.md", ["vlm.md"]),
    "grad_hook_overhead.py": ("--rounds 1 --steps 1 --out {out}/grad_hook.md", ["grad_hook.md"]),
    "tune_published.py": ("--out {out}/tune_published.md", ["tune_published.md"]),
    "tune_deepseek_v3.py": ("--smoke --out {out}/tune_deepseek_v3.md", ["tune_deepseek_v3.md"]),
    "mla.py": ("--smoke --out {out}/mla.md", ["mla.md"]),
    # 2 gloo ranks compiling one block per CP x recompute mode: ~20 s here
    "compile_memory.py": ("--smoke --out {out}/compile_memory.md --port 29581", ["compile_memory.md"]),
    "lora.py": ("--smoke --out {out}/lora.md", ["lora.md", "step peak above start (profiler)"]),
    # the measured runs need 4 ranks per layout and a bandwidth probe (minutes); the report and the tuner's
    # predictions for every layout are recomputed from the committed measurements
    "tune_validation.py": (
        "--from-json bench/results/tune_validation.json --out {out}/tune_validation",
        ["tune_validation.md"],
    ),
    "gpu.py": ("--smoke --only fs-none --out {out} --profile {out}", ["gpu_smoke.md", "gpu_smoke.json", "profile.txt"]),
    "compare_strategies.py": (
        "--quick --world 4 --steps 1 --warmup 1 --only FS-DDP --out {out}",
        ["compare_strategies_quick_subset.md", "compare_strategies_quick_subset.json"],
    ),
    # its measured run (every device type alone, then the hetero job: 8 Trainer ranks, ~30 s here) is
    # "--rounds 1 --steps 3 --seq 16 --rank-batch 2 --layers 2 --configs even"; its ranks' code (_start, _rank_main)
    # runs in tune_hetero_validation's smoke run below, so here the report is rendered from the committed run
    "hetero.py": ("--from-json bench/results/hetero.json --out {out}/hetero.md", ["hetero.md"]),
    "hetero_call_cost.py": ("--reps 2 --pause-ms 1 --seq 16 --out {out}/call_cost.md", ["call_cost.md"]),
    # its measured run is 18 jobs of 4 Trainer ranks (minutes; "--smoke" alone is one minute here): the library path
    # it times is tests/strategies/test_dualpipe_overlap.py's, so here the report is rendered from the committed run
    "dualpipe_overlap.py": (
        "--from-json bench/results/dualpipe_overlap.json --out {out}/overlap.md",
        ["overlap.md"],
    ),
    "tune_hetero_validation.py": (
        "--rounds 1 --plans 1 --steps 1 --seq 16 --global-batch 4 --out {out}/thv",
        ["thv.md", "thv.json"],
    ),
}
# helpers imported by the scripts above, not scripts
HELPERS = {"_procs.py": "launcher helpers", "_tune_report.py": "tune_validation's report",
           "compare_report.py": "compare_strategies' report", "profile_comm.py": "compare_strategies' profiler",
           "compare_options.py": "compare_strategies' options and runs (`bench --help`)",
           "_timeline.py": "pipeline's and hetero's timeline drawing"}  # fmt: skip
# script -> why it has no smoke run here (each with its smallest setting, for a manual run)
SKIPPED: dict[str, str] = {
    "convert.py": "its smallest checkpoint (--size-gb 0.002: one layer and two 128 MB embeddings of the fixed Llama"
    " shape, ~300 MB written and read 4 times) in 6 spawned processes takes about a minute on 2 cores; by hand:"
    " python bench/convert.py --size-gb 0.002 --shard 50MB --tp 2 --workdir /tmp/convert-bench",
}


def _run(script: str, args: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, BENCH_START_METHOD="fork", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(BENCH / script), *args.replace("{out}", str(out)).split()]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _timed_run(script: str, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = _run(script, SMOKE[script][0], out)
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def bench_runs(request, launcher, tmp_path_factory):
    """script -> (its output folder, a handle on its run): the selected scripts, two at a time in test order."""
    launcher.close()  # own processes (as the marker does for each test): no idle shared workers on the cores
    scripts = [item.callspec.params["script"] for item in selected(request, "test_bench_script_runs")]
    with background(workers=2) as jobs:
        folders = {}
        for script in scripts:
            folders[script] = tmp_path_factory.mktemp(script.removesuffix(".py"))
            jobs.submit(script, _timed_run, script, folders[script])
        yield {script: (folders[script], jobs) for script in scripts}


def test_every_script_is_listed():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == set(SMOKE) | set(HELPERS) | set(SKIPPED), "give each new bench/ script a smoke setting here"


@pytest.mark.own_processes
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_bench_script_runs(script, bench_runs):
    _, expected = SMOKE[script]
    out, jobs = bench_runs[script]
    proc, seconds = jobs.result(script)
    assert proc.returncode == 0, f"{script} exited {proc.returncode} after {seconds:.0f} s:\n{proc.stderr[-4000:]}"
    for item in expected:
        written = list(out.rglob(item))
        assert written or item in proc.stdout, f"{script} wrote no {item} and did not print it:\n{proc.stdout[-2000:]}"


@pytest.mark.parametrize("script", sorted(SKIPPED))
def test_bench_script_skipped(script):
    pytest.skip(SKIPPED[script])


def test_dead_rank_ends_the_run():
    """A rank that dies ends the collection with its exit code at once; the ranks still running are terminated."""
    sys.path.insert(0, str(BENCH))
    try:
        from _procs import collect
    finally:
        sys.path.remove(str(BENCH))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=sys.exit, args=(3,))]
    for p in procs:
        p.start()
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        collect(procs, queue, 2, timeout=60, name="dead")
    assert time.perf_counter() - start < 20
    assert all(p.exitcode is not None for p in procs)


def test_a_tensor_result_is_refused():
    """A tensor on the result queue travels as a shared-memory handle that dies with its rank (an ``EOFError`` now
    and then in CI, when the rank exits first): :func:`collect` refuses one wherever it sits in the result."""
    sys.path.insert(0, str(BENCH))
    try:
        from _procs import collect
    finally:
        sys.path.remove(str(BENCH))
    queue = multiprocessing.get_context("fork").Queue()
    queue.put((0, {"mode": [1.0, torch.zeros(2)]}))
    with pytest.raises(TypeError, match="put a tensor on the result queue"):
        collect([], queue, 1, timeout=10, name="tensor")
    queue.put((0, {"mode": [1.0, 2.0]}))
    assert collect([], queue, 1, timeout=10, name="plain") == [(0, {"mode": [1.0, 2.0]})]
