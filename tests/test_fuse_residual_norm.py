"""fuse_residual_norm: golden IR before/after, the spellings it must fire on, and the cases it must refuse."""

import pytest
import torch
from conftest import assert_close_for_dtype, ulp
from torch import nn

import dzc
from dzc.models.decoder import AddRMSNorm, DeepSeekRMSNorm, HFRMSNorm
from dzc.models.vision import AddLayerNorm


class DeepSeekAddNorm(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.norm = DeepSeekRMSNorm(hidden, 1e-6)

    def forward(self, x, residual):
        return self.norm(x, residual)


def _stages(model, options, *inputs):
    compiled = dzc.compile(model, "cuda", options)
    compiled(*inputs)
    report = compiled.report
    assert report.compiles == 1
    return dict(report.graphs[0].stages), report


def _bf16(*shape):
    return torch.randn(*shape).bfloat16()


def test_golden_hf_spelling(options):
    stages, report = _stages(AddRMSNorm().bfloat16(), options, _bf16(3, 64), _bf16(3, 64))
    assert stages["capture"] == """\
# captured by Dynamo + AOTAutograd
graph(%a0: sym s0, %a1: bf16[s0, 64], %a2: bf16[s0, 64], %a3: bf16[64]):
  %0 = aten.add.Tensor(%a1, %a2)  # bf16[s0, 64]
  %1 = prims.convert_element_type.default(%0, f32)  # f32[s0, 64]
  %2 = aten.pow.Tensor_Scalar(%1, 2)  # f32[s0, 64]
  %3 = aten.mean.dim(%2, [-1], True)  # f32[s0, 1]
  %4 = aten.add.Tensor(%3, 1e-06)  # f32[s0, 1]
  %5 = aten.rsqrt.default(%4)  # f32[s0, 1]
  %6 = aten.mul.Tensor(%1, %5)  # f32[s0, 64]
  %7 = prims.convert_element_type.default(%6, bf16)  # bf16[s0, 64]
  %8 = aten.mul.Tensor(%a3, %7)  # bf16[s0, 64]
  return (%8, %0)
"""
    assert stages["fuse_residual_norm"] == """\
# built by fuse_residual_norm
graph(%a0: sym s0, %a1: bf16[s0, 64], %a2: bf16[s0, 64], %a3: bf16[64]):
  %0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, False, True, bf16, bf16)  # (bf16[s0, 64], bf16[s0, 64])
  %1 = %0[0]  # bf16[s0, 64]
  %2 = %0[1]  # bf16[s0, 64]
  return (%1, %2)
"""
    assert report.fired() == {"fuse_residual_norm": 1}


def test_golden_deepseek_spelling(options):
    stages, report = _stages(DeepSeekAddNorm().float(), options, _bf16(3, 64), _bf16(3, 64))
    assert stages["fuse_residual_norm"] == """\
# built by fuse_residual_norm
graph(%a0: sym s0, %a1: bf16[s0, 64], %a2: bf16[s0, 64], %a3: f32[64]):
  %0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, True, False, bf16, bf16)  # (bf16[s0, 64], bf16[s0, 64])
  %1 = %0[0]  # bf16[s0, 64]
  %2 = %0[1]  # bf16[s0, 64]
  return (%1, %2)
"""
    assert report.fired() == {"fuse_residual_norm": 1}


def test_torch_rms_norm_spelling_fires_and_matches(options, seed):
    norm = nn.RMSNorm(64, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.normal_()

    def add_norm(x, residual):
        h = x + residual
        return norm(h), h

    x, residual = _bf16(5, 64), _bf16(5, 64)
    compiled = dzc.compile(add_norm, "cuda", options)
    y, h = compiled(x, residual)
    expected_y, expected_h = add_norm(x, residual)
    assert compiled.report.fired() == {"fuse_residual_norm": 1}
    assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
    # y is judged from the kernel's own h (a one-ulp h is not counted twice); torch's RMSNorm rounds once, which
    # the interpreter truncates.
    assert_close_for_dtype(y, norm(h), max_bf16_ulps=1.0)


class VarianceEscapes(nn.Module):
    """The variance is returned too: the fused op cannot serve that use."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64))

    def forward(self, x, residual):
        h = (x + residual).float()
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + 1e-6)), variance


class FP32SumEscapes(nn.Module):
    """DeepSeek spelling whose fp32 sum also feeds another fp32 op."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64))

    def forward(self, x, residual):
        s = x.float() + residual.float()
        y = (self.weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)
        return y, s.exp()


class BroadcastResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = HFRMSNorm(64, 1e-6)

    def forward(self, x, bias):
        return self.norm(x + bias)


def test_refuses_when_an_intermediate_escapes(options):
    stages, report = _stages(VarianceEscapes(), options, torch.randn(4, 64), torch.randn(4, 64))
    assert report.fired() == {}
    assert stages["fuse_residual_norm"].splitlines()[1:] == stages["capture"].splitlines()[1:]
    [(_, reason)] = report.refusals["fuse_residual_norm"]
    assert "another use" in reason


def test_refuses_when_the_fp32_sum_has_another_use(options):
    stages, report = _stages(FP32SumEscapes(), options, _bf16(4, 64), _bf16(4, 64))
    assert report.fired() == {}
    assert report.refusals["fuse_residual_norm"][0][1] == "the fp32 sum has a use the fused op cannot serve"
    assert "dzc.add_rms_norm" not in stages["lowered"]


def test_refuses_a_broadcasting_add(options):
    _, report = _stages(BroadcastResidual(), options, torch.randn(4, 64), torch.randn(64))
    assert report.fired() == {}
    assert report.refusals["fuse_residual_norm"][0][1] == "the residual add broadcasts"


def test_pass_does_not_mutate_its_input(options):
    from torch._dynamo.backends.common import aot_autograd

    from dzc.passes.fuse_residual_norm import fuse_residual_norm

    graphs = []

    def keep(gm, _):
        graphs.append(gm.graph)
        return gm

    with torch.no_grad():
        torch.compile(AddRMSNorm(), backend=aot_autograd(fw_compiler=keep))(torch.randn(3, 64), torch.randn(3, 64))
    before = str(graphs[0])
    result = fuse_residual_norm(graphs[0])
    assert result.rewrites and str(graphs[0]) == before


def test_golden_layer_norm_spelling(options, seed):
    model = AddLayerNorm().bfloat16()
    x, residual = _bf16(5, 64), _bf16(5, 64)
    stages, report = _stages(model, options, x, residual)
    assert "aten.var_mean.correction" in stages["capture"]
    assert stages["fuse_residual_norm"] == """\
# built by fuse_residual_norm
graph(%a0: sym s0, %a1: bf16[s0, 64], %a2: bf16[s0, 64], %a3: bf16[64], %a4: bf16[64]):
  %0 = dzc.add_layer_norm.default(%a1, %a2, %a3, %a4, 1e-06, False, bf16, bf16)  # (bf16[s0, 64], bf16[s0, 64])
  %1 = %0[0]  # bf16[s0, 64]
  %2 = %0[1]  # bf16[s0, 64]
  return (%1, %2)
"""
    assert report.passes["fuse_residual_norm"] == 1
    assert [(k.op, k.codegen) for k in report.kernels] == [("add_layer_norm", "triton")]
    y, h = dzc.compile(model, "cuda", options)(x, residual)
    expected_y, expected_h = model(x, residual)
    # One bf16 ulp: the Triton interpreter truncates fp32 -> bf16 casts where eager rounds to nearest even.
    assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
    # y is a function of the rounded sum: judged from the kernel's own h (a one-ulp h is not counted twice).
    assert_close_for_dtype(y, model.norm(h), max_bf16_ulps=1.0)


def test_layer_norm_whose_mean_escapes_is_refused(options):
    class MeanEscapes(nn.Module):
        def forward(self, x, residual):
            h = x + residual
            var, mean = torch.var_mean(h, dim=-1, correction=0, keepdim=True)
            return (h - mean) * torch.rsqrt(var + 1e-5), mean

    _, report = _stages(MeanEscapes(), options, torch.randn(4, 64), torch.randn(4, 64))
    assert report.passes["fuse_residual_norm"] == 0
    [(_, reason)] = report.refusals["fuse_residual_norm"]
    assert "another use" in reason


# ---------------------------------------------------------------------------------------------------------
# Every norm spelling released models use: golden IR, numerics against eager, a refusal case each.

H = 64


class ResidualNorm(nn.Module):
    """x + residual, then `norm(h)` as a subclass spells it; returns (y, h). weight: drawn around `centre`."""

    def __init__(self, centre=1.0, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter((centre + 0.1 * torch.randn(H)).to(dtype))

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


class GemmaNorm(ResidualNorm):
    """Gemma: fp32 math, the weight stored as an offset from 1 and applied as `x * (1 + w)` before the cast."""

    def __init__(self):
        super().__init__(centre=0.0)

    def norm(self, h):
        v = h.float()
        out = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (out * (1.0 + self.weight.float())).type_as(h)


class NormWithoutWeight(ResidualNorm):
    def norm(self, h):
        v = h.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


class SeparateUpcastNorm(ResidualNorm):
    """T5: the variance over an upcast copy, `h * rsqrt(var)` on the bf16 h (type promotion upcasts it)."""

    def norm(self, h):
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + 1e-6)).to(self.weight.dtype)


class DivideBySqrtNorm(ResidualNorm):
    def norm(self, h):
        v = h.float()
        return self.weight * (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


class SumOverHiddenNorm(ResidualNorm):
    def norm(self, h):
        v = h.float()
        return self.weight * (v * torch.rsqrt(v.pow(2).sum(-1, keepdim=True) / H + 1e-6)).to(h.dtype)


class EpsInsideTheMeanNorm(ResidualNorm):
    """rsqrt(mean(v² + eps)): the mean of the squares plus eps."""

    def norm(self, h):
        v = h.float()
        return self.weight * (v * torch.rsqrt((v.pow(2) + 1e-6).mean(-1, keepdim=True))).to(h.dtype)


class MeanWithoutKeepdimNorm(ResidualNorm):
    """rsqrt(mean(v², -1) + eps).unsqueeze(-1): the mean without keepdim, its dim put back after the rsqrt."""

    def norm(self, h):
        v = h.float()
        return self.weight * (v * torch.rsqrt(v.pow(2).mean(-1) + 1e-6).unsqueeze(-1)).to(h.dtype)


class Bf16MathNorm(ResidualNorm):
    """Every step in the activations' dtype, no upcast."""

    def norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def _fused_line(stages):
    [line] = [line for line in stages["fuse_residual_norm"].splitlines() if "dzc.add_rms_norm" in line]
    return line.strip()


def _eager_y_from(model, h):
    """The eager model's y for the kernel's own sum h (h + 0 is h): a one-ulp difference in h is not counted twice."""
    with torch.no_grad():
        return model(h, torch.zeros_like(h))[0]


def _assert_y_close(y, expected, ulps):
    """y within `ulps` units in the last place of its dtype, at the expected value's magnitude or at the row's
    typical magnitude (a value near 0 inherits the absolute error of the larger values it was computed with)."""
    assert not y.isnan().any(), "NaN in the output: an element was not written"
    scale = torch.maximum(expected.float().abs(), expected.float().abs().mean(-1, keepdim=True) / 4)
    excess = (y.float() - expected.float()).abs() - ulps * ulp(scale, y.dtype)
    assert (excess <= 0).all(), f"y exceeds {ulps} ulps by up to {excess.max().item():.3g}"


# (model, the fused op's line after fuse_residual_norm, ulps of y allowed against eager). In the interpreter each
# rounding point truncates where eager rounds to nearest even: one ulp per rounding of y's path, plus the weight's
# magnification of the normalised value's.
SPELLINGS = {
    "gemma_one_plus_weight": (GemmaNorm, "%2 = dzc.add_rms_norm.default(%a1, %a2, %1, 1e-06, False, False, bf16, bf16)"
                              "  # (bf16[s0, 64], bf16[s0, 64])", 2),
    "without_weight": (NormWithoutWeight, "%0 = dzc.add_rms_norm.default(%a1, %a2, None, 1e-06, False, False, bf16, "
                       "bf16)  # (bf16[s0, 64], bf16[s0, 64])", 1),
    "separate_upcast": (SeparateUpcastNorm, "%0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, False, True, bf16, "
                        "bf16)  # (bf16[s0, 64], bf16[s0, 64])", 3),
    "divide_by_sqrt": (DivideBySqrtNorm, "%0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, False, True, bf16, bf16, "
                       "f32, True)  # (bf16[s0, 64], bf16[s0, 64])", 3),
    "sum_over_hidden": (SumOverHiddenNorm, "%0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, False, True, bf16, "
                        "bf16)  # (bf16[s0, 64], bf16[s0, 64])", 3),
    "eps_inside_the_mean": (EpsInsideTheMeanNorm, "%0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, False, True, "
                            "bf16, bf16)  # (bf16[s0, 64], bf16[s0, 64])", 3),
    "mean_without_keepdim": (MeanWithoutKeepdimNorm, "%0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, False, "
                             "True, bf16, bf16)  # (bf16[s0, 64], bf16[s0, 64])", 3),
    "bf16_math": (Bf16MathNorm, "%0 = dzc.add_rms_norm.default(%a1, %a2, %a3, 1e-06, False, False, bf16, bf16, bf16, "
                  "False)  # (bf16[s0, 64], bf16[s0, 64])", 6),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_norm_spelling_fuses_and_matches_eager(spelling, options, seed):
    model_class, fused_line, ulps = SPELLINGS[spelling]
    model = model_class()
    x, residual = _bf16(5, H), _bf16(5, H)
    compiled = dzc.compile(model, "cuda", options)
    y, h = compiled(x, residual)
    stages = dict(compiled.report.graphs[0].stages)
    assert _fused_line(stages) == fused_line
    # Nothing of the norm is left beside the fused op (Gemma's `1 + w` stays: it is the weight, hoisted before it).
    assert "rsqrt" not in stages["fuse_residual_norm"] and "mean" not in stages["fuse_residual_norm"]
    assert compiled.report.fired()["fuse_residual_norm"] == 1
    assert [k.op for k in compiled.report.kernels] == ["add_rms_norm"]
    with torch.no_grad():
        expected_y, expected_h = model(x, residual)
    assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
    _assert_y_close(y, _eager_y_from(model, h), ulps)


def test_golden_gemma_weight_is_hoisted_before_the_add(options):
    stages, report = _stages(GemmaNorm(), options, _bf16(3, H), _bf16(3, H))
    assert stages["fuse_residual_norm"] == """\
# built by fuse_residual_norm
graph(%a0: sym s0, %a1: bf16[s0, 64], %a2: bf16[s0, 64], %a3: bf16[64]):
  %0 = prims.convert_element_type.default(%a3, f32)  # f32[64]
  %1 = aten.add.Tensor(%0, 1.0)  # f32[64]
  %2 = dzc.add_rms_norm.default(%a1, %a2, %1, 1e-06, False, False, bf16, bf16)  # (bf16[s0, 64], bf16[s0, 64])
  %3 = %2[0]  # bf16[s0, 64]
  %4 = %2[1]  # bf16[s0, 64]
  return (%3, %4)
"""


def test_fp32_sum_over_hidden_matches_eager_tightly(options, seed):
    model = SumOverHiddenNorm()
    model.weight.data = model.weight.data.float()
    x, residual = torch.randn(5, H), torch.randn(5, H)
    compiled = dzc.compile(model, "cuda", options)
    y, h = compiled(x, residual)
    assert compiled.report.fired()["fuse_residual_norm"] == 1
    with torch.no_grad():
        expected_y, expected_h = model(x, residual)
    assert_close_for_dtype(h, expected_h)
    assert_close_for_dtype(y, expected_y)


class WeightFromTheSum(ResidualNorm):
    """A per-column scale computed from the sum itself: it cannot be read before the add."""

    def norm(self, h):
        v = h.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + h.mean(0).float())).to(h.dtype)


class NormalisedEscapes(ResidualNorm):
    def forward(self, x, residual):
        v = (x + residual).float()
        normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed.to(x.dtype), normed


class UpcastCopyEscapes(ResidualNorm):
    def forward(self, x, residual):
        h = x + residual
        upcast = h.to(torch.float32)
        variance = upcast.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + 1e-6)).to(h.dtype), upcast.exp()


class RootEscapes(ResidualNorm):
    def forward(self, x, residual):
        v = (x + residual).float()
        root = torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * (v / root).to(x.dtype), root


class HalfTheSum(ResidualNorm):
    """sum(-1) / (H / 2) is twice the mean square: not an RMSNorm."""

    def norm(self, h):
        v = h.float()
        return self.weight * (v * torch.rsqrt(v.pow(2).sum(-1, keepdim=True) / (H // 2) + 1e-6)).to(h.dtype)


class ColumnsWithoutKeepdim(ResidualNorm):
    """rsqrt(mean(v², 0) + eps).unsqueeze(0): each column's root mean square over the rows, not a row's."""

    def norm(self, h):
        v = h.float()
        return self.weight * (v * torch.rsqrt(v.pow(2).mean(0) + 1e-6).unsqueeze(0)).to(h.dtype)


class Bf16MathCastToHalf(ResidualNorm):
    def norm(self, h):
        return self.weight.half() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).half()


REFUSALS = {
    "weight_from_the_sum": (WeightFromTheSum, "the weight is computed after the residual add, not from parameters "
                                              "alone"),
    "normalised_value_escapes": (NormalisedEscapes, "another use"),
    "upcast_copy_escapes": (UpcastCopyEscapes, "the fp32 copy of the sum has another use"),
    "root_escapes": (RootEscapes, "another use"),
    "bf16_math_cast_to_half": (Bf16MathCastToHalf, "the normalised value is cast to a dtype other than the norm "
                                                   "input's"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_spelling_refuses_what_it_cannot_fuse(case, options):
    model_class, reason = REFUSALS[case]
    stages, report = _stages(model_class(), options, _bf16(4, H), _bf16(4, H))
    assert report.passes["fuse_residual_norm"] == 0
    assert "dzc.add_rms_norm" not in stages["fuse_residual_norm"]
    [(_, why)] = report.refusals["fuse_residual_norm"]
    assert reason in why


def test_a_sum_over_another_count_is_not_a_mean(options):
    stages, report = _stages(HalfTheSum(), options, _bf16(4, H), _bf16(4, H))
    assert report.passes["fuse_residual_norm"] == 0 and report.refusals["fuse_residual_norm"] == []
    assert stages["fuse_residual_norm"].splitlines()[1:] == stages["capture"].splitlines()[1:]


def test_a_mean_over_the_rows_is_not_a_norm_of_each_row(options):
    stages, report = _stages(ColumnsWithoutKeepdim(), options, _bf16(4, H), _bf16(4, H))
    assert report.passes["fuse_residual_norm"] == 0 and report.refusals["fuse_residual_norm"] == []
    assert stages["fuse_residual_norm"].splitlines()[1:] == stages["capture"].splitlines()[1:]


def test_float64_models_are_refused_with_a_reason(options, seed):
    model = AddRMSNorm().double()
    x, residual = torch.randn(4, H, dtype=torch.float64), torch.randn(4, H, dtype=torch.float64)
    compiled = dzc.compile(model, "cuda", options)
    y, h = compiled(x, residual)
    report = compiled.report
    assert report.passes["fuse_residual_norm"] == 0
    [(_, why)] = report.refusals["fuse_residual_norm"]
    assert why.startswith("float64 tensors")
    with torch.no_grad():
        expected_y, expected_h = model(x, residual)
    assert torch.equal(h, expected_h) and torch.allclose(y, expected_y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_dtype,compute_dtype,divide_by_rms", [
    (torch.float32, torch.float32, False), (None, torch.float32, True), (torch.bfloat16, torch.bfloat16, False),
    (None, torch.bfloat16, True)])
def test_new_kernel_variants_match_the_reference_in_every_legal_config(weight_dtype, compute_dtype, divide_by_rms,
                                                                      seed, tmp_path):
    """The op's new rounding points (no weight, an fp32 weight, bf16 steps, `/ sqrt`), kernel against reference."""
    from dzc.ops.add_rms_norm import add_rms_norm_reference
    from dzc.targets import add_rms_norm as family
    from dzc.targets import resolve_target, triton_codegen
    from dzc.targets.launch import legal_configs

    bf16 = torch.bfloat16
    spec = family.AddRmsNormSpec(96, bf16, bf16, weight_dtype, bf16, bf16, False, False, compute_dtype, divide_by_rms)
    profile = resolve_target("cuda").profile
    path = tmp_path / "kernel.py"
    path.write_text(family.triton_source(spec, profile))
    kernel = triton_codegen.load_kernel(path, family.TRITON_KERNEL_NAME)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, residual = (torch.randn(7, 96, device=device).to(bf16) for _ in range(2))
    weight = (1.0 + 0.1 * torch.randn(96, device=device)).to(weight_dtype) if weight_dtype else None
    statics = (False, False, bf16, bf16, compute_dtype, divide_by_rms)
    configs, _ = legal_configs(family, "triton", spec, profile)
    for config in configs[:4]:
        y, h = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        family.triton_launch(kernel, config, x, residual, weight, 1e-6, y, h)
        _, expected_h = add_rms_norm_reference(x, residual, weight, 1e-6, *statics)
        assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
        expected_y, _ = add_rms_norm_reference(h, torch.zeros_like(h), weight, 1e-6, *statics)
        # bf16 steps: five roundings, each one ulp apart where the interpreter truncates (and the CPU reference's
        # bf16 mean rounds the sum before dividing).
        _assert_y_close(y.cpu(), expected_y.cpu(), 6 if compute_dtype == bf16 else 2)


class PermutedSumLayerNorm(nn.Module):
    """A ViT's residual stream kept [tokens, batch, hidden] (a transposed sum): capture's LayerNorm copies it
    contiguous before the statistics (SigLIP's encoder after its permuted patch embeddings)."""

    def __init__(self, hidden=64, copy_escapes=False):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=1e-6)
        self.copy_escapes = copy_escapes

    def forward(self, x, residual):
        h = x.transpose(0, 1) + residual.transpose(0, 1)
        if self.copy_escapes:
            copy = h.contiguous()
            return self.norm(copy), copy * 2
        return self.norm(h), h


def test_layer_norm_over_a_copy_of_the_sum_fuses(options, seed):
    model = PermutedSumLayerNorm()
    x, residual = torch.randn(6, 3, 64), torch.randn(6, 3, 64)
    stages, report = _stages(model, options, x, residual)
    assert "aten.clone.default" in stages["capture"]
    assert report.passes["fuse_residual_norm"] == 1, report.refusals
    assert "aten.clone" not in stages["fuse_residual_norm"] and "aten.var_mean" not in stages["fuse_residual_norm"]
    y, h = dzc.compile(model, "cuda", options)(x, residual)
    expected_y, expected_h = model(x, residual)
    torch.testing.assert_close(h, expected_h, atol=0, rtol=0)
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=1e-5)


def test_a_copy_of_the_sum_read_elsewhere_is_refused(options):
    _, report = _stages(PermutedSumLayerNorm(copy_escapes=True), options, torch.randn(6, 3, 64),
                        torch.randn(6, 3, 64))
    assert report.passes["fuse_residual_norm"] == 0
    assert [reason for _, reason in report.refusals["fuse_residual_norm"]] == ["the copy of the sum has another use"]


class FlattenedRowsNorm(ResidualNorm):
    """The norm reads the sum through a view that flattens the leading dims (the rows are the same rows)."""

    def norm(self, h):
        v = h.reshape(-1, H).float()
        return self.weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


class FlattenedThenUpcastNorm(ResidualNorm):
    def norm(self, h):
        v = h.float().view(-1, H)
        return self.weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


@pytest.mark.parametrize("model_class", [FlattenedRowsNorm, FlattenedThenUpcastNorm], ids=lambda c: c.__name__)
def test_a_norm_read_through_a_row_view_fuses_and_matches_eager(model_class, options, seed):
    """norm(view(x + residual)) = view(norm(x + residual)) when the view keeps the last dim: the fused op runs on
    the sum's shape and its y is viewed as the model viewed the sum."""
    model = model_class()
    x, residual = _bf16(2, 5, H), _bf16(2, 5, H)
    compiled = dzc.compile(model, "cuda", options)
    y, h = compiled(x, residual)
    assert compiled.report.fired()["fuse_residual_norm"] == 1
    stages = dict(compiled.report.graphs[0].stages)
    assert "rsqrt" not in stages["fuse_residual_norm"]
    assert y.shape == (10, H) and h.shape == (2, 5, H)
    with torch.no_grad():
        expected_y, expected_h = model(x, residual)
    assert_close_for_dtype(h, expected_h, max_bf16_ulps=1.0)
    _assert_y_close(y, _eager_y_from(model, h), 3)


class ColumnsViewNorm(ResidualNorm):
    """A view that splits the hidden dim: the norm's rows are no longer the sum's rows."""

    def norm(self, h):
        v = h.reshape(-1, H // 2).float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def test_a_view_that_splits_the_hidden_dim_is_not_fused(options):
    stages, report = _stages(ColumnsViewNorm(), options, _bf16(4, H), _bf16(4, H))
    assert report.passes["fuse_residual_norm"] == 0
    [(_, why)] = report.refusals["fuse_residual_norm"]
    assert "no residual add feeds this norm" in why or "view" in why, why
