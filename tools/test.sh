#!/usr/bin/env bash
# Set up, then run the test suite (CPU-only; GPU tests are skipped without a CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/python -m pytest -q -p no:logging "$@"
