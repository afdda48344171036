#!/usr/bin/env bash
# Copy OpenAI's triton_kernels package (matmul_ogs with MXFP4 weights, top-k routing, Hopper/Blackwell swizzled
# weight layouts; the baseline "triton_kernels matmul_ogs (MXFP4)" of tools/bench_mxfp4_moe.py) out of a triton git
# snapshot into the git-ignored .triton-kernels/, recording the commit in .triton-kernels/SOURCE.
#
#   bash tools/fetch_triton_kernels.sh [GIT_DIR [REV]]
#
# GIT_DIR: a git directory of github.com/triton-lang/triton or of a fork that shares its history (a bare mirror is
# enough: no work tree is needed), or a folder holding one as repo/ or .git/; default: the first
# /work/.mirror/triton-lang+triton* (then any /work/.mirror/*+[Tt]riton*) directory that has REV.
# REV: the commit to copy from. Default: the v3.6.0 tag if the snapshot has it, else the release/3.6.x branch, else
# 85400f80bf859a34ad7a746ffda877faf80312ab, the main commit release/3.6.x was cut from (Nov 2025).
#
# The package must match the Triton the GPU machine runs (3.6.0): main's triton_kernels needs a newer Triton and
# has another API. Where no snapshot with the tag or the branch can be had (the triton repository is over the
# snapshot size limit; the fork triton-lang/Triton-to-tile-IR carries main's history to Dec 2025), the branch
# point above stands in for it: the Python sources of the triton 3.6.0 wheel (PyPI) match main's at that commit
# (and at none after 2e1a036c, the first commit whose strings libtriton.so of the wheel lacks) except for
# the version number and one knobs.py line cherry-picked later, and python/triton_kernels did not change between
# e7fb8414 and 6294db5a (the first triton_kernels commit after the cut). Cherry-picks that the release branch took
# into triton_kernels after the cut, if any, are not in it.
# The copied code is public third-party code: it is never committed here (/.triton-kernels/ is in .gitignore).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.triton-kernels"
BRANCH_POINT=85400f80bf859a34ad7a746ffda877faf80312ab
PACKAGE=python/triton_kernels

SRC="${1:-}"
REV="${2:-}"
if [[ -n "$SRC" ]]; then
  sources=("$SRC")
else
  mapfile -t sources < <(ls -d /work/.mirror/triton-lang+triton* /work/.mirror/*+[Tt]riton* 2>/dev/null | awk '!seen[$0]++')
  (( ${#sources[@]} )) || { echo "no /work/.mirror/*+triton* directory: pass the git dir" >&2; exit 1; }
fi
if [[ -n "$REV" ]]; then
  revs=("$REV")
else
  revs=(v3.6.0 release/3.6.x origin/release/3.6.x "$BRANCH_POINT")
fi

GIT_DIR_PATH="" COMMIT=""
for src in "${sources[@]}"; do
  for candidate in "$src" "$src/repo" "$src/.git"; do
    for rev in "${revs[@]}"; do
      if commit="$(git --git-dir="$candidate" rev-parse --verify -q "$rev^{commit}" 2>/dev/null)" &&
         git --git-dir="$candidate" cat-file -e "$commit:$PACKAGE/triton_kernels/__init__.py" 2>/dev/null; then
        GIT_DIR_PATH="$candidate" COMMIT="$commit" REV_USED="$rev"
        break 3
      fi
    done
  done
done
[[ -n "$COMMIT" ]] || { echo "none of ${sources[*]} is a git directory with $PACKAGE at ${revs[*]}" >&2; exit 1; }

rm -rf "$DEST"
mkdir -p "$DEST"
# The package itself (what goes on sys.path) and its pyproject; tests/ and bench/ stay out: a top-level `tests`
# package on sys.path would shadow others.
git --git-dir="$GIT_DIR_PATH" archive "$COMMIT" "$PACKAGE/triton_kernels" "$PACKAGE/pyproject.toml" |
  tar -x -C "$DEST" --strip-components=2
{
  echo "repository: https://github.com/triton-lang/triton ($PACKAGE)"
  echo "snapshot: $GIT_DIR_PATH"
  echo "rev: $REV_USED"
  echo "commit: $COMMIT"
  echo "date: $(git --git-dir="$GIT_DIR_PATH" log -1 --format=%cI "$COMMIT")"
  echo "subject: $(git --git-dir="$GIT_DIR_PATH" log -1 --format=%s "$COMMIT")"
  echo "triton version file: $(git --git-dir="$GIT_DIR_PATH" show "$COMMIT:python/triton/__init__.py" 2>/dev/null |
    sed -n "s/^__version__ = '\(.*\)'/\1/p")"
} > "$DEST/SOURCE"
echo "triton_kernels $COMMIT ($REV_USED) -> $DEST: $(find "$DEST" -name '*.py' | wc -l) files, $(du -sh "$DEST" | cut -f1)"
