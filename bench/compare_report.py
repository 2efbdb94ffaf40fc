"""Tables, charts and theory columns of ``compare_strategies.py`` (kept apart so ``--render`` needs no run).

The theory is ``lightning_flagscale.accounting.state_bytes``'s, for Ψ the parameters one rank's model-parallel part holds
and N the data-parallel size, all fp32 (``32-true``): data-parallel wire bytes ``comm_theory_bytes(4Ψ, N, stage)``,
state bytes as this package holds them ``expected_state_bytes(Ψ, N, stage)`` and the ZeRO paper's
``zero_theory_bytes(Ψ, N, stage, "fp32")``.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightning_flagscale.accounting.state_bytes import comm_theory_bytes, expected_state_bytes, zero_theory_bytes

__all__ = ["chart", "machine_info", "markdown", "mib", "summarise"]


def _state_theory(stage: int, psi: int, n: int) -> tuple[float, float]:
    """(this package's layout, ZeRO paper formula) state bytes of one rank, fp32 Adam."""
    return expected_state_bytes(psi, n, stage).total, zero_theory_bytes(psi, n, stage, layout="fp32").total


PHASE_NAMES = ("forward", "backward", "sync", "optimizer", "between")
"""Rank 0's step phases in the bench: ``forward`` (batch start to the first ``on_before_backward``; under PP the whole
schedule), ``backward`` (to the last ``on_after_backward``), ``sync`` (to ``on_before_optimizer_step``: gradient
reduction still in flight, the step guard), ``optimizer`` (to batch end: clipping, the step, ZeRO gathers),
``between`` (batch end to the next batch start: data, logging, Lightning's loop)."""


def _dp_comm_theory(stage: int, psi: int, n: int) -> float:
    return comm_theory_bytes(4 * psi, n, stage).total


def summarise(spec: Any, ranks: list[dict[str, Any]], settings: dict[str, Any], world: int) -> dict[str, Any]:
    """One table row from the per-rank results (per-rank figures are means over ranks; theory per rank, summed)."""
    r0 = ranks[0]
    elapsed = r0["t1"] - r0["t0"]
    tokens = settings["global_batch"] * settings["seq_len"] * settings["steps"]
    # Every step synchronises the ranks (gradient reduction), so rank 0's step boundaries are the job's. The median
    # step time resists the bursts of a shared machine better than the wall time of the whole window.
    step_times = [b - a for a, b in zip(r0["marks"], r0["marks"][1:])]
    median_step = statistics.median(step_times)
    comm_theory = sum(_dp_comm_theory(spec.zero_stage, r["psi_local"], r["dp"]) for r in ranks)
    state_exp = sum(_state_theory(spec.zero_stage, r["psi_local"], r["dp"])[0] for r in ranks)
    state_paper = sum(_state_theory(spec.zero_stage, r["psi_local"], r["dp"])[1] for r in ranks)
    dp_bytes = sum(r["traffic"]["dp"] for r in ranks)
    state = sum(sum(r["state"].values()) for r in ranks) if all("state" in r for r in ranks) else float("nan")
    ops: dict[str, dict[str, float]] = {}
    for r in ranks:
        for cls_, d in r["ops"].items():
            for op, b in d.items():
                ops.setdefault(cls_, {}).setdefault(op, 0.0)
                ops[cls_][op] += b / world
    return {
        **asdict(spec),
        "dp": r0["dp"],
        "elapsed_s": elapsed,
        "step_times_s": step_times,
        "tokens_per_s": settings["global_batch"] * settings["seq_len"] / median_step,
        "tokens_per_s_wall": tokens / elapsed,
        "dp_bytes_per_rank": dp_bytes / world,
        "dp_bytes_theory_per_rank": comm_theory / world,
        "dp_bytes_ratio": dp_bytes / comm_theory if comm_theory else float("nan"),
        "tp_bytes_per_rank": sum(r["traffic"]["tp"] for r in ranks) / world,
        "pp_bytes_per_rank": sum(r["traffic"]["pp"] for r in ranks) / world,
        "ops_per_rank": ops,
        "state_bytes_per_rank": state / world,
        "state_theory_per_rank": state_exp / world,
        "state_paper_per_rank": state_paper / world,
        "state_ratio": state / state_exp,
        "state_by_kind_per_rank": {k: sum(r["state"][k] for r in ranks) / world for k in r0.get("state", {})},
        "peak_rss_max": max(r["peak_rss"] for r in ranks),
        "psi_local_per_rank": [r["psi_local"] for r in ranks],
        "final_loss": r0["final_loss"],
        "overlap": r0.get("overlap"),
    }


def machine_info() -> dict[str, Any]:
    import lightning

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
    }


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def markdown(report: dict[str, Any]) -> str:
    """The Markdown table (and its context) for the README."""
    rows = report["rows"]
    by_name = {r["name"]: r for r in rows}
    m, s = report["machine"], report["settings"]
    timing = "tokens/s from the median step time" if "step_times_s" in rows[0] else "tokens/s over the timed window"
    lines = [
        "# FlagScaleStrategy vs Lightning's built-in strategies",
        "",
        f"`{report['command']}` — world size {report['world']} (gloo, CPU, 1 thread per rank), fp32, decoder of "
        f"{report['num_params'] / 1e6:.1f}M parameters ({', '.join(f'{k}={v}' for k, v in s['model'].items())}), "
        f"seq {s['seq_len']}, global batch {s['global_batch']}, {s['warmup']} warm-up + {s['steps']} timed steps "
        f"({timing}, median over {len(rows[0].get('tokens_per_s_samples', [0]))} round(s)), "
        f"then one step with communication accounting. Machine: {m['nproc']} CPUs (nproc), {m['cpu']}, torch {m['torch']}, "
        f"Lightning {m['lightning']}, {report['date']}.",
        "",
        "| config | tokens/s (min-max) | vs peer | exposed comm ms / step ms | comm ops started in backward | "
        "DP MiB/rank/step (theory, ratio) | TP MiB | PP MiB | state MiB/rank (theory, ratio) | ZeRO paper MiB | "
        "peak RSS MiB |",
        "|---|---:|---|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        vs = ""
        if r["peer"] and r["peer"] in by_name:
            vs = _versus(r, by_name[r["peer"]], report.get("targets", {}).get(r["name"]))
        samples = r.get("tokens_per_s_samples") or [r["tokens_per_s"]]
        spread = f" ({min(samples):.0f}-{max(samples):.0f})" if len(samples) > 1 else ""
        ov = r.get("overlap")
        exposed = f"{ov['exposed_comm_ms']:.0f} / {ov['step_ms']:.0f}" if ov else "n/a"
        started = f"{ov['comm_before_backward_end']}/{ov['comm_ops']}" if ov else "n/a"
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.0f}{spread} | {vs} | {exposed} | {started} | {mib(r['dp_bytes_per_rank'])} "
            f"({mib(r['dp_bytes_theory_per_rank'])}, {r['dp_bytes_ratio']:.3f}) | {mib(r['tp_bytes_per_rank'])} | "
            f"{mib(r['pp_bytes_per_rank'])} | {mib(r['state_bytes_per_rank'])} "
            f"({mib(r['state_theory_per_rank'])}, {r['state_ratio']:.3f}) | {mib(r['state_paper_per_rank'])} | "
            f"{mib(r['peak_rss_max'])} |"
        )
    lines += [
        "",
        "DP bytes: wire bytes per rank on data-parallel groups under the ring model (`CommTracker`), theory "
        "2·4Ψ(N-1)/N (DDP, ZeRO-1) or 3·4Ψ(N-1)/N (FSDP, ZeRO-3), Ψ the parameters of the rank's TP shard / pipeline "
        "stage, N the data-parallel size. TP/PP: tensor-parallel collectives and pipeline P2P, measured. State: "
        "parameters + gradients + optimizer states per rank at the optimizer step; theory 16Ψ (DDP), 16Ψ/N "
        "(FSDP, ZeRO-3), 8Ψ + 12Ψ/N for this package's ZeRO-1 (full fp32 gradient buckets, fp32 main slice), "
        "4Ψ + 16Ψ/N for its ZeRO-2 (only the fp32 main-gradient shard); the ZeRO paper's column is its Fig. 1 "
        "formula (ZeRO-1: 8Ψ + 8Ψ/N). Peak RSS: the largest rank's, whole process (Python, torch, Lightning "
        "included). Exposed comm (`bench/profile_comm.py`, torch.profiler trace of rank 0's last warm-up step): "
        "time a gloo collective ran while the training thread ran no aten op (waiting, or in Python), next to that "
        "step's length; comm ops started in backward: collectives that began before the step's last backward node "
        "finished, of all collectives in the step.",
        "",
        "Timing runs 4 processes on a 2-core machine (how loaded it was: the first finding): tokens/s are "
        "noisy; only ratios measured in the same run are meaningful. vs peer: median of the same-round ratios "
        "(each round runs every configuration once, in order), with their min-max; a target is met (✓) only when "
        "the whole min-max range clears it, missed (✗) when the whole range is below it, and undecided (~) when "
        "the range straddles it.",
    ]
    phase_rows = [r for r in rows if r.get("phase_steps_s")]
    if phase_rows:
        lines += [
            "",
            "Step phases, rank 0, median ms over the timed steps of every round (`bench/compare_strategies.py` "
            "`PHASES`): forward (under PP the whole schedule) | backward | sync: after backward, before the optimizer "
            "hooks (gradient reduction still in flight, the step guard) | optimizer (clipping, the step, ZeRO "
            "parameter gathers) | between steps (data loading, logging, Lightning's loop).",
            "",
            "| config | forward | backward | sync | optimizer | between | sum |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in phase_rows:
            med = {k: statistics.median(v) * 1e3 for k, v in r["phase_steps_s"].items() if v}
            cells = " | ".join(f"{med[k]:.0f}" if k in med else "n/a" for k in PHASE_NAMES)
            lines.append(f"| {r['name']} | {cells} | {sum(med.values()):.0f} |")
    for name, err in report.get("failed", {}).items():
        lines += ["", f"{name} failed: `{err}`"]
    if report.get("notes"):
        lines += ["", "## Findings", "", *report["notes"]]
    return "\n".join(lines) + "\n"


def same_round_ratios(row: dict[str, Any], peer: dict[str, Any]) -> list[float]:
    """tokens/s of ``row`` over its peer's, round by round (the rounds interleave every configuration)."""
    mine = row.get("tokens_per_s_samples") or [row["tokens_per_s"]]
    theirs = peer.get("tokens_per_s_samples") or [peer["tokens_per_s"]]
    return [a / b for a, b in zip(mine, theirs)]


def _versus(row: dict[str, Any], peer: dict[str, Any], target: float | None) -> str:
    ratios = same_round_ratios(row, peer)
    lo, hi = min(ratios), max(ratios)
    spread = f" ({lo:.2f}-{hi:.2f})" if len(ratios) > 1 else ""
    mark = ""
    if target is not None:
        mark = " ✓" if lo >= target else (f" ✗ (target {target:.2f})" if hi < target else f" ~ (target {target:.2f})")
    return f"{statistics.median(ratios):.2f}x{spread} {peer['name']}{mark}"


def _moved(row: dict[str, Any]) -> float:
    return row["dp_bytes_per_rank"] + row["tp_bytes_per_rank"] + row["pp_bytes_per_rank"]


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [r["name"] for r in rows]
    colors = ["#888888" if r["family"] == "lightning" else "#7b2cbf" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("tokens/s (higher is better)", [r["tokens_per_s"] for r in rows]),
        ("bytes moved per rank per step (MiB)", [_moved(r) / 2**20 for r in rows]),
        ("state bytes per rank (MiB)", [r["state_bytes_per_rank"] / 2**20 for r in rows]),
    ]
    for ax, (title, values) in zip(axes, panels):
        ax.bar(names, values, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=60)
    fig.suptitle(f"FlagScaleStrategy (purple) vs Lightning (grey), {report['world']} CPU ranks, "
                 f"{report['num_params'] / 1e6:.1f}M params")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
