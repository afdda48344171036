"""Test setup: Triton's interpreter on machines without a GPU, seeded inputs that print their seed, and a fresh
cache directory per test so that no compile cache entry or tuning-database state leaks between tests."""

import os

import torch

# Must happen before Triton is imported (its library functions are @triton.jit too); dzc/__init__ does the same,
# but pytest plugins may import torch._dynamo (and so Triton) before dzc.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import dzc  # noqa: E402


# Seconds each of the heaviest test files takes on CI's 2 cores (--durations of two runs of tools/test.sh's command,
# 2026-12-05). Under pytest-xdist (tools/test.sh: --dist loadfile, one file per worker at a time) the files are
# handed out heaviest first, so that the last ones are short and neither worker idles long at the end; xdist's own
# order (most tests first) left files of a few long tests (the fuzzer's, the multimodal model's, the selftest's)
# for the end. A file not listed here and not yet measured counts as UNMEASURED_FILE_SECONDS (a new file is often
# a kernel's: not left for last); the small files, listed or not, come last. A scheduling hint only: which tests
# run is unchanged.
FILE_SECONDS = {
    "test_dsa_kernels.py": 550, "test_model_zoo.py": 395, "test_dsa_indexer_tilelang.py": 200,
    "test_tools_smoke.py": 180, "test_regions.py": 140, "test_mxfp4_moe_kernels.py": 125,
    "test_mxfp4_moe_w4a8.py": 115, "test_varlen_attention_kernels.py": 90, "test_mxfp4_moe_decode_layout.py": 90,
    "test_fuzz.py": 60, "test_distributed.py": 60, "test_reinplace_cache_writes.py": 55,
    "test_hf_attention_interface.py": 45, "test_fuse_mxfp4_experts.py": 45, "test_vision_models.py": 40,
    "test_multimodal_model.py": 40, "test_fuse_windowed_attention.py": 40, "test_dsa_models.py": 40,
    "test_sparse_attention_without_cache.py": 35, "test_selftest.py": 35, "test_fuse_vision_attention.py": 35,
    "test_frame_cache.py": 35, "test_models.py": 30, "test_autotune.py": 30, "test_add_layer_norm_kernels.py": 30,
    "test_tilelang_add_rms_norm.py": 25, "test_packaging_and_dump.py": 25, "test_mxfp4_moe_w4a8_online.py": 25,
    "test_fuse_sparse_attention.py": 25, "test_capture.py": 25, "test_all_reduce_kernel.py": 25,
    "test_warm_compile.py": 20, "test_tilelang_long_context.py": 20, "test_sparse_attention_ws_static.py": 20,
    "test_tilelang_prebuild.py": 15, "test_musa_static_checks.py": 15, "test_musa_runtime.py": 15,
    "test_faults.py": 15, "test_add_rms_norm_kernels.py": 15, "test_failures_now.py": 15, "test_targets.py": 10,
    "test_fuse_residual_norm.py": 10
}
UNMEASURED_FILE_SECONDS = 50
# Files measured under 8 s (not worth a line above each).
SMALL_FILES = ("test_host_path.py", "test_external_candidates.py", "test_coverage.py", "test_warm_compile_capture.py",
               "test_tuning_database.py", "test_runtime_cuda_graph_decisions.py", "test_check_rewrites.py",
               "test_mxfp4_format.py", "test_cuda_graph_eligibility.py", "test_attention_patterns.py",
               "test_tilelang_launch_alignment.py", "test_passes_are_model_agnostic.py", "test_rotary_patterns.py",
               "test_kv_cache.py", "test_ir_text.py", "test_canonicalize_graph.py", "test_graph_pass.py",
               "test_compile_cache.py", "test_cuda_graphs.py")


def pytest_configure(config):
    """Under xdist's file or scope distribution, its work queue keeps the collection's order of files (the order
    pytest_collection_modifyitems gives them), not its own by test count."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def _heaviest_files_first(items):
    """items stably sorted by their file's FILE_SECONDS, largest first (a file's tests stay together, in order)."""
    def seconds(item):
        name = item.path.name
        return FILE_SECONDS.get(name, 0 if name in SMALL_FILES else UNMEASURED_FILE_SECONDS)

    items.sort(key=lambda item: -seconds(item))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; `anydevice` ones pick CUDA where present, else the CPU; the others are the CPU
    suite: they build CPU tensors for a GPU target, which run through Triton's interpreter, and Triton picks the
    interpreter once per process, at import. So each half runs in its own process: on a GPU machine tools/test.sh
    runs the CPU suite with CUDA hidden, then the `gpu` and `anydevice` tests. `gpu` tests of TileLang kernels (the
    test's name or its module's file name says "tilelang") need TileLang installed too."""
    gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    tilelang_missing = importlib.util.find_spec("tilelang") is None
    skip_tilelang = pytest.mark.skip(reason="TileLang is not installed: tools/gpu_campaign.sh installs it from "
                                            ".whl-gpu1/.whl-gpu2")
    skip_cpu = pytest.mark.skip(reason="CPU suite: run it with CUDA hidden (CUDA_VISIBLE_DEVICES=, as tools/test.sh "
                                       "does on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        elif "gpu" in item.keywords and tilelang_missing and ("tilelang" in item.name or "tilelang" in item.path.name):
            item.add_marker(skip_tilelang)
        elif gpu and "gpu" not in item.keywords and "anydevice" not in item.keywords:
            item.add_marker(skip_cpu)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection: the order xdist hands files out in
        _heaviest_files_first(items)


def pytest_runtest_logreport(report):
    """With DZC_TEST_FAILURES_NOW=1 (tools/gpu_campaign.sh sets it), a failed test's report and captured output
    (its seed) go to stderr as it fails, not only in the summary at the end: a campaign part cut by its time limit
    still shows why a test failed (session 46 lost a top-k failure that way)."""
    if report.failed and os.environ.get("DZC_TEST_FAILURES_NOW") == "1":
        sections = "".join(f"--- {name}\n{text}\n" for name, text in report.sections)
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n{sections}")
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    """Each test's own default cache directory (DZC_CACHE_DIR, where dzc.compile keeps its compile cache entries,
    frame entries, kernel sources and tuning database unless CompileOptions.cache_dir says otherwise): a shared one
    made a test's outcome depend on which tests, in which worker, had compiled the same graph before (session 53's
    CI). Tests of hits across processes or compiles name their directories themselves."""
    monkeypatch.setenv("DZC_CACHE_DIR", str(tmp_path / "dzc-default-cache"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's caches and recompile counters are per process: without a reset, a test's compiles count against
    the recompile limit of the next test that compiles the same model code."""
    torch._dynamo.reset()


@pytest.fixture
def seed(request):
    """A fresh seed per test, printed in the failure report (`seed = ...` in the locals) and seeding torch."""
    value = int(os.environ.get("DZC_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(value)
    print(f"seed = {value} (rerun with DZC_TEST_SEED={value})")
    return value


@pytest.fixture
def options(tmp_path):
    """CompileOptions with a private cache dir and no tuning (tuning has its own tests)."""
    return dzc.CompileOptions(cache_dir=str(tmp_path / "cache"), autotune=False)


def ulp(values: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Size of one unit in the last place of `dtype` at each value's magnitude (subnormals: the smallest step)."""
    info = torch.finfo(dtype)
    magnitude = values.float().abs().clamp_min(info.tiny)
    return 2.0 ** torch.floor(torch.log2(magnitude)) * info.eps


def bf16_ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place, measured at the expected value's magnitude."""
    return (actual.float() - expected.float()).abs() / ulp(expected)


def assert_close_for_dtype(actual: torch.Tensor, expected: torch.Tensor, max_bf16_ulps: float = 1.0):
    """fp32/fp16: tight tolerances; bf16: at most `max_bf16_ulps` units in the last place."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert not actual.isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    if actual.dtype == torch.bfloat16:
        worst = bf16_ulps(actual, expected).max().item()
        assert worst <= max_bf16_ulps, f"{worst} bf16 ulps apart"
    else:
        tol = {torch.float32: 1e-5, torch.float16: 1e-3}[actual.dtype]
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def assert_hf_rms_norm_output_close(y: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                                    expected_y: torch.Tensor):
    """y = HF RMSNorm(h) in bf16 or fp16 (the normalised value cast to y's dtype, then times the weight) against
    `expected_y`, computed from the kernel's own h so that a one-ulp difference in h is not counted twice. Each of
    the two roundings can land one ulp away from eager's: the normalised value's because the kernel sums the
    squares in another order (a value near a rounding tie goes the other way) and, on the CPU, because Triton's
    interpreter truncates fp32 -> bf16 casts; the product's because of that or on its own. The bound: |w| ulps of
    the normalised value carried through the multiply, plus one ulp of the product (two of y's near a power of
    two) and y's own half ulp."""
    assert not y.isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    bound = 2.5 * ulp(expected_y, y.dtype) + weight.float().abs() * ulp(normed, y.dtype)
    excess = (y.float() - expected_y.float()).abs() - bound
    assert (excess <= 0).all(), f"y exceeds the two-rounding bound by up to {excess.max().item():.3g}"


def assert_add_rms_norm_matches_eager(model, x: torch.Tensor, residual: torch.Tensor, y: torch.Tensor,
                                      h: torch.Tensor):
    """Outputs of a compiled dzc.models.decoder.AddRMSNorm (or a module with its `norm`) against eager: h within
    one bf16 ulp (the interpreter truncates the sum's cast), y within the HF RMSNorm's two-rounding bound."""
    with torch.no_grad():
        _, expected_h = model(x, residual)
        expected_y = model.norm(h)
    assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
    assert_hf_rms_norm_output_close(y, h, model.norm.weight, model.norm.variance_epsilon, expected_y)


def assert_warm_values_rebuilt(values, inductor_cache: bool) -> None:
    """A warm hit's stored fake values (dzc.compile_cache._DeferredValues) after its compile by Inductor: some but
    not all rebuilt where Inductor's FX graph cache hit (its inputs' and outputs', and what dzc read), every one
    where the cache was off."""
    tensors = [item for items in values.storages.values() for item in items]
    rebuilt = [item for item in tensors if item.value is not None]
    if inductor_cache:
        assert 0 < len(rebuilt) < len(tensors) and values.pending, (len(rebuilt), len(tensors))
    else:
        assert values.pending == {} and len(rebuilt) == len(tensors)


def run_ahead_of_time_script(script: str, tmp_path, timeout: int = 600, **env) -> list:
    """Run `script` with argv[1] = tmp_path in a fresh Python with Triton's interpreter off (set explicitly: dzc
    must not turn it on over it), as compiling for a GPU without one needs; extra environment variables from
    `env`. The script prints one line `RESULTS <json>`; returns the parsed JSON."""
    environment = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), **env)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          env=environment, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


_GPT_OSS_GEMM_SASS = """
import dataclasses, json, os, sys
from pathlib import Path
sys.path.insert(0, os.path.join(os.environ["DZC_ROOT"], "tools"))
import diagnose_mxfp4_moe_kernels as tool

spec, results = tool.bench.model_spec("gpt-oss-120b"), {}
for label, text in json.loads(os.environ["DZC_SASS_CONFIGS"]).items():
    (Path(sys.argv[1]) / label).mkdir()
    config = tool.parse_config(text)
    results[label] = dict(
        profiles=tool.static_profiles(spec, config, Path(sys.argv[1]) / label),
        shared_estimate=tool.family.triton_shared_memory_bytes(
            dataclasses.replace(spec, fp8_activations=tool.is_w4a8(config)), config))
print("RESULTS " + json.dumps(results))
"""
# Whether Triton is the one the static SASS tables of docs/mxfp4_moe_kernels.md were read from (3.9+): counts and
# shapes are checked exactly only there.
SASS_TABLES_TRITON = tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2]) >= (3, 9)


def gpt_oss_gemm_sass(tmp_path, **configs: str) -> dict:
    """label -> {"profiles": the two MXFP4 MoE GEMMs of gpt-oss-120b compiled for sm_90 with that config
    (KEY=VALUE,...: W4A8 where FP8=1) and read by `tools/diagnose_mxfp4_moe_kernels.py --sass` (its
    static_profiles), "shared_estimate": the family's shared-memory estimate for it}; no GPU needed."""
    return run_ahead_of_time_script(_GPT_OSS_GEMM_SASS, tmp_path, DZC_ROOT=str(Path(__file__).resolve().parents[1]),
                                    DZC_SASS_CONFIGS=json.dumps(configs))


def compile_tuned_and_check(model, cache_dir, tokens_list):
    """dzc.compile(model) for cuda (the Triton interpreter on CPU tensors) with tuning on, a bf16 AddRMSNorm-style
    model (x, residual -> y, h) of hidden 64 run at each token count and checked against eager, the fusion
    asserted from the report. Returns the compiled model and the last call's inputs."""
    compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(cache_dir), autotune=True))
    for tokens in tokens_list:
        x, residual = torch.randn(tokens, 64).bfloat16(), torch.randn(tokens, 64).bfloat16()
        y, h = compiled(x, residual)
        assert_add_rms_norm_matches_eager(model, x, residual, y, h)
    assert compiled.report.fired() == {"fuse_residual_norm": 1}
    return compiled, (x, residual)


def run_pass_on_capture(graph_pass, module, *inputs, dynamic=False):
    """Capture `module` as dzc does (AOTAutograd, Inductor's decompositions), run `graph_pass` on the graph and
    execute its result (dzc ops as their references, no kernels: fast): (captured GraphModule, PassResult, output
    of the rewritten graph, eager output)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    captured = []

    def rewrite(gm, _):
        result = graph_pass(gm.graph)
        captured.append((gm, result))
        return torch.fx.GraphModule(gm, result.graph)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=rewrite, inference_compiler=rewrite, decompositions=select_decomp_table())
    with torch.no_grad():
        expected = module(*inputs)
        actual = torch.compile(module, backend=backend, dynamic=dynamic)(*inputs)
    gm, result = captured[0]
    return gm, result, actual, expected
