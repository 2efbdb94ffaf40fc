"""Tuner search, profiles, CLI and heterogeneous plans (issue 16 items 2, 4, 5, 7): every candidate is a valid
``ParallelConfig``, profiles and ``--json`` round-trip, hetero plans validate, errors name the constraint, and the
written recipe parses and builds the strategy."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re

import pytest
import yaml

from lightning_flagscale.config import ParallelConfig, TransformerConfig
from lightning_flagscale.config.layer_split import edge_extra_blocks
from lightning_flagscale.config.schedules import SCHEDULE_NAMES
from lightning_flagscale.parallel.data_parallel.grad_buckets import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.tune import (
    BUILTIN_PROFILES,
    Hardware,
    HardwareProfile,
    SearchSpace,
    load_profile,
    search,
    tune_main,
)
from lightning_flagscale.tune.cost import estimate_step
from lightning_flagscale.tune.hardware import builtin_profile
from lightning_flagscale.tune.hetero import DeviceGroup, _stage_cost, balance_layers, plan_hetero, plan_hetero_dp
from lightning_flagscale.tune.runner import HistoryPruner, _strategy_args
from lightning_flagscale.tune.search import enumerate_layouts

TINY = TransformerConfig.from_preset("llama-tiny")
MOE = TransformerConfig.from_preset("mixtral-tiny", num_layers=8)  # enough blocks for 4 stages x 2 chunks


def test_search_drops_virtual_sizes_the_even_split_cannot_take():
    # 6 layers on 2 ranks: VPP 2 leaves 3 slots a rank for 2 chunks; the search used to rank it and fail inside the
    # memory model's stage plan. It is refused (counted), and VPP 3 is searched instead.
    model = TransformerConfig.from_preset("llama-tiny", num_layers=6)
    space = SearchSpace(schedules=("interleaved_1f1b",), virtual_sizes=(2, 3), zero_stages=(1,), recompute=("none",))
    result = search(model, 2, seq_len=64, global_batch=8, hardware=builtin_profile("h100"), space=space, top_k=None)
    vpps = {c.config.virtual_pipeline_parallel_size for c in result.candidates if c.config.pp_enabled}
    assert vpps == {3}
    assert any(reason.startswith("invalid: virtual_pipeline_parallel_size=2 does") for reason in result.pruned)


def test_every_candidate_of_the_full_space_constructs_and_validates():
    space = SearchSpace(expert_tensor_parallel_sizes=(1, 2, 8))  # ETP 8 does not fit with EP > 1: counted, dropped
    layouts, refused = enumerate_layouts(MOE, 8, seq_len=64, global_batch=16, space=space)
    assert len(layouts) > 500
    assert any(reason.startswith("invalid: expert_parallel_size x expert_tensor_parallel_size") for reason in refused)
    seen = {
        "schedules": {c.pipeline_schedule for c in layouts if c.pp_enabled},
        "vpp": {c.virtual_pipeline_parallel_size for c in layouts},
        "cp_modes": {c.context_parallel_mode for c in layouts if c.cp_enabled},
        "ep": {c.expert_parallel_size for c in layouts},
        "zero": {c.zero_stage for c in layouts},
        "recompute": {c.recompute for c in layouts},
        "mbs": {c.micro_batch_size for c in layouts},
        "tp": {c.tensor_parallel_size for c in layouts},
        "etp": {c.expert_tensor_parallel_size for c in layouts},
    }
    assert seen["schedules"] == set(SCHEDULE_NAMES) and seen["vpp"] >= {1, 2, 4}
    assert seen["cp_modes"] == {"ring", "ulysses", "hybrid"} and seen["ep"] >= {1, 2, 4, 8}
    assert seen["zero"] == {0, 1, 2, 3} and seen["recompute"] == {"none", "selective", "full"}  # MoE: no selective_mm
    dense, _ = enumerate_layouts(TransformerConfig.from_preset("llama-tiny"), 2, seq_len=64, global_batch=8)
    assert {c.recompute for c in dense} == {"none", "selective", "selective_mm", "full"}
    assert seen["mbs"] == {1, 2, 4} and seen["tp"] >= {1, 2} and seen["etp"] == {1, 2, 8}
    for c in layouts:  # the strategy's keyword arguments rebuild exactly this layout, and it validates
        rebuilt = ParallelConfig(**_strategy_args(c)).resolve(8)
        rebuilt.validate_model(MOE)
        assert rebuilt == c and c.world_size == 8


def test_search_ranks_by_predicted_time_within_the_budget():
    hw = builtin_profile("h100").replace(memory_bytes=2e7)
    result = search(MOE, 8, seq_len=64, global_batch=16, hardware=hw, top_k=None)
    assert result.candidates and result.pruned["memory"] > 0
    times = [c.step_seconds for c in result.candidates]
    assert times == sorted(times)
    assert all(c.memory_bytes <= 2e7 for c in result.candidates)
    best = result.candidates[0].cost
    assert best.step_seconds >= best.bubble_seconds >= 0 and 0 < best.mfu < 1


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_profile_json_round_trip(name, tmp_path):
    profile = builtin_profile(name).replace(compute_scale=0.61)
    profile.save(tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    assert loaded == profile
    assert loaded.collective_seconds("all_reduce", 1e9, 8) == profile.collective_seconds("all_reduce", 1e9, 8)
    assert loaded.gemm_efficiency(1e12) == profile.gemm_efficiency(1e12)


def test_profile_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"a100.*h100.*h200"):
        load_profile("b300")
    bad = builtin_profile("h100").to_dict() | {"flops": 1.0}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown keys \\['flops'\\]"):
        load_profile(tmp_path / "bad.json")


def test_link_model_is_alpha_beta_per_collective():
    p = builtin_profile("h100")
    n, size = 8, 1e9
    ar = p.link("all_reduce", n, "intra")
    assert p.collective_seconds("all_reduce", size, n) == pytest.approx(
        ar.latency + 2 * 7 / 8 * size / ar.bus_bandwidth
    )
    ag = p.link("all_gather", n, "inter")
    assert p.collective_seconds("all_gather", size, n, inter_node=True) == pytest.approx(
        ag.latency + 7 / 8 * size / ag.bus_bandwidth
    )
    assert p.collective_seconds("all_reduce", size, 1) == 0.0
    assert p.gemm_efficiency(1e6) < p.gemm_efficiency(1e10) < p.gemm_efficiency(1e14) <= 1.0
    legacy = Hardware(flops=1e12, intra_node_bandwidth=2e9, inter_node_bandwidth=1e9, memory_bytes=4e9)
    assert legacy.peak_flops == 1e12 and legacy.memory_bytes == 4e9 and legacy.gemm_efficiency(1.0) == 1.0
    assert legacy.collective_seconds("p2p", 1e9, 2, inter_node=True) == 1.0  # the pre-profile fields still work


def _tune_json(capsys, *argv: str) -> dict:
    tune_main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_cli_json_round_trips_to_configs(capsys):
    out = _tune_json(capsys, "--preset", "mixtral-tiny", "--devices", "4", "--seq-len", "64", "--global-batch", "8",
                     "--top", "7", "--profile", "a100")  # fmt: skip
    assert out["profile"] == "a100" and len(out["candidates"]) == 7
    for row in out["candidates"]:
        c = ParallelConfig(**row["parallel"]).resolve(4)
        assert c.dp == row["data_parallel_size"]
        assert row["memory_bytes"] <= row["memory_budget_bytes"] == 80e9
        for key in ("tokens_per_second", "mfu", "bubble_seconds", "exposed_comm_seconds", "step_seconds"):
            assert row[key] >= 0
    assert [r["step_seconds"] for r in out["candidates"]] == sorted(r["step_seconds"] for r in out["candidates"])


def test_cli_errors_name_the_constraint(capsys):
    with pytest.raises(SystemExit, match=r"needs .* GB per device against the 0.0 GB budget \(memory constraint\)"):
        tune_main(["--preset", "llama-tiny", "--devices", "4", "--seq-len", "64", "--global-batch", "8",
                   "--memory-gb", "0.001"])  # fmt: skip
    with pytest.raises(
        SystemExit,
        match=r"No valid layout for 5 devices: every candidate was refused: .*batch: global batch not divisible",
    ):
        tune_main(["--preset", "llama-tiny", "--devices", "5", "--seq-len", "64", "--global-batch", "4"])
    with pytest.raises(SystemExit, match="Unknown hardware profile 'tpu'"):
        tune_main(["--preset", "llama-tiny", "--devices", "2", "--profile", "tpu"])
    with pytest.raises(SystemExit, match="TYPE:COUNT:PROFILE"):
        tune_main(["--preset", "llama-tiny", "--hetero", "H100-8"])


def test_run_trains_on_the_device_the_profile_describes(tmp_path, monkeypatch, capsys):
    """``--run`` trains CPU processes for a CPU profile and CUDA devices for a GPU one, and refuses up front what this
    machine cannot run: a GPU plan on too few CUDA devices (its predictions compared with, or refitted on, CPU steps
    would mean nothing) and a fused attention backend on CPU processes."""
    import torch

    import lightning_flagscale.tune.runner as runner
    from lightning_flagscale.tune.runner import RunResult

    argv = ["--preset", "llama-tiny", "--devices", "2", "--seq-len", "64", "--global-batch", "4", "--run", "1",
            "--run-dir", str(tmp_path / "runs")]  # fmt: skip
    seen = []

    def fake_runs(model, candidates, *, k, accelerator, **kwargs):
        seen.append((model.attn_backend, accelerator))
        return [RunResult(c, "ok", 0.5, 3e9, 2.5e9 if accelerator == "gpu" else None) for c in candidates[:k]]

    monkeypatch.setattr(runner, "run_candidates", fake_runs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"profile 'h100' \(H100\) plans 2 GPUs; this machine has 0 CUDA device"):
        tune_main(argv)  # the built-in H100 profile, no GPU here
    HardwareProfile(name="cpu", device_type="cpu-1threads", peak_flops=2e10, hbm_bandwidth=5e9).save(
        tmp_path / "cpu.json"
    )
    cpu = [*argv, "--profile", str(tmp_path / "cpu.json")]
    with pytest.raises(SystemExit, match=r"--run trains the candidates here on CPU processes .* where"
                       r" attn_backend='flash_attn' cannot run"):  # fmt: skip
        tune_main([*cpu, "--attn-backend", "flash_attn"])
    assert seen == []  # nothing ran
    tune_main(cpu)
    assert seen == [("torch", "cpu")] and "allocated" not in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "runs" / "best.yaml").read_text())["trainer"]["accelerator"] == "cpu"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit, match="plans 2 GPUs; this machine has 1 CUDA device"):
        tune_main(argv)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    tune_main([*argv, "--attn-backend", "flash_attn"])  # a fused backend trains on GPUs
    out = capsys.readouterr().out
    assert seen[-1] == ("flash_attn", "gpu") and "note:" not in out
    assert re.search(r" ok memory [\d.]+ GB predicted, 2.50 GB allocated", out), out  # the device peak, not RSS
    assert yaml.safe_load((tmp_path / "runs" / "best.yaml").read_text())["trainer"]["accelerator"] == "gpu"
    tune_main([*argv, "--profile", "a100"])  # an A100 plan run on H100s: said, not refused
    assert seen[-1] == ("torch", "gpu")
    assert "note: profile 'a100' describes A100 devices and this machine runs 'NVIDIA H100" in capsys.readouterr().out


def test_run_candidates_train_on_the_accelerator_they_are_given(tmp_path, monkeypatch):
    import lightning_flagscale.tune.runner as runner

    recipes = []

    def fake_run_one(recipe, workdir, timeout):
        recipes.append(recipe)
        return "ok", 0.1, {"rss": 1e9, "device": 5e8}, ""

    monkeypatch.setattr(runner, "_run_one", fake_run_one)
    model = TransformerConfig.from_preset("llama-tiny")
    cands = search(model, 2, seq_len=64, global_batch=4, hardware=load_profile("h100"), top_k=2).candidates
    runs = runner.run_candidates(model, cands[:1], k=1, seq_len=64, global_batch=4, devices=2, workdir=tmp_path,
                                 accelerator="gpu")  # fmt: skip
    assert [r["trainer"]["accelerator"] for r in recipes] == ["gpu"]
    assert [(r.status, r.peak_rss_bytes, r.peak_device_bytes) for r in runs] == [("ok", 1e9, 5e8)]
    assert runs[0].to_dict()["peak_device_bytes"] == 5e8


def test_the_step_timer_waits_for_the_device_and_reads_its_peak(tmp_path, monkeypatch):
    """On a CUDA device each step's end waits for the kernels (the host would time its launches) and the device's
    allocator peak is recorded; a CPU rank records none."""
    import types

    import torch

    from lightning_flagscale.tune.runner import StepTimer

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123)
    trainer = types.SimpleNamespace(global_rank=1)
    for device, expect in ((torch.device("cuda", 1), 123), (torch.device("cpu"), None)):
        calls.clear()
        timer, module = StepTimer(str(tmp_path / device.type)), types.SimpleNamespace(device=device)
        timer.on_train_batch_end(trainer, module, None, None, 0)
        timer.on_train_end(trainer, module)
        assert calls == ([("sync", device)] if expect else []) and len(timer.times) == 1
        data = json.loads((tmp_path / device.type / "1.json").read_text())
        assert data["peak_device"] == expect and data["peak_rss"] > 0


def test_the_gradient_bucket_size_reaches_the_model_the_recipe_and_the_strategy(tmp_path, capsys):
    """``--grad-bucket-numel``: priced (smaller buckets, more calls, each paying the latency), written into the
    recipe the strategy reads, and left out of it at the default."""
    from lightning_flagscale import FlagScaleStrategy

    argv = ["--preset", "llama-tiny", "--devices", "4", "--seq-len", "64", "--global-batch", "8", "--top", "100000"]
    default = {json.dumps(r["parallel"], sort_keys=True): r for r in _tune_json(capsys, *argv)["candidates"]}
    small = {json.dumps(r["parallel"], sort_keys=True): r
             for r in _tune_json(capsys, *argv, "--grad-bucket-numel", "4096")["candidates"]}  # fmt: skip
    assert default.keys() == small.keys()  # the same layouts fit (ZeRO-2's two staging buckets shrink, no more)
    slower = 0
    for key, row in default.items():
        zero, cp = row["parallel"].get("zero_stage", 0), row["parallel"].get("context_parallel_size", 1)
        if row["data_parallel_size"] * cp > 1 and zero < 3:  # buckets reduced over data x context ranks
            # more calls, each paying the latency, but a smaller last bucket after backward
            slower += small[key]["step_seconds"] > row["step_seconds"]
        else:  # no bucket reduction (one replica), or ZeRO-3's per-unit gathers: the bucket size plays no part
            assert small[key]["step_seconds"] == pytest.approx(row["step_seconds"])
    assert slower > 0
    for numel, written in ((4096, True), (DEFAULT_BUCKET_NUMEL, False)):
        path = tmp_path / f"best{numel}.yaml"
        tune_main([*argv[:-2], "--top", "1", "--write-recipe", str(path), "--grad-bucket-numel", str(numel)])
        init_args = yaml.safe_load(path.read_text())["trainer"]["strategy"]["init_args"]
        assert ("grad_bucket_numel" in init_args) is written
        assert FlagScaleStrategy(**init_args).parallel.grad_bucket_numel == numel
    capsys.readouterr()
    with pytest.raises(SystemExit, match="--grad-bucket-numel 0: a bucket holds at least one element"):
        tune_main([*argv, "--grad-bucket-numel", "0"])


def test_written_recipe_parses_and_constructs_the_strategy(tmp_path, capsys):
    from lightning_flagscale import FlagScaleStrategy
    from lightning_flagscale.cli import main
    from lightning_flagscale.data import LMDataModule
    from lightning_flagscale.models import CausalLMModule

    cpu = HardwareProfile(name="cpu-test", device_type="cpu-1threads", peak_flops=5e10, hbm_bandwidth=1e10)
    cpu.save(tmp_path / "cpu.json")
    path = tmp_path / "best.yaml"
    tune_main(["--preset", "llama-tiny", "--devices", "4", "--seq-len", "64", "--global-batch", "8",
               "--profile", str(tmp_path / "cpu.json"), "--write-recipe", str(path), "--top", "1"])  # fmt: skip
    capsys.readouterr()
    recipe = yaml.safe_load(path.read_text())
    assert recipe["trainer"]["accelerator"] == "cpu" and recipe["trainer"]["devices"] == 4
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    parsed = yaml.safe_load(capsys.readouterr().out)
    assert parsed["trainer"]["strategy"]["class_path"].endswith("FlagScaleStrategy")
    strategy = FlagScaleStrategy(**recipe["trainer"]["strategy"]["init_args"])
    best = search(TINY, 4, seq_len=64, global_batch=8, hardware=cpu, top_k=1).candidates[0]
    assert strategy.parallel.resolve(4) == best.config
    CausalLMModule(**recipe["model"])
    LMDataModule(**recipe["data"])


def test_history_pruning_skips_dominated_layouts():
    def layout(**kw) -> ParallelConfig:
        return ParallelConfig(**{"tensor_parallel_size": 2, **kw}).resolve(4)

    pruner = HistoryPruner()
    pruner.record(layout(micro_batch_size=2), "oom")
    assert "memory" in pruner.prune_reason(layout(micro_batch_size=4))
    assert pruner.prune_reason(layout(micro_batch_size=2, zero_stage=1)) is None  # ZeRO-1 holds less
    assert pruner.prune_reason(layout(micro_batch_size=1)) is None  # less memory: worth a try
    assert pruner.prune_reason(layout(micro_batch_size=2, recompute="full")) is None
    pruner.record(layout(zero_stage=1), "ok")
    assert "slower" in pruner.prune_reason(layout(zero_stage=3))
    assert pruner.prune_reason(layout(zero_stage=0)) is None
    pruner.record(layout(recompute="selective"), "ok")
    assert "slower" in pruner.prune_reason(layout(recompute="full"))
    assert pruner.prune_reason(layout(tensor_parallel_size=4)) is None  # a different structure: no rule


def test_balance_layers_equalises_stage_times():
    assert balance_layers([1.0, 3.0], [0.0, 0.0], 32) == [24, 8]
    counts = balance_layers([1.0, 1.0, 1.0], [0.0, 0.0, 4.0], 12)
    assert counts == [5, 5, 2] and sum(counts) == 12
    with pytest.raises(ValueError, match="fewer than the 3 pipeline stages"):
        balance_layers([1.0] * 3, [0.0] * 3, 2)


def _h100_a100(adjust=lambda profile: profile) -> list[DeviceGroup]:
    """8 H100 then 8 A100, their built-in profiles passed through ``adjust``."""
    return [
        DeviceGroup(device_type=kind.upper(), count=8, profile=adjust(builtin_profile(kind)))
        for kind in ("h100", "a100")
    ]


def test_hetero_plans_validate_and_give_faster_devices_more_work():
    groups = _h100_a100()
    model = TransformerConfig.from_preset("llama3-8b")
    plans = plan_hetero(model, groups, seq_len=4096, global_batch=64)
    assert plans and [p.step_seconds for p in plans] == sorted(p.step_seconds for p in plans)
    for plan in plans:
        c = plan.config(16)  # ParallelConfig validates the meshes and the layer split
        stage_configs = c.stage_group_configs(model.num_layers)
        assert sum(plan.parallel["hetero_layers"]) == model.num_layers and len(stage_configs) >= 2
        assert plan.imbalance < 1.3
    best = plans[0].parallel
    h100_stages = best["hetero_meshes"][0]["pipeline_parallel_size"]
    per_stage = best["hetero_layers"]
    assert min(per_stage[:h100_stages]) > max(per_stage[h100_stages:])  # H100 stages take more blocks
    shallow = TransformerConfig.from_preset("llama3-8b", num_layers=4)  # whole model on each device
    dp = plan_hetero_dp(shallow, groups, seq_len=1024, global_batch=64, zero_stage=3)
    sizes = dp.parallel["hetero_dp_batch_sizes"]
    assert sum(sizes) == 64 and min(sizes[:8]) > max(sizes[8:])
    dp.config(16)
    with pytest.raises(ValueError, match="memory constraint"):
        plan_hetero_dp(model, groups, seq_len=4096, global_batch=64, zero_stage=0)
    for tiny in plan_hetero(TINY, [DeviceGroup(device_type=g.device_type, count=2, profile=g.profile) for g in groups],
                            seq_len=128, global_batch=8):  # fmt: skip
        tiny.config(4).stage_group_configs(TINY.num_layers)


def test_hetero_planners_search_zero_stage_and_recompute_to_fit():
    # Each rank of hetero-DP runs its share as one batch: llama3-8b at 4096 tokens and 6 sequences on an H100 does
    # not fit with ZeRO-1 and no recompute (the CLI's example used to end there, advising a knob it does not have);
    # the planner tries the ZeRO stages and recompute policies, and keeps the fastest plan that fits.
    groups = _h100_a100()
    model = TransformerConfig.from_preset("llama3-8b")
    kw = dict(seq_len=4096, global_batch=64)
    with pytest.raises(ValueError, match=r"zero_stage \[1\] x recompute \['none'\].*memory constraint"):
        plan_hetero_dp(model, groups, **kw, zero_stage=1, recompute="none")
    plan = plan_hetero_dp(model, groups, **kw)
    assert plan.parallel["recompute"] != "none"
    assert all(m <= g.profile.memory_bytes for m, g in zip(plan.memory_bytes, [g for g in groups for _ in range(8)]))
    fitting = []
    for rc in ("none", "selective", "selective_mm", "full"):
        for zero in (1, 2, 3):
            with contextlib.suppress(ValueError):
                fitting.append(plan_hetero_dp(model, groups, **kw, zero_stage=zero, recompute=rc).step_seconds)
    assert plan.step_seconds == min(fitting)
    plan.config(16)
    # selective_mm runs on dense blocks only: an MoE model tries the other policies, and is refused it alone
    moe = TransformerConfig.from_preset("mixtral-tiny")
    assert plan_hetero_dp(moe, groups, seq_len=64, global_batch=64).parallel["recompute"] != "selective_mm"
    with pytest.raises(ValueError, match="'selective_mm' runs on dense blocks only"):
        plan_hetero_dp(moe, groups, seq_len=64, global_batch=64, recompute="selective_mm")
    # meshes: with 24 GB a device nothing fits without recompute; the planner finds plans that recompute
    small = [dataclasses.replace(g, profile=g.profile.replace(memory_bytes=24e9)) for g in groups]
    assert plan_hetero(model, small, **kw, recompute="none") == []
    meshes = plan_hetero(model, small, **kw)
    assert meshes and all(p.parallel["recompute"] != "none" for p in meshes)
    for p in meshes:
        p.config(16).stage_group_configs(model.num_layers)


def test_hetero_mesh_plans_pay_the_slowest_mesh_data_parallel_reduction():
    # Every mesh reduces its stages' gradients over its own DP ranks after the last backward (ZeRO-1 then gathers
    # its parameters; ZeRO-3 gathers them during the step, prefetched under compute): with free links the step is the
    # 1F1B schedule alone, with slow links what compute does not hide adds to it.
    from lightning_flagscale.tune.hardware import COLLECTIVES, LinkPoint

    def with_links(profile, bandwidth):
        link = [LinkPoint(group_size=2, latency=0.0, bus_bandwidth=bandwidth)]
        # a negligible optimizer phase (1e-21 s a parameter): the links are what this test isolates
        return profile.replace(links={k: {"intra": link, "inter": link} for k in COLLECTIVES},
                               optimizer_seconds_per_param=1e-21)  # fmt: skip

    model = TransformerConfig.from_preset("llama3-8b")
    kw = dict(seq_len=4096, global_batch=64, micro_batch_size=1, recompute="none", schedule="1f1b")

    def layout(plan):
        return [(m["tensor_parallel_size"], m["data_parallel_size"], m["pipeline_parallel_size"])
                for m in plan.parallel["hetero_meshes"]]  # fmt: skip

    steps = {}
    for name, bandwidth in (("free", float("inf")), ("slow", 1e9)):
        groups = _h100_a100(lambda profile, bandwidth=bandwidth: with_links(profile, bandwidth))
        for zero in (1, 3):
            plans = plan_hetero(model, groups, **kw, zero_stage=zero)
            plan = next(p for p in plans if layout(p) == [(2, 4, 1), (2, 4, 1)])
            m = 64 // (plan.parallel["micro_batch_size"] * plan.parallel["hetero_meshes"][0]["data_parallel_size"])
            schedule = (m + len(plan.stage_seconds) - 1) * max(plan.stage_seconds)
            steps[name, zero] = plan.step_seconds - schedule
    assert steps["free", 1] == pytest.approx(0.0, abs=1e-9) and steps["free", 3] == pytest.approx(0.0, abs=1e-9)
    assert steps["slow", 1] > 0.0 and steps["slow", 3] > 0.0


def test_hetero_plans_pay_the_optimizer_phase_and_the_loop_once_a_step():
    """After the last backward every rank steps its own parameters (sharded by ZeRO over its mesh's DP ranks) and the
    training loop runs, once a step: the slowest stage's optimizer phase plus the loop for mesh plans; for hetero-DP
    the optimizer over a 1/world ZeRO shard, not once per sample of a rank's share."""
    from lightning_flagscale.tune.cost import _rank_params

    model = TransformerConfig.from_preset("llama3-8b")

    def groups(per_param, overhead):
        return _h100_a100(  # memory to spare: the same plans fit under both
            lambda p: p.replace(optimizer_seconds_per_param=per_param, step_overhead=overhead, memory_bytes=1e12)
        )

    kw = dict(seq_len=4096, global_batch=64, micro_batch_size=1, zero_stage=1, recompute="none", schedule="1f1b")
    cheap, dear = (plan_hetero(model, groups(*g), **kw) for g in ((1e-12, 0.0), (2e-9, 0.05)))

    def key(p):
        return json.dumps(p.parallel)

    dear = {key(p): p for p in dear}
    checked = 0
    for plan in cheap:
        other = dear.get(key(plan))
        if other is None:
            continue
        layers, meshes = plan.parallel["hetero_layers"], plan.parallel["hetero_meshes"]
        split = ParallelConfig(pipeline_parallel_size=len(layers), pipeline_layers=layers)
        mesh_of = [m for m in meshes for _ in range(m["pipeline_parallel_size"])]
        # each stage's parameters as one of its TP ranks holds them (split projections, whole norms), over its DP ranks
        tp_local = [_rank_params(model, dataclasses.replace(split, tensor_parallel_size=m["tensor_parallel_size"]))[s]
                    for s, m in enumerate(mesh_of)]  # fmt: skip
        shard = max((dense + expert) / m["data_parallel_size"]
                    for (dense, expert), m in zip(tp_local, mesh_of, strict=True))  # fmt: skip
        expected = (2e-9 - 1e-12) * shard + 0.05
        assert other.step_seconds - plan.step_seconds == pytest.approx(expected, rel=1e-6)
        checked += 1
    assert checked > 0
    dp_kw = dict(seq_len=4096, global_batch=64, zero_stage=1, recompute="none")
    cheap_dp, dear_dp = (plan_hetero_dp(model, groups(*g), **dp_kw) for g in ((1e-12, 0.0), (2e-9, 0.05)))
    assert cheap_dp.parallel == dear_dp.parallel  # the shares follow compute speed alone
    shard = model.num_params() / 16  # ZeRO-1 over the 16 ranks
    assert dear_dp.step_seconds - cheap_dp.step_seconds == pytest.approx((2e-9 - 1e-12) * shard + 0.05, rel=1e-6)


def test_hetero_mesh_plans_pay_the_activation_hops_across_device_types():
    # Only inter-node P2P is slow (1 ms + 1 GB/s): an H100 mesh (TP 2, DP 4) feeding an A100 mesh (TP 2, DP 4) moves
    # each micro-batch's activations forward and their gradients back across nodes; every receiving rank gets its
    # DP rows whole (4096 tokens x 4096 hidden x bf16 for one sample), exposed once per 1F1B slot each way.
    from lightning_flagscale.tune.hardware import COLLECTIVES, LinkPoint

    def with_links(profile):
        free = [LinkPoint(group_size=2, latency=0.0, bus_bandwidth=float("inf"))]
        slow = [LinkPoint(group_size=2, latency=1e-3, bus_bandwidth=1e9)]
        links = {k: {"intra": free, "inter": slow if k == "p2p" else free} for k in COLLECTIVES}
        return profile.replace(links=links, optimizer_seconds_per_param=1e-21)  # a negligible optimizer phase

    model = TransformerConfig.from_preset("llama3-8b")
    plans = plan_hetero(model, _h100_a100(with_links), seq_len=4096, global_batch=64, micro_batch_size=1,
                        zero_stage=1, recompute="none", schedule="1f1b")  # fmt: skip
    plan = next(p for p in plans if [(m["tensor_parallel_size"], m["data_parallel_size"], m["pipeline_parallel_size"])
                                     for m in p.parallel["hetero_meshes"]] == [(2, 4, 1), (2, 4, 1)])  # fmt: skip
    slots = 64 // 4 + 2 - 1  # m micro-batches of 4 samples (1 per DP rank) over 2 stages
    hop = 1e-3 + 4096 * 4096 * 2 / 1e9
    assert plan.step_seconds - slots * max(plan.stage_seconds) == pytest.approx(2 * slots * hop, rel=1e-9)
    # which boundaries a schedule crosses: looped chunks wrap from the last stage group to the first, a V turns inside
    from lightning_flagscale.tune.hetero import _boundaries

    assert _boundaries(3, 1, False) == [(0, 1), (1, 2)] == _boundaries(3, 2, True)
    assert _boundaries(3, 2, False) == [(0, 1), (1, 2), (2, 0)]


def _assert_balanced_with_head(model, groups, plan, *, seq_len):
    """``plan``'s stage times are each stage's blocks at its mesh's block time plus the LM head on the stage group
    of the last global stage (the last group; the first under a V placement, where the V turns back), and its split
    has the fastest slowest stage of every split into at least one block a stage (brute force). Returns the head's
    seconds on each stage as the plan priced it (its stage time less its blocks')."""
    par = plan.parallel
    layouts = [(m["tensor_parallel_size"], m["data_parallel_size"], m["pipeline_parallel_size"])
               for m in par["hetero_meshes"]]  # fmt: skip
    samples = par["micro_batch_size"] * layouts[0][1]
    block, head = [], []
    for g, layout in zip(groups, layouts, strict=True):
        one, lm, _ = _stage_cost(model, layout, g, samples, seq_len, par["zero_stage"], par["recompute"])
        block += [one.f + one.b] * layout[2]
        head += [lm] * layout[2]
    stages = len(block)
    v_shaped = par["pipeline_schedule"] in ("zbv", "dualpipev")
    at = 0 if v_shaped else stages - 1
    extra = [head[s] if s == at else 0.0 for s in range(stages)]
    layers = par["hetero_layers"]
    assert plan.stage_seconds == pytest.approx([n * t + e for n, t, e in zip(layers, block, extra)], rel=1e-12)
    priced = [t - n * b for t, n, b in zip(plan.stage_seconds, layers, block)]  # the head as the planner priced it

    def splits(left, parts):
        if parts == 1:
            yield (left,)
            return
        for n in range(1, left - parts + 2):
            for rest in splits(left - n, parts - 1):
                yield (n, *rest)

    best = min(max(n * t + e for n, t, e in zip(split, block, extra)) for split in splits(model.num_layers, stages))
    assert max(plan.stage_seconds) == pytest.approx(best, rel=1e-12)
    return [e if e > 1e-9 * max(plan.stage_seconds) else 0.0 for e in priced]


def test_hetero_mesh_plans_price_the_fill_and_drain_for_their_own_micro_batch_count(monkeypatch):
    # The V schedules' bubble is a replay of m micro-batches (tune/cost.py::_v_bubble); without m it priced 2p.
    import lightning_flagscale.tune.hetero as hetero

    seen, real = [], hetero._bubble

    def spy(c, one, overlap=False, m=None):
        seen.append(m)
        return real(c, one, overlap, m)

    monkeypatch.setattr(hetero, "_bubble", spy)
    kw = dict(seq_len=4096, global_batch=16, micro_batch_size=1, zero_stage=1, recompute="none", schedule="zbv")
    plans = plan_hetero(TransformerConfig.from_preset("llama3-8b"), _h100_a100(), **kw)
    assert plans and seen and all(isinstance(m, int) and 1 <= m <= 16 for m in seen), seen


def test_hetero_mesh_planner_tries_every_schedule():
    # With v model chunks per stage group the fill and drain shrink: with free links and the same layers, the
    # interleaved 1F1B step is the 1F1B step less (S - 1)(1 - 1/v) slowest-stage slots (v = 2 and 4), zero-bubble
    # fills what is left of each slot with deferred weight gradients (ZBV, two chunks, the same as zero-bubble's two),
    # DualPipeV's order (replayed, as ZB-V's) idles more than ZB-V's while w < b. Every plan validates as the
    # strategy's config.
    from lightning_flagscale.tune.hardware import COLLECTIVES, LinkPoint

    free = [LinkPoint(group_size=2, latency=0.0, bus_bandwidth=float("inf"))]

    def with_free_links(profile):
        return profile.replace(links={k: {"intra": free, "inter": free} for k in COLLECTIVES})

    model = TransformerConfig.from_preset("llama3-8b")
    groups = _h100_a100(with_free_links)
    kw = dict(seq_len=4096, global_batch=16, micro_batch_size=1, zero_stage=1, recompute="none")
    plans = plan_hetero(model, groups, **kw)
    kinds = [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zero_bubble", 2), ("zero_bubble", 4),
             ("zbv", 2), ("dualpipev", 2)]  # fmt: skip

    def kind(p):
        return p.parallel["pipeline_schedule"], p.parallel.get("virtual_pipeline_parallel_size", 1)

    assert {kind(p) for p in plans} == set(kinds)
    for p in plans:
        c = p.config(16)
        c.stage_group_configs(model.num_layers)
        assert (c.pipeline_schedule, c.virtual_pipeline_parallel_size) == kind(p)

    def key(p):
        return json.dumps(p.parallel["hetero_meshes"]), p.parallel["micro_batch_size"]

    by = {k: {key(p): p for p in plans if kind(p) == k} for k in kinds}
    for p in plans:  # each split balances its stage times, the LM head on the group of the last model chunk
        _assert_balanced_with_head(model, groups, p, seq_len=4096)
    checked = 0
    for k, one in by[("1f1b", 1)].items():
        il2, il4, zb2, zb4, zbv, dpv = (by[name].get(k) for name in kinds[1:])
        if any(p is None for p in (il2, il4, zb2, zb4, zbv, dpv)):
            continue
        # the looped placements end on the last group, as 1F1B does: the same split; the V placements end on the
        # first (H100, faster here), so they split differently, both the same way
        assert all(p.parallel["hetero_layers"] == one.parallel["hetero_layers"] for p in (il2, il4, zb2, zb4))
        assert zbv.parallel["hetero_layers"] == dpv.parallel["hetero_layers"] != one.parallel["hetero_layers"]
        stages, slowest = len(one.stage_seconds), max(one.stage_seconds)
        for v, il in ((2, il2), (4, il4)):
            assert one.step_seconds - il.step_seconds == pytest.approx((stages - 1) * slowest * (1 - 1 / v), rel=1e-9)
        assert zb2.step_seconds < il2.step_seconds and zb4.step_seconds < il4.step_seconds
        assert zbv.step_seconds < dpv.step_seconds  # w < b: torch's DualPipeV order idles more than ZB-V's (replayed)
        checked += 1
    assert checked > 0
    # the schedule's live micro-batches decide memory: interleaving holds more on the first stage group than 1F1B
    first = next(k for k in by[("1f1b", 1)] if k in by[("interleaved_1f1b", 2)])
    assert by[("interleaved_1f1b", 2)][first].memory_bytes[0] > by[("1f1b", 1)][first].memory_bytes[0]
    only = plan_hetero(model, groups, **kw, schedule="interleaved_1f1b", virtual_size=4)
    assert only and {kind(p) for p in only} == {("interleaved_1f1b", 4)}
    with pytest.raises(ValueError, match="virtual_size=1: multi-chunk schedules hold at least 2"):
        plan_hetero(model, groups, **kw, virtual_size=1)
    with pytest.raises(ValueError, match=r"schedule=\['gpipe'\]: the mesh planner plans"):
        plan_hetero(model, groups, **kw, schedule=("1f1b", "gpipe"))


def test_flags_the_chosen_mode_would_not_read_are_refused():
    plan = ["--preset", "llama-tiny", "--devices", "2", "--seq-len", "64", "--global-batch", "4"]
    for argv, message in (
        ([*plan, "--calibrate-dtype", "bf16"], "--calibrate-dtype only apply with --calibrate"),
        ([*plan, "--calibrate-out", "x.json", "--calibrate-groups", "2"],
         "--calibrate-groups, --calibrate-out only apply with --calibrate"),
        (["--calibrate", "--devices", "8", "--preset", "llama3-70b"],
         "--devices, --preset: not read by --calibrate, which measures this machine"),
        ([*plan, "--run-steps", "3"], "--run-steps only apply with --run K"),
        ([*plan, "--run-dir", "d"], "--run-dir only apply with --run K"),
        ([*plan, "--recipe-steps", "5"], "--recipe-steps sets the written recipe's max_steps: add --write-recipe"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            tune_main(argv)


def test_bad_values_are_refused_before_searching():
    plan = ["--preset", "llama-tiny", "--devices", "2", "--seq-len", "64", "--global-batch", "4"]
    for extra, message in (
        (["--schedules", "1f1b,foo"], r"--schedules 1f1b,foo: Unknown pipeline schedule\(s\) \['foo'\]"),
        (["--seq-len", "0"], "--seq-len 0: must be at least 1"),
        (["--global-batch", "0"], "--global-batch 0: must be at least 1"),
        (["--top", "0"], "--top 0: must be at least 1"),
        (["--run", "1", "--run-steps", "2"], r"--run-steps 2: must be at least 3 \(the first step warms up"),
        (["--memory-gb", "-1"], "--memory-gb -1.0: a device's memory must be positive"),
    ):
        with pytest.raises(SystemExit, match=message):
            tune_main(plan + extra)
    with pytest.raises(ValueError, match="Unknown context-parallel mode"):
        SearchSpace(context_parallel_modes=("ring", "striped"))
    with pytest.raises(ValueError, match="global_batch=0: each must be at least 1"):
        search(TransformerConfig.from_preset("llama-tiny"), 2, seq_len=64, global_batch=0)


def test_the_hetero_command_honours_or_refuses_every_flag(tmp_path, capsys):
    """``tune --hetero`` takes --schedules, --memory-gb, --grad-bucket-numel and --write-recipe (the fastest plan as
    a ``fit --config`` recipe) and refuses, naming why, what a hetero plan cannot use; nothing is silently ignored."""
    argv = ["--preset", "llama3-8b", "--hetero", "H100:8:h100,A100:8:a100", "--seq-len", "4096", "--global-batch", "64"]
    for extra, message in (
        (["--run", "1"], "--run does not apply to --hetero: hetero plans are not trained here"),
        (["--refit-profile", "r.json"], "--refit-profile does not apply to --hetero"),
        (["--profile", "a100"], "--profile does not apply to --hetero: each device group names its profile"),
        (["--devices", "8"], "--devices 8 disagrees with the 16 devices of --hetero"),
        (["--schedules", "1f1b,gpipe"], r"--schedules 1f1b,gpipe: schedule=\['gpipe'\]: the mesh planner plans"),
    ):
        with pytest.raises(SystemExit, match=message):
            tune_main(argv + extra)
    tune_main([*argv, "--schedules", "zbv", "--json", "--top", "100"])
    plans = json.loads(capsys.readouterr().out)
    assert plans and {p["parallel"]["pipeline_schedule"] for p in plans if p["kind"] == "meshes"} == {"zbv"}
    with pytest.raises(SystemExit, match="No heterogeneous plan fits in memory"):
        tune_main([*argv, "--memory-gb", "1"])  # every group's budget, not the unused --profile's
    assert "hetero-DP does not fit" in capsys.readouterr().out
    recipe_path = tmp_path / "hetero.yaml"
    tune_main([*argv, "--write-recipe", str(recipe_path), "--grad-bucket-numel", "1000000", "--recipe-steps", "7"])
    first = capsys.readouterr().out.splitlines()[0]  # the fastest plan, printed first
    best = json.loads(first[first.index("{") :])
    recipe = yaml.safe_load(recipe_path.read_text())
    trainer = recipe["trainer"]
    assert (trainer["accelerator"], trainer["devices"], trainer["num_nodes"], trainer["max_steps"]) == ("gpu", 8, 2, 7)
    assert trainer["strategy"]["init_args"] == {**best, "grad_bucket_numel": 1000000}
    first_dp = best["hetero_meshes"][0]["data_parallel_size"] if "hetero_meshes" in best else 1
    assert recipe["data"]["batch_size"] == 64 // first_dp and recipe["data"]["seq_len"] == 4096
    assert "predicted step" in recipe_path.read_text().splitlines()[0]


def test_hetero_mesh_planner_puts_the_head_where_the_v_turns_back():
    # A100 first, H100 second, one stage each, a 128k vocabulary (the head about two blocks): 1F1B runs the head on
    # the H100 group, ZBV and DualPipeV on the A100 group (the last model chunk comes back to the first group), so
    # there the slower A100 group takes fewer blocks than under 1F1B, and each split balances its own stage times.
    # The pre-launch stage planner (config/layer_split.py edge_extra_blocks) puts the head on the same group.
    model = TransformerConfig.from_preset("llama3-8b")
    groups = list(reversed(_h100_a100()))
    kw = dict(seq_len=4096, global_batch=16, micro_batch_size=1, zero_stage=1, recompute="none", max_pp_per_mesh=1)
    one = {json.dumps(p.parallel["hetero_meshes"]): p for p in plan_hetero(model, groups, **kw, schedule="1f1b")}
    checked = 0
    for schedule in ("zbv", "dualpipev"):
        for p in plan_hetero(model, groups, **kw, schedule=schedule):
            base = one[json.dumps(p.parallel["hetero_meshes"])]
            assert p.parallel["hetero_layers"][0] < base.parallel["hetero_layers"][0]
            for q, at in ((p, 0), (base, 1)):
                head = _assert_balanced_with_head(model, groups, q, seq_len=4096)
                v = q.parallel.get("virtual_pipeline_parallel_size", 1)
                edges = edge_extra_blocks(model, 4096, 2, virtual=v, schedule=q.parallel["pipeline_schedule"])
                assert [h > 0 for h in head] == [e > 0 for e in edges] == [s == at for s in range(2)]
            checked += 1
    assert checked > 0


def test_hetero_mesh_plans_are_runnable_by_the_hetero_pipeline_runner():
    """The planner offers only what the hetero pipeline runner runs: its own rule that a looped multi-chunk schedule
    needs the micro-batch count to be a multiple of the stage groups (3 groups and 4 micro-batches were planned,
    and refused at the first step), and the V schedules' minimum of micro-batches."""
    from lightning_flagscale.parallel.hetero_mesh.runner import schedule_order
    from lightning_flagscale.tune.hardware import COLLECTIVES, LinkPoint

    link = [LinkPoint(group_size=2, latency=1e-5, bus_bandwidth=1e10)]
    fast = HardwareProfile(name="fast", device_type="fast", peak_flops=4e10, hbm_bandwidth=5e10, memory_bytes=1e9,
                           links={k: {"intra": link, "inter": link} for k in COLLECTIVES})  # fmt: skip
    slow = fast.replace(name="slow", device_type="slow", peak_flops=2e10, hbm_bandwidth=2.5e10)
    groups = [DeviceGroup(device_type=p.device_type, count=2, profile=p) for p in (fast, slow)]
    model = TransformerConfig.from_preset("llama-tiny", num_layers=8, hidden_size=128, intermediate_size=256,
                                          num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    looped_three = {}
    for global_batch in (16, 24):  # 16: no micro-batch count divides by 3; 24: every one does
        looped_three[global_batch] = 0
        for plan in plan_hetero(model, groups, seq_len=128, global_batch=global_batch):
            p = plan.parallel
            stages, v = len(p["hetero_layers"]), p.get("virtual_pipeline_parallel_size", 1)
            m = global_batch // (p["micro_batch_size"] * p["hetero_meshes"][0]["data_parallel_size"])
            for group in range(stages):
                schedule_order(p["pipeline_schedule"], stages, group, v, m, train=True)  # raises if refused
            if stages == 3 and v > 1 and p["pipeline_schedule"] in ("interleaved_1f1b", "zero_bubble"):
                looped_three[global_batch] += 1
    assert looped_three[16] == 0 and looped_three[24] > 0  # offered exactly where the runner runs them


def test_hetero_mesh_planner_tries_micro_batch_sizes():
    groups = _h100_a100()
    model = TransformerConfig.from_preset("llama3-8b")
    kw = dict(seq_len=4096, global_batch=64)
    plans = plan_hetero(model, groups, **kw)
    assert {p.parallel["micro_batch_size"] for p in plans} == {1, 2, 4}
    fixed = [plan_hetero(model, groups, **kw, micro_batch_size=mbs)[0].step_seconds for mbs in (1, 2, 4)]
    assert plans[0].step_seconds == min(fixed)


def test_calibrated_scale_reproduces_a_measured_step():
    from lightning_flagscale.tune import calibrate_compute_scale

    c = ParallelConfig(tensor_parallel_size=2).resolve(4)
    hw = builtin_profile("h100")
    fitted = calibrate_compute_scale(TINY, c, 64, 8, hw, tokens_per_second=1e5)
    assert estimate_step(TINY, c, 64, 8, fitted).tokens_per_second == pytest.approx(1e5, rel=1e-6)


def test_ring_context_parallelism_through_the_torch_block_kernel_is_not_ranked_on_gpu_profiles(capsys):
    """A GPU profile prices torch's fused SDPA, not the exact fp32 block kernel ring CP runs with
    ``attn_backend="torch"``: those layouts are refused with the fix named, Ulysses (SDPA) is ranked, and a fused
    backend, or a profile that measured the block kernel, ranks the ring again."""
    model = TransformerConfig.from_preset("llama-tiny")
    h100 = builtin_profile("h100")
    argv = dict(seq_len=256, global_batch=8, top_k=None)

    def modes(result):
        return {(c.config.context_parallel_mode if c.config.context_parallel_size > 1 else "none")
                for c in result.candidates}  # fmt: skip

    torch_ring = search(model, 4, hardware=h100, **argv)
    assert modes(torch_ring) == {"none", "ulysses"}
    refused = {why: n for why, n in torch_ring.pruned.items() if why.startswith("kernel:")}
    assert sum(refused.values()) > 0 and all("attn_backend='torch'" in why for why in refused)
    with pytest.raises(ValueError, match="Set attn_backend='flash_attn' or 'transformer_engine' for a fused ring"):
        estimate_step(model, ParallelConfig(context_parallel_size=2).resolve(2), 256, 2, h100)
    for backend in ("flash_attn", "transformer_engine"):
        fused = search(dataclasses.replace(model, attn_backend=backend), 4, hardware=h100, **argv)
        assert modes(fused) == {"none", "ulysses", "ring", "hybrid"} and not any(
            why.startswith("kernel:") for why in fused.pruned
        )
    measured = search(model, 4, hardware=h100.replace(ring_blocks=[(1.0, 0.01, 0.01)]), **argv)
    assert "ring" in modes(measured)
    # the CLI says how many it left out and how to rank them
    tune_main(["--preset", "llama-tiny", "--devices", "4", "--seq-len", "256", "--global-batch", "8"])
    out = capsys.readouterr().out
    assert f"{sum(refused.values())} ring / hybrid context-parallel layouts not ranked" in out
    tune_main(["--preset", "llama-tiny", "--devices", "4", "--seq-len", "256", "--global-batch", "8", "--top", "50",
               "--attn-backend", "flash_attn"])  # fmt: skip
    out = capsys.readouterr().out
    assert "not ranked" not in out and " ring " in out


def test_the_published_deepseek_v3_layout_is_in_the_search_space():
    """DeepSeek-V3's training layout (report section 3.2: 2048 GPUs, PP 16, EP 64 over the 128 data-parallel ranks of
    each stage, ZeRO-1, DualPipe: here its V form) is a layout the search enumerates; ``max_context_parallel`` bounds
    CP as ``max_tensor_parallel`` bounds TP."""
    from lightning_flagscale.tune.search import describe_layout

    model = TransformerConfig.from_preset("deepseek-v3")
    space = SearchSpace(schedules=("dualpipev",), zero_stages=(1,), sequence_parallel=(False,), micro_batch_sizes=(1,),
                        recompute=("full",), max_tensor_parallel=1, max_context_parallel=1)  # fmt: skip
    layouts, _ = enumerate_layouts(model, 2048, seq_len=4096, global_batch=15360, space=space)
    names = {describe_layout(c) for c in layouts}
    assert "tp1 pp16/v2 dualpipev ep64 dp128 zero1 mbs1 rc=full" in names
    assert all(c.context_parallel_size == 1 and c.tensor_parallel_size == 1 for c in layouts)
    assert {c.expert_parallel_size for c in layouts if c.pipeline_parallel_size == 16} == {1, 2, 4, 8, 16, 32, 64, 128}
