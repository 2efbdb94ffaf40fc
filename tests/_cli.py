"""Running ``lightning-flagscale`` inside the shared test workers."""

from __future__ import annotations

import os
from collections.abc import Sequence

_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def run_cli(argv: Sequence[str]):
    """``lightning-flagscale fit|validate|...`` in this process; returns the ``FlagScaleCLI`` object.

    A recipe's ``seed_everything`` sets process-wide environment variables (Lightning's samplers read the seed from
    them); the shared workers outlive the test, so they are restored afterwards.
    """
    from lightning_flagscale.cli_train import run_lightning_cli

    saved = {key: os.environ.get(key) for key in _SEED_VARIABLES}
    try:
        return run_lightning_cli(list(argv))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
