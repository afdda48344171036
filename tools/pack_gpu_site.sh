#!/usr/bin/env bash
# Pack the GPU machine's missing Python packages (TileLang, apache-tvm-ffi, torch-c-dlpack-ext, z3-solver: the
# wheels ../shared/tools/gpu-wheels.sh fetches into .whl-gpu1 and .whl-gpu2, 79 MiB) as one installed site folder
# in an xz tarball, .gpu-site.tar.xz (45 MiB), under the 64 MiB a device call carries: a fresh machine then gets
# TileLang in one call (`bash tools/gpu_campaign.sh site`, carrying .gpu-site.tar.xz) instead of two, and a
# machine recalled between those two calls no longer loses the first one's install.
#   bash tools/pack_gpu_site.sh      # after bash ../shared/tools/gpu-wheels.sh; ~2 min on 2 cores
# The wheels are installed here for the GPU machine's Python (3.12, x86-64): pip's --python-version with --target.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
ls .whl-gpu1/*.whl .whl-gpu2/*.whl > /dev/null  # run ../shared/tools/gpu-wheels.sh first
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" --python-version 3.12 \
  --implementation cp --only-binary=:all: .whl-gpu1/*.whl .whl-gpu2/*.whl
tar -C "$site" -cf - . | xz -9 -T0 > .gpu-site.tar.xz.tmp
mv .gpu-site.tar.xz.tmp .gpu-site.tar.xz
du -h .gpu-site.tar.xz
