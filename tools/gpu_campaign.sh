#!/usr/bin/env bash
# The H200 check-and-benchmark campaign, in two calls of the device tool (each carries one wheel folder that
# ../shared/tools/gpu-wheels.sh fetched; the machine keeps /tmp between the two while warm):
#   call 1 (carry .whl-gpu1):  bash tools/gpu_campaign.sh 1   # install dzc + TileLang, Triton numerics on the GPU
#   call 2 (carry .whl-gpu2):  bash tools/gpu_campaign.sh 2   # z3; TileLang numerics; the benchmark
set -uo pipefail
step=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl-gpu$step/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ "$step" = 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m pytest tests/test_add_rms_norm_kernels.py -q -p no:logging 2>&1 | tee "$OUT/gpu_tests_triton.log" | tail -5
else
  python3 -m pytest tests/test_tilelang_add_rms_norm.py -m gpu -q -p no:logging 2>&1 | tee "$OUT/gpu_tests_tilelang.log" | tail -5
  python3 tools/diagnose_overhead.py --hidden 2880 --tokens 1 4096 2>&1 | grep -v "^ *[-A-Z]" > "$OUT/overhead.log"
  python3 tools/bench_add_rms_norm.py --out "$OUT/add_rms_norm_h200.md" 2>&1 | tee "$OUT/bench.log" | tail -14
  cat "$OUT/overhead.log"
fi
