"""fuse_vision_attention: golden IR per upstream spelling of packed attention, the rotary fold, the cases it must
refuse or leave alone, and dzc.varlen_attention's reference against an independent per-image computation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dzc
from dzc.models.decoder import Attention, DecoderConfig
from dzc.models.vision import attend, block_diagonal_mask
from dzc.ops.varlen_attention import apply_vision_rotary, varlen_attention_reference
from tests.conftest import assert_close_for_dtype


class PackedAttention(nn.Module):
    """q, k, v [tokens, heads, head_dim] of a pack -> attention restricted to each segment of cu_seqlens, spelled
    as the vision encoders (models/vision.py, transformers) spell it; optionally with HF's vision rotary first."""

    def __init__(self, spelling: str, sdpa: bool, rotary: bool = False, causal: bool = False):
        super().__init__()
        self.spelling, self.sdpa, self.rotary, self.causal = spelling, sdpa, rotary, causal

    def forward(self, q, k, v, cu_seqlens, cos, sin):
        if self.rotary:
            q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, tokens, head_dim]
        if self.spelling == "mask":
            out = attend(q, k, v, block_diagonal_mask(cu_seqlens, q.shape[1]), 0.25, self.sdpa)
        elif self.spelling in ("bias", "padded-bias"):  # the bool mask as an additive bias, as SDPA does on GPUs
            tokens = q.shape[1]
            bias = torch.where(~block_diagonal_mask(cu_seqlens, tokens), float("-inf"), 0.0)
            if self.spelling == "padded-bias":  # and padded for its memory-efficient kernel, sliced back
                bias = F.pad(bias, (0, 8 - tokens % 8))[..., :tokens]
            out = torch.softmax(q @ k.transpose(1, 2) * 0.25 + bias, dim=-1) @ v
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            pieces = zip(*(torch.split(t, lengths, dim=1) for t in (q, k, v)))
            if self.causal:
                out = torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True) for a, b, c in pieces], 1)
            else:
                out = torch.cat([attend(a, b, c, None, 0.25, self.sdpa) for a, b, c in pieces], dim=1)
        return out.transpose(0, 1)


def _pack(lengths, heads=2, head_dim=16, dtype=torch.float32):
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, heads, head_dim).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    angles = torch.randn(tokens, head_dim // 2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return q, k, v, cu, cos, sin


def _compile(module, options, *inputs):
    compiled = dzc.compile(module, "cuda", options)
    out = compiled(*inputs)
    return compiled, out


AFTER_MASK_ROTARY = """\
# built by fuse_vision_attention
graph(%a0: sym s0, %a1: sym s1, %a2: f32[s0, s1, 16], %a3: f32[s0, 16], %a4: sym s0, %a5: f32[s0, 16], %a6: f32[s0, s1, 16], %a7: f32[s0, s1, 16], %a8: sym s2, %a9: i32[s2]):
  %0 = aten.slice.Tensor(%a9, 0, 1, 9223372036854775807)  # i32[s2 - 1]
  %1 = aten.slice.Tensor(%a9, 0, 0, -1)  # i32[s2 - 1]
  %2 = aten.sub.Tensor(%0, %1)  # i32[s2 - 1]
  %3 = aten.max.default(%2)  # i32[]
  %4 = aten._local_scalar_dense.default(%3)  # sym s3
  %5 = dzc.varlen_attention.default(%a2, %a6, %a7, %a9, %4, 0.25, %a3, %a5)  # f32[s0, s1, 16]
  %6 = aten.permute.default(%5, [1, 0, 2])  # f32[s1, s0, 16]
  %7 = aten.clone.default(%6, memory_format=torch.contiguous_format)  # f32[s1, s0, 16]
  %8 = aten.permute.default(%7, [1, 0, 2])  # f32[s0, s1, 16]
  return (%8,)
"""


def test_golden_block_diagonal_mask_with_rotary_sdpa(options, seed):
    inputs = _pack([5, 11, 8])
    module = PackedAttention("mask", sdpa=True, rotary=True)
    compiled, out = _compile(module, options, *inputs)
    stages = dict(compiled.report.graphs[0].stages)
    before = stages["capture"]
    assert "aten.searchsorted.Tensor" in before and before.count("aten.bmm.default") == 2
    assert stages["fuse_vision_attention"] == AFTER_MASK_ROTARY
    assert compiled.report.passes["fuse_vision_attention"] == 1
    assert_close_for_dtype(out, module(*inputs))


AFTER_SPLIT = """\
  %22 = sym_max(%4, %8)  # sym Max(s4, s5)
  %23 = sym_max(%22, %12)  # sym Max(s4, s5, s6)
  %24 = dzc.varlen_attention.default(%a2, %a4, %a6, %a7, %23, 0.25, None, None)  # f32[s0, s1, 16]
  %25 = aten.permute.default(%24, [1, 0, 2])  # f32[s1, s0, 16]
  %26 = aten.clone.default(%25, memory_format=torch.contiguous_format)  # f32[s1, s0, 16]
  %27 = aten.permute.default(%26, [1, 0, 2])  # f32[s4 + s5 + s6, s1, 16]
  return (%27,)
"""


def test_golden_per_image_split_and_cat_eager(options, seed):
    """Eager attention per image (matmul, softmax, matmul); the bf16 test below covers SDPA per image."""
    inputs = _pack([6, 13, 9])
    module = PackedAttention("split", sdpa=False)
    compiled, out = _compile(module, options, *inputs)
    stages = dict(compiled.report.graphs[0].stages)
    assert stages["capture"].count("aten.split_with_sizes.default") == 3
    assert stages["capture"].count("aten.bmm.default") == 6  # unrolled: 2 per image
    after = stages["fuse_vision_attention"]
    # The lengths stay (Dynamo's runtime asserts on them); one op over the pack replaces the three attentions.
    assert "aten.bmm" not in after and "split_with_sizes" not in after and "aten.cat" not in after
    assert after.count("aten._local_scalar_dense.default") == 3
    assert after.endswith(AFTER_SPLIT), after
    assert compiled.report.passes["fuse_vision_attention"] == 1
    assert_close_for_dtype(out, module(*inputs))


def test_split_with_rotary_folds_and_matches_in_bf16(options, seed):
    inputs = _pack([4, 12], dtype=torch.bfloat16)
    module = PackedAttention("split", sdpa=True, rotary=True)
    compiled, out = _compile(module, options, *inputs)
    after = dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]
    [op_line] = [line for line in after.splitlines() if "dzc.varlen_attention" in line]
    assert "None" not in op_line  # cos, sin handed to the op
    assert "aten.neg" not in after  # rotate_half is gone
    # The kernel's own bf16 accuracy is tested against the op's reference with the kernels; here the whole graph
    # is compared with the model's eager result (SDPA computes in fp32 and rounds once, like the op).
    torch.testing.assert_close(out.float(), module(*inputs).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("spelling", ["bias", "padded-bias"])
def test_additive_block_diagonal_bias_fires(spelling, options, seed):
    inputs = _pack([3, 9, 5])
    module = PackedAttention(spelling, sdpa=False)
    compiled, out = _compile(module, options, *inputs)
    after = dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]
    assert compiled.report.passes["fuse_vision_attention"] == 1
    assert "aten.bmm" not in after and "aten.where" not in after and "searchsorted" not in after
    assert_close_for_dtype(out, module(*inputs))


def test_refuses_causal_attention_per_image(options):
    inputs = _pack([5, 7])
    compiled, _ = _compile(PackedAttention("split", sdpa=True, causal=True), options, *inputs)
    report = compiled.report
    assert report.passes["fuse_vision_attention"] == 0
    reasons = {reason for _, reason in report.refusals["fuse_vision_attention"]}
    assert reasons == {"causal, masked or dropout attention inside an image"}


def test_refuses_when_an_intermediate_escapes(options):
    inputs = _pack([5, 7])
    compiled, _ = _compile(MaskEscapes(), options, *inputs)
    report = compiled.report
    assert report.passes["fuse_vision_attention"] == 0
    [(_, reason)] = report.refusals["fuse_vision_attention"]
    assert "has a use outside it" in reason


class MaskEscapes(nn.Module):
    """Returns the attention probabilities too (HF eager returns attn_weights): they cannot be recomputed."""

    def forward(self, q, k, v, cu_seqlens, cos, sin):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        scores = (q @ k.transpose(1, 2)) * 0.25
        scores = scores.masked_fill(~block_diagonal_mask(cu_seqlens, q.shape[1]), float("-inf"))
        probs = scores.softmax(-1)
        return (probs @ v).transpose(0, 1), probs


def test_causal_text_attention_is_left_alone(options):
    attention = Attention(DecoderConfig(hidden=32, heads=2))
    compiled, _ = _compile(attention, options, torch.randn(2, 9, 32))
    report = compiled.report
    assert report.passes["fuse_vision_attention"] == 0 and not report.refusals["fuse_vision_attention"]
    assert "dzc.varlen_attention" not in dict(report.graphs[0].stages)["lowered"]


def test_unmasked_attention_over_one_image_is_left_alone(options):
    def vit_attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    compiled, _ = _compile(vit_attention, options, *(torch.randn(2, 10, 16) for _ in range(3)))
    assert compiled.report.passes["fuse_vision_attention"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_per_image_softmax_attention(dtype, seed):
    """The op's reference against per-image attention computed another way (SDPA on each image, fp32)."""
    q, k, v, cu, cos, sin = _pack([1, 7, 30, 2], heads=3, head_dim=8, dtype=dtype)
    out = varlen_attention_reference(q, k, v, cu, 30, 0.3, cos, sin)
    rq, rk = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expected = F.scaled_dot_product_attention(*(t[start:end].float().transpose(0, 1) for t in (rq, rk, v)),
                                                  scale=0.3).transpose(0, 1).to(dtype)
        if dtype == torch.bfloat16:
            # Both compute in fp32 and round once; their fp32 sums differ in order, which can flip a rounding
            # (one unit, counted at the larger neighbour near zero).
            torch.testing.assert_close(out[start:end], expected, atol=1e-3, rtol=2**-7)
        else:
            assert_close_for_dtype(out[start:end], expected)


def test_reference_rejects_bad_arguments():
    q, k, v, cu, cos, sin = _pack([3, 4])
    with pytest.raises(ValueError, match="more than max_seqlen"):
        varlen_attention_reference(q, k, v, cu, 3, 0.25)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the token count 7"):
        varlen_attention_reference(q, k, v, cu[:-1], 4, 0.25)
    with pytest.raises(ValueError, match="1-D int32"):
        varlen_attention_reference(q, k, v, cu.long(), 4, 0.25)
    with pytest.raises(ValueError, match="cos and sin must be given together"):
        varlen_attention_reference(q, k, v, cu, 4, 0.25, cos, None)
    with pytest.raises(ValueError, match="k has shape"):
        varlen_attention_reference(q, k[..., :8], v[..., :8], cu, 4, 0.25)
    with pytest.raises(ValueError, match="v must match k"):
        varlen_attention_reference(q, k[:, :1], v, cu, 4, 0.25)
