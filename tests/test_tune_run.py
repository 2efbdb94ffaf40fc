"""Tuner parts that start their own processes: ``tune --calibrate``'s micro-benchmarks (a spawned gloo world) and
``tune --run`` (candidates trained by ``lightning-flagscale fit`` subprocesses). Timing is never asserted: what a
measurement is depends on the machine's load; what the code does with it is tested on a clock the test controls."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch.multiprocessing as mp
import yaml

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.tune import HardwareProfile, estimate_step, load_profile, search, tune_main
from lightning_flagscale.tune.calibrate import _busy_seconds, _run_world, calibrate, fit_alpha_beta
from lightning_flagscale.tune.hardware import COLLECTIVES
from lightning_flagscale.tune.search import describe_layout
from tests._world_ranks import world_rank

pytestmark = pytest.mark.own_processes


def test_alpha_beta_fit_recovers_a_line():
    alpha, busbw = fit_alpha_beta([(x, 2e-5 + x / 3e9) for x in (1e3, 1e5, 1e7)])
    assert math.isclose(alpha, 2e-5, rel_tol=1e-6) and math.isclose(busbw, 3e9, rel_tol=1e-6)


def test_optimizer_busy_time_shares_the_cores():
    # 4 ranks on 2 cores took 1 s each for the optimizer phase: each was busy 0.5 s (the cost model multiplies back)
    assert _busy_seconds(1.0, ranks=4, units=2) == 0.5
    assert _busy_seconds(1.0, ranks=2, units=4) == 1.0  # a core each: wall time is busy time
    assert _busy_seconds(1.0, ranks=4, units=0) == 1.0  # units unknown (GPUs): unchanged
    with pytest.raises(ValueError, match="optimizer_numel"):
        calibrate(optimizer_numel=0)


def test_gpu_calibration_is_refused_without_the_gpus_it_needs(monkeypatch, tmp_path):
    # on this machine (no CUDA device): the CUDA path says how many GPUs it needs and has, before measuring anything
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"groups of 4 needs 4 GPUs \(one a rank\); this machine has 0"):
        calibrate(device="cuda", group_sizes=(2, 4))
    with pytest.raises(SystemExit, match=r"groups of 2 needs 2 GPUs \(one a rank\); this machine has 0"):
        tune_main(["--calibrate", "--calibrate-device", "cuda", "--calibrate-groups", "2", "--calibrate-out",
                   str(tmp_path / "gpu.json")])  # fmt: skip
    assert not (tmp_path / "gpu.json").exists()
    with pytest.raises(ValueError, match="calibrate 'cpu' processes or 'cuda' devices"):
        calibrate(device="xpu")


def test_the_calibrate_command_passes_the_device_and_dtype(monkeypatch, tmp_path, capsys):
    # the CLI's wiring (the measurements themselves: test_calibration_produces_a_sane_profile): the device defaults
    # to CUDA where there is one, the dtype to the device's (None: calibrate decides), CPU bf16 keeps GEMMs small
    import torch

    import lightning_flagscale.tune.calibrate as calibrate_module

    seen = []
    h100 = load_profile("h100").replace(device_type="NVIDIA H100 80GB HBM3")

    def fake(**kw):
        seen.append(kw)
        return h100

    monkeypatch.setattr(calibrate_module, "calibrate", fake)
    out = ["--calibrate-out", str(tmp_path / "p.json")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tune_main(["--calibrate", *out])
    assert seen[-1]["device"] == "cuda" and "dtype" not in seen[-1] and "gemm_sizes" not in seen[-1]
    printed = capsys.readouterr().out
    assert "(NVIDIA H100 80GB HBM3, flash_attn attention curve, transformer_engine attention curve, torch attention" \
        " curve): peak 989 TFLOP/s" in printed  # fmt: skip
    assert load_profile(tmp_path / "p.json") == h100
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tune_main(["--calibrate", "--calibrate-dtype", "bf16", *out])
    assert seen[-1]["device"] == "cpu" and seen[-1]["dtype"] is torch.bfloat16 and seen[-1]["gemm_sizes"]
    tune_main(["--calibrate", "--calibrate-device", "cuda", "--calibrate-dtype", "fp32", *out])
    assert seen[-1]["device"] == "cuda" and seen[-1]["dtype"] is torch.float32 and "gemm_sizes" not in seen[-1]


def test_gpu_timings_wait_for_the_device(monkeypatch):
    """CUDA kernels run asynchronously: every timed repeat (and each of a forward and its backward) is bracketed by
    a device synchronisation, or the host would time its launches; CPU timings need none."""
    import torch

    from lightning_flagscale.tune.calibrate import _forward_backward_seconds, _median_seconds

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    cuda = torch.device("cuda", 0)
    _median_seconds(lambda: events.append("run"), 3, cuda)
    assert events == ["run"] + ["sync", "run", "sync"] * 3  # warm-up, then each repeat between two waits
    events.clear()
    _forward_backward_seconds(lambda: (events.append("fwd"), lambda: events.append("bwd")), 1, cuda)
    assert events == ["sync", "fwd", "sync", "bwd", "sync"] * 2
    events.clear()
    _median_seconds(lambda: events.append("run"), 2)
    assert events == ["run"] * 3


def test_fused_attention_kernels_are_measured_where_installed(monkeypatch):
    """A GPU calibration curves each fused backend that is installed (flash-attn here, faked; Transformer Engine
    absent), never on CPU processes; the per-call curve of a backend goes through its ring block kernel, on the
    causal half of the score FLOPs."""
    import sys
    import types

    import torch

    from lightning_flagscale.tune.calibrate import _fused_kernels, _kernel_calls, measure_attention_calls

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_interface = types.ModuleType("flash_attn.flash_attn_interface")
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fake.flash_attn_interface)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed
    assert _fused_kernels(torch.device("cuda", 0)) == ["flash_attn"]
    assert _fused_kernels(torch.device("cpu")) == []
    causal = _kernel_calls("torch", (16, 32), 2, 1, 8, 1, torch.float32, torch.device("cpu"), causal=True)
    whole = _kernel_calls("torch", (16, 32), 2, 1, 8, 1, torch.float32, torch.device("cpu"), causal=False)
    assert [f for f, _, _ in causal] == [0.5 * 4 * n * n * 2 * 8 for n in (16, 32)]
    assert [f for f, _, _ in whole] == [4 * n * n * 2 * 8 for n in (16, 32)]
    assert all(fwd > 0 and bwd > 0 for _, fwd, bwd in causal + whole)
    sdpa = measure_attention_calls((16, 32), heads=2, head_dim=8, repeats=1)
    assert [f for f, _, _ in sdpa] == [f for f, _, _ in causal]  # the same FLOPs convention as a fused curve


def test_a_gpu_node_takes_the_network_between_nodes_from_its_builtin_profile():
    # one node measures NVLink, not the network between nodes: an H100 node's profile keeps the built-in H100
    # inter-node links (400G/GPU) rather than pricing multi-node plans at NVLink rates; an unknown GPU gets none
    from lightning_flagscale.tune.calibrate import builtin_inter_node_links

    name, links = builtin_inter_node_links("NVIDIA H100 80GB HBM3")
    h100 = load_profile("h100")
    assert name == "h100" and set(links) == set(COLLECTIVES)
    assert all(links[k] == h100.links[k]["inter"] != h100.links[k]["intra"] for k in COLLECTIVES)
    assert builtin_inter_node_links("NVIDIA A100-SXM4-80GB")[0] == "a100"
    assert builtin_inter_node_links("NVIDIA L40S") is None


def test_a_gpu_calibration_times_a_kernel_bound_reference():
    """``compute_scale`` is fitted on the reference decoder's step: on an H100 the CPU reference (14M parameters on
    64 tokens) would take under a millisecond of kernels, i.e. its launches, and set the factor for launch-bound
    work; the GPU's (Llama-3-8B blocks on 4096 tokens, dense and MoE) is priced at tens of milliseconds."""
    from lightning_flagscale.tune.calibrate import references
    from lightning_flagscale.tune.cost import _rank_pass

    h100 = load_profile("h100").replace(compute_scale=1.0)

    def seconds(reference: dict) -> float:
        config = TransformerConfig(**reference)
        one = _rank_pass(config, ParallelConfig().resolve(1), config.max_seq_len, h100)
        return one.f + one.b

    dense, moe = references("cuda")
    assert TransformerConfig(**moe).num_experts == 8 and seconds(dense) > 0.01 and seconds(moe) > 0.01
    assert seconds(references("cpu")[0]) < 1e-3


def test_a_calibration_world_that_hangs_is_killed_and_named(monkeypatch):
    import signal
    import types

    import lightning_flagscale.tune.calibrate as calibrate_module

    worlds = []
    start_processes = calibrate_module.mp.start_processes

    def recorded(*args, **kwargs):
        worlds.append(start_processes(*args, **kwargs))
        return worlds[-1]

    monkeypatch.setattr(calibrate_module.mp, "start_processes", recorded)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    assert _run_world(world_rank, ("ok", results), 2, results, timeout=300) == ("done", "ok")
    with pytest.raises(TimeoutError, match="calibration world of 2 ranks did not finish within 3 s"):
        _run_world(world_rank, ("hang", results), 2, ctx.Queue(), timeout=3)
    # killed, not waited for: the hung rank (asleep for an hour) ended by SIGKILL, nothing of the world alive
    hung = worlds[-1].processes
    assert not any(p.is_alive() for p in hung) and hung[1].exitcode == -signal.SIGKILL, [p.exitcode for p in hung]
    # rank 0 reports, rank 1 never exits. The deadline is read on a clock that jumps past it once the report is in:
    # however long the spawned interpreters take to start on a loaded machine, the report comes first.
    shared = ctx.Queue()

    class Reported:
        seen = False

        def get(self, timeout):
            value = shared.get(timeout=timeout)
            Reported.seen = True
            return value

    def monotonic() -> float:
        return time.monotonic() + (1e6 if Reported.seen else 0.0)

    monkeypatch.setattr(calibrate_module, "time", types.SimpleNamespace(monotonic=monotonic))
    with pytest.raises(TimeoutError, match="did not exit within 300 s after the world reported"):
        _run_world(world_rank, ("hang", shared), 2, Reported(), timeout=300)
    assert worlds[-1].processes[1].exitcode == -signal.SIGKILL


def test_a_calibration_rank_that_fails_fails_the_calibration():
    ctx = mp.get_context("spawn")
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 broke"):
        _run_world(world_rank, ("fail", ctx.Queue()), 2, ctx.Queue(), timeout=300)


def test_a_rank_that_aborts_while_exiting_after_the_report_is_named_and_the_results_kept():
    # torch 2.13 + gloo sometimes ends a finished process with "terminate called without an active exception"
    ctx = mp.get_context("spawn")
    results, reported = ctx.Queue(), ctx.Event()
    with pytest.warns(UserWarning, match="process 1 terminated with signal SIGABRT after its world reported"):
        assert _run_world(world_rank, ("abort_after", results, reported), 2, results, timeout=300) == (
            "done",
            "abort_after",
        )
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        _run_world(world_rank, ("abort_before", ctx.Queue()), 2, ctx.Queue(), timeout=300)


def test_four_rank_calibration_times_every_group_size():
    # 4 ranks: the 2-rank points come from both pairs at once ({0, 1} and {2, 3}, as training runs its groups;
    # P2P between 2i and 2i+1), the 4-rank ones from the whole world; every collective gets a point per size
    from lightning_flagscale.tune.calibrate import measure_collectives

    links = measure_collectives(group_sizes=(2, 4), sizes=(4 << 10, 64 << 10), repeats=1)
    for kind in COLLECTIVES:
        sizes = [2] if kind == "p2p" else [2, 4]
        assert sorted(links[kind]) == sizes, kind
        for n in sizes:
            assert links[kind][n].group_size == n and links[kind][n].latency >= 0 and links[kind][n].bus_bandwidth > 0


def test_calibration_produces_a_complete_profile(tmp_path):
    """A real calibration (a spawned gloo world) yields every part of a profile, finite and in the form the cost
    model reads. What the timings are is not asserted (a loaded machine decides them); what the code derives from
    them is: efficiencies relative to the measured peak, residuals never negative, the reference step reproduced,
    and a profile the search runs on. How the measurements become the profile, with a clock the test controls:
    ``test_calibration_arithmetic_under_an_injected_clock``."""
    profile = calibrate(group_sizes=(2,), message_bytes=(4 << 10, 256 << 10), gemm_sizes=(32, 128), seq_lens=(64,),
                        repeats=2, optimizer_numel=1 << 20, worlds=1)  # fmt: skip

    def positive(*values: float) -> bool:
        return all(math.isfinite(v) and v > 0 for v in values)

    def residual(*values: float) -> bool:  # clamped at zero by the calibration
        return all(math.isfinite(v) and v >= 0 for v in values)

    assert positive(profile.peak_flops, profile.hbm_bandwidth, profile.optimizer_seconds_per_param)
    assert positive(profile.input_grad_gemm_factor, profile.weight_grad_gemm_factor)  # measured, not assumed
    assert all(0 < eff <= 1 for _, eff in profile.gemm) and max(eff for _, eff in profile.gemm) == 1.0
    assert [f for f, _ in profile.gemm] == sorted({2.0 * r * n * n for n in (32, 128) for r in (n, 8 * n)})
    assert 0 < profile.attention_efficiency <= 1
    assert profile.compute_units_per_node >= 1  # the cores the spawned ranks share
    # the end-to-end factor from the reference decoder step: the profile then predicts that step's busy time
    assert positive(profile.compute_scale) and "reference decoder step" in profile.source
    from lightning_flagscale.tune.calibrate import REFERENCE, reference_compute_scale
    from lightning_flagscale.tune.cost import _rank_pass

    reference = TransformerConfig(**REFERENCE)
    scaled = profile.replace(compute_scale=reference_compute_scale(profile, 0.05))
    one = _rank_pass(reference, ParallelConfig().resolve(1), reference.max_seq_len, scaled)
    assert one.f + one.b == pytest.approx(0.05)  # a 50 ms reference step is what the scaled profile predicts
    # each row count's factor over the GEMM curve, the curve itself from 512 rows up
    assert [r for r, _ in profile.gemm_rows] == [8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0]
    assert profile.gemm_rows[-1] == (512.0, 1.0) and positive(*(f for _, f in profile.gemm_rows))
    # attention calls and ring blocks by size, forward and backward apart
    for points in (profile.attention_calls, profile.ring_blocks):
        assert len(points) >= 4 and all(positive(f, fwd, bwd) for f, fwd, bwd in points)
    # the DTensor TP plan's host time (per block and at the ends, forward and backward), a blocking collective's
    # wait with every rank computing, an MoE block's and selective recompute's residuals, the schedule's host time
    # per action and the training loop's own cost per step: residuals, never negative
    assert len(profile.tp_overhead) == 4 and residual(*profile.tp_overhead)
    assert [n for n, _ in profile.blocking_collective] == [2.0] and residual(profile.blocking_collective[0][1])
    assert len(profile.moe_overhead) == 2 and residual(*profile.moe_overhead)
    assert len(profile.selective_overhead) == 2 and residual(*profile.selective_overhead)
    assert residual(profile.pipeline_action_overhead, profile.step_overhead)
    for kind in COLLECTIVES:
        point = profile.link(kind, 2, "intra")
        assert point.group_size == 2 and residual(point.latency) and positive(point.bus_bandwidth)
    # CPU processes: gloo, no fused kernel curves (flash-attn and TE need a GPU)
    assert profile.device_type.startswith("cpu-") and "gloo, CPU, float32" in profile.source
    assert profile.attention_kernels == {}
    profile.save(tmp_path / "cpu.json")
    assert load_profile(tmp_path / "cpu.json") == profile
    tiny = TransformerConfig.from_preset("llama-tiny")
    assert search(tiny, 2, seq_len=64, global_batch=4, hardware=profile, top_k=3).candidates


def test_calibration_arithmetic_under_an_injected_clock(monkeypatch):
    """Every region the calibration times lasts exactly ``TICK`` on a fake clock, and the spawned world's timings
    are given: the profile is then fixed, and each part is what the measurements make of it (a rate is FLOPs or
    bytes over the time, an efficiency that rate over the peak, an attention backward 2.5x the forward's FLOPs, a
    time on cores shared by more ranks than cores scaled to the busy time)."""
    import types

    import torch

    import lightning_flagscale.tune.calibrate as cal
    from lightning_flagscale.tune.cost import _rank_pass
    from lightning_flagscale.tune.hardware import LinkPoint

    tick = 1e-3
    clock = {"now": 0.0}

    def perf_counter() -> float:
        clock["now"] += tick
        return clock["now"]

    monkeypatch.setattr(cal, "time", types.SimpleNamespace(perf_counter=perf_counter, monotonic=time.monotonic,
                                                           strftime=time.strftime))  # fmt: skip
    links = {kind: {2: LinkPoint(group_size=2, latency=1e-5, bus_bandwidth=1e9)} for kind in COLLECTIVES}
    world = cal._WorldTimes(optimizer=2e-9, reference=0.2, tp_overhead=(1e-3, 2e-3, 3e-3, 4e-3), blocking={2: 5e-4},
                            moe=(1.0, 2.0, 3.0, 5.0), selective=(1.0, 2.0, 3.0, 5.0), pipeline=0.5, loop=0.3)  # fmt: skip
    monkeypatch.setattr(cal, "_measure_world", lambda *args, **kwargs: (links, world))
    monkeypatch.setattr(cal.os, "cpu_count", lambda: 1)  # 2 ranks on 1 core: busy time is half the wall time
    shapes = cal.Shapes(gemm_sizes=(16, 32), seq_lens=(16, 32), message_bytes=(1024,), attention_calls=(8, 16, 32),
                        attention_heads=2, attention_head_dim=8, ring_blocks=(8, 16), rows_width=64,
                        memory_numel=1024)  # fmt: skip
    profile = cal._calibrate((2,), shapes, 1, 1e9, "fake", torch.float32, 1 << 10, 1)

    def flat(points) -> list[float]:
        return [v for point in points for v in point]

    flops = sorted({2.0 * r * n * n for n in (16, 32) for r in (n, 8 * n)})
    peak = flops[-1] / tick
    assert profile.peak_flops == pytest.approx(peak, rel=1e-12)
    assert flat(profile.gemm) == pytest.approx(flat((f, f / flops[-1]) for f in flops), rel=1e-12)
    assert profile.input_grad_gemm_factor == pytest.approx(1.0) and profile.weight_grad_gemm_factor == pytest.approx(
        1.0
    )
    best_attention = 0.5 * 4 * 32 * 32 * 4 * 64 / tick  # measure_attention's default heads (4) and head dim (64)
    assert profile.attention_efficiency == pytest.approx(min(1.0, best_attention / peak), rel=1e-12)
    calls = [(0.5 * 4 * s * s * 2 * 8, 0.5 * 4 * s * s * 2 * 8 / (tick * peak), 2.5 * 0.5 * 4 * s * s * 2 * 8 /
              (tick * peak)) for s in (8, 16, 32)]  # fmt: skip
    assert flat(profile.attention_calls) == pytest.approx(flat(calls), rel=1e-12)
    blocks = [(4.0 * n * n * 2 * 8, 4.0 * n * n * 2 * 8 / (tick * peak), 2.5 * 4.0 * n * n * 2 * 8 / (tick * peak))
              for n in (8, 16)]  # fmt: skip
    assert flat(profile.ring_blocks) == pytest.approx(flat(blocks), rel=1e-12)
    assert profile.hbm_bandwidth == pytest.approx(3 * 4 * 1024 / tick, rel=1e-12)
    assert profile.gemm_rows[-1] == (512.0, 1.0) and len(profile.gemm_rows) == 7
    # the world's timings, as busy time of 2 ranks sharing 1 core
    assert profile.compute_units_per_node == 1.0
    assert profile.optimizer_seconds_per_param == pytest.approx(1e-9, rel=1e-12)
    assert profile.tp_overhead == pytest.approx((5e-4, 1e-3, 1.5e-3, 2e-3), rel=1e-12)
    assert profile.blocking_collective == [(2.0, 5e-4)]
    assert profile.link("all_reduce", 2, "intra") == links["all_reduce"][2]
    # the scaled profile predicts the reference step's busy time (0.2 s of wall time on half a core)
    reference = TransformerConfig(**cal.REFERENCE)
    one = _rank_pass(reference, ParallelConfig().resolve(1), reference.max_seq_len, profile)
    assert one.f + one.b == pytest.approx(0.1, rel=1e-9)
    # the MoE router's GEMM runs in fp32 whatever the dtype: calibrated in fp32, its rate is the peak; in bf16, fp32
    # GEMMs are timed apart (here made 4x slower than the bf16 ones) and their fastest size's rate is fp32_peak_flops
    assert profile.fp32_peak_flops == profile.peak_flops and profile.fp32_gemm == []
    linear = cal.measure_linear_gemms

    def fp32_slower(sizes, dtype, **kw):
        return [
            (f, fwd / (4 if dtype == torch.float32 else 1), ig, wg) for f, fwd, ig, wg in linear(sizes, dtype, **kw)
        ]

    monkeypatch.setattr(cal, "measure_linear_gemms", fp32_slower)
    bf16 = cal._calibrate((2,), shapes, 1, 1e9, "fake", torch.bfloat16, 1 << 10, 1)
    assert bf16.peak_flops == pytest.approx(peak, rel=1e-12)
    assert bf16.fp32_peak_flops == pytest.approx(peak / 4, rel=1e-12)
    assert flat(bf16.fp32_gemm) == pytest.approx(flat(profile.gemm), rel=1e-12)  # every size 4x slower: same curve


def test_run_trains_the_top_candidate_and_writes_it_as_a_recipe(tmp_path, capsys):
    # A profile whose fittable range (compute_scale 1e-3..1e3) spans measured steps from ~0.5 ms to ~500 s: at a
    # 2e10 peak its fastest reachable step was 53 ms, and a step measured faster than that (36-43 ms here) was
    # rightly refused by the fit; the test depended on this machine being slow.
    HardwareProfile(name="cpu", device_type="cpu-1threads", peak_flops=2e12, hbm_bandwidth=5e9).save(
        tmp_path / "p.json"
    )
    best = tmp_path / "best.yaml"
    tune_main(["--preset", "llama-tiny", "--devices", "2", "--seq-len", "32", "--global-batch", "4", "--profile",
               str(tmp_path / "p.json"), "--schedules", "1f1b", "--run", "1", "--run-steps", "3", "--run-dir",
               str(tmp_path / "runs"), "--write-recipe", str(best), "--refit-profile", str(tmp_path / "refit.json")])  # fmt: skip
    out = capsys.readouterr().out
    row = re.search(r"^(\S.*?)\s+([\d.]+)s\s+([\d.]+)s ok", out, re.MULTILINE)
    assert row, out
    layout, predicted, measured = row.group(1), float(row.group(2)), float(row.group(3))
    assert predicted > 0 and measured > 0  # measured next to predicted (values are not asserted: a loaded machine)
    recipe = yaml.safe_load(best.read_text())
    assert recipe["trainer"]["devices"] == 2 and recipe["trainer"]["accelerator"] == "cpu"
    written = ParallelConfig(**recipe["trainer"]["strategy"]["init_args"]).resolve(2)
    assert describe_layout(written) == layout  # the measured best is what the recipe trains
    # the profile refitted on the one run predicts exactly that run's measured step (no timing asserted: the
    # measurement is whatever this machine gave, the fit must reproduce it)
    refit = load_profile(tmp_path / "refit.json")
    assert "refitted on 1" in refit.source and refit.compute_scale != 1.0
    model = TransformerConfig.from_preset("llama-tiny")
    step = estimate_step(model, written, 32, 4, refit).step_seconds
    assert step == pytest.approx(measured, abs=1e-3)  # `measured` as printed, to the millisecond


def test_a_hetero_recipe_written_by_tune_trains_with_fit(tmp_path, capsys):
    # tune --hetero --write-recipe on two CPU device groups (one 4x faster), then `fit --config` on that file: the
    # plan as written is a recipe the CLI trains (4 processes, a couple of steps)
    from lightning_flagscale.tune.hardware import LinkPoint
    from lightning_flagscale.tune.runner import _run_one

    link = [LinkPoint(group_size=2, latency=1e-5, bus_bandwidth=1e10)]
    fast = HardwareProfile(name="fast", device_type="cpu-fast", peak_flops=4e10, hbm_bandwidth=5e10, memory_bytes=1e9,
                           links={k: {"intra": link, "inter": link} for k in COLLECTIVES})  # fmt: skip
    slow = fast.replace(name="slow", device_type="cpu-slow", peak_flops=1e10, hbm_bandwidth=1.25e10)
    for profile in (fast, slow):
        profile.save(tmp_path / f"{profile.name}.json")
    path = tmp_path / "hetero.yaml"
    tune_main(["--preset", "llama-tiny", "--hetero", f"fast:2:{tmp_path / 'fast.json'},slow:2:{tmp_path / 'slow.json'}",
               "--seq-len", "32", "--global-batch", "8", "--write-recipe", str(path), "--recipe-steps", "3"])  # fmt: skip
    assert f"wrote {path}" in capsys.readouterr().out
    recipe = yaml.safe_load(path.read_text())
    assert recipe["trainer"]["accelerator"] == "cpu" and recipe["trainer"]["devices"] == 4
    status, seconds, _, message = _run_one(recipe, tmp_path / "run", timeout=600)
    assert status == "ok" and seconds > 0, message  # it trained and its steps were timed


def test_a_refit_out_of_reach_still_writes_the_recipe_and_fails_loudly(tmp_path, monkeypatch, capsys):
    # Runs measured faster than the profile can reach at any compute_scale: the winner's recipe is written, no
    # profile is, and the command exits with the fit's reason instead of a traceback.
    import lightning_flagscale.tune.runner as runner
    from lightning_flagscale.tune.runner import RunResult

    def fake_runs(model, candidates, *, k, **kwargs):
        return [RunResult(candidate=c, status="ok", measured_step_seconds=1e-9) for c in candidates[:k]]

    monkeypatch.setattr(runner, "run_candidates", fake_runs)
    HardwareProfile(name="cpu", device_type="cpu-1threads", peak_flops=2e10, hbm_bandwidth=5e9).save(
        tmp_path / "p.json"
    )
    best, refit = tmp_path / "best.yaml", tmp_path / "refit.json"
    with pytest.raises(SystemExit, match=r"--refit-profile .*refit.json not written: no compute_scale .* fast end"):
        tune_main(["--preset", "llama-tiny", "--devices", "2", "--seq-len", "32", "--global-batch", "4", "--profile",
                   str(tmp_path / "p.json"), "--run", "2", "--run-dir", str(tmp_path / "runs"), "--write-recipe",
                   str(best), "--refit-profile", str(refit)])  # fmt: skip
    assert best.exists() and not refit.exists()
    assert "measured / predicted" in capsys.readouterr().out


def test_refit_profile_without_run_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="add --run"):
        tune_main(["--preset", "llama-tiny", "--devices", "2", "--seq-len", "32", "--global-batch", "4",
                   "--refit-profile", str(tmp_path / "r.json")])  # fmt: skip
