"""``lightning-flagscale bench``: runs the repository's ``bench/compare_strategies.py`` (a repository tool).

The benchmark (run specs, peer Lightning modules, spawning, Markdown and plots) lives in ``bench/``, not in the
installed package; the formulas it compares against are the package's (``accounting/state_bytes.py``). This entry point
finds ``bench/compare_strategies.py`` in the checkout the package is imported from, or under the current directory,
and runs it as a script with the same arguments; without a checkout it says how to get one. ``--help`` runs
``bench/compare_options.py`` (the same options, without importing torch), so it answers at once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["bench_main", "find_bench_script"]

_SCRIPT = Path("bench") / "compare_strategies.py"
_OPTIONS = "compare_options.py"


def find_bench_script(cwd: Path | None = None) -> Path | None:
    """``bench/compare_strategies.py`` of the checkout holding this package, else of ``cwd``; ``None`` if absent."""
    for root in (Path(__file__).resolve().parent.parent, (cwd or Path.cwd()).resolve()):
        if (root / _SCRIPT).is_file():
            return root / _SCRIPT
    return None


def bench_main(argv: list[str]) -> None:
    """Run the benchmark script in a fresh interpreter (its workers are spawned from it) and exit with its code."""
    script = find_bench_script()
    if script is None:
        raise SystemExit(
            "lightning-flagscale bench is a repository tool: bench/compare_strategies.py was not found next to the "
            f"installed package ({Path(__file__).resolve().parent.parent}) nor under the current directory "
            f"({Path.cwd()}). Run it from a checkout of the lightning-flagscale repository: "
            "`python bench/compare_strategies.py [--quick]`."
        )
    if "-h" in argv or "--help" in argv:
        script = script.with_name(_OPTIONS)
    # A subprocess, not an import: the script's spawned workers must find their target in its `__main__`.
    code = subprocess.call([sys.executable, str(script), *argv])
    if code:
        raise SystemExit(code)
