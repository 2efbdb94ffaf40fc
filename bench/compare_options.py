"""The options and the runs of ``bench/compare_strategies.py``, importable without torch.

``lightning-flagscale bench --help`` runs this file: the benchmark itself imports torch and Lightning (seconds), its
options need neither. ``compare_strategies.py`` imports ``SPECS``, ``TARGETS``, ``RunSpec`` and ``build_parser`` from here.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SPECS", "TARGETS", "RunSpec", "build_parser"]


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One configuration of the comparison."""

    name: str
    """Label in tables and charts."""
    family: str
    """``"lightning"`` (a built-in strategy) or ``"flagscale"``."""
    kind: str
    """``"ddp"``, ``"fsdp"``, ``"model_parallel"`` (Lightning) or ``"flagscale"``."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    zero_stage: int = 0
    """FlagScale ZeRO stage (0 = DDP); for Lightning peers the stage whose formulas describe them."""
    peer: str | None = None
    """Name of the closest Lightning configuration (FlagScale configs only)."""
    overlap: bool = True
    """FlagScale ``overlap_grad_reduce``: DDP/ZeRO-1/2 buckets reduced during backward (issue 15)."""
    param_gather: bool = False
    """FlagScale ``overlap_param_gather``: ZeRO-1/2's parameter all-gather in flight into the next forward."""
    zero3_impl: str = "auto"
    """FlagScale ZeRO-3 engine: ``"auto"`` (the default: flat-buffer ZeRO-3 for these layouts) or ``"fsdp2"``."""


SPECS: tuple[RunSpec, ...] = (
    RunSpec(name="L-DDP", family="lightning", kind="ddp"),
    RunSpec(name="L-FSDP", family="lightning", kind="fsdp", zero_stage=3),
    RunSpec(name="L-TP2xFSDP2", family="lightning", kind="model_parallel", tp=2, zero_stage=3),
    # Not a target peer: ModelParallelStrategy with TP=1 is Lightning's FSDP2, the same sharding engine as ZeRO-3.
    RunSpec(name="L-FSDP2", family="lightning", kind="model_parallel", zero_stage=3),
    RunSpec(name="FS-DDP", family="flagscale", kind="flagscale", peer="L-DDP"),
    RunSpec(name="FS-DDP-noovl", family="flagscale", kind="flagscale", peer="L-DDP", overlap=False),
    RunSpec(name="FS-ZeRO1", family="flagscale", kind="flagscale", zero_stage=1, peer="L-DDP"),
    RunSpec(name="FS-ZeRO1-noovl", family="flagscale", kind="flagscale", zero_stage=1, peer="L-DDP", overlap=False),
    RunSpec(name="FS-ZeRO1-pg", family="flagscale", kind="flagscale", zero_stage=1, peer="L-DDP", param_gather=True),
    RunSpec(name="FS-ZeRO2", family="flagscale", kind="flagscale", zero_stage=2, peer="L-DDP"),
    RunSpec(name="FS-ZeRO2-pg", family="flagscale", kind="flagscale", zero_stage=2, peer="L-DDP", param_gather=True),
    RunSpec(name="FS-ZeRO3", family="flagscale", kind="flagscale", zero_stage=3, peer="L-FSDP"),
    RunSpec(
        name="FS-ZeRO3-fsdp2", family="flagscale", kind="flagscale", zero_stage=3, peer="L-FSDP", zero3_impl="fsdp2"
    ),
    RunSpec(name="FS-TP2xZeRO1", family="flagscale", kind="flagscale", tp=2, zero_stage=1, peer="L-TP2xFSDP2"),
    RunSpec(name="FS-TP2xZeRO3", family="flagscale", kind="flagscale", tp=2, zero_stage=3, peer="L-TP2xFSDP2"),
    RunSpec(
        name="FS-TP2xZeRO3-fsdp2",
        family="flagscale",
        kind="flagscale",
        tp=2,
        zero_stage=3,
        peer="L-TP2xFSDP2",
        zero3_impl="fsdp2",
    ),
    RunSpec(name="FS-PP2xDP2", family="flagscale", kind="flagscale", pp=2, peer="L-DDP"),
)

# Issue 15's targets: FlagScale config -> minimum tokens/s ratio to its peer.
TARGETS: dict[str, float] = {"FS-DDP": 1.0, "FS-ZeRO1": 0.95, "FS-ZeRO2": 0.95, "FS-ZeRO1-pg": 0.95, "FS-ZeRO2-pg": 0.95, "FS-ZeRO3": 1.0, "FS-TP2xZeRO3": 1.05,
                             "FS-ZeRO3-fsdp2": 1.0, "FS-TP2xZeRO3-fsdp2": 1.05}  # fmt: skip


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """The benchmark's command line; ``description`` is ``compare_strategies.py``'s docstring."""
    parser = argparse.ArgumentParser(
        prog="lightning-flagscale bench", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few-million-parameter decoder, fewer steps")
    parser.add_argument("--out", default="bench/results", help="folder for the JSON, Markdown and PNG outputs")
    parser.add_argument("--world", type=int, default=4, help="processes per configuration (multiple of 4)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 8, --quick 5)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 3, --quick 2)")
    parser.add_argument("--only", nargs="+", default=None, help=f"subset of {[s.name for s in SPECS]}")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all configs; tokens/s is the median")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="torch.profiler table of rank 0's last warm-up step per config, written under DIR")  # fmt: skip
    parser.add_argument("--bucket", type=int, default=None,
                        help="FlagScale grad_bucket_numel (default: the strategy's, 4M elements)")  # fmt: skip
    parser.add_argument("--note", action="append", default=[], help="a finding to add to the Markdown (repeatable)")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="no run: rewrite the Markdown and PNG of a saved report (with --note findings)")  # fmt: skip
    return parser


if __name__ == "__main__":  # `lightning-flagscale bench --help`: the help, read without importing the benchmark
    script = Path(__file__).with_name("compare_strategies.py")
    build_parser(ast.get_docstring(ast.parse(script.read_text()))).parse_args(sys.argv[1:])
