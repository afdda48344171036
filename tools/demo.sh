#!/usr/bin/env bash
# Set up, then compile a reference model for target "cuda" (on a CPU-only machine through Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/python tools/demo.py "$@"
