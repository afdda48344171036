"""fuse_residual_norm: golden IR before/after, the spellings it must fire on, and the cases it must refuse."""

import torch
from conftest import assert_close_for_dtype
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
