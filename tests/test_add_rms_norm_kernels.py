"""Numerics of every generated add_rms_norm Triton kernel, in every legal config, against the op's reference.

On CPU the kernels run through Triton's interpreter (bf16 math upcast to fp32 on load; the interpreter truncates
fp32 -> bf16 casts instead of rounding to nearest even, which costs at most one bf16 ulp per rounding).
"""

import itertools

import pytest
import torch
from conftest import assert_close_for_dtype, assert_hf_rms_norm_output_close

from dzc.ops import add_rms_norm_reference
from dzc.targets import add_rms_norm as family
from dzc.targets import resolve_target, triton_codegen
from dzc.targets.launch import legal_configs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.anydevice  # every test here runs on DEVICE
SPECS = [
    family.AddRmsNormSpec(hidden, dtype, dtype, weight_dtype, dtype, dtype, sum_in_fp32, cast_before_weight)
    for hidden, dtype, (sum_in_fp32, cast_before_weight, weight_dtype) in itertools.product(
        (64, 200),
        (torch.float32, torch.float16, torch.bfloat16),
        ((False, True, None), (True, False, torch.float32)),  # HF Llama / DeepSeek rounding points
    )
]
SPECS = [s if s.weight_dtype is not None else s.__class__(**{**s.__dict__, "weight_dtype": s.x_dtype})
         for s in SPECS]


def _load(spec, profile, tmp_path):
    path = tmp_path / f"k_{abs(hash(spec))}.py"
    path.write_text(family.triton_source(spec, profile))
    return triton_codegen.load_kernel(path, family.TRITON_KERNEL_NAME)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", ","))
def test_every_legal_config_matches_reference(spec, seed, tmp_path):
    profile = resolve_target("cuda").profile
    kernel = _load(spec, profile, tmp_path)
    configs, _ = legal_configs(family, "triton", spec, profile)
    assert configs, "no legal config"
    for tokens in (1, 37):
        x = torch.randn(tokens, spec.hidden, device=DEVICE).to(spec.x_dtype)
        residual = torch.randn(tokens, spec.hidden, device=DEVICE).to(spec.residual_dtype)
        weight = torch.randn(spec.hidden, device=DEVICE).to(spec.weight_dtype)
        eps = 1e-6
        expected_y, expected_h = add_rms_norm_reference(x, residual, weight, eps, spec.sum_in_fp32,
                                                        spec.cast_before_weight, spec.out_dtype, spec.sum_dtype)
        for config in configs:
            y = torch.full_like(expected_y, float("nan"))
            h = torch.full_like(expected_h, float("nan"))
            family.triton_launch(kernel, config, x, residual, weight, eps, y, h)
            assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
            if not spec.sum_in_fp32:
                # y is a function of the rounded sum: judge it from the kernel's own h, so that a one-ulp
                # difference there (the interpreter truncates casts) is not counted twice.
                expected_y, _ = add_rms_norm_reference(h, torch.zeros_like(h), weight, eps, False,
                                                       spec.cast_before_weight, spec.out_dtype, spec.sum_dtype)
            if spec.cast_before_weight and spec.out_dtype in (torch.bfloat16, torch.float16):
                assert_hf_rms_norm_output_close(y, h, weight, eps, expected_y)
            else:
                assert_close_for_dtype(y, expected_y, max_bf16_ulps=1.0)


def test_configs_cover_large_hidden_sizes():
    """gpt-oss (2880) and DeepSeek (7168) hidden sizes get configs on every profile, MUSA ones included."""
    for name in ("cuda:sm_90", "cuda:sm_80", "musa:mp_22", "musa:mp_31"):
        profile = resolve_target(name).profile
        for hidden in (2880, 7168):
            spec = family.AddRmsNormSpec(hidden, *[torch.bfloat16] * 5, False, True)
            configs, _ = legal_configs(family, "triton", spec, profile)
            assert configs, (name, hidden)
            assert all(c["BLOCK"] >= hidden for c in configs)
