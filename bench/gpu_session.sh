#!/usr/bin/env bash
# One device call (DEVELOPERS.md): bench/gpu.py with a profiled step per row, then the GPU-marked tests.
#   run(command="bash bench/gpu_session.sh", timeout_s=...)   # writes into $OUT
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# Wheels the device image lacks (torchao for fp8, docs/gpu.md says how to download them), carried in .whl/
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
TESTS_S=${TESTS_S:-200}; BENCH_BUDGET_S=${BENCH_BUDGET_S:-230}; ROWS=${ROWS:-}; ROUNDS=${ROUNDS:-1}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
  date -u; } > "$OUT/env.txt" 2>&1
python3 bench/gpu.py --out "$OUT" --profile "$OUT" --steps 8 --warmup 3 --timeout 150 --budget "$BENCH_BUDGET_S" --rounds "$ROUNDS" \
  ${ROWS:+--only $ROWS} 2>&1 | tee "$OUT/bench_log.txt"
if [ "$TESTS_S" -gt 0 ]; then
  timeout "$TESTS_S" python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -n 6 -v -rA --tb=short \
    tests/multimodal/test_prealloc_gpu.py tests/strategies/test_lightning_strategies.py tests/strategies/test_teardown.py \
    tests/strategies/test_precision_parity.py tests/parallel/test_context.py > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest rc $?" >> "$OUT/pytest_gpu.txt"
fi
