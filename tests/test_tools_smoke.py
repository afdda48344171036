"""Every tool in tools/ runs its smallest mode on the CPU, so that a change elsewhere cannot break one unseen (the
MUSA-constrained runs crashed on the first W4A8 op they met, and nothing had run them since W4A8 landed).

Tools that measure a GPU have a --dry-run: arguments checked, everything up to the first device launch built
(models, compile wrappers, problems on the meta device, specs and config lists), the plan printed. Tools that can
run on the CPU run for real on tiny shapes through Triton's interpreter. All run at once, each in its own process,
as the user runs them: `python tools/<tool>.py ...` (forked from one process that has imported torch and dzc, so
that each does not pay that start-up again: tests/prewarmed_cli.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prewarmed_cli import Job
from prewarmed_cli import run as run_prewarmed

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"

# tool -> (argv, text its output must contain). {tmp} is the test's scratch directory.
SMOKE = {
    "bench_add_rms_norm.py": (["--dry-run", "--quick"], "dry run: add_rms_norm hidden 2880"),
    "diagnose_add_rms_norm_configs.py": (["--dry-run", "--hidden", "2880"], "| 2880 | all | dry run:"),
    # Runs for real: llama_decoder compiled cold and warm, each in a fresh process (the warm one hits the cache), and
    # warm again with Inductor's graph looked up by hash (the CPU's fallback runs the graph as Python: the same) and
    # without TileLang's prim_func records (none on the CPU: its kernels are Triton's).
    "bench_compile.py": (["--quick", "--warm-by-hash", "--forget-tilelang-records"],
                         "| llama_decoder | dzc, regions on, warm without TileLang records (0 removed) | | "),
    "bench_cache_writes.py": (["--dry-run", "--quick"], "dry run: dzc: (batch, context) [(1, 32768), (8, 32768)]"),
    "bench_dsa.py": (["--dry-run", "--quick"], "dry run: B=1 q=4096 ctx=8192"),
    # found or not (a fresh clone has no .triton-kernels/), the baseline's line comes first
    "bench_mxfp4_moe.py": (["--dry-run", "--quick"], "dry run: triton_kernels "),
    # The W4A8 default (the stacked online tile since session 40) and the online tiles (campaign step s37-w4a8-online)
    "bench_mxfp4_moe.py --match": (["--dry-run", "--models", "gpt-oss-120b", "--tokens", "8192", "--codegens", "triton",
                                    "--w4a8", "--triton-kernels", "none", "--match", "FP8=1 SPLIT_K=1 WORKSPACE=0",
                                    "FP8_STACKED=1 SPLIT_K=1 WORKSPACE=0"],
                                   "w4a8: 4 configs (default BLOCK_K=128 BLOCK_M=64 BLOCK_N=64 FP8=1 FP8_STACKED=1 "
                                   "SPLIT_K=1 WORKSPACE=0"),
    "bench_multimodal.py": (["--dry-run", "--quick"], "dry run: 2 decoder layers"),
    "bench_vision_attention.py": (["--dry-run", "--quick", "--musa-legal", "--codegens", "triton", "auto"],
                                  "dry run: d=80 rope=False auto: dzc's tuner (untuned)"),
    # An A/B of LONGEST_FIRST=1 (campaign step s47-vision-lpt): the default and the twins.
    "bench_vision_attention.py --match": (["--dry-run", "--head-dims", "128", "--packs", "mixed", "large",
                                           "--codegens", "tilelang", "--match", "LONGEST_FIRST=1"],
                                          "dry run: d=128 rope=False tilelang: 5 configs, packs ['mixed', 'large']"),
    "bench_windowed_attention.py": (["--dry-run", "--quick"], "dry run: decode 64x1 over 8192 window 128"),
    "diagnose_overhead.py": (["--dry-run", "--hidden", "64"], "dry run: H=64"),
    # Runs for real: the MoE layer's breakdown through the interpreter (a second entry of a tool: "<tool> <mode>").
    "diagnose_overhead.py --op mxfp4_moe": (["--op", "mxfp4_moe", "--device", "cpu", "--tokens", "1", "--calls", "2",
                                             "--cache-dir", "{tmp}/overhead"], "host overhead, all layers"),
    "diagnose_sparse_attention_configs.py": (["--dry-run"], "| decode | dry run:"),
    "diagnose_sparse_attention_configs.py --match": (["--dry-run", "--codegen", "tilelang", "--match", "ROW_ADDRESS=1"],
                                                     "| prefill | dry run: 2 of"),
    "diagnose_dsa_indexer_configs.py": (["--dry-run", "--match", "MIN_BLOCKS=3"], "dry run: "),
    "diagnose_dsa_topk_configs.py": (["--dry-run", "--match", "RADIX_BITS=10"], "dry run: 5 of 8 configs"),
    "diagnose_dsa_topk_phases.py": (["--dry-run", "--lengths", "32768"], "dry run: 128 rows of 32768, CACHE=32768"),
    # Runs for real: one request (its prefill) and a decode step, then the reports and their coverage.
    "demo.py": (["--requests", "1", "--decode-steps", "1"], "largest unfused ops (left to the fallback)"),
    # Runs for real: world size 1, gloo, tiny sizes through the interpreter (torchrun adds ranks on GPUs).
    "bench_distributed.py": (["--quick"], "| all_reduce_add_rms_norm | 64 | 8 |"),
    # Runs for real through the interpreter (the lookup-table decoders need the GPU's inline PTX).
    "diagnose_mxfp4_decode.py": (["--check-only", "--hidden", "64", "--out-features", "32", "--experts", "4",
                                  "--rows", "2", "--variants", "arith+fma", "--block-n", "32", "--block-k", "64",
                                  "--stages", "1", "--prefetch", "0"], "| arith+fma | 32 | 64 | 4 | 1 | 0 | correct"),
    "diagnose_varlen_attention_configs.py": (["--head-dim", "16", "--dtype", "float32", "--lengths", "1", "5", "0",
                                              "--heads", "1", "--in-process", "--config",
                                              "BLOCK_M=64 BLOCK_N=32 D_HI=0 D_LO=16 num_warps=4 num_stages=1"],
                                             "matches: max abs error"),
    # W4A8 has no legal config on mp_22 (no FP8): listed as not on this profile, not a crash; add_rms_norm runs.
    "musa_constrained_runs.py": (["--device", "cpu", "--quick", "--family", "mxfp4_moe_w4a8", "--family",
                                  "add_rms_norm", "--profile", "musa:mp_22", "--out", "{tmp}/musa.md"],
                                 "not on this profile: mxfp4_moe_w4a8 on musa:mp_22"),
    "diagnose_mxfp4_moe_numerics.py": (["--dry-run", "--workdir", "{tmp}/work"], ""),
    "diagnose_mxfp4_moe_kernels.py": (["--dry-run"], "dry run: gpt-oss-120b T=[1, 8, 64] BLOCK_K=128"),
    "diagnose_multimodal_decode.py": (["--dry-run", "--passes", "fuse_mxfp4_experts"],
                                      "dry run: 8 calls (0:prefill, 0:decode, 0:decode, 0:decode, 1:prefill, "
                                      "1:decode, 1:decode, 2:prefill) x 4 runs (eager, dzc, dzc without CUDA "
                                      "graphs, dzc without fuse_mxfp4_experts)"),
    # Run by their own tests (tests/test_model_zoo.py, the fuzzer's test): here they must at least import and parse
    # their arguments.
    "zoo.py": (["--help"], "usage:"),
    "fuzz.py": (["--help"], "usage:"),

}


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"  # CPU tensors run Triton kernels through the interpreter, also on a GPU machine
    env["DZC_CACHE_DIR"] = str(tmp_path / "cache")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the smallest mode on the CPU, wherever the test runs
    for knob in ("DZC_DUMP_DIR", "DZC_DEBUG", "DZC_AUTOTUNE_LOG", "DZC_TUNING_DB"):
        env.pop(knob, None)
    return env


# Most tools are CPU-bound; bench_compile mostly waits on its own child processes.
AT_ONCE = 4
# The longest runs (~15-30 s each on two cores), started first so that the others fill in around them.
FIRST = ("bench_compile.py", "demo.py", "bench_distributed.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every tool's smoke command, AT_ONCE at a time; tool -> CompletedProcess (stderr merged into stdout)."""
    tmp_path = tmp_path_factory.mktemp("tools")
    jobs = {tool: Job([str(TOOLS / tool.split()[0]), *(a.replace("{tmp}", str(tmp_path)) for a in SMOKE[tool][0])],
                      cwd=str(tmp_path), merge_stderr=True)
            for tool in sorted(SMOKE, key=lambda tool: tool not in FIRST)
            if (TOOLS / tool.split()[0]).exists()}  # a tool gone: the coverage test says so
    return run_prewarmed(jobs, env=_env(tmp_path), at_once=AT_ONCE, timeout=900)


def test_every_tool_has_a_smoke_run():
    tools = sorted(p.name for p in TOOLS.glob("*.py"))
    assert sorted(set(tools) - set(SMOKE)) == [], "give every tool a smallest CPU mode (--dry-run) and list it here"


@pytest.mark.parametrize("tool", sorted(SMOKE))
def test_tool_smallest_mode_runs_on_the_cpu(runs, tool):
    if tool not in runs:
        pytest.skip(f"tools/{tool} is gone")
    result = runs[tool]
    assert result.returncode == 0, f"{' '.join(result.args)}\n{result.stdout[-6000:]}"
    assert SMOKE[tool][1] in result.stdout, result.stdout[-6000:]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("*.sh")))
def test_shell_tools_parse(script):
    result = subprocess.run(["bash", "-n", str(TOOLS / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_busy_share_counts_overlapping_activity_once_and_gaps_as_idle():
    """bench_multimodal's GPU-busy figure (issue 18's decode goal) from a trace's activity spans."""
    import sys
    sys.path.insert(0, str(TOOLS))
    from bench_multimodal import busy_fraction
    assert busy_fraction([(20, 30), (0, 10), (5, 12)]) == pytest.approx(22 / 30)  # 0-12 and 20-30 of 0-30
    assert busy_fraction([(0, 4), (4, 9)]) == 1.0  # back to back: no gap
    with pytest.raises(ValueError, match="no GPU activity"):
        busy_fraction([])


def test_distributed_check_allows_near_tie_rows_only_where_the_layer_selects():
    """bench_distributed's check: a selecting layer (router / indexer top-k in bf16) may differ on a few whole rows
    (the H200's DSA+MoE layer: 1% of rows), never on many, nor by a shifted median; other layers on none."""
    import sys

    import torch
    sys.path.insert(0, str(TOOLS))
    from bench_distributed import FLIPPED_ROWS, check
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(1, 400, 64, generator=generator)
    close = expected + 1e-3 * torch.randn(expected.shape, generator=generator)
    flipped = close.clone()
    flipped[0, :4] = torch.randn(4, 64, generator=generator)  # 1% of rows: another expert's output
    check("close", close, expected, 2 ** -4)
    check("flipped rows", flipped, expected, 2 ** -4, selects=True)
    with pytest.raises(SystemExit, match="differs from eager"):
        check("flipped rows, no selection", flipped, expected, 2 ** -4)
    many = close.clone()
    many[0, :int(400 * FLIPPED_ROWS) + 8] = torch.randn(int(400 * FLIPPED_ROWS) + 8, 64, generator=generator)
    with pytest.raises(SystemExit, match="of the rows differ"):
        check("too many rows", many, expected, 2 ** -4, selects=True)
    with pytest.raises(SystemExit, match="median row"):
        check("shifted", expected + 0.05 * expected.abs().max(), expected, 2 ** -4, selects=True)
