"""dzc.add_layer_norm kernels (targets/add_layer_norm.py), both code generators, against the op's reference.

CPU: every legal Triton config through the interpreter (bf16 math upcast to fp32 on load; the interpreter truncates
fp32 -> bf16/fp16 casts instead of rounding to nearest even, which costs at most one ulp per rounding); config
legality on every profile (MUSA included); Triton compiled ahead of time for sm_90 / sm_80; TileLang lowered to CUDA
and compiled with nvcc for sm_90a; a MoonViT-style encoder compiled end to end with the LayerNorm kernels bound.
GPU (marker `gpu`): both codegens' numerics and the encoder with each codegen. Seeds are printed on failure
(DZC_TEST_SEED=<seed> replays them).
"""

from __future__ import annotations

import ast
import itertools
import shutil
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import assert_close_for_dtype, run_ahead_of_time_script, ulp

import dzc
from dzc.models.vision import TINY_MOONVIT, build_vision_encoder, pack_images
from dzc.ops import add_layer_norm_reference
from dzc.lowering import Execution
from dzc.selftest import lower_op
from dzc.targets import INTERPRETER, TARGETS, resolve_target, tilelang_codegen, triton_codegen
from dzc.targets import add_layer_norm as family
from dzc.targets.add_layer_norm import AddLayerNormSpec
from dzc.targets.launch import legal_configs
from dzc.targets.legality import config_problems
from dzc.targets.profiles import SM_90

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6


def _spec(hidden, dtype, *, weight=True, bias=True, sum_in_fp32=False, sum_dtype=None):
    return AddLayerNormSpec(hidden, dtype, sum_dtype or dtype, dtype if weight else None, dtype if bias else None,
                            dtype, sum_dtype or dtype, sum_in_fp32)


def _inputs(spec: AddLayerNormSpec, tokens: int, device, generator: torch.Generator | None = None):
    """Random activations (mean and scale away from 0 and 1, so a wrong mean or variance shows), a weight around 1
    and a random bias."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    x = (0.5 + 2 * randn(tokens, spec.hidden)).to(spec.x_dtype)
    residual = randn(tokens, spec.hidden).to(spec.residual_dtype)
    weight = (1 + 0.1 * randn(spec.hidden)).to(spec.weight_dtype) if spec.weight_dtype else None
    bias = (0.1 * randn(spec.hidden)).to(spec.bias_dtype) if spec.bias_dtype else None
    return x, residual, weight, bias


def _reference(spec: AddLayerNormSpec, x, residual, weight, bias):
    return add_layer_norm_reference(x, residual, weight, bias, EPS, spec.sum_in_fp32, spec.out_dtype,
                                    spec.sum_dtype)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    """NaN-filled output: an element the kernel never writes cannot match the reference."""
    return torch.full_like(like, float("nan"))


# ---------------------------------------------------------------------------------------------------------
# Triton through the interpreter: every legal config


INTERPRETER_SPECS = {
    # 80: MoonViT-like head-sized rows (not a power of two: BLOCK 128 is masked); 200 and 48 likewise.
    "fp32-80": _spec(80, FP32),
    "fp16-80-weight-only": _spec(80, FP16, bias=False),
    "bf16-80": _spec(80, BF16),
    "bf16-200-fp32-sum": _spec(200, BF16, sum_in_fp32=True),
    "fp16-48-no-affine": _spec(48, FP16, weight=False, bias=False),
    "bf16-bias-only-fp32-residual": _spec(96, BF16, weight=False, sum_dtype=FP32, sum_in_fp32=True),
}


def _load_triton(spec, profile, tmp_path):
    path = tmp_path / f"add_layer_norm_{abs(hash(spec))}.py"
    path.write_text(family.triton_source(spec, profile))
    return triton_codegen.load_kernel(path, family.TRITON_KERNEL_NAME)


def _check_triton_outputs(spec, x, residual, weight, bias, y, h):
    expected_y, expected_h = _reference(spec, x, residual, weight, bias)
    assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
    if not spec.sum_in_fp32:
        # y is a function of the rounded sum: judged from the kernel's own h, so that a one-ulp difference there
        # (the interpreter truncates casts) is not counted twice.
        expected_y, _ = add_layer_norm_reference(h, torch.zeros_like(h), weight, bias, EPS, False, spec.out_dtype,
                                                 spec.sum_dtype)
    if bias is None or y.dtype != torch.bfloat16:
        assert_close_for_dtype(y, expected_y, max_bf16_ulps=1.0)
        return
    # y = normed·w + b in fp32, rounded once. Where the two terms nearly cancel, y is far smaller than they are and
    # the fp32 terms (the kernel sums the row's statistics in another order) differ from the reference's by
    # fractions of the terms' own ulps, not y's (seed 1663769186: y 4e-7 from terms of 0.025, 8 of y's ulps). So
    # one bf16 ulp of the larger of |y| and |b|.
    assert not y.isnan().any(), "NaN in the output: an element was not written (outputs are poisoned)"
    scale = torch.maximum(expected_y.float().abs(), bias.float().abs().expand_as(expected_y))
    worst = ((y.float() - expected_y.float()).abs() / ulp(scale)).max().item()
    assert worst <= 1.0, f"{worst} bf16 ulps (of max(|y|, |b|)) apart"


@pytest.mark.parametrize("spec_id", INTERPRETER_SPECS)
def test_every_legal_triton_config_matches_reference(spec_id, seed, tmp_path):
    spec = INTERPRETER_SPECS[spec_id]
    profile = resolve_target("cuda").profile
    kernel = _load_triton(spec, profile, tmp_path)
    configs, _ = legal_configs(family, "triton", spec, profile)
    assert len(configs) > 1, "a config space to tune over"
    for tokens in (1, 37):  # 37: partial last program for every ROWS > 1
        x, residual, weight, bias = _inputs(spec, tokens, "cpu")
        for config in configs:
            y = _poisoned(torch.empty(tokens, spec.hidden, dtype=spec.out_dtype))
            h = _poisoned(torch.empty(tokens, spec.hidden, dtype=spec.sum_dtype))
            family.triton_launch(kernel, config, x, residual, weight, bias, EPS, y, h)
            _check_triton_outputs(spec, x, residual, weight, bias, y, h)


@pytest.mark.parametrize("hidden", (1152, 1280))
def test_vision_widths_through_the_op(hidden, seed, tmp_path):
    """MoonViT's and Qwen2.5-VL's widths (1152 pads to a 2048 block), 3-D activations with a strided residual,
    bound as lowering binds them (dzc-selftest's path: the op with a kernel_id)."""
    target = resolve_target("cuda")
    options = dzc.CompileOptions(codegen="triton", autotune=False, cache_dir=str(tmp_path))
    x = (0.5 + 2 * torch.randn(2, 3, hidden)).bfloat16()
    residual = torch.randn(2, 3, 2 * hidden).bfloat16()[..., :hidden]  # rows of a wider buffer
    weight, bias = (1 + 0.1 * torch.randn(hidden)).bfloat16(), (0.1 * torch.randn(hidden)).bfloat16()
    args = (x, residual, weight, bias, EPS, False, BF16, BF16)
    record, spec = lower_op("add_layer_norm", args, target, options, Execution(INTERPRETER))
    assert record.codegen == "triton" and spec.hidden == hidden and spec.block == 2048
    y, h = torch.ops.dzc.add_layer_norm.default(*args, kernel_id=record.kernel_id)
    assert y.shape == h.shape == x.shape and y.is_contiguous()
    _check_triton_outputs(spec, x.reshape(-1, hidden), residual.reshape(-1, hidden), weight, bias,
                          y.reshape(-1, hidden), h.reshape(-1, hidden))


def test_prepare_refuses_arguments_the_kernel_was_not_built_for():
    spec = _spec(64, FP32, bias=False)
    x, residual, weight, _ = _inputs(spec, 3, "cpu")
    with pytest.raises(ValueError, match="got bias \\(64,\\)"):
        family.prepare(spec, x, residual, weight, torch.randn(64), EPS)
    with pytest.raises(ValueError, match="got weight None"):
        family.prepare(spec, x, residual, None, None, EPS)
    with pytest.raises(ValueError, match="got weight \\(32,\\)"):
        family.prepare(spec, x, residual, torch.randn(32), None, EPS)
    with pytest.raises(ValueError, match="residual \\(3, 32\\)"):
        family.prepare(spec, x, residual[:, :32], weight, None, EPS)


# ---------------------------------------------------------------------------------------------------------
# Config legality on every profile, both codegens


LEGALITY_SPECS = [_spec(hidden, dtype, weight=weight, bias=bias)
                  for hidden, dtype, (weight, bias) in itertools.product(
                      (80, 1152, 1280, 8192), (BF16, FP16, FP32), ((True, True), (False, False)))]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_emitted_config_is_legal(name):
    profile = TARGETS[name].profile
    for spec in LEGALITY_SPECS:
        for codegen in ("triton", "tilelang"):
            where = (name, codegen, spec.describe())
            emitted = getattr(family, f"{codegen}_configs")(spec, profile)
            legal, illegal = legal_configs(family, codegen, spec, profile)
            assert legal and len(legal) + illegal == len(emitted), where
            smem = getattr(family, f"{codegen}_shared_memory_bytes")
            for config in legal:
                threads = config.num_warps * profile.warp_size
                assert config_problems(profile, threads=threads, num_warps=config.num_warps if codegen == "triton"
                                       else None, shared_memory_bytes=smem(spec, config), dtypes=spec.dtypes) == []
                # The same facts, checked independently of config_problems.
                assert threads <= profile.max_threads_per_block and config.num_warps <= profile.max_num_warps, where
                assert smem(spec, config) <= profile.shared_memory_per_block, where
                if codegen == "triton":
                    assert config["BLOCK"] >= spec.hidden, where
                else:
                    assert config["THREADS"] == threads, where
            # The untuned default must be one the tuner could also have picked.
            assert getattr(family, f"{codegen}_default_config")(spec, profile) in legal, where


# ---------------------------------------------------------------------------------------------------------
# Triton ahead of time (no GPU)


_AOT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path

    import torch
    import dzc
    from dzc.targets import add_layer_norm as family, triton_codegen
    from dzc.targets.launch import legal_configs
    from dzc.targets.profiles import SM_80, SM_90

    assert not triton_codegen.interpreting()
    out = Path(sys.argv[1])
    bf16 = torch.bfloat16
    results = []
    # (profile, hidden, weight and bias?, sum_in_fp32, which config): defaults and the widest legal configs; no
    # weight and bias (None pointers, constexpr); the fp32 sum; a row of 8192.
    for profile, hidden, affine, sum_in_fp32, which in (
            (SM_90, 1152, True, False, "default"), (SM_90, 1152, True, False, "last"),
            (SM_90, 1280, False, True, "default"), (SM_90, 80, True, False, "last"),
            (SM_80, 8192, True, True, "last")):
        spec = family.AddLayerNormSpec(hidden, bf16, bf16, bf16 if affine else None, bf16 if affine else None,
                                       bf16, bf16, sum_in_fp32)
        legal, _ = legal_configs(family, "triton", spec, profile)
        config = family.triton_default_config(spec, profile) if which == "default" else legal[-1]
        path = out / f"add_layer_norm_{profile.arch}_{hidden}_{affine}.py"
        path.write_text(family.triton_source(spec, profile))
        kernel = triton_codegen.compile_ahead_of_time(path, family.TRITON_KERNEL_NAME,
                                                      *family.triton_signature(spec, config),
                                                      num_warps=config.num_warps, profile=profile)
        results.append(dict(profile=profile.name, hidden=hidden, config=str(config), legal=config in legal,
                            num_warps=config.num_warps, estimate=family.triton_shared_memory_bytes(spec, config),
                            limit=profile.shared_memory_per_block, shared=kernel.metadata.shared,
                            compiled_warps=kernel.metadata.num_warps, arch=kernel.metadata.target.arch,
                            ptx_target=".target sm_%d" % profile.compute_capability in kernel.asm["ptx"]))
    print("RESULTS " + json.dumps(results))
""")


def test_triton_kernels_compile_ahead_of_time(tmp_path):
    results = run_ahead_of_time_script(_AOT_SCRIPT, tmp_path, timeout=300, TRITON_DEFAULT_FP_FUSION="1")
    assert len(results) == 5
    for r in results:
        assert r["legal"] and r["ptx_target"], r
        assert r["compiled_warps"] == r["num_warps"], r
        assert r["arch"] == {"cuda:sm_90": 90, "cuda:sm_80": 80}[r["profile"]], r
        # The legality check's shared-memory estimate must not undercount what Triton allocates.
        assert r["shared"] <= r["estimate"] <= r["limit"], r


# ---------------------------------------------------------------------------------------------------------
# TileLang: source, lowering to CUDA, nvcc (no GPU)


TILELANG_SPECS = {
    "bf16-1152": _spec(1152, BF16),  # padded to whole 16-byte vectors per thread
    "bf16-1280-fp32-sum": _spec(1280, BF16, sum_in_fp32=True),
    "fp16-80-weight-only": _spec(80, FP16, bias=False),
    "fp32-200-no-affine": _spec(200, FP32, weight=False, bias=False),
}

requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tilelang_add_layer_norm")


def _tilelang_path(directory: Path, spec_id: str, profile) -> Path:
    path = directory / f"add_layer_norm_{spec_id.replace('-', '_')}_{profile.arch}.py"
    if not path.exists():
        path.write_text(family.tilelang_source(TILELANG_SPECS[spec_id], profile))
    return path


@pytest.fixture(scope="module")
def lowered(source_dir):
    """lowered(spec_id, config) -> TileLang's artifact for sm_90; each lowering runs once per module."""
    artifacts = {}

    def lower(spec_id, config):
        if (spec_id, config) not in artifacts:
            artifacts[spec_id, config] = tilelang_codegen.lower(_tilelang_path(source_dir, spec_id, SM_90),
                                                                family.TILELANG_FACTORY_NAME, config, SM_90)
        return artifacts[spec_id, config]

    return lower


@pytest.mark.parametrize("spec_id", TILELANG_SPECS)
def test_tilelang_source_takes_only_the_parameters_the_layer_norm_has(spec_id):
    spec = TILELANG_SPECS[spec_id]
    source = family.tilelang_source(spec, SM_90)
    module = ast.parse(source)
    assert "do not edit" in ast.get_docstring(module) and "$" not in source
    (factory,) = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == family.TILELANG_FACTORY_NAME]
    assert [arg.arg for arg in factory.args.args] == ["threads", "rows"]
    (prim_func,) = [n for n in ast.walk(factory) if isinstance(n, ast.FunctionDef) and n.name == "add_layer_norm"]
    expected = ["x", "residual"] + ["weight"] * (spec.weight_dtype is not None) + \
        ["bias"] * (spec.bias_dtype is not None) + ["y", "h", "eps"]
    assert [arg.arg for arg in prim_func.args.args] == expected


@pytest.mark.parametrize("spec_id", TILELANG_SPECS)
def test_tilelang_default_config_lowers_to_cuda(spec_id, lowered):
    spec = TILELANG_SPECS[spec_id]
    config = family.tilelang_default_config(spec, SM_90)
    artifact = lowered(spec_id, config)
    cuda_source = artifact.kernel_source
    assert "__global__" in cuda_source and "float eps" in cuda_source and "int tokens" in cuda_source
    assert ("weight" in cuda_source) == (spec.weight_dtype is not None)
    assert ("bias" in cuda_source) == (spec.bias_dtype is not None)
    assert cuda_source.count("tl::AllReduce<tl::SumOp") == 2, "the mean, then the variance"
    (device_func,) = artifact.device_mod.functions.values()
    assert int(device_func.attrs.get("dyn_shared_memory_buf", 0)) <= family.tilelang_shared_memory_bytes(spec, config)


@requires_nvcc
@pytest.mark.slow
def test_tilelang_cuda_compiles_with_nvcc_for_sm_90a(lowered, tmp_path):
    """The default config of the MoonViT width, and a several-rows-per-block config (partial blocks)."""
    from concurrent.futures import ThreadPoolExecutor

    rows_config = max(family.tilelang_configs(TILELANG_SPECS["fp16-80-weight-only"], SM_90), key=lambda c: c["ROWS"])
    assert rows_config["ROWS"] > 1
    cases = (("bf16-1152", family.tilelang_default_config(TILELANG_SPECS["bf16-1152"], SM_90)),
             ("fp16-80-weight-only", rows_config))
    with ThreadPoolExecutor(2) as nvcc:  # each nvcc beside the next lowering and the other: the CI machine's 2 cores
        objects = [nvcc.submit(tilelang_codegen.nvcc_compile, lowered(spec_id, config).kernel_source, SM_90, tmp_path)
                   for spec_id, config in cases]
        for compiled in objects:
            assert compiled.result().stat().st_size > 0


class RecordingKernels:
    """Stands in for tilelang_codegen.load's result: records what the launcher hands the kernel."""

    def __init__(self):
        self.calls = []

    def kernel_for(self, config):
        return lambda *args: self.calls.append((config, args))


def test_tilelang_launch_passes_only_present_parameters():
    config = family.tilelang_default_config(TILELANG_SPECS["fp16-80-weight-only"], SM_90)
    x, residual, weight = torch.randn(3, 80), torch.randn(3, 80), torch.randn(80)
    y, h = torch.empty(3, 80), torch.empty(3, 80)
    kernels = RecordingKernels()
    family.tilelang_launch(kernels, config, x, residual, weight, None, EPS, y, h)
    family.tilelang_launch(kernels, config, x, residual, None, None, EPS, y, h)
    (_, with_weight), (_, without) = kernels.calls
    assert with_weight[2] is weight and len(with_weight) == 6 and len(without) == 5
    assert with_weight[-1] == EPS and isinstance(with_weight[-1], float)
    # A strided output: the kernel writes a dense temporary (copied back after the launch; see
    # tests/test_tilelang_launch_alignment.py).
    family.tilelang_launch(kernels, config, x, residual, weight, None, EPS, torch.empty(6, 80)[::2], h)
    (_, strided_y) = kernels.calls[-1]
    assert strided_y[3].is_contiguous() and strided_y[3].shape == (3, 80) and strided_y[4] is h


# ---------------------------------------------------------------------------------------------------------
# A MoonViT-style encoder end to end


def _compile_encoder(cfg, dtype, device, options):
    model = build_vision_encoder(cfg, dtype).to(device)
    compiled = dzc.compile(model, "cuda", options)
    pack = pack_images([(2, 4), (4, 2), (2, 2)], cfg, dtype, generator=torch.Generator().manual_seed(3))
    inputs = [t.to(device) for t in pack.inputs()]
    with torch.no_grad():
        return compiled(*inputs), model(*inputs), compiled.report


def _assert_layer_norm_kernels(report, cfg, codegen):
    # Per block: the attention residual into norm2; the last block's output into the merger's norm.
    assert report.passes["fuse_residual_norm"] == 2 * cfg.layers
    norm_kernels = [k for k in report.kernels if k.op == "add_layer_norm"]
    assert norm_kernels and all(k.codegen == codegen for k in norm_kernels), report.kernels
    assert sum(k.uses for k in norm_kernels) == 2 * cfg.layers
    assert "reference" not in {k.codegen for k in report.kernels}


def test_moonvit_encoder_runs_the_layer_norm_kernels(options):
    cfg = replace(TINY_MOONVIT, attention="mask", layers=1)
    actual, expected, report = _compile_encoder(cfg, torch.float32, "cpu", options)
    _assert_layer_norm_kernels(report, cfg, "triton")
    assert all(k.execution == "triton interpreter (cpu)" for k in report.kernels if k.op == "add_layer_norm")
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# On a CUDA GPU: both codegens


GPU_SPECS = {
    "bf16-1152": _spec(1152, BF16),
    "bf16-1280-fp32-sum": _spec(1280, BF16, sum_in_fp32=True),
    "bf16-8192-no-affine": _spec(8192, BF16, weight=False, bias=False),
    "fp16-80-weight-only": _spec(80, FP16, bias=False),
    "fp32-200": _spec(200, FP32),
    "bf16-fp32-residual": _spec(1152, BF16, sum_dtype=FP32, sum_in_fp32=True),
}
GPU_TOKENS = (1, 7, 300, 4097)


def _gpu_profile():
    major, _ = torch.cuda.get_device_capability()
    return {9: TARGETS["cuda:sm_90"], 8: TARGETS["cuda:sm_80"]}[major].profile


def _gpu_check(spec, launch, configs, seed):
    """Each config × token count on fresh inputs, NaN-poisoned outputs; on the GPU casts round to nearest even
    like torch, so h is exact and y within one ulp (reduction order)."""
    for config, tokens in itertools.product(configs, GPU_TOKENS):
        x, residual, weight, bias = _inputs(spec, tokens, "cuda", torch.Generator().manual_seed(seed + tokens))
        y = _poisoned(torch.empty(tokens, spec.hidden, dtype=spec.out_dtype, device="cuda"))
        h = _poisoned(torch.empty(tokens, spec.hidden, dtype=spec.sum_dtype, device="cuda"))
        launch(config, x, residual, weight, bias, EPS, y, h)
        expected_y, expected_h = _reference(spec, x, residual, weight, bias)
        where = f"{spec.describe()} {config} tokens={tokens} seed={seed}"
        torch.testing.assert_close(h, expected_h, atol=0, rtol=0, msg=lambda m: f"h, {where}: {m}")
        try:
            if y.dtype == torch.bfloat16:
                _assert_layer_norm_close(y, expected_y, h, weight, bias)
            else:
                assert_close_for_dtype(y, expected_y, max_bf16_ulps=1.0)
        except AssertionError as err:
            raise AssertionError(f"y, {where}: {err}") from err


def _assert_layer_norm_close(y, expected_y, h, weight, bias):
    """At most one bf16 ulp at the magnitude of the terms each output sums, |normed * weight| + |bias|, plus the
    noise of the fp32 statistics: a centred output near zero is the difference of such terms, and kernel and
    reference each sum the row's N fp32 values in their own order, so their means differ by about sqrt(N) fp32
    ulps of the row's magnitude (observed: a few 1e-6 at N = 8192), which such an output shows in full. A wrong
    statistic (mean, variance, eps placement) is off by orders of magnitude more."""
    hf = h.float()
    centred = hf - hf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + EPS)
    scale = weight.float().abs() if weight is not None else 1.0
    terms = (centred * rstd).abs() * scale + (bias.float().abs() if bias is not None else 0.0)
    statistics_noise = (4 * hf.shape[-1] ** 0.5 * torch.finfo(torch.float32).eps
                        * hf.abs().mean(-1, keepdim=True) * rstd * scale)
    allowed = ulp(terms.clamp_min(expected_y.float().abs())) + statistics_noise
    worst = ((y.float() - expected_y.float()).abs() / allowed).max()
    assert worst <= 1.0, f"{worst.item()} x (one bf16 ulp at the terms' magnitude + the statistics' fp32 noise)"


@pytest.mark.gpu
@pytest.mark.parametrize("spec_id", GPU_SPECS)
def test_triton_kernel_matches_reference_on_gpu(spec_id, seed, tmp_path):
    spec = GPU_SPECS[spec_id]
    profile = _gpu_profile()
    path = tmp_path / "kernel.py"
    path.write_text(family.triton_source(spec, profile))
    kernel = triton_codegen.load(family, path, spec, profile)
    legal, _ = legal_configs(family, "triton", spec, profile)
    # The default, the most rows per program (partial last programs) and the most warps (cross-warp reductions).
    tested = {family.triton_default_config(spec, profile), max(legal, key=lambda c: (c["ROWS"], c.num_warps)),
              max(legal, key=lambda c: (c.num_warps, c["ROWS"]))}
    _gpu_check(spec, lambda *args: family.triton_launch(kernel, *args), sorted(tested, key=str), seed)


@pytest.mark.gpu
@pytest.mark.parametrize("spec_id", GPU_SPECS)
def test_tilelang_kernel_matches_reference_on_gpu(spec_id, seed, tmp_path):
    spec = GPU_SPECS[spec_id]
    profile = _gpu_profile()
    path = tmp_path / "kernel.py"
    path.write_text(family.tilelang_source(spec, profile))
    kernels = tilelang_codegen.load(family, path, spec, profile)
    # The default; for two specs also the config with the most rows per block (partial last blocks exercise the
    # row masks). Each TileLang config is a ~10 s compile.
    tested = {family.tilelang_default_config(spec, profile)}
    if spec_id in ("bf16-1152", "fp16-80-weight-only"):
        tested.add(max(family.tilelang_configs(spec, profile), key=lambda c: c["ROWS"]))
    _gpu_check(spec, lambda *args: family.tilelang_launch(kernels, *args), sorted(tested, key=str), seed)


@pytest.mark.gpu
@pytest.mark.parametrize("codegen", ["triton", "tilelang"])
def test_moonvit_encoder_on_gpu(codegen, tmp_path):
    """Head dim 80 (real attention kernels), bf16, each codegen for every op."""
    cfg = replace(TINY_MOONVIT, hidden=160, heads=2, attention="mask")
    options = dzc.CompileOptions(codegen=codegen, cache_dir=str(tmp_path), autotune=False)
    actual, expected, report = _compile_encoder(cfg, BF16, "cuda", options)
    _assert_layer_norm_kernels(report, cfg, codegen)
    torch.testing.assert_close(actual.float(), expected.float(), atol=5e-2, rtol=5e-2)
