#!/usr/bin/env bash
# Set up, then run the test suite. On a CPU machine: the CPU suite (GPU tests are skipped). On a GPU machine: the
# CPU suite with CUDA hidden (Triton's interpreter is chosen per process, at import), then the tests marked gpu or
# anydevice (those pick CUDA where present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# The CPU suite runs on every core, one test file per worker (pytest-xdist; a file's module fixtures stay shared).
# The GPU tests run in one process: they share the device.
# The 20 slowest tests are listed at the end: the suite must stay near 20 minutes on CI's 2 cores.
workers=(-n "$(( $(nproc) < 4 ? $(nproc) : 4 ))" --dist loadfile --durations=20)  # at most 4: memory
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  CUDA_VISIBLE_DEVICES= .venv/bin/python -m pytest -q -p no:logging "${workers[@]}" "$@"
  .venv/bin/python -m pytest -q -p no:logging -m "gpu or anydevice" "$@"
else
  .venv/bin/python -m pytest -q -p no:logging "${workers[@]}" "$@"
fi
