#!/usr/bin/env bash
# MUSA validation on the H200 (issue 6; docs/musa.md says what each step proves), after `bash tools/gpu_campaign.sh 1`
# in the same warm machine (dzc installed editable, TileLang in /tmp/site):
#   bash tools/gpu_musa_validation.sh     # quick (~3 min): each family's first case in the self-test (Triton),
#                                         # the runtime-double tests, quick MUSA-constrained runs (Triton)
# or the full validation in three device calls of at most 10 minutes each:
#   bash tools/gpu_musa_validation.sh 1   # dzc-selftest --target cuda, Triton (every case) + MUSA dry runs
#   bash tools/gpu_musa_validation.sh 2   # dzc-selftest --target cuda, TileLang (first case of each family)
#   bash tools/gpu_musa_validation.sh 3   # runtime double tests + MUSA-constrained runs, Triton and TileLang
#                                         # (QUICK=0: every case and every legal config)
# Writes under $OUT: selftest_cuda_{triton,tilelang}.json/.log, selftest_musa_mp_{22,31}_dry.json/.log,
# gpu_tests_musa_runtime.log, musa_constrained.md/.json/.log.
set -uo pipefail
step=${1:-quick}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
failed=0

if [ "$step" = quick ]; then
  python3 -m dzc.selftest --target cuda --codegen triton --quick --no-tune \
    --json "$OUT/selftest_cuda_triton.json" 2>&1 | tee "$OUT/selftest_cuda_triton.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  python3 -m pytest tests/test_musa_runtime.py -q -p no:logging 2>&1 | tee "$OUT/gpu_tests_musa_runtime.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  python3 tools/musa_constrained_runs.py --quick --out "$OUT/musa_constrained.md" \
    --json "$OUT/musa_constrained.json" 2>&1 | tee "$OUT/musa_constrained.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
elif [ "$step" = 1 ]; then
  # dzc-selftest on the CUDA device, Triton kernels: every family x case, numerics against the references, timed
  # against eager. Untuned (each kernel's default config) to fit the call; the JSON is the artifact.
  python3 -m dzc.selftest --target cuda --codegen triton --no-tune --json "$OUT/selftest_cuda_triton.json" 2>&1 \
    | tee "$OUT/selftest_cuda_triton.log" | tail -45
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  # Dry runs for both MUSA profiles: every case generated and statically checked, and its Triton source compiled
  # for sm_90 at the same threads per block, its compiled shared memory against the MUSA limit.
  for profile in mp_22 mp_31; do
    python3 -m dzc.selftest --target musa:$profile --dry-run --codegen triton \
      --json "$OUT/selftest_musa_${profile}_dry.json" 2>&1 | tee "$OUT/selftest_musa_${profile}_dry.log" | tail -4
    [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  done
elif [ "$step" = 2 ]; then
  # TileLang compiles take ~10-30 s per kernel: the first case of each family.
  python3 -m dzc.selftest --target cuda --codegen tilelang --quick --no-tune \
    --json "$OUT/selftest_cuda_tilelang.json" 2>&1 | tee "$OUT/selftest_cuda_tilelang.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
else
  # The MUSA runtime layer over the CUDA-backed test double of torch.musa (device strings, streams, events,
  # launch, tuning timings); the CPU-double tests that need Triton's interpreter skip themselves here.
  python3 -m pytest tests/test_musa_runtime.py -q -p no:logging 2>&1 | tee "$OUT/gpu_tests_musa_runtime.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  # MUSA-constrained runs: mp_22 / mp_31 kernels with MUSA-legal configs at the same threads per block and MUSA
  # dtypes, numerics against the references, Triton's compiled shared memory against the MUSA limit; TileLang's
  # MUSA-profile programs compiled for sm_90 with the MUSA pass configs upstream knows.
  python3 tools/musa_constrained_runs.py --out "$OUT/musa_constrained.md" --json "$OUT/musa_constrained.json" \
    --tilelang $([ "${QUICK:-1}" = 1 ] && echo --quick) 2>&1 | tee "$OUT/musa_constrained.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
fi

echo "gpu_musa_validation step $step: $([ $failed = 0 ] && echo all passed || echo FAILURES, see $OUT)"
exit $failed
