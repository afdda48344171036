#!/usr/bin/env bash
# The H200 check-and-benchmark campaign, in device calls made back to back while the machine stays warm (it keeps
# /tmp between calls). Calls 1 and 2 each carry one wheel folder fetched by ../shared/tools/gpu-wheels.sh:
#   call 1 (carry .whl-gpu1):  bash tools/gpu_campaign.sh 1   # install dzc + TileLang; GPU tests of the Triton
#                                                            # paths; dzc-selftest (Triton) + MUSA dry runs
#   call 2 (carry .whl-gpu2):  bash tools/gpu_campaign.sh 2   # z3; TileLang GPU tests; MUSA-constrained runs and
#                                                            # the runtime double; add_rms_norm benchmark
#   call 3:                    bash tools/gpu_campaign.sh 3   # end-to-end multimodal benchmark (the whole call)
#   call 4:                    bash tools/gpu_campaign.sh 4   # kernel benchmarks (MoE, DSA, vision attention)
#   call 5:                    bash tools/gpu_campaign.sh 5   # MoE numerics (W4A8 and W4A16); W4A8 timings; MoE memory table
# Diagnosis of the MoE kernels that are wrong on the GPU (issue 15), each GEMM on its own:
#   (carry .whl-gpu1)          bash tools/gpu_campaign.sh moe-diag-1   # W4A8 diagnosis + its tests
#   (carry .whl-gpu2)          bash tools/gpu_campaign.sh moe-diag-2   # TileLang W4A16 diagnosis
# Session 8 (issues 15, 16):
#   (carry .whl-gpu1)          bash tools/gpu_campaign.sh s8-1   # MoE and CUDA-graph GPU tests; W4A8 op timings
#   (carry .whl-gpu2)          bash tools/gpu_campaign.sh s8-2   # TileLang MoE GPU tests; the op fuzzer, both codegens
#   (carry .whl-gpu1)          bash tools/gpu_campaign.sh s8-3   # after the fixes: CUDA-graph, MoE, norm GPU tests; fuzz (Triton)
#   (carry .whl-gpu2)          bash tools/gpu_campaign.sh s8-4   # TileLang MoE GPU test; fuzz (TileLang)
# Next session (what session 8 left unrun on the GPU):
#   (carry .whl-gpu1)          bash tools/gpu_campaign.sh next-1   # GPU tests of the session-8 work (Triton paths)
#   (carry .whl-gpu2)          bash tools/gpu_campaign.sh next-2   # TileLang GPU tests; the fuzzer, Triton then TileLang
#                              bash tools/gpu_campaign.sh next-3   # W4A8 at prefill sizes; the model zoo on the GPU
# Session 9: the parts of next-1/next-2 that ran out of time (the GPU half only: -m gpu), in two short calls:
#   (carry .whl-gpu1)          bash tools/gpu_campaign.sh s9-1   # runtime + kernel GPU tests (Triton), fuzz smoke
#   (carry .whl-gpu2)          bash tools/gpu_campaign.sh s9-2   # TileLang alignment tests + the add_layer_norm repro
# With little device time left, one call without TileLang instead:
#   bash tools/gpu_campaign.sh triton   # GPU tests of the Triton paths of the newest work; end-to-end and norm benches
# Everything lands under $OUT (logs, result tables).
set -uo pipefail
step=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
wheels=${step##*-}
if [ "$wheels" = 1 ] || [ "$wheels" = 2 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl-gpu$wheels/*.whl 2>&1 \
    | grep -v WARNING
fi
# Each part gets a time limit so that one slow part cannot take the rest of the call with it.
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  # SIGINT first: pytest then still prints which tests failed and why; a part that ignores it is killed 20 s later.
  timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "    exit $? ($name)"; tail -n "${TAIL:-6}" "$OUT/$name.log"
}
case $step in
1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  # The HF GptOss experts' spelling depends on the transformers version (5.17 on this machine in session 5).
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
  TAIL=12 part gpu_tests_triton 230 python3 -m pytest -q -p no:logging -m gpu -k "not tilelang" \
    tests/test_add_layer_norm_kernels.py tests/test_reinplace_cache_writes.py tests/test_dsa_models.py \
    tests/test_cuda_graphs.py tests/test_fuse_mxfp4_experts.py tests/test_add_rms_norm_kernels.py
  TAIL=12 part musa_validation_1 250 bash tools/gpu_musa_validation.sh 1
  # The pack whose last, 17-token window the excluded varlen tilings got wrong (session 5): every legal config.
  TAIL=30 part diag_varlen_windows 150 python3 tools/diagnose_varlen_attention_configs.py --rope --head-dim 80 \
    --lengths 64 64 64 64 64 64 17 --heads 2
  ;;
2)
  part gpu_tests_tilelang 250 python3 -m pytest -q -p no:logging -m gpu -k tilelang tests/
  TAIL=12 part musa_validation_3 150 bash tools/gpu_musa_validation.sh 3
  TAIL=30 part bench_add_rms_norm 170 python3 tools/bench_add_rms_norm.py --out "$OUT/add_rms_norm_h200.md"
  ;;
3)
  # The torch.compile baseline in reduce-overhead mode: max-autotune compiled the model for over 400 s twice.
  TAIL=40 part bench_multimodal 560 python3 tools/bench_multimodal.py --quick --compile-mode reduce-overhead \
    --out "$OUT/multimodal_h200.md"
  ;;
4)
  TAIL=30 part bench_mxfp4_moe 200 python3 tools/bench_mxfp4_moe.py --quick --out "$OUT/mxfp4_moe_h200.md"
  TAIL=30 part bench_dsa 200 python3 tools/bench_dsa.py --quick --out "$OUT/dsa_h200.md"
  TAIL=30 part bench_vision_attention 150 python3 tools/bench_vision_attention.py --quick --out "$OUT/vision_attention_h200.md"
  ;;
5)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  # Not marked gpu: every test of these files runs on the GPU when there is one (the AOT ones compile for sm_90);
  # the W4A16 kernels' file too, for their gate/up epilogue's rounding (changed with W4A8).
  TAIL=12 part gpu_tests_moe 300 python3 -m pytest -q -p no:logging tests/test_mxfp4_moe_w4a8.py \
    tests/test_mxfp4_moe_kernels.py
  TAIL=30 part bench_mxfp4_moe_memory 120 python3 tools/bench_mxfp4_moe.py --memory-only \
    --out "$OUT/mxfp4_moe_memory_h200.md"
  TAIL=30 part bench_mxfp4_moe_w4a8 240 python3 tools/bench_mxfp4_moe.py --quick --w4a8 --codegens triton \
    --out "$OUT/mxfp4_moe_w4a8_h200.md"
  ;;
moe-diag-1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  TAIL=40 part diag_w4a8 200 python3 tools/diagnose_mxfp4_moe_numerics.py --codegen w4a8
  TAIL=20 part gpu_tests_w4a8 200 python3 -m pytest -q -p no:logging -rf tests/test_mxfp4_moe_w4a8.py
  ;;
moe-diag-2)
  TAIL=60 part diag_tilelang 400 python3 tools/diagnose_mxfp4_moe_numerics.py --codegen tilelang \
    --cases float32-T1 silu --configs 2 --workdir "$OUT/tl"
  ;;
s8-1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  TAIL=15 part gpu_tests_moe 240 python3 -m pytest -q -p no:logging -rf -k "not tilelang" \
    tests/test_mxfp4_moe_w4a8.py tests/test_mxfp4_moe_kernels.py
  TAIL=15 part gpu_tests_cuda_graphs 200 python3 -m pytest -q -p no:logging -rf tests/test_cuda_graphs.py \
    tests/test_reinplace_cache_writes.py tests/test_multimodal_model.py -m gpu
  TAIL=30 part bench_mxfp4_moe_w4a8 200 python3 tools/bench_mxfp4_moe.py --quick --w4a8 --memory-layers 0 \
    --out "$OUT/mxfp4_moe_w4a8_h200.md"
  ;;
s8-2)
  TAIL=15 part gpu_tests_moe 420 python3 -m pytest -q -p no:logging -rf tests/test_mxfp4_moe_kernels.py \
    tests/test_mxfp4_moe_w4a8.py
  [ -f tools/fuzz.py ] && TAIL=30 part fuzz 240 python3 tools/fuzz.py --out "$OUT/fuzz_h200.md"
  ;;
s8-3)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=25 part gpu_tests_cuda_graphs 150 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_cuda_graphs.py \
    tests/test_reinplace_cache_writes.py tests/test_multimodal_model.py tests/test_check_rewrites.py
  TAIL=8 part gpu_tests_moe_norm 100 python3 -m pytest -q -p no:logging -rf -k "not tilelang" -x \
    tests/test_mxfp4_moe_w4a8.py tests/test_add_rms_norm_kernels.py
  TAIL=30 part fuzz_triton 60 python3 tools/fuzz.py --codegens triton --cases 6 --out "$OUT/fuzz_h200_triton.md"
  ;;
s8-4)
  TAIL=8 part gpu_tests_tilelang_moe 170 python3 -m pytest -q -p no:logging -rf \
    tests/test_mxfp4_moe_kernels.py::test_tilelang_on_gpu_every_selftest_case
  TAIL=30 part fuzz_tilelang 60 python3 tools/fuzz.py --codegens tilelang --cases 4 --out "$OUT/fuzz_h200_tilelang.md"
  ;;
next-1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=25 part gpu_tests_runtime 240 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_cuda_graphs.py \
    tests/test_reinplace_cache_writes.py tests/test_multimodal_model.py tests/test_check_rewrites.py \
    tests/test_capture.py tests/test_dsa_models.py
  TAIL=15 part gpu_tests_kernels 300 python3 -m pytest -q -p no:logging -rf -k "not tilelang" \
    tests/test_add_rms_norm_kernels.py tests/test_fuse_residual_norm.py tests/test_mxfp4_moe_kernels.py \
    tests/test_mxfp4_moe_w4a8.py tests/test_dsa_kernels.py tests/test_tilelang_launch_alignment.py
  ;;
next-2)
  TAIL=15 part gpu_tests_tilelang 300 python3 -m pytest -q -p no:logging -rf -m gpu -k tilelang tests/
  TAIL=30 part fuzz_triton 280 python3 tools/fuzz.py --codegens triton --out "$OUT/fuzz_h200_triton.md"
  ;;
next-3)
  TAIL=30 part fuzz_tilelang 300 python3 tools/fuzz.py --codegens tilelang --out "$OUT/fuzz_h200_tilelang.md"
  TAIL=30 part bench_w4a8_prefill 240 python3 tools/bench_mxfp4_moe.py --w4a8 --models gpt-oss-120b \
    --tokens 4096 8192 --routing uniform --codegens triton --memory-layers 0 --out "$OUT/mxfp4_moe_w4a8_prefill.md"
  ;;
s9-1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=15 part gpu_tests_runtime 100 python3 -m pytest -q -p no:logging -rf -m gpu --durations=8 \
    tests/test_reinplace_cache_writes.py tests/test_check_rewrites.py tests/test_capture.py
  TAIL=15 part gpu_tests_kernels 170 python3 -m pytest -q -p no:logging -rf -m gpu -k "not tilelang" --durations=8 \
    tests/test_add_rms_norm_kernels.py tests/test_fuse_residual_norm.py tests/test_mxfp4_moe_kernels.py \
    tests/test_mxfp4_moe_w4a8.py tests/test_dsa_kernels.py tests/test_tilelang_launch_alignment.py
  TAIL=30 part fuzz_triton_smoke 60 python3 tools/fuzz.py --codegens triton --cases 4 \
    --out "$OUT/fuzz_h200_triton_smoke.md"
  ;;
s9-2)
  TAIL=15 part gpu_tests_tilelang_alignment 150 python3 -m pytest -q -p no:logging -rf -m gpu --durations=8 \
    tests/test_tilelang_launch_alignment.py
  TAIL=30 part fuzz_repro_add_layer_norm 90 python3 tools/fuzz.py --ops add_layer_norm --codegens tilelang \
    --seed 0 --only 5
  ;;
triton)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  TAIL=12 part gpu_tests_triton 120 python3 -m pytest -q -p no:logging -m gpu -k "not tilelang" \
    tests/test_add_layer_norm_kernels.py tests/test_reinplace_cache_writes.py tests/test_dsa_models.py \
    tests/test_cuda_graphs.py
  TAIL=40 part bench_multimodal 280 python3 tools/bench_multimodal.py --quick --compile-mode reduce-overhead \
    --out "$OUT/multimodal_h200.md"
  TAIL=20 part bench_add_layer_norm 60 python3 tools/bench_add_rms_norm.py --op add_layer_norm --quick \
    --codegens triton --out "$OUT/add_layer_norm_h200.md"
  ;;
esac
# The device tool brings back only a few files per call: everything goes back as one archive.
(cd "$OUT" && tar czf "/tmp/campaign_$step.tgz" . && rm -rf ./* && mv "/tmp/campaign_$step.tgz" .)
