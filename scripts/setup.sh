#!/usr/bin/env bash
# Creates .venv (if missing) and installs the CPU build of torch first, then the package with its dev extras.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned to the CPU build that lies on this kind of machine's disk; a bare `torch` requirement
# resolved by another package would pull a multi-GB CUDA build instead.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[dev]"
.venv/bin/python -c "import torch, lightning, lightning_flagscale; print('ready: torch', torch.__version__, '| lightning', lightning.__version__, '| lightning-flagscale', lightning_flagscale.__version__)"
