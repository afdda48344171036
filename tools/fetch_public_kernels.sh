#!/usr/bin/env bash
# Copy the public TileLang DeepSeek-V3.2 example kernels (baselines for tools/bench_dsa.py) out of a tilelang git
# snapshot into the git-ignored .public-kernels/deepseek_v32/, recording the commit in .public-kernels/SOURCE.
#
#   bash tools/fetch_public_kernels.sh [GIT_DIR [REV]]
#
# GIT_DIR: a git directory of github.com/tile-ai/tilelang (a bare mirror is enough: no work tree is needed), or a
# folder holding one as repo/ or .git/; default: the newest /work/.mirror/tile-ai+tilelang* directory. REV: the
# commit to copy from (default HEAD). The copied code is public third-party code: it is never committed here.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.public-kernels"
FILES=(sparse_mla_fwd sparse_mla_fwd_pipelined topk_selector fp8_lighting_indexer utils)

SRC="${1:-}"
REV="${2:-HEAD}"
if [[ -z "$SRC" ]]; then
  SRC="$(ls -dt /work/.mirror/tile-ai+tilelang* 2>/dev/null | head -n 1 || true)"
  [[ -n "$SRC" ]] || { echo "no /work/.mirror/tile-ai+tilelang* directory: pass the git dir" >&2; exit 1; }
fi
for candidate in "$SRC" "$SRC/repo" "$SRC/.git"; do
  if git --git-dir="$candidate" rev-parse --verify -q "$REV^{commit}" >/dev/null 2>&1; then
    GIT_DIR_PATH="$candidate"
    break
  fi
done
[[ -n "${GIT_DIR_PATH:-}" ]] || { echo "$SRC: not a git directory with $REV" >&2; exit 1; }

COMMIT="$(git --git-dir="$GIT_DIR_PATH" rev-parse "$REV^{commit}")"
mkdir -p "$DEST/deepseek_v32"
copied=() missing=()
for name in "${FILES[@]}"; do
  path="examples/deepseek_v32/$name.py"
  if git --git-dir="$GIT_DIR_PATH" cat-file -e "$COMMIT:$path" 2>/dev/null; then
    git --git-dir="$GIT_DIR_PATH" show "$COMMIT:$path" > "$DEST/deepseek_v32/$name.py"
    copied+=("$name.py")
  else
    rm -f "$DEST/deepseek_v32/$name.py"
    missing+=("$name.py")
  fi
done
{
  echo "repository: https://github.com/tile-ai/tilelang"
  echo "commit: $COMMIT"
  echo "date: $(git --git-dir="$GIT_DIR_PATH" log -1 --format=%cI "$COMMIT")"
  echo "version file: $(git --git-dir="$GIT_DIR_PATH" show "$COMMIT:VERSION" 2>/dev/null || echo '?')"
  echo "copied: ${copied[*]:-none}"
  echo "missing: ${missing[*]:-none}"
} > "$DEST/SOURCE"
echo "tilelang $COMMIT -> $DEST/deepseek_v32: copied ${copied[*]:-none}"
if (( ${#missing[@]} )); then
  echo "missing in this snapshot: ${missing[*]}"
fi
