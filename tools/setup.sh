#!/usr/bin/env bash
# Create .venv (once) with dzc and its test dependencies. The CPU torch wheel is pinned first: an unpinned torch
# pulls a CUDA build of several GB. Python 3.10+ and nvcc (for the TileLang compile tests) are expected.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
