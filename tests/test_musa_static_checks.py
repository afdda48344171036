"""Static validation of MUSA kernels without a MUSA card: every kernel of every family with self-test cases is
legal for mp_22 and mp_31 (configs and source), the checker catches what MUSA Triton builds and TileLang-MUSA
reject, the compile environment asks for SQMMA only where it applies, and golden sources pin what add_rms_norm
emits for mp_22 and mp_31.

Regenerate the golden files after an intended template change:  python tests/test_musa_static_checks.py --update
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dzc.lowering import PREFERRED_CODEGENS, Execution, NoLegalConfig
from dzc.options import CompileOptions
from dzc.selftest import lower_op
from dzc.targets import KERNEL_FAMILIES, TARGETS, add_rms_norm, musa_triton, static_check
from dzc.targets.launch import legal_configs
from dzc.targets.profiles import MP_22, MP_31, SM_90

GOLDEN = Path(__file__).parent / "golden" / "musa"
MUSA_PROFILES = {p.name: p for p in (MP_22, MP_31)}
FAMILIES_WITH_CASES = sorted(name for name, family in KERNEL_FAMILIES.items() if hasattr(family, "selftest_cases"))
# Ops that exist only where the profile has native E4M3 (mp_31, not mp_22): lowering them elsewhere must say so.
NEEDS_FP8 = {"mxfp4_moe_w4a8"}


@pytest.mark.parametrize("profile_name", sorted(MUSA_PROFILES))
@pytest.mark.parametrize("family_name", FAMILIES_WITH_CASES)
def test_every_kernel_is_legal_on_musa_profiles(family_name, profile_name, tmp_path):
    target = TARGETS[profile_name]
    family = KERNEL_FAMILIES[family_name]
    cases = family.selftest_cases(target.profile)
    assert cases, f"{family_name} offers no self-test case for {profile_name}"
    for codegen in (name for name in target.codegens
                    if name in PREFERRED_CODEGENS[family_name] and hasattr(family, f"{name}_source")):
        options = CompileOptions(codegen=codegen, autotune=False, cache_dir=str(tmp_path))
        for case, make_args in cases:
            args = make_args(torch.device("cpu"), torch.Generator().manual_seed(0))
            for value in args:
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    assert target.profile.supports_dtype(value.dtype), (case, value.dtype)
            if family_name in NEEDS_FP8 and not target.profile.supports_dtype(torch.float8_e4m3fn):
                with pytest.raises(NoLegalConfig, match=profile_name):
                    lower_op(family_name, args, target, options, Execution(None, "static check"))
                continue
            try:
                record, spec = lower_op(family_name, args, target, options, Execution(None, "static check"))
            except NoLegalConfig:  # a codegen with no kernel for the spec says so: TileLang's MoE with fp32
                # activations, TileLang's sparse attention over the FP8 latent cache (a uint8 page pool)
                fp8_latent = any(isinstance(a, torch.Tensor) and a.dtype == torch.uint8 and a.dim() == 4 for a in args)
                assert codegen == "tilelang" and (
                    (family_name, args[0].dtype) == ("mxfp4_moe", torch.float32)
                    or (family_name == "sparse_attention" and fp8_latent)
                    # TileLang's indexer takes heads in multiples of 16 (these cases have 8) and no float q against
                    # the FP8 cache (targets.dsa_indexer.tilelang_supports)
                    or family_name == "dsa_indexer"), case
                continue
            source = Path(record.source_path).read_text()
            assert static_check.kernel_problems(family, codegen, spec, target.profile, source) == [], (codegen, case)


_FORBIDDEN_SOURCE = '''
import triton
import triton.language as tl
from triton.experimental import gluon


@triton.jit
def kernel(a_ptr, desc_ptr):
    # tl.inline_asm_elementwise in a comment is not a use
    note = "tl.dot_scaled in a string is not a use"
    desc = tl.make_tensor_descriptor(desc_ptr, shape=[16, 16], strides=[16, 1], block_shape=[16, 16])
    x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a_ptr], dtype=tl.int32, is_pure=True, pack=1)
    y = tl.dot_scaled(x, None, "e2m1", x, None, "e2m1")
    z = tl.extra.cuda.libdevice.exp(y)
'''


def test_checker_names_every_api_musa_triton_builds_reject():
    problems = "\n".join(musa_triton.source_problems(_FORBIDDEN_SOURCE, MP_31))
    for api in ("dot_scaled", "inline_asm_elementwise", "gluon", "extra.cuda", "make_tensor_descriptor"):
        assert f"uses {api}:" in problems, (api, problems)
    assert "mtgpu 3.2.0" in problems, "tensor descriptors are refused because the vendor build lacks them"
    assert musa_triton.source_problems(_FORBIDDEN_SOURCE, SM_90) == [], "all of it is fine on CUDA"
    flagtree = musa_triton.KNOWN_MUSA_FLAVOURS[1]
    assert flagtree.name == "mthreads" and flagtree.tensor_descriptors
    # On FlagTree 3.6 descriptors exist, but the profile does not allow them (it must run on the vendor build).
    assert "uses make_tensor_descriptor:" in "\n".join(musa_triton.source_problems(_FORBIDDEN_SOURCE, MP_31,
                                                                                    flagtree))


def test_checker_refuses_fp4_fp6_and_fp8_where_not_native():
    source = 'import tilelang.language as T\nA = T.alloc_shared((16, 16), "float4_e2m1fn")\nB = T.float8_e4m3\n'
    mp22 = static_check.tilelang_source_problems(source, MP_22)
    assert mp22 == ["uses float4_e2m1fn buffers: not native on mp_22", "uses float8_e4m3 buffers: not native on mp_22"]
    assert static_check.tilelang_source_problems(source, MP_31) == ["uses float4_e2m1fn buffers: not native on mp_31"]
    assert static_check.tilelang_source_problems('X = "float6_e3m2fn"', MP_31) == [
        "uses float6_e3m2fn buffers: not native on mp_31"]


def test_checker_catches_an_illegal_default_config(monkeypatch):
    """The untuned default is chosen, not pruned: the checker must judge it too (here 16 warps of 128 lanes)."""
    spec = add_rms_norm.AddRmsNormSpec(7168, *[torch.bfloat16] * 5, False, True)
    source = add_rms_norm.triton_source(spec, MP_22)
    assert static_check.kernel_problems(add_rms_norm, "triton", spec, MP_22, source) == []
    too_wide = add_rms_norm.triton_default_config(spec, MP_31)  # sized for 32-lane warps
    monkeypatch.setattr(add_rms_norm, "triton_default_config", lambda spec, profile: too_wide)
    problems = static_check.kernel_problems(add_rms_norm, "triton", spec, MP_22, source)
    assert any(f"num_warps={too_wide.num_warps} > 8" in p for p in problems), problems


def test_sqmma_is_requested_for_matrix_kernels_on_mp_31_only():
    dot = "import triton.language as tl\ndef k(a, b):\n    return tl.dot(a, b)\n"
    assert musa_triton.compile_environment(MP_31, dot) == {"MUSA_ENABLE_SQMMA": "1"}
    assert musa_triton.compile_environment(MP_22, dot) == {}
    assert musa_triton.compile_environment(SM_90, dot) == {}
    spec = add_rms_norm.AddRmsNormSpec(64, *[torch.bfloat16] * 5, False, True)
    assert musa_triton.compile_environment(MP_31, add_rms_norm.triton_source(spec, MP_31)) == {}, "no tl.dot"


# ---------------------------------------------------------------------------------------------------------
# Golden sources

GOLDEN_SPEC = add_rms_norm.AddRmsNormSpec(2880, *[torch.bfloat16] * 5, False, True)


def _golden_text(profile, codegen: str) -> str:
    """What add_rms_norm emits for the golden spec on `profile`: the legal configs, the default, the source."""
    legal, illegal = legal_configs(add_rms_norm, codegen, GOLDEN_SPEC, profile)
    default = getattr(add_rms_norm, f"{codegen}_default_config")(GOLDEN_SPEC, profile)
    source = getattr(add_rms_norm, f"{codegen}_source")(GOLDEN_SPEC, profile)
    lines = [f"# add_rms_norm {codegen} for {profile.name}: {GOLDEN_SPEC.describe()}",
             f"# legal configs ({illegal} dropped as illegal):", *(f"#   {c}" for c in legal),
             f"# default: {default}", source]
    return "\n".join(lines)


def _golden_path(profile, codegen: str) -> Path:
    return GOLDEN / f"add_rms_norm_{codegen}_{profile.arch}.txt"


@pytest.mark.parametrize("codegen", ["triton", "tilelang"])
@pytest.mark.parametrize("profile_name", sorted(MUSA_PROFILES))
def test_golden_add_rms_norm_source(profile_name, codegen):
    profile = MUSA_PROFILES[profile_name]
    expected = _golden_path(profile, codegen).read_text()
    assert _golden_text(profile, codegen) == expected, (
        f"{_golden_path(profile, codegen)} differs; if the change is intended, run "
        f"python tests/test_musa_static_checks.py --update and review the diff")


def test_golden_configs_follow_the_warp_size():
    """What the golden files pin, stated: mp_22's 128-lane warps allow at most 8, mp_31's 32-lane warps more."""
    for profile, most in ((MP_22, 8), (MP_31, 32)):
        legal, _ = legal_configs(add_rms_norm, "triton", GOLDEN_SPEC, profile)
        assert max(c.num_warps for c in legal) <= most
        assert all(c.num_warps * profile.warp_size <= 1024 for c in legal)
    mp22_threads = {c.num_warps * 128 for c in legal_configs(add_rms_norm, "triton", GOLDEN_SPEC, MP_22)[0]}
    assert mp22_threads <= {128, 256, 512, 1024}


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for golden_profile in MUSA_PROFILES.values():
        for golden_codegen in ("triton", "tilelang"):
            _golden_path(golden_profile, golden_codegen).write_text(_golden_text(golden_profile, golden_codegen))
            print("wrote", _golden_path(golden_profile, golden_codegen))
