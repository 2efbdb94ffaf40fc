"""FlagScaleStrategy side by side with Lightning's DDP, FSDP and ModelParallel strategies (issue 7).

    python bench/compare_strategies.py [--quick] [--out bench/results] [--only L-DDP FS-DDP ...]

Same as ``lightning-flagscale bench``; see ``lightning_flagscale/bench_cli.py`` for what is measured and the theory.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_flagscale.bench_cli import bench_main

if __name__ == "__main__":
    bench_main(sys.argv[1:])
