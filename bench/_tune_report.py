"""Tables of ``bench/tune_validation.py``: predicted vs measured memory and time, errors, Spearman, best layout."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

__all__ = ["spearman", "write_report"]

MIB = 2**20


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _measured(runs: list[list[dict]]) -> tuple[float, float, float, float, float]:
    """(peak bytes of the largest rank, its state bytes, median step seconds, min, max) over rounds."""
    peaks, states, times = [], [], []
    for ranks in runs:
        per_rank = [(sum(r["state_start"].values()) + r["peak_delta"], sum(r["state_start"].values())) for r in ranks]
        peak, state = max(per_rank)
        peaks.append(peak)
        states.append(state)
        # a step takes as long as its slowest rank
        times.extend(max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"])))
    return max(peaks), statistics.median(states), statistics.median(times), min(times), max(times)


def _hardware(results: dict, args, predict, measured_time: dict[str, float]):
    from lightning_flagscale.tune.hardware import Hardware

    if args.profile:
        return Hardware(**json.loads(Path(args.profile).read_text())), f"profile `{args.profile}`"
    base = Hardware(flops=1e12, intra_node_bandwidth=results["bandwidth"], inter_node_bandwidth=results["bandwidth"],
                    devices_per_node=4, memory_bytes=float("inf"))  # fmt: skip
    first = args.layouts[0]
    # Calibrate flops on the first layout: the compute term is linear in 1/flops, communication is not.
    _, t_base = predict(first, base)
    comm = predict(first, dataclasses.replace(base, flops=float("inf")))[1]
    flops = base.flops * (t_base - comm) / max(measured_time[first] - comm, 1e-9)
    note = (f"calibrated here: flops={flops / 1e9:.2f} GFLOP/s fitted to `{first}`, link bandwidth "
            f"{results['bandwidth'] / 1e6:.0f} MB/s from a timed 16 MiB all-reduce over 4 processes")  # fmt: skip
    return dataclasses.replace(base, flops=flops), note


def write_report(results: dict, args, predict, path: Path) -> None:
    names = [n for n in args.layouts if n in results["runs"]]
    meas = {n: _measured(results["runs"][n]) for n in names}
    hw, hw_note = _hardware(results, args, predict, {n: meas[n][2] for n in names})
    rows, pm, mm, pt, mt = [], [], [], [], []
    for n in names:
        breakdown, seconds = predict(n, hw)
        heavy = breakdown.heaviest
        peak, state, t_med, t_min, t_max = meas[n]
        mem_err = breakdown.peak / peak - 1
        t_err = seconds / t_med - 1
        pm.append(breakdown.peak)
        mm.append(peak)
        pt.append(seconds)
        mt.append(t_med)
        rows.append(
            f"| {n} | {heavy.states / MIB:.1f} | {state / MIB:.1f} | {(heavy.activations + heavy.transient) / MIB:.1f}"
            f" | {heavy.live_microbatches} | {breakdown.peak / MIB:.1f} | {peak / MIB:.1f} | {mem_err:+.1%}"
            f" | {seconds:.2f} | {t_med:.2f} ({t_min:.2f}-{t_max:.2f}) | {t_err:+.1%} | {len(results['runs'][n])} |"
        )
    mem_ok = sum(abs(a / b - 1) <= 0.10 for a, b in zip(pm, mm))
    time_ok = sum(abs(a / b - 1) <= 0.20 for a, b in zip(pt, mt))
    best_pred = names[min(range(len(names)), key=pt.__getitem__)]
    best_meas = names[min(range(len(names)), key=mt.__getitem__)]
    lines = [
        "# Tuner validation: predicted vs measured, 4 CPU processes",
        "",
        f"Measured under load (a 2-core machine shared by ~5 engineers), up to {args.rounds} interleaved round(s) "
        "(column `rounds`); "
        "`python bench/tune_validation.py` regenerates this file.",
        "Model: Llama-shaped 26.1M parameters (h=512, 6 layers, 8 heads / 4 KV, SwiGLU 1408, vocab 8192 padded to a "
        "multiple of 64); MoE layouts: 4 layers, 4 experts top-2 of width 704 (29M). Sequence 64, global batch 4, "
        "bf16-mixed (Megatron layout), AdamW.",
        "",
        "Memory measured = state bytes at the start of step 1 (`parallel.memory.state_bytes`) + the peak of bytes "
        "allocated above that level during the step, from the allocator's events (`tune.measure.AllocationPeak`, "
        "`torch.profiler` with `profile_memory=True`), largest rank. Predicted = `tune.memory.memory_breakdown`, "
        "heaviest rank (states + activations + transients, or the optimizer step if higher).",
        f"Time: median (min-max) over rounds of step 2, slowest rank; predicted by `tune.cost.estimate_step_"
        f"seconds` with {hw_note}.",
        "",
        "| layout | pred. states MiB | meas. states MiB | pred. act.+transient MiB | live mb | pred. peak MiB"
        " | meas. peak MiB | mem err | pred. s | meas. s | time err | rounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- memory within 10%: {mem_ok}/{len(names)} layouts; Spearman(pred, meas) memory = {spearman(pm, mm):.2f}",
        f"- time within 20%: {time_ok}/{len(names)} layouts; Spearman(pred, meas) time = {spearman(pt, mt):.2f}",
        f"- predicted best: `{best_pred}` (measured {meas[best_pred][2]:.2f} s); measured best: `{best_meas}` "
        f"({meas[best_meas][2]:.2f} s): predicted best is {meas[best_pred][2] / meas[best_meas][2] - 1:+.1%} "
        "off the measured best",
    ]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
