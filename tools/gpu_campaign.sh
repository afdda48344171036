#!/usr/bin/env bash
# The H200 check-and-benchmark campaign, in device calls made back to back while the machine stays warm (it keeps
# /tmp between calls). A step whose name ends in -1 or -2 installs the wheel folder .whl-gpu1 or .whl-gpu2
# (fetched by ../shared/tools/gpu-wheels.sh; carry it in that call) into its own /tmp/site-gpuN.
# The full campaign, on a fresh machine:
#   call 1 (carry .whl-gpu1):  bash tools/gpu_campaign.sh 1   # install dzc + TileLang; GPU tests of the Triton
#                                                            # paths; dzc-selftest (Triton) + MUSA dry runs
#   call 2 (carry .whl-gpu2):  bash tools/gpu_campaign.sh 2   # z3; TileLang GPU tests; MUSA-constrained runs and
#                                                            # the runtime double; add_rms_norm benchmark
#   call 3:                    bash tools/gpu_campaign.sh 3   # end-to-end multimodal benchmark (the whole call)
#   call 4:                    bash tools/gpu_campaign.sh 4   # kernel benchmarks (MoE, DSA, vision attention)
#   call 5:                    bash tools/gpu_campaign.sh 5   # MoE numerics (W4A8 and W4A16); W4A8 timings; MoE memory table
# A fresh machine gets TileLang in one call instead of two: tools/pack_gpu_site.sh packs both wheel folders as
# .gpu-site.tar.xz (45 MiB); carry it in a call that starts with `bash tools/gpu_campaign.sh site &&`.
# With little device time left, one call without TileLang instead:
#   bash tools/gpu_campaign.sh triton   # GPU tests of the Triton paths; end-to-end and norm benches
# Two GPUs (kind nvidia-h200-x2, when lent; a fresh machine: carry .whl-gpu1 though TileLang is not needed):
#   bash tools/gpu_campaign.sh tp-1     # distributed tests and benchmark under torchrun
# One GPU: bash tools/gpu_campaign.sh s18-allreduce   # dzc's one-shot all-reduce kernel at world size 1
# Next session. Session 55 had no machine (every start refused; its device time went on the refusals). Pending,
# on a fresh machine:
#   call 1 (carry .gpu-site.tar.xz): bash tools/gpu_campaign.sh site && bash tools/gpu_campaign.sh s55-topk
#       issue 14: the top-k's two session-55 changes (mask appends in WARP_VOTE=1's collect, a test-free plain
#       first sweep) on the GPU for the first time: numerics of the cached 10-bit configs, then the 32K phases.
#       The other 10 top-k configs (tuning candidates: the tuner compares each with the untuned choice's selected
#       logits, exactly) are not on the GPU since those changes either: tilelang_topk_matches_reference_on_gpu.
#   call 2: bash tools/gpu_campaign.sh s55-profile   # Nsight Compute on the top-k and the indexer's prefill chunk
# Every card so far was an H200 except sessions 38-41, 43-47 and 51-53 (H100): compare timings within one run only.
# Earlier sessions' steps are in git history; their results are in docs/results.
# Everything lands under $OUT (logs, result tables).
set -uo pipefail
step=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# One target folder per wheel folder: session 11 lost TileLang when the second call installed into the first's
# folder (`--upgrade --target` on a shared folder); separate folders worked.
export PYTHONPATH=/tmp/site-gpu1:/tmp/site-gpu2:$PWD PYTHONUNBUFFERED=1
# A failed test's report (and seed) in the part's log as it fails: a part cut by its time limit keeps it (session 46
# lost one; tests/conftest.py).
export DZC_TEST_FAILURES_NOW=1
# The campaign is where candidates get validated: its tuning times those not yet run on a GPU too.
export DZC_TUNE_UNVALIDATED=1
wheels=${step##*-}
if [ "$step" = site ]; then  # the same packages in one carry (tools/pack_gpu_site.sh)
  python3 -c "import tarfile; tarfile.open('.gpu-site.tar.xz').extractall('/tmp/site-gpu1', filter='tar')"
elif [ "$wheels" = 1 ] || [ "$wheels" = 2 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-gpu$wheels .whl-gpu$wheels/*.whl 2>&1 \
    | grep -v WARNING
fi
python3 -c "import tilelang" > /tmp/tilelang-import.log 2>&1 && echo "tilelang: importable" \
  || { echo "tilelang: not importable (carry .whl-gpu1 and .whl-gpu2 on this machine):"; tail -n 2 /tmp/tilelang-import.log; }
# Each part gets a time limit so that one slow part cannot take the rest of the call with it.
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2 code; shift 2
  echo "=== $name"
  # SIGINT first: pytest then still prints which tests failed and why; a part that ignores it is killed 20 s later.
  # timeout signals its own process group, the part's children included. TileLang's compile swallows a SIGINT
  # that comes while it compiles (session 47), so the watcher sends the group two more, 5 and 10 s later.
  timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  { sleep $((limit + 5)); kill -INT -- "-$pid"; sleep 5; kill -INT -- "-$pid"; } 2>/dev/null &
  local watcher=$!
  wait "$pid"; code=$?
  kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null
  echo "    exit $code ($name)"; tail -n "${TAIL:-6}" "$OUT/$name.log"
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
tp-1)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # no NVLink multicast on these machines
  nvidia-smi --query-gpu=name --format=csv,noheader
  TAIL=20 part gpu_tests_distributed 200 python3 -m pytest -q -p no:logging -rf -s \
    tests/test_distributed.py::test_tensor_parallel_on_two_gpus
  # dzc's one-shot all-reduce + add + RMSNorm kernel on 2 ranks; bench_distributed below times it (its own column).
  TAIL=12 part gpu_tests_one_shot 150 python3 -m pytest -q -p no:logging -rf -s \
    tests/test_all_reduce_kernel.py::test_one_shot_kernel_on_two_gpus
  # Untuned: tuning the MoE buckets outran 200 s at world size 1 (session 23).
  TAIL=40 part bench_distributed 360 torchrun --nproc-per-node 2 tools/bench_distributed.py --no-tune \
    --out "$OUT/distributed_h200.md"
  ;;
s55-topk)
  # (after site) issue 14, two changes to every TileLang top-k (session 55, CPU-checked: generated CUDA run on CPU
  # threads): WARP_VOTE=1's second sweep appends the bin's keys by masks (one population count a warp and step
  # instead of ~24), and the plain first sweep's steps inside the row take no position tests (as SPECULATE=1's). GPU
  # numerics of the cached 10-bit configs of both spans (plain, votes, speculative buffer: the untuned choices and
  # the twin), then the 32K phases of the untuned choice (votes) beside its twin without votes (same first sweep:
  # the collect is the A/B; session 53, H100: collect 4.35 µs with the old votes, 4.06 without, histogram 5.1).
  TAIL=6 part gpu_tests_topk 300 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_dsa_kernels.py \
    -k "tilelang_topk_matches_reference_on_gpu and sweep8192-radix10-cache32768"
  TAIL=40 part topk_phases 240 python3 tools/diagnose_dsa_topk_phases.py --lengths 32768 \
    --match "CACHE=32768 CANDIDATES=4096 RADIX_BITS=10 SWEEP=8192 THREADS=1024 WIDTH=32768 num"
  ;;
s55-profile)
  # (after site) issue 14: where the top-k (128 rows of 32K, the untuned choice) and the FP8 indexer's prefill chunk
  # (1024 rows at the end of 8K, the untuned choice) spend their cycles: Nsight Compute's per-instruction counters
  # (SourceCounters: instructions executed and warp-stall samples a SASS line) and the kernels' summary sections,
  # each on one checked kernel's second launch; exported as CSV (source page) and text (details page).
  ncu --version | tail -1
  ncu_sections="--section SourceCounters --section WarpStateStats --section SchedulerStats --section Occupancy"
  ncu_sections="$ncu_sections --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats"
  TAIL=4 part ncu_topk 240 ncu --clock-control none $ncu_sections --import-source no -k regex:dsa_topk \
    --launch-skip 1 --launch-count 1 -f -o "$OUT/topk" \
    python3 tools/diagnose_dsa_topk_configs.py --only-default --lengths 32768 --launches 2
  TAIL=4 part ncu_indexer 240 ncu --clock-control none $ncu_sections --import-source no -k regex:dsa_indexer \
    --launch-skip 1 --launch-count 1 -f -o "$OUT/indexer" \
    python3 tools/diagnose_dsa_indexer_configs.py --shapes prefill --only-default --launches 2
  for name in topk indexer; do
    [ -f "$OUT/$name.ncu-rep" ] || continue
    ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
    ncu -i "$OUT/$name.ncu-rep" --page source --print-source sass --csv > "$OUT/${name}_sass.csv" 2>&1 \
      || ncu -i "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/${name}_raw.csv" 2>&1
    ls -la "$OUT/${name}"*
  done
  ;;
s18-allreduce)
  # Issue 17, one GPU: dzc's one-shot all-reduce + add + RMSNorm kernel through symmetric memory at world size 1
  # (the barrier signals only itself); skips with torch's error if a single-rank rendezvous is refused.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # no NVLink multicast on these machines
  TAIL=12 part gpu_tests_one_shot_world1 200 python3 -m pytest -q -p no:logging -rs -rf -s \
    tests/test_all_reduce_kernel.py::test_one_shot_kernel_at_world_size_1_on_one_gpu
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
site|wheels-1|wheels-2)
  # (carry .gpu-site.tar.xz; or .whl-gpu1, then .whl-gpu2, in two calls) TileLang for the steps below that use it,
  # and dzc itself: installs only
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  ;;
s29-1)
  # (carry .whl-gpu1 and .triton-kernels) dzc + TileLang part 1; MoE Triton numerics; the split-K loop form
  # (runtime step count) timed by the tuner at decode sizes; the frame entry's Inductor fallback on the GPU.
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
  TAIL=12 part gpu_tests_moe 200 python3 -m pytest -q -p no:logging -k "not tilelang" tests/test_mxfp4_moe_kernels.py
  TAIL=12 part gpu_test_frame 120 python3 -m pytest -q -p no:logging \
    tests/test_frame_cache.py::test_a_frame_entry_on_the_gpu_builds_its_inductor_fallback
  TAIL=30 part bench_moe_decode 240 env DZC_AUTOTUNE_LOG=1 python3 tools/bench_mxfp4_moe.py \
    --models gpt-oss-120b deepseek-style --tokens 1 8 64 --routing uniform --codegens triton --memory-layers 0 \
    --out "$OUT/mxfp4_moe_decode_h200.md"
  ;;
s30-indexer)
  # (after wheels-1 and wheels-2) issue 14: the TileLang indexer's untuned choice beside its twin asking for three
  # programs a multiprocessor (MIN_BLOCKS=3, not yet timed) and the old 256 x 128 x 2 chunk-4 choice, on decode at
  # 64 and 1 sequences and a prefill chunk; then the GPU numerics of those configs (every GPU case).
  TAIL=14 part diag_indexer 330 python3 tools/diagnose_dsa_indexer_configs.py --match MIN_BLOCKS=3 \
    "BLOCK_N=128 CHUNK=4 ROWS=2 STAGES=2"
  # (pytest's -k cannot name "CHUNK=8": the test ids are picked from the collected list)
  mapfile -t ids < <(python3 -m pytest -q --collect-only -p no:logging tests/test_dsa_indexer_tilelang.py \
    -k every_config 2>/dev/null | grep -E "MIN_BLOCKS|CHUNK=8")
  TAIL=8 part gpu_tests_indexer 240 python3 -m pytest -q -p no:logging -rf "${ids[@]}"
  ;;
s30-topk-numerics)
  # (after wheels-1 and wheels-2) issue 14: the GPU numerics of every TileLang top-k config (the default kernel
  # changed in session 29: warp-0 scan, prefetching sweeps; checked on CPU threads only until this step).
  TAIL=8 part gpu_tests_topk 240 python3 -m pytest -q -p no:logging -rf tests/test_dsa_kernels.py \
    -k "tilelang_topk_matches_reference_on_gpu or tilelang_topk_through_lowering"
  ;;
s30-topk)
  # (after s30-topk-numerics) issue 14: the TileLang top-k's tuning candidates at 64 x 2 rows of 32K and 128K,
  # each timed and logged, now with 10-bit radix rounds (two rounds instead of three).
  TAIL=30 part topk_tuned 300 env DZC_AUTOTUNE_LOG=1 python3 tools/bench_dsa.py --only topk --batches 64 --queries 2 \
    --contexts 32768 131072 --topk-codegens tilelang --cuda-graphs --out "$OUT/dsa_topk_tuned_h200.md"
  # Fixed against per-position time (rows of 4K-32K positions): what the 3x goal has to cut.
  TAIL=8 part topk_lengths 200 python3 tools/diagnose_dsa_topk_configs.py
  ;;
s30-topk-cache)
  # (after wheels-1 and wheels-2) issue 14: the top-k with the row's keys cached in shared memory (one read of a
  # 32K row from memory; the CACHE configs): GPU numerics of those configs, then each timed over rows of 4K-32K
  # beside the default, then the tuned bench at 32K and 128K (the tuner picks among all).
  TAIL=8 part gpu_tests_topk_cache 200 python3 -m pytest -q -p no:logging -rf tests/test_dsa_kernels.py \
    -k "tilelang_topk_matches_reference_on_gpu and cache32768"
  TAIL=8 part topk_cache_lengths 150 python3 tools/diagnose_dsa_topk_configs.py --match CACHE "RADIX_BITS=10 SWEEP=8192"
  TAIL=30 part topk_cache_tuned 200 env DZC_AUTOTUNE_LOG=1 python3 tools/bench_dsa.py --only topk --batches 64 \
    --queries 2 --contexts 32768 131072 --topk-codegens tilelang --cuda-graphs --out "$OUT/dsa_topk_cache_h200.md"
  ;;
s31-ep)
  # issue 17: where the expert-parallel layer's ~2 ms at 64 tokens goes (world size 1): its collectives and host
  # reads, a profile of 5 calls, and the EP table with each EP pass off and the whole layer without CUDA graphs.
  TAIL=40 part bench_ep 560 python3 tools/bench_distributed.py --no-tune --tables ep --out "$OUT/distributed_ep_h200.md"
  ;;
s31-vision)
  # (after wheels-1 and wheels-2) issue 14: the varlen kernels after session 30's NaN-leak fix (the pipelined
  # kernel's tail block unpipelined, the warp-specialized producer zeroing a partial v tile): the GPU numerics not
  # run in session 30, then the timing beside cuDNN at head dims 72, 80, 128 on the mixed pack.
  TAIL=8 part gpu_tests_varlen 300 python3 -m pytest -q -p no:logging -rf tests/test_varlen_attention_kernels.py \
    -k "tilelang_on_gpu and not d72-bfloat16-rope0 and not d128-bfloat16-rope0"
  TAIL=30 part bench_vision 280 python3 tools/bench_vision_attention.py --head-dims 72 80 128 --packs mixed \
    --codegens tilelang --no-compile-baseline --out "$OUT/vision_attention_h200.md"
  ;;
s30-moe)
  # (carry .triton-kernels) issue 15: the decode rows s29-1's time limit cut (deepseek-style at 8 and 64 tokens),
  # both routings.
  TAIL=20 part bench_moe_decode 540 python3 tools/bench_mxfp4_moe.py --models deepseek-style --tokens 8 64 \
    --routing uniform skewed --codegens triton --memory-layers 0 --out "$OUT/mxfp4_moe_decode_h200.md"
  ;;
s33-host)
  # (after wheels-1) issues 18/15: what s32-host's limits cut: the MoE op's host time uninstrumented (untuned
  # defaults now; s32's run autotuned every candidate and outran its part), and the GPU tests the part's 170 s did
  # not reach (the run stopped in a Triton compile after 51 passed).
  TAIL=60 part diagnose_overhead_moe 200 python3 tools/diagnose_overhead.py --op mxfp4_moe --tokens 1 64 --calls 300
  TAIL=8 part gpu_tests_moe_rest 300 python3 -m pytest -q -p no:logging -rf tests/test_mxfp4_moe_kernels.py \
    -k "not tilelang and (on_gpu or default_configs or tma_launch or routing_kernels)"
  ;;
s33-topk-phases)
  # (after wheels-1 and wheels-2) issue 14: the top-k's phases timed from inside the kernel (PHASE_STAMPS=1: thread
  # 0's globaltimer and clock64 at each phase's end); 4096-position rows show the length-independent work.
  TAIL=60 part topk_phases 240 python3 tools/diagnose_dsa_topk_phases.py --lengths 4096 32768 131072
  ;;
s32-vision-tests)
  # (after wheels-1 and wheels-2) issue 14: the varlen TileLang numerics not run since session 30's NaN-leak fix,
  # one parametrization a process, the three side by side (each builds ~9 TileLang kernels at ~12 s, CPU-bound:
  # one after the other they outran session 31's 300 s limit).
  for id in d80-bfloat16-rope1 d72-float16-rope1 d80-float16-rope0; do
    TAIL=4 part "gpu_tests_varlen_$id" 420 python3 -m pytest -q -p no:logging -rf \
      "tests/test_varlen_attention_kernels.py::test_tilelang_on_gpu[$id]" &
  done
  wait
  ;;
s32-vision-split)
  # (after wheels-1 and wheels-2) issue 14: the warp-specialized kernel with split columns (SPLIT_COLUMNS=1: 64 +
  # 16 columns, one 128-byte TMA box a row) beside the unsplit configs (five 32-byte boxes, every other row's
  # straddling two sectors at head dim 72) and cuDNN, same run; each config's time is in the log.
  TAIL=40 part bench_vision_split 420 python3 tools/bench_vision_attention.py --head-dims 72 80 --packs mixed \
    --codegens tilelang --no-compile-baseline --work-dir /tmp/dzc-vision-split --out "$OUT/vision_attention_split_h200.md"
  ;;
s32-vision-auto)
  # (after wheels-1 and wheels-2) issue 14: what a dzc.compile user gets at head dims 72 and 128 (codegen auto:
  # Triton's configs tuned, the TileLang kernel's default beside them) against cuDNN, mixed pack.
  TAIL=30 part bench_vision_auto 560 python3 tools/bench_vision_attention.py --head-dims 72 128 --packs mixed \
    --codegens auto --no-compile-baseline --work-dir /tmp/dzc-vision-auto --out "$OUT/vision_attention_auto_h200.md"
  ;;
s34-moe-tiles)
  # (after wheels-1) issue 15: the first per-kernel timing of W4A8 (FP8=1 runs against its reference now) beside the
  # tuned W4A16 SWAP_AB tiles at gpt-oss-120b T=8192, then Triton 3.6's own SASS of the same tiles (session 33's
  # static counts were Triton 3.9's), then the W4A8 bench.
  # Each tile with and without session 33's opt-in knobs (DECODE=2: signs merged four values a PRMT; FP8_STACKED=1:
  # gate and up rows in one MMA, one wgmma wait a step), as they are offered to the tuner.
  swap="BLOCK_K=128,SPLIT_K=1,SWAP_AB=1" ws="BLOCK_K=128,SPLIT_K=1,WORKSPACE=1,FP8=1"
  moe_tiles=("BLOCK_M=128,BLOCK_N=64,$swap,num_warps=4,num_stages=3"
    "BLOCK_M=128,BLOCK_N=64,$swap,DECODE=2,num_warps=4,num_stages=3"
    "BLOCK_M=128,BLOCK_N=128,$swap,num_warps=8,num_stages=3"
    "BLOCK_M=128,BLOCK_N=128,$swap,DECODE=2,num_warps=8,num_stages=3"
    "BLOCK_M=256,BLOCK_N=64,$swap,num_warps=8,num_stages=3"
    "BLOCK_M=256,BLOCK_N=64,$swap,DECODE=2,num_warps=8,num_stages=3"
    "BLOCK_M=64,BLOCK_N=64,$ws,num_warps=4,num_stages=3"
    "BLOCK_M=64,BLOCK_N=64,$ws,FP8_STACKED=1,num_warps=4,num_stages=3"
    "BLOCK_M=128,BLOCK_N=64,$ws,num_warps=8,num_stages=3"
    "BLOCK_M=128,BLOCK_N=64,$ws,FP8_STACKED=1,num_warps=8,num_stages=3"
    "BLOCK_M=128,BLOCK_N=128,$ws,num_warps=8,num_stages=3"
    "BLOCK_M=128,BLOCK_N=128,$ws,FP8_STACKED=1,num_warps=8,num_stages=3")
  TAIL=40 part moe_tiles 300 python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 8192 --configs "${moe_tiles[@]}"
  TAIL=40 part moe_tiles_sass 150 python3 tools/diagnose_mxfp4_moe_kernels.py --sass --configs "${moe_tiles[@]}"
  TAIL=12 part bench_moe_w4a8 400 python3 tools/bench_mxfp4_moe.py --models gpt-oss-120b --tokens 8192 \
    --routing uniform --codegens triton --w4a8 --memory-layers 0 --out "$OUT/mxfp4_moe_w4a8_h200.md"
  ;;
s35-moe)
  # (after wheels-1) issue 15: GPU numerics of the tiles session 34 timed or added (DECODE=2's inline PTX runs only
  # on a GPU; FP8_STACKED; the 256-row SWAP_AB tiles), then s34-moe-tiles' timing, the 256-row tiles included.
  TAIL=8 part gpu_tests_moe_tiles 240 python3 -m pytest -q -p no:logging -rf tests/test_mxfp4_moe_kernels.py \
    tests/test_mxfp4_moe_w4a8.py -k "swap_ab or decode or stacked or 256"
  swap="BLOCK_K=128,SPLIT_K=1,SWAP_AB=1" ws="BLOCK_K=128,SPLIT_K=1,WORKSPACE=1,FP8=1"
  tiles=("BLOCK_M=128,BLOCK_N=64,$swap,num_warps=4,num_stages=3"
    "BLOCK_M=128,BLOCK_N=64,$swap,DECODE=2,num_warps=4,num_stages=3"
    "BLOCK_M=256,BLOCK_N=64,$swap,num_warps=8,num_stages=3"
    "BLOCK_M=256,BLOCK_N=64,$swap,DECODE=2,num_warps=8,num_stages=3"
    "BLOCK_M=64,BLOCK_N=64,$ws,num_warps=4,num_stages=3"
    "BLOCK_M=64,BLOCK_N=64,$ws,FP8_STACKED=1,num_warps=4,num_stages=3"
    "BLOCK_M=128,BLOCK_N=64,$ws,num_warps=4,num_stages=3")  # (the last: W4A8's untuned choice, not timed in s34)
  TAIL=60 part moe_tiles_35 300 python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 8192 --configs "${tiles[@]}"
  # Decode (issue 15: 0.68-0.74x triton_kernels at 8-64 tokens, sessions 27-30): where each kernel's microseconds go
  # beside triton_kernels' layer (carry .triton-kernels), at the tuner's session-29 picks (split 2 and 1).
  decode=("BLOCK_M=16,BLOCK_N=64,$swap,num_warps=4,num_stages=3"
    "BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,SPLIT_K=2,SWAP_AB=1,num_warps=4,num_stages=3")
  TAIL=60 part moe_decode_kernels 150 python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 8 64 \
    --configs "${decode[@]}"
  ;;
s36-moe)
  # (after wheels-1) issue 15: bench_mxfp4_moe at gpt-oss-120b T=8192, the tuned rows and the untuned choices
  # session 35 made (DECODE=2 on the SWAP_AB prefill tile; W4A8 64 x 64 FP8_STACKED), W4A16 and W4A8, beside
  # triton_kernels (carry .triton-kernels too) and grouped_mm.
  TAIL=12 part bench_moe_prefill 480 python3 tools/bench_mxfp4_moe.py --models gpt-oss-120b --tokens 8192 \
    --routing uniform --codegens triton --w4a8 --memory-layers 0 --out "$OUT/mxfp4_moe_prefill_h200.md"
  ;;
s37-w4a8-online)
  # (after wheels-1) issue 15: the online W4A8 path (FP8=1 WORKSPACE=0: both GEMMs convert the packed weights to E4M3
  # in registers by a byte-permute lookup; no conversion kernel, no workspace), checked on CPU only so far. First its
  # GPU numerics (the inline-PTX lookup runs only there: every relative exponent bit for bit, the layer bit for bit
  # against the workspace tile and against the reference), then each kernel's time at gpt-oss-120b T=8192 beside
  # the W4A8 default's (its conversion kernel alone took 7.5 ms in session 35), then the layer: the W4A16 and
  # W4A8 defaults and the four online tiles in one run.
  TAIL=8 part gpu_tests_w4a8_online 300 python3 -m pytest -q -p no:logging -rf tests/test_mxfp4_moe_w4a8_online.py \
    tests/test_mxfp4_moe_w4a8.py -k "online or conversion_kernel"
  fp8="BLOCK_K=128,SPLIT_K=1,FP8=1"
  tiles=("BLOCK_M=64,BLOCK_N=64,$fp8,WORKSPACE=1,FP8_STACKED=1,num_warps=4,num_stages=3"
    "BLOCK_M=64,BLOCK_N=64,$fp8,WORKSPACE=0,num_warps=4,num_stages=3"
    "BLOCK_M=64,BLOCK_N=64,$fp8,WORKSPACE=0,FP8_STACKED=1,num_warps=4,num_stages=3"
    "BLOCK_M=128,BLOCK_N=64,$fp8,WORKSPACE=0,num_warps=8,num_stages=3"
    "BLOCK_M=128,BLOCK_N=64,$fp8,WORKSPACE=0,FP8_STACKED=1,num_warps=8,num_stages=3")
  TAIL=60 part w4a8_online_kernels 300 python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 8192 --configs "${tiles[@]}"
  TAIL=12 part bench_w4a8_online 400 python3 tools/bench_mxfp4_moe.py --models gpt-oss-120b --tokens 8192 \
    --routing uniform --codegens triton --w4a8 --memory-layers 0 --triton-kernels none \
    --match "FP8=1 SPLIT_K=1 WORKSPACE=0" "FP8_STACKED=1 SPLIT_K=1 WORKSPACE=0" \
    --out "$OUT/mxfp4_moe_w4a8_online_h200.md"
  ;;
s36-topk)
  # (after wheels-1 and wheels-2) issue 14: the SPECULATE=1 top-k (a candidate buffer filled during the first
  # sweep; session 35's first GPU run: the second sweep gone, the first 1.9x slower, 128K 46.3 -> 43.3 us) after
  # its first sweep was pipelined: GPU numerics of every config with a twin, then phases and the configs table.
  TAIL=6 part gpu_tests_topk 240 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_dsa_kernels.py \
    -k "tilelang_topk_matches_reference_on_gpu and (speculate or vote)"
  TAIL=60 part topk_speculate_phases 200 python3 tools/diagnose_dsa_topk_phases.py --lengths 32768 65536 131072 \
    --match SPECULATE=1
  TAIL=12 part topk_speculate_configs 150 python3 tools/diagnose_dsa_topk_configs.py --width 131072 \
    --lengths 40000 65536 98304 131072 --match SPECULATE=1
  ;;
s40-outline)
  # (after site) issue 18: the repeated layers' calls outlined for Inductor's fallback compile (dzc/outline_regions.py:
  # Inductor lowers each distinct body once). First the multimodal model end to end on the GPU (Inductor fallback,
  # paged caches written in place, CUDA-graph replays) against eager and its fp32 oracle, then the cold compile at
  # 32 + 16 layers with the outlining on and off, same machine.
  TAIL=4 part gpu_tests_outline 200 python3 -m pytest -q -p no:logging -rf tests/test_multimodal_model.py -m gpu
  for knob in 1 0; do
    TAIL=2 part compile_outline_$knob 200 env DZC_OUTLINE_FOR_INDUCTOR=$knob DZC_DEBUG=1 \
      python3 tools/bench_compile.py --models multimodal --no-torch --cold-only --layers 32 --vision-layers 16 \
      --child-logs "$OUT/compile_logs_$knob" --out "$OUT/compile_outline_$knob.md"
  done
  ;;
s40-compile-profile)
  # (after site) issue 18: the W4A8 online layer against the workspace path bit for bit (its first GPU run stopped at
  # the test's own workspace check, which looked "cuda" up where the buffer was kept as "cuda:0"), then the cold
  # compile at half depth (32 + 16 layers) under cProfile (full depth, session 40: 226 s, of which Inductor's compile
  # of the leftover ops 133 s): where the fallback compile's seconds go, the whole profile brought back as .pstats.
  TAIL=4 part gpu_tests_w4a8_bits 90 python3 -m pytest -q -p no:logging -rf tests/test_mxfp4_moe_w4a8_online.py \
    -k "workspace_paths_bits"
  TAIL=3 part bench_compile_profile 360 env DZC_DEBUG=1 python3 tools/bench_compile.py --models multimodal \
    --no-torch --cold-only --layers 32 --vision-layers 16 --child-logs "$OUT/compile_logs" \
    --profile-cold "$OUT/compile_profile"
  ;;
s41-decode-bisect)
  # (after site) the multimodal model's decode steps were 30-70% off its fp32 oracle on the H100 in session 41 with
  # the repeated layers outlined for Inductor (3 runs of 3; every prefill within eager's error), within it with
  # outlining off (1 run), and on the CPU host with Inductor's C++ backend either way: outlining now off by default.
  # First the GPU test as dzc now compiles, then each call's error with outlining on (dzc as it compiles, and with
  # one pass left out at a time) and off.
  TAIL=4 part gpu_tests_multimodal 150 python3 -m pytest -q -p no:logging -rf tests/test_multimodal_model.py -m gpu
  TAIL=12 part decoder_keys 120 python3 tools/diagnose_multimodal_decode.py --graph-keys
  TAIL=6 part decode_flat 60 env DZC_OUTLINE_FOR_INDUCTOR=0 python3 tools/diagnose_multimodal_decode.py --passes
  TAIL=14 part decode_bisect_outlined 360 env DZC_OUTLINE_FOR_INDUCTOR=1 python3 tools/diagnose_multimodal_decode.py
  ;;
s42-decode)
  # (after site) s41-decode-bisect in less device time: the test's requests as dzc now compiles (outlining off)
  # with the decoder's CUDA-graph keys and Dynamo's frame count around each call (why no decode step was
  # captured), then each call's error with outlining on, with one pass left out at a time.
  TAIL=12 part decoder_keys 120 python3 tools/diagnose_multimodal_decode.py --graph-keys
  TAIL=14 part decode_bisect_outlined 300 env DZC_OUTLINE_FOR_INDUCTOR=1 python3 tools/diagnose_multimodal_decode.py \
    --passes reinplace_cache_writes fuse_sparse_attention fuse_mxfp4_experts fuse_residual_norm canonicalize_graph
  ;;
s43-check)
  # (after site) session 43's fixes on the GPU: the multimodal model end to end (its regions now bind each layer's
  # data-dependent sizes to symbols of their own), the MoE fusion's and the models' GPU tests, the precompile GPU
  # test (its failure now prints the report's line), then the decode rows (eager, dzc, without CUDA graphs, and
  # without fuse_mxfp4_experts: the MoE as a loop over experts, which failed with index_add_ before the fix).
  TAIL=4 part gpu_tests_multimodal 200 python3 -m pytest -q -p no:logging -rf tests/test_multimodal_model.py \
    tests/test_fuse_mxfp4_experts.py tests/test_dsa_models.py -m gpu
  TAIL=4 part gpu_tests_precompile 120 python3 -m pytest -q -p no:logging -rf tests/test_triton_precompile.py -m gpu
  TAIL=8 part decode_rows 240 python3 tools/diagnose_multimodal_decode.py --passes fuse_mxfp4_experts
  ;;
s47-vision-lpt)
  # (after site) issue 14: LONGEST_FIRST=1 (session 47: the varlen kernel's grid takes the segments longest first,
  # so that a pack's longest images do not fill the last wave), never run on a GPU: its numerics first (every GPU
  # case of the kernel tests, poisoned neighbours), then, only if those pass, the default and the twins at head dims
  # 72, 80 and 128 beside cuDNN on the mixed and large packs.
  TAIL=8 part gpu_tests_varlen_longest_first 300 python3 -m pytest -q -p no:logging -rf -m gpu \
    tests/test_varlen_attention_longest_first.py \
    "tests/test_varlen_attention_kernels.py::test_kernels_ignore_nan_and_inf_in_other_segments[d80-bf16-longest-first]"
  if grep -qE "[0-9]+ passed" "$OUT/gpu_tests_varlen_longest_first.log" \
      && ! grep -qE "[0-9]+ (failed|errors?)\b" "$OUT/gpu_tests_varlen_longest_first.log"; then
    TAIL=40 part bench_vision_longest_first 420 python3 tools/bench_vision_attention.py --head-dims 72 80 128 \
      --packs mixed large --codegens tilelang --no-compile-baseline --match LONGEST_FIRST=1 \
      --work-dir /tmp/dzc-vision-lpt --out "$OUT/vision_attention_longest_first.md"
  fi
  ;;
s47-topk-flake)
  # (after site) issue 14: session 46's one failure of the top-k config threads512-width131072-sweep8192-radix8-cache0
  # (its output lost to the part's time limit; 13 seeded reruns passed): the 128K configs without cached keys, one
  # seed a process until one fails or the time is up; a failing seed's whole output is kept.
  end=$((SECONDS + 240)); seed=2000
  while [ $SECONDS -lt $end ]; do
    seed=$((seed + 1))
    DZC_TEST_SEED=$seed timeout 120 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_dsa_kernels.py \
      -k "tilelang_topk_matches_reference_on_gpu and width131072 and cache0" > "$OUT/topk_seed_$seed.log" 2>&1 \
      && rm "$OUT/topk_seed_$seed.log" || { echo "seed $seed failed:"; grep -E "^E " "$OUT/topk_seed_$seed.log" \
      | head -5; break; }
  done
  echo "seeds 2001-$seed run"
  ;;
s49-compile)
  # (after site) issue 18 at 32 + 16 layers, outlined (the default since session 51): cold, warm, and warm again
  # without the TileLang kernels' prim_func records (session 49: a warm start reads each kernel's prim_func from its
  # record instead of running TileLang's front end, and starts no prebuild child for a kernel in TileLang's cache;
  # the last row is the warm start as it was before, in the same run), and warm with Inductor's graph looked up by
  # hash (session 52: the compile cache entry keeps Inductor's key, dzc/inductor_entry.py; the A/B in one run).
  TAIL=4 part compile_records 340 env DZC_DEBUG=1 python3 tools/bench_compile.py --models multimodal \
    --no-torch --layers 32 --vision-layers 16 --warm-by-hash --forget-tilelang-records \
    --child-logs "$OUT/compile_logs" \
    --out "$OUT/compile_records.md"
  ;;
s42-precompile-decode)
  # (after site) the new DZC_TRITON_PRECOMPILE path's GPU test (the MoE block's kernels compiled ahead, then served
  # the first call, bit for bit), the decoder's CUDA-graph keys, then s42-decode's bisect for what time is left.
  TAIL=4 part gpu_tests_precompile 120 python3 -m pytest -q -p no:logging -rf tests/test_triton_precompile.py -m gpu
  TAIL=12 part decoder_keys 100 python3 tools/diagnose_multimodal_decode.py --graph-keys
  TAIL=14 part decode_bisect_outlined "${BISECT_S:-240}" env DZC_OUTLINE_FOR_INDUCTOR=1 \
    python3 tools/diagnose_multimodal_decode.py --passes reinplace_cache_writes fuse_sparse_attention fuse_mxfp4_experts
  ;;
s42-precompile-compile)
  # (after site) issue 18: the cold compile at 32 + 16 layers (flat, no tuning) without and with
  # DZC_TRITON_PRECOMPILE=1 (the Triton kernels compiled ahead of the first call, in parallel with Inductor's compile):
  # the first run's share (session 41: 17.9 s of 129.3) is what it should cut. Run after s42-precompile-decode's
  # GPU test has passed.
  for knob in 0 1; do
    TAIL=8 part "compile_precompile_$knob" 280 env DZC_DEBUG=1 DZC_TRITON_PRECOMPILE=$knob python3 \
      tools/bench_compile.py --models multimodal --no-torch --cold-only --layers 32 --vision-layers 16 \
      --child-logs "$OUT/compile_logs_$knob" --out "$OUT/compile_precompile_${knob}_h200.md"
  done
  ;;
s42-compile-profile)
  # (after site) issue 18: the multimodal model at 32 + 16 layers, flat (outlining off, as it was by default in
  # sessions 41-50), cold then warm, each first call under cProfile (.pstats brought back): where the fallback compile's (63.7 s
  # in session 41) and the first run's (17.9 s) seconds go cold, and the warm start's outside the report's stages.
  TAIL=6 part bench_compile_profile 560 env DZC_OUTLINE_FOR_INDUCTOR=0 DZC_DEBUG=1 python3 tools/bench_compile.py --models multimodal \
    --no-torch --layers 32 --vision-layers 16 --child-logs "$OUT/compile_logs" \
    --profile-cold "$OUT/compile_profile" --profile-warm "$OUT/compile_profile" --out "$OUT/compile_profile_h200.md"
  ;;
s41-w4a8)
  # (after site) issue 15: W4A8's GPU numerics in full (the activation quantization now takes 32 rows a program; the
  # online layer against the workspace path bit for bit, never reached on a GPU), then each kernel's time at
  # gpt-oss-120b T=8192: the untuned online tile (its quantize kernels took 603 us of 7528 in session 40) and the
  # workspace 128 x 128 tile (how fast the grouped FP8 GEMM itself runs at a larger tile).
  TAIL=8 part gpu_tests_w4a8 240 python3 -m pytest -q -p no:logging -rf tests/test_mxfp4_moe_w4a8.py \
    tests/test_mxfp4_moe_w4a8_online.py
  fp8="BLOCK_K=128,SPLIT_K=1,FP8=1,FP8_STACKED=1,num_stages=3"
  TAIL=40 part w4a8_kernels 200 python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 8192 --configs \
    "BLOCK_M=64,BLOCK_N=64,$fp8,WORKSPACE=0,num_warps=4" "BLOCK_M=128,BLOCK_N=128,$fp8,WORKSPACE=1,num_warps=8"
  ;;
s36-compile)
  # (after site) issue 18: the multimodal model at full depth (61 decoder + 32 vision layers, no tuning), cold then
  # warm, each child's output and dzc's report streamed to logs (session 35's cold run passed 380 s with its output
  # lost). PROFILE_WARM=1: the warm first call under cProfile instead of the by-hash row (its 60 heaviest functions
  # in the log, the .pstats brought back; session 53).
  if [ "${PROFILE_WARM:-0}" = 1 ]; then extra=(--profile-warm "$OUT/compile_profile"); else extra=(--warm-by-hash); fi
  TAIL=12 part bench_compile_full_depth 560 env DZC_DEBUG=1 python3 tools/bench_compile.py --models multimodal \
    --no-torch --layers 61 --vision-layers 32 "${extra[@]}" --child-logs "$OUT/compile_logs" \
    --out "$OUT/compile_full_depth_h200.md"
  ;;
s38-compile-scaling)
  # (after site) issue 18: the full-depth cold compile ran past 560 s on an H100 host (session 38; 51.5-56.6 s on the
  # 2-core CPU host): the cold compile at 8 + 4 and 16 + 8 layers, each child's stage breakdown (the per-layer cost
  # on this host), then the full depth for 400 s with the compiling thread's whole stack sampled every 30 s.
  for depth in "8 4" "16 8"; do
    set -- $depth
    TAIL=14 part "compile_depth_$1" 280 env DZC_DEBUG=1 python3 tools/bench_compile.py --models multimodal \
      --no-torch --cold-only --layers "$1" --vision-layers "$2" --child-logs "$OUT/compile_logs_$1" \
      --out "$OUT/compile_depth_$1_h200.md"
  done
  TAIL=4 part compile_full_depth_stacks 400 env DZC_DEBUG=1 DZC_CACHE_DIR=/tmp/c38s/dzc \
    TORCHINDUCTOR_CACHE_DIR=/tmp/c38s/inductor TRITON_CACHE_DIR=/tmp/c38s/triton TILELANG_CACHE_DIR=/tmp/c38s/tl \
    python3 -c "
import runpy, sys, threading, time, traceback
main = threading.main_thread().ident
def sample(start=time.time()):
    while True:
        time.sleep(30)
        stack = traceback.format_stack(sys._current_frames()[main])
        with open('$OUT/compile_stacks.txt', 'a') as f:
            f.write(f'=== {time.time() - start:.0f} s\n' + ''.join(stack))
threading.Thread(target=sample, daemon=True).start()
sys.argv = ['tools/bench_compile.py', '--child', 'dzc', '--model', 'multimodal', '--cache-dir', '/tmp/c38s/dzc',
            '--regions', 'on', '--layers', '61', '--vision-layers', '32']
runpy.run_path('tools/bench_compile.py', run_name='__main__')"
  ;;
s35-compile)
  # (after wheels-1: dzc installed) issue 18: the goal's measurement, cold compile of the reference multimodal model
  # at full depth (61 decoder + 32 vision layers, no tuning) on the GPU host, where the leftovers go to Inductor and
  # the first run builds real kernels; until now only measured on the 2-core CPU host (77.7 s of compile stages).
  # First the warm goal (<= 3 s and <= torch.compile's warm) on llama_decoder, both compilers reading one primed
  # bytecode cache (this machine's torch ships no .pyc files: session 22 found 1.9 s of each warm start compiling
  # its modules from source, which an installed torch does not).
  TAIL=8 part bench_compile_warm 200 python3 tools/bench_compile.py --models llama_decoder \
    --out "$OUT/compile_warm_h200.md"
  # Session 35 ran past 380 s here with the child's output lost: now it is streamed to a log, with dzc's report
  # (the compile's stage breakdown) printed when the compile ends, before the first run builds the kernels.
  TAIL=12 part bench_compile_full_depth 500 env DZC_DEBUG=1 python3 tools/bench_compile.py --models multimodal \
    --no-torch --cold-only --layers 61 --vision-layers 32 --child-logs "$OUT/compile_logs" \
    --out "$OUT/compile_full_depth_h200.md"
  ;;
s35-vision-large)
  # (after wheels-1 and wheels-2) issue 14: the large pack (never timed since the warp-specialized kernel's split
  # and ping-pong configs) at the goal's three head dims, every TileLang config beside cuDNN.
  TAIL=40 part bench_vision_large 560 python3 tools/bench_vision_attention.py --head-dims 72 80 128 --packs large \
    --codegens tilelang --no-compile-baseline --work-dir /tmp/dzc-vision-large \
    --out "$OUT/vision_attention_large_h200.md"
  ;;
s38-vision-128)
  # (after wheels-1 and wheels-2) issue 14: head dim 128's OVERLAP=1 configs (the softmax kept under the previous
  # block's P V MMA, O's rescale under the next S MMA: static, docs/results/vision_attention_h200.md, "Head dim 128,
  # static (session 38)"), never run on a GPU: their numerics first (poisoned neighbours; every warp-specialized
  # config at 128), then, only if those pass, every shortlisted TileLang config at 128 beside cuDNN, mixed pack.
  TAIL=8 part gpu_tests_varlen_overlap 420 python3 -m pytest -q -p no:logging -rf \
    "tests/test_varlen_attention_kernels.py::test_kernels_ignore_nan_and_inf_in_other_segments[d128-bf16-overlap]" \
    "tests/test_varlen_attention_kernels.py::test_tilelang_on_gpu[d128-bfloat16-rope0]"
  if grep -qE "[0-9]+ passed" "$OUT/gpu_tests_varlen_overlap.log" \
      && ! grep -qE "[0-9]+ (failed|errors?|skipped)\b" "$OUT/gpu_tests_varlen_overlap.log"; then
    TAIL=40 part bench_vision_128 420 python3 tools/bench_vision_attention.py --head-dims 128 --packs mixed \
      --codegens tilelang --no-compile-baseline --work-dir /tmp/dzc-vision-128 --out "$OUT/vision_attention_128_h200.md"
  else
    echo "    bench_vision_128 not run: the OVERLAP=1 numerics did not all pass (gpu_tests_varlen_overlap.log)"
  fi
  ;;
s38-sparse-prefill)
  # (after wheels-1 and wheels-2) issue 14: BALANCED=1, the warp-specialized sparse MLA attention's consumers split
  # as in FlashMLA's Hopper sparse prefill (each consumer warpgroup the score GEMM and softmax of its own tile of a
  # pair, half of Dv of both tiles' P V; static only: docs/results/sparse_attention_warp_specialized_h200.md,
  # "FlashMLA's sparse prefill beside dzc's, static (session 38)"). Never ran on a GPU: its numerics first (128 heads
  # prefill, 1 and 16 splits, 16 heads 16 splits); only if all 4 pass, the prefill A/B (untuned, BALANCED=1, the
  # public pipelined kernel) at 4096 queries, ctx 8K, one process.
  TAIL=8 part gpu_tests_sparse_balanced 360 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_dsa_kernels.py \
    -k "warp_specialized_sparse_attention_on_gpu and balanced"
  if grep -q "4 passed" "$OUT/gpu_tests_sparse_balanced.log" \
      && ! grep -qE "[0-9]+ (failed|errors?)\b" "$OUT/gpu_tests_sparse_balanced.log"; then
    TAIL=12 part sparse_balanced_prefill 300 python3 tools/diagnose_sparse_attention_configs.py --variants prefill \
      --codegen tilelang --match BALANCED=1 --public .public-kernels/deepseek_v32
  else
    echo "    the numerics did not all pass: the timing part is skipped"
  fi
  ;;
s25-busy)
  # (after wheels-1: dzc installed) issues 18/14/15: bench_multimodal --quick again, its
  # torch.compile column falling back to mode "default" when reduce-overhead's capture fails (as in s24-busy);
  # Triton kernels only.
  TAIL=30 part bench_multimodal 420 env PYTHONPATH=/tmp/site-gpu1:$PWD python3 tools/bench_multimodal.py --quick \
    --compile-mode reduce-overhead --no-warm --out "$OUT/multimodal_quick_h200.md"
  ;;
s39-moe-decode)
  # (after site; carry .triton-kernels) issue 15: the layer (CUDA graph) at gpt-oss-120b T=1, 8 and 64 with the decode
  # buckets' untuned tile since session 39 (TMA_STACKED=1 DECODE=2 BLOCK_N 64: per kernel 1.18x and 1.20x the TMA
  # tile at 8 and 64 tokens; the layer bench had not offered DECODE=2 with TMA_STACKED) beside triton_kernels, the
  # TMA_STACKED tiles tuned.
  TAIL=12 part bench_moe_decode 400 python3 tools/bench_mxfp4_moe.py --models gpt-oss-120b --tokens 1 8 64 \
    --routing uniform --codegens triton --memory-layers 0 --match "TMA_STACKED=1" \
    --out "$OUT/mxfp4_moe_decode_h200.md"
  ;;
s37-moe-decode)
  # (after wheels-1; carry .triton-kernels) issue 15: the decode GEMMs beside triton_kernels' (static comparison:
  # docs/mxfp4_moe_kernels.md, "Decode beside triton_kernels"). TMA_STACKED (gate/up rows as one TMA box and one MMA
  # operand) never ran on a GPU: its numerics first (the DECODE=2 tiles' inline PTX too, which the interpreter does
  # not run), then each kernel's time at gpt-oss-120b T=8 and 64 beside the untuned tile and triton_kernels, then
  # the layer (CUDA graph) with the offered TMA_STACKED tiles beside the defaults.
  TAIL=8 part gpu_tests_moe_decode_layout 300 python3 -m pytest -q -p no:logging -rf \
    tests/test_mxfp4_moe_decode_layout.py
  base="BLOCK_M=16,BLOCK_K=128,TMA=1,SWAP_AB=1,num_warps=4,num_stages=3"
  tiles=("BLOCK_N=64,SPLIT_K=1,$base" "BLOCK_N=64,SPLIT_K=2,$base" "BLOCK_N=64,SPLIT_K=1,$base,DECODE=2"
    "BLOCK_N=64,SPLIT_K=1,$base,TMA_STACKED=1" "BLOCK_N=64,SPLIT_K=1,$base,TMA_STACKED=1,DECODE=2"
    "BLOCK_N=128,SPLIT_K=1,$base,TMA_STACKED=1" "BLOCK_N=128,SPLIT_K=1,$base,TMA_STACKED=1,DECODE=2"
    "BLOCK_N=64,SPLIT_K=2,$base,TMA_STACKED=1,DECODE=2")
  TAIL=120 part moe_decode_kernels 400 python3 tools/diagnose_mxfp4_moe_kernels.py --tokens 8 64 --configs "${tiles[@]}"
  TAIL=12 part bench_moe_decode 400 python3 tools/bench_mxfp4_moe.py --models gpt-oss-120b --tokens 1 8 64 \
    --routing uniform --codegens triton --memory-layers 0 --match "TMA_STACKED=1" \
    --out "$OUT/mxfp4_moe_decode_stacked_h200.md"
  ;;
s38-moe-ws)
  # (after wheels-1 and wheels-2) issue 15: WARP_SPECIALIZED=1, the TileLang W4A16 prefill GEMMs' warp-specialized
  # form (a producer warpgroup decoding MXFP4 into a shared-memory ring as 16-byte vectors beside cp.async-gathered
  # activation rows, two consumer warpgroups running wgmma, full/empty mbarriers; static only:
  # docs/mxfp4_moe_kernels.md, "TileLang warp-specialized prefill"). Never ran on a GPU: its numerics first (every
  # WARP_SPECIALIZED config on the selftest case it takes and two larger ones with N tails and skew); only if they
  # pass, the layer at gpt-oss-120b T=8192 (CUDA graph, uniform routing; bench_mxfp4_moe's own helpers, as its table
  # times TileLang only up to 64 tokens): Triton's untuned choice (SWAP_AB, 311 TFLOP/s in session 35), TileLang's
  # untuned choice and the four WARP_SPECIALIZED configs, each checked against the reference first.
  TAIL=8 part gpu_tests_moe_ws 480 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_mxfp4_moe_kernels.py \
    -k "tilelang_on_gpu_every_selftest_case and warp_specialized"
  if grep -q "1 passed" "$OUT/gpu_tests_moe_ws.log"; then
    TAIL=14 part bench_moe_ws 540 python3 - <<'EOF'
import sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "tools")
import bench_mxfp4_moe as bench
device, tokens = torch.device("cuda"), 8192
generator = torch.Generator(device=device).manual_seed(0)
layer = bench.random_layer("gpt-oss-120b", device, generator)
spec = layer.spec
op_args = layer.args(*bench.random_routing(spec, tokens, False, device, generator))
expected = bench.mxfp4_moe_reference(*op_args)
print(f"gpt-oss-120b T={tokens}: {bench.family.flops(spec, tokens) / 1e12:.4f} TFLOP a layer (TFLOP/s = that / s)")
workdir = Path(tempfile.mkdtemp(prefix="dzc-moe-ws-"))
for codegen in ("triton", "tilelang"):
    kernels = bench.DzcKernels(spec, codegen, workdir, ["WARP_SPECIALIZED=1"])
    errors = []
    default_s, best_s, best = bench.time_configs(kernels, bench.family.token_bucket(tokens), False, 0, op_args,
                                                 lambda config: (expected, bench.W4A16_TOLERANCE), errors, codegen)
    print(f"{codegen}: default {default_s * 1e6:.1f} us, best {best_s * 1e6:.1f} us ({best}); errors {errors}")
EOF
  else
    echo "    the numerics did not pass: the timing part is skipped"
  fi
  ;;
s37-fp8-cluster)
  # (after wheels-1 and wheels-2) issue 14: CLUSTER=2, the FP8 latent cache's two-CTA crossover (the two head blocks
  # of a query row as a cluster, each dequantizing half a tile into both CTAs' shared memory; static only:
  # docs/results/sparse_attention_warp_specialized_h200.md, last section). Never ran on a GPU: numerics first
  # (prefill, 1 split, 16 splits, beside the other FP8 warp-specialized cases); only if all 7 pass, the decode A/B at
  # 64 x 2 rows, ctx 32K, 1 split, one process.
  TAIL=8 part gpu_tests_fp8_cluster 300 python3 -m pytest -q -p no:logging -rf -m gpu tests/test_dsa_kernels.py \
    -k "warp_specialized_sparse_attention_on_gpu and fp8"
  if grep -q "7 passed" "$OUT/gpu_tests_fp8_cluster.log"; then
    TAIL=12 part fp8_cluster_decode 240 python3 tools/diagnose_sparse_attention_configs.py --variants decode \
      --fp8-cache --codegen tilelang --match CLUSTER=2 SPLITS=1
  else
    echo "    the numerics did not all pass: the timing part is skipped"
  fi
  ;;
s37-indexer-ws)
  # (after wheels-1 and wheels-2) issue 14: WARP_SPECIALIZED=1, the TileLang FP8 indexer's warp-specialized prefill
  # form (a producer warpgroup filling a 4-stage ring by cp.async + mbarriers, two consumer warpgroups taking the key
  # tiles in turn; static only: docs/results/dsa_indexer_tilelang_h200.md, last section). Never ran on a GPU: its
  # numerics first (2 and 4 rows, pages of 16-128); only if all pass, its time beside the untuned choice on the prefill
  # chunk (1024 rows, 8K) and at decode (64 seqs x 2 rows, 32K: the untuned choice stays there), one process.
  # (6 builds, then 3 configs timed: the page-64 builds come from TileLang's kernel cache; if the call runs out of
  # time, rerun the timing part alone.)
  TAIL=8 part gpu_tests_indexer_ws 420 python3 -m pytest -q -p no:logging -rf -m gpu \
    tests/test_dsa_indexer_warp_specialized.py
  if grep -q "6 passed" "$OUT/gpu_tests_indexer_ws.log"; then
    TAIL=8 part indexer_ws_timing 300 python3 tools/diagnose_dsa_indexer_configs.py --shapes prefill decode-64 \
      --match WARP_SPECIALIZED=1 --limit-s 240
  else
    echo "    the numerics did not all pass: the timing part is skipped"
  fi
  ;;
esac
# The device tool brings back only a few files per call: everything goes back as one archive.
(cd "$OUT" && tar czf "/tmp/campaign_$step.tgz" . && rm -rf ./* && mv "/tmp/campaign_$step.tgz" .)
