"""``lightning-flagscale tune``: rank layouts, calibrate this machine, run the top candidates, plan hetero jobs.

    lightning-flagscale tune --preset llama3-8b --devices 64 --seq-len 8192 --global-batch 512 [--profile h100]
    lightning-flagscale tune --calibrate --calibrate-out cpu.json           # micro-benchmarks -> profile JSON
    lightning-flagscale tune --preset llama-tiny --devices 2 --seq-len 64 --global-batch 4 --profile cpu.json \\
        --run 2 --write-recipe best.yaml                                     # train the top 2, write the winner
        [--refit-profile cpu-refit.json]                                     # + the profile refitted on those runs
    lightning-flagscale tune --preset llama3-8b --hetero H100:8:h100,A100:8:a100 --seq-len 4096 --global-batch 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

# Called through their modules so tests can stand in for the slow parts (a calibration, a training run).
import lightning_flagscale.tune.calibrate as calibration
import lightning_flagscale.tune.runner as runner
from lightning_flagscale.cli_parsers import LIST_PRESETS, tune_parser
from lightning_flagscale.config import PRESETS, ParallelConfig, TransformerConfig
from lightning_flagscale.config.parallel import DEFAULT_BUCKET_NUMEL
from lightning_flagscale.tune.cost import MeasuredStep, estimate_step, fit_compute_scale
from lightning_flagscale.tune.hardware import HardwareProfile, load_profile
from lightning_flagscale.tune.hetero import SCHEDULES, DeviceGroup, plan_hetero, plan_hetero_dp
from lightning_flagscale.tune.runner import _strategy_args, recipe_dict, write_recipe
from lightning_flagscale.tune.search import Candidate, SearchResult, SearchSpace, search

__all__ = ["candidate_json", "describe_presets", "no_fit_message", "tune_main"]


def candidate_json(cand: Candidate, budget: float) -> dict[str, Any]:
    """One ranked layout as JSON: ``parallel`` holds the ``ParallelConfig`` / strategy keyword arguments."""
    cost = cand.cost
    return {
        "layout": cand.describe(), "parallel": _strategy_args(cand.config), "data_parallel_size": cand.config.dp,
        "memory_bytes": cand.memory_bytes, "memory_budget_bytes": budget, "step_seconds": cost.step_seconds,
        "tokens_per_second": cost.tokens_per_second, "mfu": cost.mfu, "bubble_seconds": cost.bubble_seconds,
        "exposed_comm_seconds": cost.exposed_comm_seconds, "comm": cost.comm,
    }  # fmt: skip


def no_fit_message(result: SearchResult, budget: float, devices: int) -> str:
    """Why nothing can run, naming the constraint."""
    others = [(why, n) for why, n in result.pruned.most_common() if why != "memory"][:4]
    reasons = ", ".join(f"{why} ({n})" for why, n in others)
    if result.considered == 0:
        return f"No valid layout for {devices} devices: every candidate was refused: {reasons}."
    need = (result.smallest_memory or 0) / 1e9
    return (
        f"No layout fits in memory: the leanest of {result.considered} valid layouts needs {need:.1f} GB per device"
        f" against the {budget / 1e9:.1f} GB budget (memory constraint); add devices, shorten sequences, lower the"
        f" global batch or use a device with more memory. Other refusals: {reasons or 'none'}."
    )


def _print_table(model: TransformerConfig, result: SearchResult, hw: HardwareProfile, devices: int) -> None:
    print(f"{model.name}: {model.num_params() / 1e9:.2f}B parameters, {devices} x {hw.name}, {result.considered} valid"
          f" layouts, {result.pruned.get('memory', 0)} over the {hw.memory_bytes / 1e9:.0f} GB budget")  # fmt: skip
    unpriced = sum(n for why, n in result.pruned.items() if why.startswith("kernel:"))
    if unpriced:
        print(f"{unpriced} ring / hybrid context-parallel layouts not ranked: with attn_backend={model.attn_backend!r}"
              f" they run the exact fp32 block kernel, which the {hw.name!r} profile does not price"
              " (--attn-backend flash_attn or transformer_engine ranks them with a fused ring)")  # fmt: skip
    width = max([56, *(len(cand.describe()) for cand in result.candidates)])  # the column fits the longest layout
    print(f"{'#':>2} {'layout':<{width}} {'tokens/s':>11} {'/device':>8} {'MFU':>6} {'memory/budget':>14}"
          f" {'bubble':>7} {'exp.comm':>8} {'step':>8}")  # fmt: skip
    for i, cand in enumerate(result.candidates, 1):
        cost = cand.cost
        mem = f"{cand.memory_bytes / 1e9:.1f}/{hw.memory_bytes / 1e9:.0f}GB"
        comm = cost.exposed_comm_seconds / cost.step_seconds
        print(f"{i:>2} {cand.describe():<{width}} {cost.tokens_per_second:11.0f} {cost.tokens_per_second / devices:8.0f}"
              f" {cost.mfu:6.1%} {mem:>14} {cost.bubble_fraction:7.1%} {comm:8.1%} {cost.step_seconds:7.3f}s")  # fmt: skip


def _calibrate(args: argparse.Namespace) -> None:
    import torch

    groups = tuple(int(x) for x in args.calibrate_groups.split(","))
    device = args.calibrate_device or ("cuda" if torch.cuda.is_available() else "cpu")
    kw: dict[str, Any] = dict(group_sizes=groups, threads=args.calibrate_threads, device=device)
    if args.calibrate_dtype:
        kw["dtype"] = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.calibrate_dtype]
    if device == "cpu" and args.calibrate_dtype == "bf16":  # CPU bf16 GEMMs can run at ~1 GFLOP/s: small shapes
        kw["gemm_sizes"] = (64, 128, 256, 512)
    try:
        profile = calibration.calibrate(**kw)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    profile.save(args.calibrate_out)
    ar = profile.link("all_reduce", max(groups), "intra")
    peak = (
        f"{profile.peak_flops / 1e12:.0f} TFLOP/s"
        if profile.peak_flops >= 1e13
        else f"{profile.peak_flops / 1e9:.1f} GFLOP/s"
    )
    kernels = "".join(f", {b} attention curve" for b in profile.attention_kernels)
    print(f"wrote {args.calibrate_out} ({profile.device_type}{kernels}): peak {peak}, attention"
          f" {profile.attention_efficiency:.0%} of peak, memory {profile.hbm_bandwidth / 1e9:.1f} GB/s, all-reduce"
          f" x{max(groups)}: {ar.latency * 1e6:.0f} us + {ar.bus_bandwidth / 1e9:.2f} GB/s; backward GEMMs at"
          f" {profile.input_grad_gemm_factor:.2f}x (input grad) / {profile.weight_grad_gemm_factor:.2f}x (weight grad)"
          f" the forward rate; TP host time {sum(profile.tp_overhead[:2]) * 1e3:.1f} ms a block, MoE dispatch"
          f" {sum(profile.moe_overhead) * 1e3:.1f} ms a block, selective recompute"
          f" {sum(profile.selective_overhead) * 1e3:.1f} ms a block, pipeline schedule"
          f" {profile.pipeline_action_overhead * 1e3:.2f} ms an action, training loop"
          f" {profile.step_overhead * 1e3:.1f} ms a step, blocking collective waits "
          + ", ".join(f"x{n:.0f}: {t * 1e3:.2f} ms" for n, t in profile.blocking_collective))  # fmt: skip


def _hetero(args: argparse.Namespace, model: TransformerConfig) -> None:
    groups = []
    for item in args.hetero.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit():
            raise SystemExit(f"--hetero entry {item!r} must be TYPE:COUNT:PROFILE, e.g. H100:8:h100.")
        try:
            profile = load_profile(parts[2])
        except ValueError as err:
            raise SystemExit(f"--hetero entry {item!r}: {err}") from None
        if args.memory_gb:
            profile = profile.replace(memory_bytes=args.memory_gb * 1e9)
        groups.append(DeviceGroup(device_type=parts[0], count=int(parts[1]), profile=profile))
    world = sum(g.count for g in groups)
    if args.devices and args.devices != world:
        raise SystemExit(f"--devices {args.devices} disagrees with the {world} devices of --hetero; drop --devices.")
    kw = dict(seq_len=args.seq_len, global_batch=args.global_batch, grad_bucket_numel=args.grad_bucket_numel)
    schedules = tuple(args.schedules.split(",")) if args.schedules else SCHEDULES
    try:
        plans = plan_hetero(model, groups, **kw, schedule=schedules)[: args.top]
    except ValueError as err:
        raise SystemExit(f"--schedules {args.schedules}: {err}") from None
    try:
        plans.append(plan_hetero_dp(model, groups, **kw))
    except ValueError as err:
        print(f"hetero-DP: {err}")
    plans.sort(key=lambda p: p.step_seconds)
    if args.json:
        print(json.dumps([dict(p.__dict__) for p in plans], indent=1))
    elif plans:
        for p in plans:
            print(f"{p.kind:<9} step {p.step_seconds:8.3f}s imbalance {p.imbalance:5.2f} {json.dumps(p.parallel)}")
    if not plans:
        raise SystemExit("No heterogeneous plan fits in memory on these device groups (memory constraint).")
    if args.write_recipe:
        _write_hetero(args, model, plans[0], groups)


def _write_hetero(args: argparse.Namespace, model: TransformerConfig, plan: Any, groups: list) -> None:
    """The fastest hetero plan as a ``fit --config`` recipe: its ``parallel`` as the strategy's arguments."""
    world = sum(g.count for g in groups)
    per_node = min(g.profile.devices_per_node for g in groups)
    if world > per_node and world % per_node:
        raise SystemExit(f"--write-recipe: {world} devices do not fill whole nodes of {per_node} (Lightning runs the same"
                         " number of devices on every node); plan device groups that do.")  # fmt: skip
    cpu = all(g.profile.device_type.startswith("cpu") for g in groups)
    recipe = recipe_dict(model, ParallelConfig().resolve(world), seq_len=args.seq_len, global_batch=args.global_batch,
                         devices=world, max_steps=args.recipe_steps, accelerator="cpu" if cpu else "gpu",
                         devices_per_node=per_node)  # fmt: skip
    strategy = dict(plan.parallel)
    if args.grad_bucket_numel != DEFAULT_BUCKET_NUMEL:
        strategy["grad_bucket_numel"] = args.grad_bucket_numel
    recipe["trainer"]["strategy"]["init_args"] = strategy
    # the loader's batch per data-parallel rank: hetero meshes read the first mesh's DP share of each step;
    # hetero-DP's samplers cut every rank's share (hetero_dp_batch_sizes) out of the whole global batch
    first_dp = plan.parallel["hetero_meshes"][0]["data_parallel_size"] if plan.kind == "meshes" else 1
    recipe["data"]["batch_size"] = args.global_batch // first_dp
    groups_text = ", ".join(f"{g.count} x {g.device_type} ({g.profile.name})" for g in groups)
    header = (f"Written by `lightning-flagscale tune --hetero` for {groups_text}: {plan.kind}, predicted step"
              f" {plan.step_seconds:.3f} s.\nRanks fill the device groups by the type each reports: FLAGSCALE_DEVICE_TYPE,"
              " else its CUDA device's name, which a group's type matches when contained in it (H100 in 'NVIDIA H100"
              " 80GB HBM3'); in rank order when all report one type.")  # fmt: skip
    path = write_recipe(args.write_recipe, recipe, header)
    print(f"wrote {path}: lightning-flagscale fit --config {path}")


def _flag(parser: argparse.ArgumentParser, dest: str) -> str:
    return next(a.option_strings[0] for a in parser._actions if a.dest == dest)


def _refuse_unused_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A flag the chosen mode would not read is an error, not ignored: calibration flags without ``--calibrate`` (and
    planning flags with it), ``--run-*`` without ``--run``, ``--recipe-steps`` without a recipe to write, and with
    ``--hetero`` what only the homogeneous search reads (``--run``, ``--refit-profile``, ``--profile``)."""
    given = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"
             and getattr(args, a.dest) != a.default}  # fmt: skip
    calibration = {d for d in given if d.startswith("calibrate")}
    if args.calibrate:
        planning = sorted(given[d] for d in set(given) - calibration)
        if planning:
            raise SystemExit(f"{', '.join(planning)}: not read by --calibrate, which measures this machine; plan with"
                             " them in a second command, --profile <the written JSON>.")  # fmt: skip
        return
    if calibration:
        raise SystemExit(f"{', '.join(sorted(given[d] for d in calibration))} only apply with --calibrate.")
    bounds = {"top": 1, "run": 0, "run_steps": 3, "recipe_steps": 1, "seq_len": 1, "global_batch": 1}
    for dest, least in bounds.items():
        if getattr(args, dest) < least:
            raise SystemExit(f"{_flag(parser, dest)} {getattr(args, dest)}: must be at least {least}"
                             + (" (the first step warms up; two more are timed)" if dest == "run_steps" else "") + ".")  # fmt: skip
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise SystemExit(f"--memory-gb {args.memory_gb}: a device's memory must be positive.")
    if not args.run and ({"run_steps", "run_dir"} & set(given)):
        raise SystemExit(f"{', '.join(sorted(given[d] for d in {'run_steps', 'run_dir'} & set(given)))} only apply"
                         " with --run K.")  # fmt: skip
    if args.hetero:  # what the homogeneous search takes and a hetero plan cannot
        for dest in ("run", "refit_profile", "profile"):
            if dest in given:
                why = ("each device group names its profile (TYPE:COUNT:PROFILE)" if dest == "profile" else
                       "hetero plans are not trained here (they need the device groups); write the best with"
                       " --write-recipe and run it with `fit --config`")  # fmt: skip
                raise SystemExit(f"{given[dest]} does not apply to --hetero: {why}.")
    if "recipe_steps" in given and not (args.write_recipe or args.run):
        raise SystemExit("--recipe-steps sets the written recipe's max_steps: add --write-recipe PATH (or --run K).")


def describe_presets() -> list[str]:
    """One line per registered preset: name, parameters, layers x hidden size, the Hugging Face model it mirrors."""
    lines = []
    for name in sorted(PRESETS):
        model = TransformerConfig.from_preset(name)
        moe = f", {model.num_experts} experts" if model.num_experts else ""
        params = model.num_params()
        size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
        lines.append(f"{name:<25} {size:>7} parameters, {model.num_layers} layers x {model.hidden_size}{moe};"
                     f" {model.hf_source}")  # fmt: skip
    return lines


def tune_main(argv: list[str]) -> None:
    """``lightning-flagscale tune``: print the best layouts for a model on a cluster (see the module docstring)."""
    parser = tune_parser()
    args = parser.parse_args(argv)
    if args.list_presets or args.preset == LIST_PRESETS:
        print("\n".join(["presets (`tune --preset NAME`, `fit --model.config NAME`):", *describe_presets()]))
        return
    _refuse_unused_flags(args, parser)
    if args.calibrate:
        return _calibrate(args)
    try:
        model = TransformerConfig.from_preset(args.preset)
        if args.attn_backend:
            model = dataclasses.replace(model, attn_backend=args.attn_backend)
        hw = load_profile(args.profile or "h100")
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.memory_gb:
        hw = hw.replace(memory_bytes=args.memory_gb * 1e9)
    if args.hetero:
        return _hetero(args, model)
    if not args.devices or args.devices < 1:
        raise SystemExit("--devices N is required (the number of devices to plan for).")
    try:
        space = SearchSpace(schedules=tuple(args.schedules.split(","))) if args.schedules else SearchSpace()
    except ValueError as err:
        raise SystemExit(f"--schedules {args.schedules}: {err}") from None
    keep = None if args.run else args.top
    if args.refit_profile and not args.run:
        raise SystemExit("--refit-profile refits on measured runs: add --run K.")
    if args.run:
        args.accelerator = _run_accelerator(hw, args.devices, model.attn_backend)
    if args.grad_bucket_numel < 1:
        raise SystemExit(f"--grad-bucket-numel {args.grad_bucket_numel}: a bucket holds at least one element.")
    try:
        result = search(model, args.devices, seq_len=args.seq_len, global_batch=args.global_batch, hardware=hw,
                        space=space, top_k=keep, grad_bucket_numel=args.grad_bucket_numel)  # fmt: skip
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if not result.candidates:
        raise SystemExit(no_fit_message(result, hw.memory_bytes, args.devices))
    best, measured = result.candidates[0], []
    if args.run:
        measured = _run(args, model, result, hw)
        best = min(measured, key=lambda r: r.measured_step_seconds).candidate
    shown = SearchResult(result.candidates[: args.top], result.considered, result.pruned, result.smallest_memory)
    if args.json:
        print(json.dumps({"model": model.name, "devices": args.devices, "profile": hw.name,
                          "considered": result.considered, "pruned": dict(result.pruned),
                          "candidates": [candidate_json(c, hw.memory_bytes) for c in shown.candidates]}, indent=1))  # fmt: skip
    elif not args.run:
        _print_table(model, shown, hw, args.devices)
    if args.run and not args.write_recipe:
        args.write_recipe = str(Path(args.run_dir) / "best.yaml")  # --run always writes its winner
    if args.write_recipe:
        _write_best(args, model, best, hw)
    if args.refit_profile:  # after the recipe: a refit out of reach must not cost the runs' winner
        try:
            _refit(args, model, measured, hw)
        except ValueError as err:
            raise SystemExit(f"--refit-profile {args.refit_profile} not written: {err}") from None


def _run_accelerator(hw: HardwareProfile, devices: int, attn_backend: str) -> str:
    """What ``--run`` trains on, refusing up front what this machine cannot run: ``cpu`` processes for a profile
    measured on CPUs (``tune --calibrate`` here), else CUDA devices, as many as the plan has. Candidates run on
    this machine only, and a GPU plan's predictions compared with (or refitted on) CPU steps would mean nothing."""
    import torch

    if hw.device_type.startswith("cpu"):
        if attn_backend != "torch":
            raise SystemExit(f"--run trains the candidates here on CPU processes ({hw.name!r} is a CPU profile), where"
                             f" attn_backend={attn_backend!r} cannot run (it needs a CUDA GPU); drop --attn-backend to"
                             " run them, or --run to rank only.")  # fmt: skip
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < devices:
        raise SystemExit(f"--run trains the candidates on this machine, and profile {hw.name!r} ({hw.device_type})"
                         f" plans {devices} GPUs; this machine has {gpus} CUDA device(s). Run `tune --run` on a node with"
                         f" {devices} GPUs, plan for --devices {gpus or 'N'} here, or drop --run to rank only (on CPUs:"
                         " `tune --calibrate` writes a profile of this machine to run against).")  # fmt: skip
    name = torch.cuda.get_device_name(0)
    if hw.device_type.lower() not in name.lower():
        print(f"note: profile {hw.name!r} describes {hw.device_type} devices and this machine runs {name!r}: measured"
              " steps will not match its predictions (--refit-profile refits its compute_scale on them)")  # fmt: skip
    return "gpu"


def _run(args: argparse.Namespace, model: TransformerConfig, result: SearchResult, hw: HardwareProfile) -> list:
    """Train the top ``--run`` candidates, print measured against predicted; the runs that trained."""
    runs = runner.run_candidates(model, result.candidates, k=args.run, seq_len=args.seq_len, global_batch=args.global_batch,
                          devices=args.devices, workdir=args.run_dir, steps=args.run_steps,
                          grad_bucket_numel=args.grad_bucket_numel, accelerator=args.accelerator)  # fmt: skip
    print(f"{'layout':<56} {'predicted':>10} {'measured':>10} {'status'}")
    for r in runs:
        measured = f"{r.measured_step_seconds:9.3f}s" if r.measured_step_seconds else f"{'-':>10}"
        memory = ""
        if r.peak_device_bytes is not None:  # a CUDA run: the allocator's peak is what the memory model predicts
            memory = (f" memory {r.candidate.memory_bytes / 1e9:.2f} GB predicted,"
                      f" {r.peak_device_bytes / 1e9:.2f} GB allocated")  # fmt: skip
        print(
            f"{r.candidate.describe():<56} {r.candidate.step_seconds:9.3f}s {measured} {r.status}{memory} {r.message}"
        )
    ratios = sorted(r.measured_step_seconds / r.candidate.step_seconds for r in runs if r.measured_step_seconds)
    if ratios:
        print(f"measured / predicted: median {ratios[len(ratios) // 2]:.2f} (min {ratios[0]:.2f}, max {ratios[-1]:.2f});"
              " step time is noisy on a shared machine")  # fmt: skip
    ok = [r for r in runs if r.status == "ok" and r.measured_step_seconds]
    if not ok:
        raise SystemExit("None of the run candidates trained (see the status column).")
    return ok


def _refit(args: argparse.Namespace, model: TransformerConfig, runs: list, hw: HardwareProfile) -> None:
    """Write ``hw`` with ``compute_scale`` fitted on the measured runs; print each run's refitted prediction."""
    measured = [
        MeasuredStep(model, r.candidate.config, args.seq_len, args.global_batch, r.measured_step_seconds) for r in runs
    ]
    fitted = fit_compute_scale(measured, hw, grad_bucket_numel=args.grad_bucket_numel)
    for m, r in zip(measured, runs):
        step = estimate_step(
            model, m.config, m.seq_len, m.global_batch, fitted, grad_bucket_numel=args.grad_bucket_numel
        )
        print(f"refitted {r.candidate.describe():<47} {step.step_seconds:9.3f}s {m.step_seconds:9.3f}s")
    fitted = fitted.replace(
        source=f"{hw.source}; compute_scale refitted on {len(runs)} `tune --run` step(s) of {model.name}"
    )
    fitted.save(args.refit_profile)
    print(f"compute_scale {hw.compute_scale:.3f} -> {fitted.compute_scale:.3f} on {len(runs)} run(s); wrote "
          f"{args.refit_profile}: lightning-flagscale tune --profile {args.refit_profile}")  # fmt: skip


def _write_best(args: argparse.Namespace, model: TransformerConfig, best: Candidate, hw: HardwareProfile) -> None:
    accelerator = "cpu" if hw.device_type.startswith("cpu") else "gpu"
    recipe = recipe_dict(model, best.config, seq_len=args.seq_len, global_batch=args.global_batch,
                         devices=args.devices, max_steps=args.recipe_steps, accelerator=accelerator,
                         devices_per_node=hw.devices_per_node, grad_bucket_numel=args.grad_bucket_numel)  # fmt: skip
    header = (f"Written by `lightning-flagscale tune` ({hw.name} profile): {best.describe()}\n"
              f"predicted {best.tokens_per_second:.0f} tokens/s, {best.memory_bytes / 1e9:.2f} GB per device")  # fmt: skip
    path = write_recipe(args.write_recipe, recipe, header)
    print(f"wrote {path}: lightning-flagscale fit --config {path}")
