"""CPU time of one stage call of bench/hetero.py's 6-block model, warm and after a pause (issue 42 item 5).

The emulated slowdown (``parallel/hetero_mesh/ranks.py``) makes every forward / backward of a rank's stage last its
factor times the least CPU time a call of that shape took. In the 4-rank hetero benchmark every call follows a pause
(the rank slept its emulated delay or waited for its neighbour, while other processes ran on its core), and a call
after a pause takes more CPU time than the same call run back to back. This script measures that in one process, with
the stage modules of the benchmark's [2, 4] split (slow first: embedding + 2 blocks; fast last: 4 blocks + norm + LM
head) and 1- and 4-block stages without them: each stage alone, forward then backward, ``--reps`` times, the least
thread CPU time of each over the repetitions (as ``BusyTimer(cost="least")`` takes it) for each kind of gap before
every call: none, a sleep, a busy spin, sleeps of 1 ms for the same time, one 1 ms sleep.

    python bench/hetero_call_cost.py [--reps 60] [--pause-ms 50] [--out bench/results/hetero_call_cost.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models.decoder import CausalLM
from lightning_flagscale.parallel.hetero_mesh.ranks import BusyTimer, attach_busy_timer
from lightning_flagscale.parallel.pipeline_parallel.plan import build_stage_module

MODEL = dict(num_layers=6, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
STAGES = {
    "slow stage of [2, 4]: embedding + 2 blocks": ["embed_tokens", "layers.0", "layers.1"],
    "fast stage of [2, 4]: 4 blocks + norm + head": ["layers.2", "layers.3", "layers.4", "layers.5", "norm", "lm_head"],
    "1 block": ["layers.2"],
    "4 blocks": ["layers.2", "layers.3", "layers.4", "layers.5"],
}


def _gap(kind: str, seconds: float) -> None:
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "spin":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    elif kind == "1 ms sleeps":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            time.sleep(0.001)
    elif kind == "one 1 ms sleep":
        time.sleep(0.001)


def measure(model: CausalLM, units: list[str], gap: str, pause: float, reps: int, seq: int) -> tuple[float, float]:
    """(forward, backward) least thread CPU seconds of a stage of ``units``, ``gap`` before every call."""
    stage = build_stage_module(model, units)
    timer = attach_busy_timer([stage], BusyTimer(1.0, None, "least"))
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).unsqueeze(0)
    for _ in range(reps):
        x = ids if stage.embed_tokens is not None else torch.randn(1, seq, model.config.hidden_size, requires_grad=True)
        _gap(gap, pause)
        out = stage(x, position_ids=positions)
        _gap(gap, pause)
        torch.autograd.backward(out, torch.randn_like(out))
    least = {kind: min(v for k, v in timer._least.items() if k[0] == kind) for kind in ("F", "B")}
    return least["F"], least["B"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--pause-ms", type=float, default=50.0)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default="bench/results/hetero_call_cost.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.from_preset("llama-tiny", **MODEL))
    gaps = ["none", "sleep", "spin", "1 ms sleeps", "one 1 ms sleep"]
    pause = args.pause_ms / 1e3
    rows = {name: {gap: measure(model, units, gap, pause, args.reps, args.seq) for gap in gaps}
            for name, units in STAGES.items()}  # fmt: skip
    lines = [
        "# One stage call's CPU time, warm and after a pause (bench/hetero.py's 6-block model, one process)",
        "",
        f"`python bench/hetero_call_cost.py --reps {args.reps} --pause-ms {args.pause_ms:g} --seq {args.seq}`;"
        f" one thread, load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}.",
        "",
        f"Least thread CPU time (ms) of forward + backward over {args.reps} repetitions, for each gap before every"
        f" forward and every backward: none (back to back), a {args.pause_ms:g} ms sleep, a {args.pause_ms:g} ms busy"
        f" spin, {args.pause_ms:g} ms of 1 ms sleeps, one 1 ms sleep. Extra: the sleep's over none.",
        "",
        "| stage | " + " | ".join(gaps) + " | extra after the sleep |",
        "|---|" + "---|" * (len(gaps) + 1),
    ]
    for name, cells in rows.items():
        total = {gap: 1e3 * sum(fb) for gap, fb in cells.items()}
        values = " | ".join(f"{total[g]:.2f}" for g in gaps)
        lines.append(f"| {name} | {values} | {total['sleep'] - total['none']:+.2f} |")
    lines += ["", "Forward / backward apart (ms), none -> sleep:", ""]
    for name, cells in rows.items():
        (f0, b0), (f1, b1) = cells["none"], cells["sleep"]
        lines.append(f"- {name}: F {1e3 * f0:.2f} -> {1e3 * f1:.2f}, B {1e3 * b0:.2f} -> {1e3 * b1:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
