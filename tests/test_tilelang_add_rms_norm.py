"""TileLang add_rms_norm: render, config legality on every profile, lowering + nvcc for CUDA, the MUSA error, and
(on a CUDA GPU) numerics against add_rms_norm_reference.

Without a GPU, TileLang kernels can only be lowered and compiled (it has no interpreter), so numerics run only
under the `gpu` marker. GPU inputs are drawn from a fresh seed each run; the seed is in every failure message,
and DZC_TEST_SEED=<seed> replays it.
"""

from __future__ import annotations

import ast
import os
import secrets
import shutil
from pathlib import Path

import pytest
import torch

from dzc.ops import add_rms_norm_reference
from dzc.targets import add_rms_norm, tilelang_codegen
from dzc.targets.add_rms_norm import AddRmsNormSpec
from dzc.targets.legality import config_problems
from dzc.targets.profiles import MP_22, MP_31, SM_80, SM_90

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _same_dtype_spec(hidden: int, dtype: torch.dtype, sum_in_fp32: bool, cast_before_weight: bool):
    return AddRmsNormSpec(hidden, dtype, dtype, dtype, dtype, dtype, sum_in_fp32, cast_before_weight)


# Flag pairs: (sum_in_fp32, cast_before_weight) as DeepSeek computes it, and as HF Llama-style code does.
DEEPSEEK, HF = (True, False), (False, True)
SPECS = {
    "bf16-2880-deepseek": _same_dtype_spec(2880, BF16, *DEEPSEEK),  # 2880 rows need column padding
    "bf16-2880-hf": _same_dtype_spec(2880, BF16, *HF),
    "bf16-7168-deepseek": _same_dtype_spec(7168, BF16, *DEEPSEEK),
    "bf16-7168-hf": _same_dtype_spec(7168, BF16, *HF),
    "fp16-64-hf": _same_dtype_spec(64, FP16, *HF),
    "fp32-64-deepseek": _same_dtype_spec(64, FP32, *DEEPSEEK),
    # DeepSeek keeps the residual stream in fp32 while activations are bf16.
    "bf16-fp32residual-7168": AddRmsNormSpec(7168, BF16, FP32, BF16, BF16, FP32, *DEEPSEEK),
}
PROFILES = {p.name: p for p in (SM_90, SM_80, MP_22, MP_31)}
CUDA_PROFILES = {p.name: p for p in (SM_90, SM_80)}

# nvcc takes ~10 s per source: two sources for both CUDA profiles. One is a default config (its lowering is
# shared with test_default_config_lowers_to_cuda); the other has several rows per block, whose lowering is slow.
NVCC_CASES = {
    "bf16-2880-hf-default": ("bf16-2880-hf", None),
    "fp16-64-hf-32x2": ("fp16-64-hf", dict(THREADS=32, ROWS=2)),
}

requires_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tilelang_add_rms_norm")


def write_source(directory: Path, spec_id: str, profile) -> Path:
    """The rendered module for (spec, profile), written once; TileLang needs its prim_funcs in real files."""
    path = directory / f"add_rms_norm_{spec_id.replace('-', '_')}_{profile.arch}.py"
    if not path.exists():
        path.write_text(add_rms_norm.tilelang_source(SPECS[spec_id], profile))
    return path


@pytest.fixture(scope="module")
def lowered(source_dir):
    """lowered(spec_id, profile, config) -> TileLang's artifact; each lowering runs once per module."""
    artifacts = {}

    def lower(spec_id: str, profile, config):
        key = spec_id, profile.name, config
        if key not in artifacts:
            artifacts[key] = tilelang_codegen.lower(write_source(source_dir, spec_id, profile),
                                                    add_rms_norm.TILELANG_FACTORY_NAME, config, profile)
        return artifacts[key]

    return lower


def find_config(spec_id: str, profile, params: dict | None):
    """The emitted config with these params, or the default for None (tests use only configs really offered)."""
    if params is None:
        return add_rms_norm.tilelang_default_config(SPECS[spec_id], profile)
    for config in add_rms_norm.tilelang_configs(SPECS[spec_id], profile):
        if dict(config.params) == params:
            return config
    raise AssertionError(f"{spec_id} on {profile.name} emits no config {params}")


def dynamic_shared_memory_bytes(artifact) -> int:
    """The dynamic shared memory the lowered kernel asks for at launch (absent when it needs none)."""
    (device_func,) = artifact.device_mod.functions.values()
    return int(device_func.attrs.get("dyn_shared_memory_buf", 0))


# ---------------------------------------------------------------------------------------------------------
# Rendering and configs (no TileLang import needed)


@pytest.mark.parametrize("spec_id", SPECS)
def test_source_is_a_readable_module_with_the_factory(spec_id):
    source = add_rms_norm.tilelang_source(SPECS[spec_id], SM_90)
    module = ast.parse(source)
    docstring = ast.get_docstring(module)
    assert "do not edit" in docstring and "cuda:sm_90" in docstring and str(SPECS[spec_id].hidden) in docstring
    (factory,) = [node for node in module.body if isinstance(node, ast.FunctionDef)
                  and node.name == add_rms_norm.TILELANG_FACTORY_NAME]
    assert [arg.arg for arg in factory.args.args] == ["threads", "rows"]
    assert "$" not in source


@pytest.mark.parametrize("profile", PROFILES.values(), ids=PROFILES)
@pytest.mark.parametrize("spec_id", SPECS)
def test_every_emitted_config_is_legal(spec_id, profile):
    spec = SPECS[spec_id]
    configs = add_rms_norm.tilelang_configs(spec, profile)
    assert configs, f"no TileLang config for {spec_id} on {profile.name}"
    for config in configs:
        threads = config["THREADS"]
        assert config.num_warps * profile.warp_size == threads, config
        problems = config_problems(profile, threads=threads, num_warps=None,
                                   shared_memory_bytes=add_rms_norm.tilelang_shared_memory_bytes(spec, config),
                                   dtypes=spec.dtypes)
        assert not problems, f"{config}: {problems}"
    assert add_rms_norm.tilelang_default_config(spec, profile) in configs


class RecordingKernels:
    """Stands in for tilelang_codegen.load's result: records what the launcher hands the kernel."""

    def __init__(self):
        self.calls = []

    def kernel_for(self, config):
        return lambda *args: self.calls.append((config, args))


def test_launch_hands_the_kernel_dense_rows():
    spec = SPECS["fp32-64-deepseek"]
    config = add_rms_norm.tilelang_default_config(spec, SM_90)
    x = torch.randn(3, 2 * spec.hidden)[:, :spec.hidden]  # rows of a wider buffer
    residual, weight = torch.randn(3, spec.hidden), torch.randn(spec.hidden)
    y, h = torch.empty(3, spec.hidden), torch.empty(3, spec.hidden)
    kernels = RecordingKernels()
    add_rms_norm.tilelang_launch(kernels, config, x, residual, weight, 1e-6, y, h)
    ((used_config, (x_arg, residual_arg, weight_arg, y_arg, h_arg, eps_arg)),) = kernels.calls
    assert used_config == config
    assert x_arg.is_contiguous() and torch.equal(x_arg, x)
    assert residual_arg is residual and weight_arg is weight and y_arg is y and h_arg is h
    assert eps_arg == 1e-6 and isinstance(eps_arg, float)
    # A strided output: the kernel writes a dense temporary (copied back after the launch; see
    # tests/test_tilelang_launch_alignment.py).
    add_rms_norm.tilelang_launch(kernels, config, x, residual, weight, 1e-6, torch.empty(6, 64)[::2], h)
    (_, (*_, y_temporary, h_arg, _)) = kernels.calls[-1]
    assert y_temporary.is_contiguous() and y_temporary.shape == (3, 64) and h_arg is h


# ---------------------------------------------------------------------------------------------------------
# Lowering (TileLang, no GPU)


@pytest.mark.parametrize("profile", CUDA_PROFILES.values(), ids=CUDA_PROFILES)
@pytest.mark.parametrize("spec_id", SPECS)
def test_default_config_lowers_to_cuda(spec_id, profile, lowered):
    spec = SPECS[spec_id]
    config = add_rms_norm.tilelang_default_config(spec, profile)
    artifact = lowered(spec_id, profile, config)
    cuda_source = artifact.kernel_source
    assert "__global__" in cuda_source
    # eps stays a run-time argument and the token count a dynamic one: one kernel for every batch.
    assert "float eps" in cuda_source and "int tokens" in cuda_source
    assert dynamic_shared_memory_bytes(artifact) <= add_rms_norm.tilelang_shared_memory_bytes(spec, config)


@pytest.mark.parametrize("profile", (MP_22, MP_31), ids=lambda p: p.name)
def test_musa_lowering_names_the_tilelang_musa_fork(profile, source_dir):
    if "musa" in tilelang_codegen.installed_target_kinds():
        pytest.skip("a TileLang with a MUSA backend is installed")
    config = add_rms_norm.tilelang_default_config(SPECS["bf16-7168-hf"], profile)
    with pytest.raises(RuntimeError, match="tilelang_musa"):
        tilelang_codegen.lower_to_device_source(write_source(source_dir, "bf16-7168-hf", profile),
                                                add_rms_norm.TILELANG_FACTORY_NAME, config, profile)


@pytest.fixture(scope="module")
def nvcc_objects(lowered, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(nvcc case, profile name) -> object file, for every NVCC_CASES entry on both CUDA profiles."""
    from concurrent.futures import ThreadPoolExecutor

    workdir = tmp_path_factory.mktemp("nvcc")
    objects = {}
    with ThreadPoolExecutor(2) as nvcc:  # two nvcc at a time, beside the lowerings: the CI machine has two cores
        for case, (spec_id, params) in NVCC_CASES.items():
            for profile in CUDA_PROFILES.values():
                cuda_source = lowered(spec_id, profile, find_config(spec_id, profile, params)).kernel_source
                objects[case, profile.name] = nvcc.submit(tilelang_codegen.nvcc_compile, cuda_source, profile,
                                                          workdir)
    return {key: compiled.result() for key, compiled in objects.items()}


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("profile_name", CUDA_PROFILES)
@pytest.mark.parametrize("case", NVCC_CASES)
def test_lowered_cuda_compiles_with_nvcc(case, profile_name, nvcc_objects):
    object_path = nvcc_objects[case, profile_name]
    assert object_path.stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------
# Numerics on a CUDA GPU

TOKEN_COUNTS = (1, 7, 64, 300)
TOLERANCES = {FP32: 1e-5, FP16: 1e-3, BF16: 2**-7}  # atol = rtol: about one ulp of values near 1


def gpu_profile():
    major, _minor = torch.cuda.get_device_capability()
    profiles = {9: SM_90, 8: SM_80}
    if major not in profiles:
        pytest.skip(f"no dzc CUDA profile for compute capability {major}.x")
    return profiles[major]


def random_inputs(spec: AddRmsNormSpec, tokens: int, seed: int, device: str, x_row_stride: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    # Sliced on the device: .to() would make a strided tensor dense.
    x = torch.randn(tokens, x_row_stride or spec.hidden, generator=generator).to(device, spec.x_dtype)
    residual = torch.randn(tokens, spec.hidden, generator=generator)
    weight = 1 + 0.1 * torch.randn(spec.hidden, generator=generator)
    return (x[:, :spec.hidden], residual.to(device, spec.residual_dtype), weight.to(device, spec.weight_dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec_id", SPECS)
def test_kernel_matches_reference_on_gpu(spec_id, source_dir):
    spec = SPECS[spec_id]
    profile = gpu_profile()
    kernels = tilelang_codegen.load(add_rms_norm, write_source(source_dir, spec_id, profile), spec, profile)
    configs = add_rms_norm.tilelang_configs(spec, profile)
    # The default, and the config with the most rows per block (partial last blocks exercise the row masks).
    tested = {add_rms_norm.tilelang_default_config(spec, profile), max(configs, key=lambda c: c["ROWS"])}
    base_seed = int(os.environ.get("DZC_TEST_SEED", secrets.randbits(31)))
    tolerance = TOLERANCES[spec.out_dtype]
    for config in tested:
        for tokens in TOKEN_COUNTS:
            seed = base_seed + tokens
            # A row stride wider than hidden checks that strided inputs still read the right elements.
            x_row_stride = spec.hidden + 64 if tokens == 7 else None
            x, residual, weight = random_inputs(spec, tokens, seed, "cuda", x_row_stride)
            eps = 1e-6
            # NaN-poisoned outputs: an element the kernel never writes cannot match the reference.
            y = torch.full((tokens, spec.hidden), float("nan"), dtype=spec.out_dtype, device="cuda")
            h = torch.full((tokens, spec.hidden), float("nan"), dtype=spec.sum_dtype, device="cuda")
            add_rms_norm.tilelang_launch(kernels, config, x, residual, weight, eps, y, h)
            expected_y, expected_h = add_rms_norm_reference(
                x, residual, weight, eps, spec.sum_in_fp32, spec.cast_before_weight, spec.out_dtype, spec.sum_dtype)
            where = f"{spec_id} {config} tokens={tokens} seed={seed} (DZC_TEST_SEED={base_seed})"
            torch.testing.assert_close(h, expected_h, atol=0, rtol=0, msg=lambda m: f"h, {where}: {m}")
            torch.testing.assert_close(y, expected_y, atol=tolerance, rtol=tolerance,
                                       msg=lambda m: f"y, {where}: {m}")
