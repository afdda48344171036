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
# Next session (session 9's work, none of it run on a GPU yet), back to back while the machine is warm:
#   (carry .whl-gpu1)          bash tools/gpu_campaign.sh next-1   # runner/host-path GPU tests; overhead diagnosis
#   (carry .whl-gpu2)          bash tools/gpu_campaign.sh next-2   # gpu + anydevice kernel tests (Triton); the fuzzer
#                              bash tools/gpu_campaign.sh next-3   # TileLang GPU tests; the fuzzer on TileLang
#                              bash tools/gpu_campaign.sh next-4   # benchmarks: add+norm back to back, compile, DSA FP8
# Session 10: bash tools/gpu_campaign.sh s10a (fresh machine, Triton only); later s10b-1 (carry .whl-gpu1), then
# a TileLang test call (carry .whl-gpu2).
# Session 11: s11-1 (carry .whl-gpu1), s11-2 (carry .whl-gpu2); after their fixes s11-3 (carry .whl-gpu1), s11-4
# (carry .whl-gpu2). Session 12: s12-1 (carry .whl-gpu1), s12-2 (carry .whl-gpu2 and .public-kernels); after the
# TileLang sparse attention rewrite s12b-1 (carry .whl-gpu1), s12b-2 (carry .whl-gpu2, .gpu-scratch), s12b-3
# (carry .public-kernels). A step installs a wheel folder when its name ends in -1 or -2. Session 13: s13-1
# (carry .whl-gpu1), s13-2 (carry .whl-gpu2 and .public-kernels): not run (session 13 had no device time, its
# work is in s14-1). Session 14: s14-1 (carry .whl-gpu1), s14-2 (carry .whl-gpu2 and .public-kernels); after
# their fixes s14-3 (carry .whl-gpu1), s14-4 (carry .whl-gpu2 and .public-kernels). Session 15 ran s15-1 and
# s15-2 (now removed: their results are in docs/results). Session 16: s16-1 (carry .whl-gpu1), s16-2 (carry
# .whl-gpu2 and .public-kernels), then s16-3 and s16-4 (now removed; results in docs/results). Session 17 ran s17-1
# to s17-6 (results in docs/results). Session 18: s18-1, s18-2, s18-swap and s18-diag (each carrying
# .triton-kernels); s18-3 (carry .public-kernels) on a machine where earlier -1 and -2 calls installed TileLang.
# Session 19 ran s18-swap (both models), s18-3, `triton`, s19-1 and s19-2 (results in docs/results). Next session:
# s19-1 (carry .whl-gpu1) and s19-2 (carry .whl-gpu2 and .public-kernels) again as the regression check, then
# `triton` with bench_compile (issue 18: `python3 tools/bench_compile.py` on the GPU) and the add+RMSNorm
# back-to-back table at hidden 2880 (`tools/bench_add_rms_norm.py --back-to-back --codegens triton`); tp-1 where
# nvidia-h200-x2 is lent.
# Two GPUs (kind nvidia-h200-x2, when lent; a fresh machine: carry .whl-gpu1 though TileLang is not needed):
#                              bash tools/gpu_campaign.sh tp-1     # distributed tests and benchmark under torchrun
# One GPU (any session): bash tools/gpu_campaign.sh s18-allreduce   # dzc's one-shot all-reduce kernel at world size 1
# With little device time left, one call without TileLang instead:
#   bash tools/gpu_campaign.sh triton   # GPU tests of the Triton paths of the newest work; end-to-end and norm benches
# Everything lands under $OUT (logs, result tables).
set -uo pipefail
step=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# One target folder per wheel folder: session 11 lost TileLang when the second call installed into the first's
# folder (`--upgrade --target` on a shared folder); separate folders worked.
export PYTHONPATH=/tmp/site-gpu1:/tmp/site-gpu2:$PWD PYTHONUNBUFFERED=1
wheels=${step##*-}
if [ "$wheels" = 1 ] || [ "$wheels" = 2 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-gpu$wheels .whl-gpu$wheels/*.whl 2>&1 \
    | grep -v WARNING
fi
python3 -c "import tilelang" > /tmp/tilelang-import.log 2>&1 && echo "tilelang: importable" \
  || { echo "tilelang: not importable (carry .whl-gpu1 and .whl-gpu2 on this machine):"; tail -n 2 /tmp/tilelang-import.log; }
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
next-1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  TAIL=20 part gpu_tests_runtime 260 python3 -m pytest -q -p no:logging -rf -m gpu --durations=10 \
    tests/test_host_path.py tests/test_cuda_graphs.py tests/test_runtime_cuda_graph_decisions.py \
    tests/test_reinplace_cache_writes.py tests/test_multimodal_model.py tests/test_capture.py
  TAIL=60 part diagnose_overhead 200 python3 tools/diagnose_overhead.py --tokens 1 64 4096
  ;;
next-2)
  TAIL=20 part gpu_tests_kernels 300 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" -k "not tilelang" \
    --durations=10 tests/test_add_rms_norm_kernels.py tests/test_mxfp4_moe_w4a8.py tests/test_dsa_kernels.py \
    tests/test_varlen_attention_kernels.py tests/test_mxfp4_moe_kernels.py tests/test_tilelang_launch_alignment.py
  TAIL=30 part fuzz_triton 260 python3 tools/fuzz.py --codegens triton --out "$OUT/fuzz_h200_triton.md"
  ;;
next-3)
  TAIL=20 part gpu_tests_tilelang 330 python3 -m pytest -q -p no:logging -rf -m gpu -k tilelang --durations=10 \
    tests/test_tilelang_launch_alignment.py tests/test_tilelang_add_rms_norm.py tests/test_mxfp4_moe_kernels.py \
    tests/test_varlen_attention_kernels.py
  TAIL=30 part fuzz_tilelang 240 python3 tools/fuzz.py --codegens tilelang --out "$OUT/fuzz_h200_tilelang.md"
  ;;
next-4)
  TAIL=30 part bench_back_to_back 200 python3 tools/bench_add_rms_norm.py --back-to-back --codegens triton \
    --out "$OUT/add_rms_norm_back_to_back_h200.md"
  TAIL=30 part bench_compile 240 python3 tools/bench_compile.py --out "$OUT/compile_time_h200.md"
  TAIL=30 part bench_dsa_fp8_cache 140 python3 tools/bench_dsa.py --quick --fp8-cache --out "$OUT/dsa_fp8_cache_h200.md"
  ;;
s10a)
  # A fresh machine, no TileLang: session 9's GPU failures re-run after their fixes; issue 18's warm compile.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=15 part gpu_tests_fixed 90 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" \
    tests/test_cuda_graphs.py::test_large_calls_take_the_guarded_path_until_a_repeated_key_is_judged \
    tests/test_dsa_kernels.py::test_indexer_matches_reference \
    tests/test_varlen_attention_kernels.py::test_compiled_graph_runs_the_generated_kernel
  TAIL=30 part bench_compile 220 python3 tools/bench_compile.py --models llama_decoder multimodal \
    --out "$OUT/compile_time_h200.md"
  ;;
s10c)
  # A fresh machine, no TileLang: the fixes of s10a's failures, DeepseekV32 without a cache, the multimodal compile.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=15 part gpu_tests_s10c 70 python3 -m pytest -q -p no:logging -rf -m gpu \
    tests/test_cuda_graphs.py::test_large_calls_take_the_guarded_path_until_a_repeated_key_is_judged \
    tests/test_sparse_attention_without_cache.py
  TAIL=30 part bench_compile_multimodal 200 python3 tools/bench_compile.py --models multimodal \
    --out "$OUT/compile_time_multimodal_h200.md"
  TAIL=30 part bench_back_to_back 80 python3 tools/bench_add_rms_norm.py --back-to-back --codegens triton \
    --out "$OUT/add_rms_norm_back_to_back_h200.md"
  ;;
s10b-1)
  # (carry .whl-gpu1) host path: back-to-back calls and the overhead breakdown.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=30 part bench_back_to_back 100 python3 tools/bench_add_rms_norm.py --back-to-back --codegens triton \
    --out "$OUT/add_rms_norm_back_to_back_h200.md"
  TAIL=60 part diagnose_overhead 70 python3 tools/diagnose_overhead.py --tokens 1 64 4096
  ;;
s11-1)
  # (carry .whl-gpu1) Next session, first call: what session 10 could not run. DeepseekV32 without a cache did not
  # fuse on the H200 (canonicalize_graph folded 2 of 4: its graph there reads a lifted tensor constant): dump it.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  DZC_DUMP_DIR="$OUT/dump_deepseek_v32_no_cache" TAIL=15 part gpu_tests_no_cache 90 python3 -m pytest -q \
    -p no:logging -rf -m gpu tests/test_sparse_attention_without_cache.py
  TAIL=15 part gpu_tests_warm_compile 120 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_warm_compile_capture.py
  TAIL=30 part fuzz_triton 260 python3 tools/fuzz.py --codegens triton --out "$OUT/fuzz_h200_triton.md"
  ;;
s11-2)
  # (carry .whl-gpu2) TileLang: the pool past 2^31 elements (both codegens), then the fuzzer on TileLang.
  TAIL=15 part gpu_tests_tilelang_long 200 python3 -m pytest -q -p no:logging -rf -m gpu \
    tests/test_tilelang_long_context.py
  TAIL=30 part fuzz_tilelang 240 python3 tools/fuzz.py --codegens tilelang --out "$OUT/fuzz_h200_tilelang.md"
  ;;
s11-3)
  # (carry .whl-gpu1) A fresh machine: the fixes of s11-1's findings; the Triton fuzzer on another seed.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=15 part gpu_tests_no_cache 90 python3 -m pytest -q -p no:logging -rf -m gpu \
    tests/test_sparse_attention_without_cache.py
  TAIL=30 part fuzz_triton_seed1 250 python3 tools/fuzz.py --codegens triton --seed 1 \
    --out "$OUT/fuzz_h200_triton_seed1.md"
  ;;
s11-4)
  # (carry .whl-gpu2) TileLang: the fuzzer again after the Dv-16 thread fix (s11-2 crashed there).
  TAIL=30 part fuzz_tilelang 420 python3 tools/fuzz.py --codegens tilelang --out "$OUT/fuzz_h200_tilelang.md"
  ;;
s12-1)
  # (carry .whl-gpu1) Next session, first call: session 11's CPU work on the GPU; issue 18's compile times.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=15 part gpu_tests_s12 200 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" \
    tests/test_vision_models.py tests/test_sparse_attention_without_cache.py tests/test_mxfp4_moe_kernels.py
  TAIL=30 part bench_compile 240 python3 tools/bench_compile.py --models llama_decoder multimodal \
    --out "$OUT/compile_time_h200.md"
  ;;
s12-2)
  # (carry .whl-gpu2 and .public-kernels: bash tools/fetch_public_kernels.sh first) Issue 14: dzc beside the public
  # TileLang DeepSeek-V3.2 kernels in one process; the first compiles of the public kernels take about a minute.
  TAIL=60 part bench_dsa_public 520 python3 tools/bench_dsa.py --quick --out "$OUT/dsa_public_h200.md"
  ;;
s12b-1)
  # (carry .whl-gpu1) Session 12's TileLang sparse attention rewrite (cp.async-pipelined gathers): install; the
  # Triton path of the spec change on the GPU.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=8 part gpu_tests_sparse_triton 90 python3 -m pytest -q -p no:logging -rf -m gpu -k triton \
    tests/test_dsa_kernels.py::test_full_size_sparse_attention_on_gpu
  ;;
s12b-2)
  # (carry .whl-gpu2 and .gpu-scratch) The rewrite against the previous template (scratch variants script), then its
  # GPU tests: full DeepSeek-V3.2 shapes, a pool past 2^31 elements, the fuzzer's sparse_attention cases.
  TAIL=40 part tl_sparse_variants 300 python3 .gpu-scratch/tl_sparse_variants.py
  TAIL=12 part gpu_tests_sparse_tilelang 200 python3 -m pytest -q -p no:logging -rf -m gpu -k tilelang \
    tests/test_dsa_kernels.py::test_full_size_sparse_attention_on_gpu tests/test_tilelang_long_context.py
  ;;
s12b-3)
  # (carry .public-kernels) Issue 14's table: dzc beside the public TileLang DeepSeek-V3.2 kernels in one process.
  TAIL=60 part bench_dsa_public 480 python3 tools/bench_dsa.py --quick --out "$OUT/dsa_public_h200.md"
  ;;
s14-1)
  # (carry .whl-gpu1) Install; sparse attention's window, sinks and index blocks (session 13, CPU only so far) on
  # the GPU's Triton kernels; session 13's decoder attention (varlen_attention causal + window + sinks + GQA,
  # fuse_windowed_attention): kernel tests, the HF models, and its speed against eager / SDPA-with-mask.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=12 part gpu_tests_sparse_extras 130 python3 -m pytest -q -p no:logging -rf tests/test_dsa_kernels.py \
    -k "window or sinks or blocks or causal"
  TAIL=12 part gpu_tests_windowed 160 python3 -m pytest -q -p no:logging -rf tests/test_varlen_attention_kernels.py \
    -k decoder tests/test_fuse_windowed_attention.py
  TAIL=20 part bench_windowed 200 python3 tools/bench_windowed_attention.py --out "$OUT/windowed_attention_h200.md"
  ;;
s14-2)
  # (carry .whl-gpu2 and .public-kernels) Issue 14's prefill rows beside the public kernels (session 12's run was
  # stopped in them), without the dense baselines (minutes at 4096 x 8K); the fuzzers' sparse_attention cases (they
  # draw window, sinks and index blocks too); what the extras cost beside the plain top-k decode kernel.
  TAIL=40 part bench_dsa_prefill 220 python3 tools/bench_dsa.py --quick --only prefill --no-baselines \
    --out "$OUT/dsa_public_prefill_h200.md"
  TAIL=20 part fuzz_sparse_triton 110 python3 tools/fuzz.py --ops sparse_attention --codegens triton --cases 32 \
    --out "$OUT/fuzz_h200_sparse_triton.md"
  TAIL=20 part fuzz_sparse_tilelang 130 python3 tools/fuzz.py --ops sparse_attention --codegens tilelang \
    --cases 12 --out "$OUT/fuzz_h200_sparse_tilelang.md"
  TAIL=12 part bench_sparse_extras 100 python3 tools/bench_dsa.py --quick --only decode --no-baselines \
    --no-public-kernels --codegens triton --extras --batches 64 --contexts 32768 --out "$OUT/dsa_extras_h200.md"
  ;;
s14-3)
  # (carry .whl-gpu1) The fixes of s14-2's findings: index blocks over rows of an odd stride (Triton 3.6's false
  # alignment: misaligned address), the fuzzer's sparse cases again; decode splits at small batches and the
  # windowed decode, timed as CUDA graph replays.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=12 part gpu_tests_sparse 150 python3 -m pytest -q -p no:logging -rf tests/test_dsa_kernels.py \
    -k "sparse_attention and not tilelang and not sm90"
  TAIL=12 part fuzz_sparse_triton 120 python3 tools/fuzz.py --ops sparse_attention --codegens triton --cases 32 \
    --out "$OUT/fuzz_h200_sparse_triton.md"
  TAIL=14 part bench_sparse_decode 120 python3 tools/bench_dsa.py --quick --only decode --no-baselines \
    --no-public-kernels --codegens triton --extras --batches 1 64 --contexts 32768 --cuda-graphs \
    --out "$OUT/dsa_decode_graphs_h200.md"
  TAIL=12 part bench_windowed 150 python3 tools/bench_windowed_attention.py --out "$OUT/windowed_attention_h200.md"
  ;;
s14-4)
  # (carry .whl-gpu2 and .public-kernels) TileLang's sparse cases in the fuzzer (now without the parts it declines);
  # decode beside the public kernels at 1 and 64 sequences, as CUDA graph replays.
  TAIL=12 part fuzz_sparse_tilelang 150 python3 tools/fuzz.py --ops sparse_attention --codegens tilelang \
    --cases 12 --out "$OUT/fuzz_h200_sparse_tilelang.md"
  TAIL=20 part bench_sparse_decode_public 200 python3 tools/bench_dsa.py --quick --only decode --no-baselines \
    --batches 1 64 --contexts 32768 --cuda-graphs --out "$OUT/dsa_decode_public_h200.md"
  ;;
s18-1)
  # (carry .triton-kernels) Issue 15, session 17's DOT_SCALED tiles (tl.dot_scaled: the compiler decodes E2M1 into
  # the MMA operand), CPU-checked only: GPU numerics, then beside the plain and TMA tiles and triton_kernels.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=6 part gpu_tests_moe_scaled 200 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" \
    -k "tma or dot_scaled" tests/test_mxfp4_moe_kernels.py
  TAIL=40 part bench_mxfp4_moe_scaled 360 python3 tools/bench_mxfp4_moe.py --codegens triton --memory-layers 0 \
    --models gpt-oss-120b --tokens 1 8 64 --routing uniform --out "$OUT/mxfp4_moe_scaled_h200.md"
  ;;
s18-2)
  # (carry .triton-kernels) The same on DeepSeek-style shapes, and the every-self-test-case GPU test (its part in
  # s17-6 ran out of time) on its own.
  TAIL=40 part bench_mxfp4_moe_scaled_ds 360 python3 tools/bench_mxfp4_moe.py --codegens triton --memory-layers 0 \
    --models deepseek-style --tokens 1 8 64 --routing uniform --out "$OUT/mxfp4_moe_scaled_ds_h200.md"
  TAIL=6 part gpu_tests_moe_all 220 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" \
    -k "gpu_every_selftest" tests/test_mxfp4_moe_kernels.py
  ;;
s18-swap)
  # (carry .triton-kernels) Issue 15: SWAP_AB tiles (the decoded weights as wgmma's A operand, straight from their
  # registers), CPU-checked only: GPU numerics (the inline-PTX decoder runs only here), then beside the plain and
  # TMA tiles and triton_kernels on gpt-oss decode shapes.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=6 part gpu_tests_moe_swap 150 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" \
    -k "swap_ab" tests/test_mxfp4_moe_kernels.py
  TAIL=12 part bench_mxfp4_moe_swap 420 python3 tools/bench_mxfp4_moe.py --codegens triton --memory-layers 0 \
    --models ${SWAP_MODELS:-gpt-oss-120b} --tokens ${SWAP_TOKENS:-1 8 64} --routing uniform \
    --out "$OUT/mxfp4_moe_swap_h200.md"
  ;;
s18-diag)
  # (carry .triton-kernels) Issue 15: per-kernel times of the layer (dzc TMA and SWAP_AB tiles, triton_kernels);
  # then Nsight Compute on one gate/up GEMM of each, where ncu is installed.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=60 part diag_moe_kernels 200 python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 1 8 64
  if command -v ncu > /dev/null; then
    TAIL=80 part ncu_moe 240 ncu --kernel-name regex:"moe_gate_up_kernel|_matmul_ogs" --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 8 --once
  else
    echo "ncu: not installed"
  fi
  ;;
s18-3)
  # (carry .public-kernels; TileLang from earlier -1 and -2 calls on this warm machine) Issue 14: dzc's TileLang
  # top-k, CPU-checked only (lowered, nvcc-compiled, its CUDA run on CPU threads): GPU numerics (every config, ties,
  # -inf/NaN, overflow and long rows), then beside dzc's Triton top-k and the public tl_topk on the same indexer logits, 1 and 64 sequences x 2
  # query rows over 32K and 128K positions, CUDA graph replays (as the 82.7 / 26.7 us of issue 14 were timed).
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=12 part gpu_tests_topk_tilelang 170 python3 -m pytest -q -p no:logging -rf -m gpu -k "tilelang and topk" \
    tests/test_dsa_kernels.py
  TAIL=30 part bench_topk 230 python3 tools/bench_dsa.py --only topk --batches 1 64 --queries 2 \
    --contexts 32768 131072 --cuda-graphs --out "$OUT/dsa_topk_tilelang_h200.md"
  ;;
tp-1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # no NVLink multicast on these machines
  nvidia-smi --query-gpu=name --format=csv,noheader
  TAIL=20 part gpu_tests_distributed 200 python3 -m pytest -q -p no:logging -rf -s \
    tests/test_distributed.py::test_tensor_parallel_on_two_gpus
  # dzc's one-shot all-reduce + add + RMSNorm kernel on 2 ranks; bench_distributed below times it (its own column).
  TAIL=12 part gpu_tests_one_shot 150 python3 -m pytest -q -p no:logging -rf -s \
    tests/test_all_reduce_kernel.py::test_one_shot_kernel_on_two_gpus
  TAIL=40 part bench_distributed 360 torchrun --nproc-per-node 2 tools/bench_distributed.py \
    --out "$OUT/distributed_h200.md"
  ;;
s18-allreduce)
  # Issue 17, one GPU: dzc's one-shot all-reduce + add + RMSNorm kernel through symmetric memory at world size 1
  # (the barrier signals only itself); skips with torch's error if a single-rank rendezvous is refused.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # no NVLink multicast on these machines
  TAIL=12 part gpu_tests_one_shot_world1 200 python3 -m pytest -q -p no:logging -rs -rf -s \
    tests/test_all_reduce_kernel.py::test_one_shot_kernel_at_world_size_1_on_one_gpu
  ;;
s19-1)
  # (carry .whl-gpu1) Issue 17's one-shot kernel at world size 1; issue 15's MoE tests with SWAP_AB the untuned
  # decode choice; the GPU suite's Triton paths with nested regions on by default (s18's 120 s cut it short).
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # no NVLink multicast on these machines
  TAIL=12 part gpu_tests_one_shot_world1 60 python3 -m pytest -q -p no:logging -rs -rf -s \
    tests/test_all_reduce_kernel.py::test_one_shot_kernel_at_world_size_1_on_one_gpu
  TAIL=6 part gpu_tests_moe_default 60 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" \
    -k "swap_ab or default or only_where" tests/test_mxfp4_moe_kernels.py
  TAIL=12 part gpu_tests_triton 190 python3 -m pytest -q -p no:logging -rf -m gpu -k "not tilelang" \
    tests/test_add_layer_norm_kernels.py tests/test_reinplace_cache_writes.py tests/test_dsa_models.py \
    tests/test_cuda_graphs.py
  ;;
s19-2)
  # (carry .whl-gpu2 and .public-kernels, after s19-1 on this warm machine) Issue 14: the TileLang top-k's GPU
  # numerics with the reference's NaN ranking made device-independent (s18-3 failed only on NaNs with the sign bit).
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=12 part gpu_tests_topk_tilelang 170 python3 -m pytest -q -p no:logging -rf -m gpu -k "topk" \
    tests/test_dsa_kernels.py
  ;;
s20-1)
  # (no carry; Triton only) Issue 18 on the GPU: compile time of the reference models, dzc cold/warm against
  # torch.compile, each in a fresh process; add+RMSNorm called back to back at hidden 2880 beside torch.compile.
  # Issue 13: the MXFP4 zoo rows on the GPU where transformers is installed.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  TAIL=30 part bench_compile 330 python3 tools/bench_compile.py --out "$OUT/compile_time_h200.md"
  TAIL=30 part bench_add_rms_norm_b2b 120 python3 tools/bench_add_rms_norm.py --back-to-back --codegens triton \
    --out "$OUT/add_rms_norm_back_to_back_h200.md"
  if python3 -c "import transformers" 2>/dev/null; then
    TAIL=20 part zoo_mxfp4 120 python3 tools/zoo.py "GptOss (MXFP4 experts)" "Qwen3-MoE (MXFP4 experts)" \
      "Mixtral (MXFP4 experts)" "DeepseekV3 (MXFP4 experts)"
  else
    echo "zoo: transformers not installed on this machine"
  fi
  ;;
s20-2)
  # (carry .whl-gpu1) installs the first TileLang wheel folder; the one-shot all-reduce at world size 1 as the check.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=6 part gpu_tests_moe_default 60 python3 -m pytest -q -p no:logging -rf -m "gpu or anydevice" \
    -k "swap_ab or default or only_where" tests/test_mxfp4_moe_kernels.py
  ;;
s20-3)
  # (carry .whl-gpu2 and .public-kernels, after s20-2 on this warm machine) Issue 14: the TileLang FP8 indexer's
  # first GPU run: numerics of every config, then prefill (indexer alone, beside Triton and the public kernel) and
  # decode, untuned defaults.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=15 part gpu_tests_indexer_tilelang 260 python3 -m pytest -q -p no:logging -rf -x -m gpu \
    tests/test_dsa_indexer_tilelang.py
  TAIL=30 part bench_indexer_prefill 150 python3 tools/bench_dsa.py --only prefill --prefill-contexts 8192 \
    --indexer-codegens triton tilelang --topk-codegens tilelang --codegens triton --no-baselines --quick --out "$OUT/dsa_indexer_tilelang_h200.md"
  TAIL=30 part bench_indexer_decode 120 python3 tools/bench_dsa.py --only decode --quick --contexts 32768 \
    --indexer-codegens triton tilelang --topk-codegens tilelang --codegens triton --no-baselines --out "$OUT/dsa_indexer_tilelang_decode_h200.md"
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
