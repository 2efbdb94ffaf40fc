"""Compiled runs inside shared test workers: each starts from an empty dynamo cache, and hitting dynamo's recompile
limit fails instead of running the rest eagerly.

A pool worker runs many tests one after another. Every compiled decoder block shares one code object, so each
layout a worker compiles adds entries to the same cache; past ``recompile_limit`` (8) dynamo silently runs the frame
eagerly, and a parity check against the eager oracle would then pass without testing compiled code.
"""

from __future__ import annotations


def fresh_dynamo() -> None:
    """Clear dynamo's in-memory caches (inductor's on-disk cache stays warm) and make the recompile limit an error."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
