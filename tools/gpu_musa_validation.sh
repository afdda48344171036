#!/usr/bin/env bash
# MUSA validation on the H200 (issue 6; docs/musa.md says what each step proves). Run it after
# `bash tools/gpu_campaign.sh 1` in the same warm machine (dzc installed editable, TileLang in /tmp/site):
#   bash tools/gpu_musa_validation.sh            # QUICK=0 for every legal config in the constrained runs
# Writes under $OUT: selftest_cuda.json/.log, gpu_tests_musa_runtime.log, musa_constrained.md/.json/.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
failed=0

# 1. dzc-selftest on the CUDA device: every family x codegen x case, numerics against the references, timed
#    against eager. Untuned (each kernel's default config) to fit the campaign's time; the JSON is the artifact.
python3 -m dzc.selftest --target cuda --no-tune --json "$OUT/selftest_cuda.json" 2>&1 | tee "$OUT/selftest_cuda.log" | tail -45
[ "${PIPESTATUS[0]}" = 0 ] || failed=1

# 2. The MUSA runtime layer over the CUDA-backed test double of torch.musa (device strings, streams, events,
#    launch, tuning timings), plus the CPU-double tests again on this machine.
python3 -m pytest tests/test_musa_runtime.py -q -p no:logging 2>&1 | tee "$OUT/gpu_tests_musa_runtime.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || failed=1

# 3. MUSA-constrained runs: mp_22 / mp_31 kernels with MUSA-legal configs at the same threads per block and MUSA
#    dtypes, numerics against the references, Triton's compiled shared memory against the MUSA limit; TileLang's
#    MUSA-profile programs compiled for sm_90 with the MUSA pass configs upstream knows.
python3 tools/musa_constrained_runs.py --out "$OUT/musa_constrained.md" --json "$OUT/musa_constrained.json" \
  --tilelang $([ "${QUICK:-1}" = 1 ] && echo --quick) 2>&1 | tee "$OUT/musa_constrained.log" | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || failed=1

echo "gpu_musa_validation: $([ $failed = 0 ] && echo all passed || echo FAILURES, see $OUT)"
exit $failed
