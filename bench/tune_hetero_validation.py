"""``tune --hetero``'s predictions against measured runs: the planner's plans for two emulated device types on 4 CPU
processes, predicted step time next to the measured one.

    python bench/tune_hetero_validation.py [--rounds 3] [--plans 6] [--profile bench/results/tune_cpu_profile.json]

Two device types, ``fast`` and ``slow``, two ranks each, emulated as ``bench/hetero.py`` does
(``FLAGSCALE_EMULATE_SLOWDOWN``: every forward and backward of a rank's stage modules is stretched by its type's
factor, B for fast and B x F for slow, by sleeping (factor - 1) x the CPU time it took). The planner sees each type
as this machine's calibrated profile (``tune --calibrate``, bf16, one thread a rank) with its compute stretched by
the same factor: ``compute_scale`` / factor, and the host times a block pays inside its forward (``tp_overhead``,
``selective_overhead``, ``moe_overhead``) x factor. What the emulation does not stretch (the optimizer phase, the
training loop, the links) keeps the profile's values.

``plan_hetero`` lists every mesh plan (layouts per mesh, layer split, schedule, micro-batch size, the least recompute
and ZeRO stage that fit) and ``plan_hetero_dp`` the hetero-DP one; ``--plans`` of them spanning the predicted range
(fastest to slowest) run in interleaved rounds, each a fresh 4-process world training with ``bf16-mixed``, AdamW and
clipping (as the recipes and ``tune_validation.py``). Measured: rank 0's wall time per optimizer step over the
timed steps, the median over rounds. Reported: predicted vs measured, the ratio, Spearman's rank correlation, and
whether the plan predicted fastest is within 10% of the fastest measured. Nothing is fitted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import collect, context
from _tune_report import spearman
from hetero import WARMUP, _start

MODEL = dict(num_layers=8, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
TYPES = ["fast", "fast", "slow", "slow"]
NOTE = (
    "What the planner does not model here: four ranks share two cores, and the work the emulation does not stretch"
    " (gloo collectives, the optimizer phase, the training loop) runs on them. The homogeneous cost model simulates"
    " shared cores (`tune/shared_cores.py`); the hetero planner prices devices of their own, as on GPUs. Plans"
    " whose blocks call many collectives (TP 2 meshes) measured slower than predicted."
)


def _emulated(profile, name: str, factor: float):
    return profile.replace(
        name=name, device_type=name, compute_scale=profile.compute_scale / factor,
        tp_overhead=tuple(t * factor for t in profile.tp_overhead),
        selective_overhead=tuple(t * factor for t in profile.selective_overhead),
        moe_overhead=tuple(t * factor for t in profile.moe_overhead),
    )  # fmt: skip


def plans(args: argparse.Namespace) -> list:
    from lightning_flagscale.config import TransformerConfig
    from lightning_flagscale.tune import load_profile
    from lightning_flagscale.tune.hetero import DeviceGroup, plan_hetero, plan_hetero_dp

    base = load_profile(args.profile)
    factors = {"fast": args.base_slowdown, "slow": args.base_slowdown * args.slowdown}
    groups = [DeviceGroup(device_type=t, count=2, profile=_emulated(base, t, f)) for t, f in factors.items()]
    model = TransformerConfig.from_preset("llama-tiny", **MODEL, max_seq_len=args.seq)
    found = plan_hetero(model, groups, seq_len=args.seq, global_batch=args.global_batch)
    found.append(plan_hetero_dp(model, groups, seq_len=args.seq, global_batch=args.global_batch))
    found.sort(key=lambda p: p.step_seconds)
    n = min(args.plans, len(found))
    picks = sorted({round(i * (len(found) - 1) / max(1, n - 1)) for i in range(n)})
    return [found[i] for i in picks]


def _run(plan, args: argparse.Namespace) -> float:
    """Seconds per optimizer step of ``plan`` (rank 0's wall clock over the timed steps)."""
    spec = dict(
        steps=WARMUP + args.steps, seq=args.seq, global_batch=args.global_batch, model=dict(MODEL),
        slowdown=f"fast={args.base_slowdown},slow={args.base_slowdown * args.slowdown}", strategy=plan.parallel,
        precision="bf16-mixed", optimizer="adamw", clip=1.0,
    )  # fmt: skip
    if plan.kind == "meshes":  # the loader feeds the first mesh's DP ranks a share of each step
        spec["loader_batch"] = args.global_batch // plan.parallel["hetero_meshes"][0]["data_parallel_size"]
    else:  # hetero-DP's samplers cut each rank's share out of the global batch
        spec["loader_batch"] = args.global_batch
    ctx = context()
    queue = ctx.Queue()
    procs = _start(ctx, TYPES, spec, queue)
    results = collect(procs, queue, len(procs), timeout=1800, name=str(plan.parallel))
    rank0 = next(r for r in results if r["rank"] == 0)
    return rank0["wall_s"] / args.steps


def describe(plan) -> str:
    p = plan.parallel
    if plan.kind != "meshes":
        return f"hetero-DP {p['hetero_dp_batch_sizes']} zero{p['zero_stage']} rc={p['recompute']}"
    meshes = " -> ".join(
        f"tp{m['tensor_parallel_size']} dp{m['data_parallel_size']}"
        + (f" pp{m['pipeline_parallel_size']}" if m["pipeline_parallel_size"] > 1 else "")
        for m in p["hetero_meshes"]
    )
    v = p.get("virtual_pipeline_parallel_size", 1)
    return (f"{meshes}, layers {p['hetero_layers']}, {p['pipeline_schedule']}" + (f"/v{v}" if v > 1 else "")
            + f", mbs {p['micro_batch_size']}, zero{p['zero_stage']}, rc={p['recompute']}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plans", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--base-slowdown", type=float, default=10.0)
    ap.add_argument("--slowdown", type=float, default=2.0, help="slow over fast")
    ap.add_argument("--profile", default="bench/results/tune_cpu_profile.json")
    ap.add_argument("--out", default="bench/results/tune_hetero_validation")
    args = ap.parse_args()
    chosen = plans(args)
    measured: list[list[float]] = [[] for _ in chosen]
    for r in range(args.rounds):  # interleaved: every round runs each plan once
        for i, plan in enumerate(chosen):
            seconds = _run(plan, args)
            measured[i].append(seconds)
            print(f"round {r + 1}: {describe(plan):<70} predicted {plan.step_seconds:7.3f}s measured {seconds:7.3f}s",
                  flush=True)  # fmt: skip
    write_report(chosen, measured, args)


def write_report(chosen: list, measured: list[list[float]], args: argparse.Namespace) -> None:
    pred = [p.step_seconds for p in chosen]
    got = [statistics.median(m) for m in measured]
    rho = spearman(pred, got)
    best_pred = min(range(len(pred)), key=pred.__getitem__)
    best_meas = min(got)
    ratios = [g / p for p, g in zip(pred, got, strict=True)]
    lines = [
        "# tune --hetero: predicted vs measured step time (CPU emulation)",
        "",
        f"`python bench/tune_hetero_validation.py --rounds {args.rounds} --plans {args.plans} --steps {args.steps}"
        f" --seq {args.seq} --global-batch {args.global_batch} --base-slowdown {args.base_slowdown} --slowdown"
        f" {args.slowdown} --profile {args.profile}` ({time.strftime('%Y-%m-%d %H:%M')}; load average at the end:"
        f" {', '.join(f'{x:.1f}' for x in os.getloadavg())}).",
        "",
        f"Model: llama-tiny shape with {MODEL}, sequence {args.seq}, global batch {args.global_batch}. Two emulated"
        f" device types of 2 ranks each: fast {args.base_slowdown}x and slow {args.base_slowdown * args.slowdown}x one"
        " core (the module docstring says how; the planner's profiles are this machine's calibration with compute"
        " stretched by the same factors). Measured: rank 0's wall seconds per optimizer step, median over"
        f" {args.rounds} interleaved rounds (min-max). Nothing is fitted.",
        "",
        "| plan | predicted s/step | measured s/step (min-max) | measured / predicted |",
        "|---|---:|---:|---:|",
    ]
    for plan, m, g, ratio in zip(chosen, measured, got, ratios, strict=True):
        lines.append(
            f"| {describe(plan)} | {plan.step_seconds:.3f} | {g:.3f} ({min(m):.3f}-{max(m):.3f}) | {ratio:.2f} |"
        )
    lines += [
        "",
        f"- Spearman rank correlation, predicted vs measured: {rho:.2f}.",
        f"- Measured / predicted: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max"
        f" {max(ratios):.2f}); within 20%: {sum(abs(r - 1) <= 0.2 for r in ratios)} of {len(ratios)}.",
        f"- The plan predicted fastest ({describe(chosen[best_pred])}) measured {got[best_pred]:.3f} s against the"
        f" fastest measured {best_meas:.3f} s: {'within' if got[best_pred] <= 1.1 * best_meas else 'not within'} 10%.",
        "",
        NOTE,
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines))
    record = dict(args=vars(args), plans=[dict(kind=p.kind, parallel=p.parallel, predicted=p.step_seconds)
                                          for p in chosen], measured=measured)  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
