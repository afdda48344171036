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


def rotate_pairs(x, spelling="slice"):
    """The interleaved (pairwise) rotation: pair (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]), as models spell it."""
    if spelling == "slice":
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    if spelling == "unbind":
        even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    pairs = x.reshape(*x.shape[:-1], -1, 2)  # "reshape"
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).reshape(x.shape)


def apply_interleaved_rotary(x, cos, sin, spelling="slice"):
    """apply_vision_rotary with the interleaved rotation: fp32, rounded back to x's dtype."""
    x32 = x.float()
    return (x32 * cos.float().unsqueeze(-2) + rotate_pairs(x32, spelling) * sin.float().unsqueeze(-2)).to(x.dtype)


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
        elif self.spelling.startswith("min-"):  # HF's masks: finfo.min where a key is hidden, not -inf
            tokens, lowest = q.shape[1], torch.finfo(q.dtype).min
            mask = block_diagonal_mask(cu_seqlens, tokens)
            scores = q @ k.transpose(1, 2) * 0.25
            if self.spelling == "min-bias":
                scores = scores + torch.where(mask, 0.0, lowest).to(q.dtype)
            elif self.spelling == "min-zeros-bias":
                scores = scores + torch.zeros(tokens, tokens, dtype=q.dtype).masked_fill(~mask, lowest)
            elif self.spelling == "min-masked-fill":
                scores = scores.masked_fill(~mask, lowest)
            elif self.spelling == "min-where-scores":
                scores = torch.where(mask, scores, lowest)
            elif self.spelling == "min-sdpa-bias":
                bias = torch.where(mask, 0.0, lowest).to(q.dtype)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.25).transpose(0, 1)
            out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        elif self.spelling == "soft-bias":  # a bias of -1e4: above attention_patterns.MASKED, so not a mask
            mask = block_diagonal_mask(cu_seqlens, q.shape[1])
            scores = q @ k.transpose(1, 2) * 0.25 + torch.where(mask, 0.0, -1e4)
            out = torch.softmax(scores, dim=-1) @ v
        elif self.spelling == "one-token-mask":  # the mask of a 1-token pack broadcast over all: no mask at all
            out = attend(q, k, v, block_diagonal_mask(cu_seqlens, 1), 0.25, self.sdpa)
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
  %0 = aten.sym_size.int(%a9, 0)  # sym s2
  %1 = prims.iota.default(%0, device='cpu', dtype=i64, requires_grad=False, start=-1, step=1)  # i64[s2]
  %2 = aten.clamp_min.default(%1, 0)  # i64[s2]
  %3 = aten.index.Tensor(%a9, [%2])  # i32[s2]
  %4 = aten.sub.Tensor(%a9, %3)  # i32[s2]
  %5 = aten.max.default(%4)  # i32[]
  %6 = aten._local_scalar_dense.default(%5)  # sym s3
  %7 = dzc.varlen_attention.default(%a2, %a6, %a7, %a9, %6, 0.25, %a3, %a5)  # f32[s0, s1, 16]
  %8 = aten.permute.default(%7, [1, 0, 2])  # f32[s1, s0, 16]
  %9 = aten.clone.default(%8, memory_format=torch.contiguous_format)  # f32[s1, s0, 16]
  %10 = aten.permute.default(%9, [1, 0, 2])  # f32[s0, s1, 16]
  return (%10,)
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


def test_a_pack_of_one_image_reuses_the_graph_inductor_compiled(seed):
    """The longest segment is read from cu_seqlens without a tensor of len(cu_seqlens) - 1 elements: Inductor
    propagates fake values again with guards on, and such a tensor's size was guarded to be at least 2, so a pack of
    one image recompiled (session 44: the multimodal encoder on an H100; on the CPU host here too)."""
    torch._dynamo.reset()
    module = PackedAttention("mask", sdpa=True, rotary=True)
    compiled = dzc.compile(module, "cuda", dzc.CompileOptions(autotune=False, fallback="inductor"))
    for lengths in ([5, 11, 8], [4, 6], [7]):
        inputs = _pack(lengths)
        assert_close_for_dtype(compiled(*inputs), module(*inputs))
    report = compiled.report
    assert report.fired()["fuse_vision_attention"] == 1
    assert report.compiles == 1 and report.recompiles == 0, str(report)[:2000]


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


@pytest.mark.parametrize("spelling", ["min-bias", "min-zeros-bias", "min-masked-fill", "min-where-scores",
                                      "min-sdpa-bias"])
def test_finfo_min_masks_fire(spelling, options, seed):
    """finfo.min in place of -inf: exact here, as every query sees at least its own key (no fully masked row)."""
    inputs = _pack([3, 9, 5])
    module = PackedAttention(spelling, sdpa=False)
    compiled, out = _compile(module, options, *inputs)
    after = dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]
    assert compiled.report.passes["fuse_vision_attention"] == 1, compiled.report.refusals["fuse_vision_attention"]
    assert "aten.bmm" not in after and "aten.where" not in after and "searchsorted" not in after
    assert_close_for_dtype(out, module(*inputs))


def test_finfo_min_mask_fires_in_bf16(options, seed):
    """bf16's finfo.min (-3.39e38), the mask built in the attention's dtype."""
    inputs = _pack([4, 12], dtype=torch.bfloat16)
    module = PackedAttention("min-masked-fill", sdpa=False)
    compiled, out = _compile(module, options, *inputs)
    assert compiled.report.passes["fuse_vision_attention"] == 1
    torch.testing.assert_close(out.float(), module(*inputs).float(), atol=2e-2, rtol=2e-2)


def test_soft_bias_above_the_masked_threshold_is_left_alone(options, seed):
    """-1e4 is a bias, not a mask (attention_patterns.MASKED is -65504): hidden keys keep some weight."""
    inputs = _pack([3, 9, 5])
    module = PackedAttention("soft-bias", sdpa=False)
    compiled, out = _compile(module, options, *inputs)
    assert compiled.report.passes["fuse_vision_attention"] == 0
    assert "dzc.varlen_attention" not in dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]
    assert_close_for_dtype(out, module(*inputs))


@pytest.mark.parametrize("sdpa", [False, True])
def test_refuses_mask_that_is_not_tokens_by_tokens(sdpa, options, seed):
    """A [1, 1] segment mask broadcast over the pack hides nothing: the op's segments would hide keys."""
    inputs = _pack([5, 7])
    module = PackedAttention("one-token-mask", sdpa=sdpa)
    compiled, out = _compile(module, options, *inputs)
    report = compiled.report
    assert report.passes["fuse_vision_attention"] == 0
    reasons = {reason for _, reason in report.refusals["fuse_vision_attention"]}
    assert reasons == {"the block-diagonal mask is not [tokens, tokens] over the attended tokens"}
    assert_close_for_dtype(out, module(*inputs))


class SegmentIdsAttention(PackedAttention):
    """The block-diagonal mask from segment ids searchsorted(cu_seqlens, arange, right=`right`) (or, `bucketize`,
    bucketize(arange, cu_seqlens, right=`right`): the same ids), compared column first (seg[:, None] ==
    seg[None, :]) or row first (the same mask). right=False is a model's off-by-one: the token at each cu_seqlens
    boundary joins the image before it, so the blocks are not cu_seqlens' segments."""

    def __init__(self, sdpa: bool, right: bool, row_first: bool, bucketize: bool = False):
        super().__init__("mask", sdpa)
        self.right, self.row_first, self.bucketize = right, row_first, bucketize

    def forward(self, q, k, v, cu_seqlens, cos, sin):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        tokens = q.shape[1]
        positions = torch.arange(tokens, dtype=cu_seqlens.dtype)
        segment = (torch.bucketize(positions, cu_seqlens, right=self.right) if self.bucketize
                   else torch.searchsorted(cu_seqlens, positions, right=self.right))
        mask = segment[None, :] == segment[:, None] if self.row_first else segment[:, None] == segment[None, :]
        return attend(q, k, v, mask, 0.25, self.sdpa).transpose(0, 1)


@pytest.mark.parametrize("sdpa", [False, True])
@pytest.mark.parametrize(("right", "row_first", "bucketize"), [(True, True, False), (False, False, False),
                                                               (False, True, False), (True, False, True),
                                                               (False, False, True)])
def test_segments_compared_row_first_fire_and_off_by_one_segments_are_left_alone(right, row_first, bucketize, sdpa,
                                                                                  options, seed):
    inputs = _pack([5, 11, 8])
    module = SegmentIdsAttention(sdpa, right, row_first, bucketize)
    compiled, out = _compile(module, options, *inputs)
    assert compiled.report.passes["fuse_vision_attention"] == right
    assert [k.op for k in compiled.report.kernels] == (["varlen_attention"] if right else [])
    assert ("dzc.varlen_attention" in dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]) == right
    assert_close_for_dtype(out, module(*inputs))


class InterleavedRotaryAttention(PackedAttention):
    """PackedAttention after the interleaved rotary on q and k, the pairs read as `pairs` says ("slice", "unbind",
    "reshape"; "mixed": interleaved on q, HF's half-split on k)."""

    def __init__(self, spelling: str, sdpa: bool, pairs: str):
        super().__init__(spelling, sdpa)
        self.pairs = pairs

    def forward(self, q, k, v, cu_seqlens, cos, sin):
        if self.pairs == "mixed":
            q, k = apply_interleaved_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        else:
            q, k = apply_interleaved_rotary(q, cos, sin, self.pairs), apply_interleaved_rotary(k, cos, sin, self.pairs)
        return super().forward(q, k, v, cu_seqlens, cos, sin)


def _interleaved_pack(lengths, pair_repeated=True, dtype=torch.float32):
    """_pack with cos, sin for the interleaved rotary: angles repeated per pair (or, pair_repeated=False, all
    head_dim angles different)."""
    q, k, v, cu, _, _ = _pack(lengths, dtype=dtype)
    angles = torch.randn(q.shape[0], q.shape[2] // 2)
    angles = angles.repeat_interleave(2, -1) if pair_repeated else torch.randn(q.shape[0], q.shape[2])
    return q, k, v, cu, angles.cos(), angles.sin()


AFTER_INTERLEAVED_ROTARY = """\
  %7 = aten.slice.Tensor(%a2, 2, 0, 9223372036854775807, 2)  # f32[s0, s1, 8]
  %8 = aten.slice.Tensor(%a2, 2, 1, 9223372036854775807, 2)  # f32[s0, s1, 8]
  %9 = aten.cat.default([%7, %8], 2)  # f32[s0, s1, 16]
  %10 = aten.slice.Tensor(%a6, 2, 0, 9223372036854775807, 2)  # f32[s0, s1, 8]
  %11 = aten.slice.Tensor(%a6, 2, 1, 9223372036854775807, 2)  # f32[s0, s1, 8]
  %12 = aten.cat.default([%10, %11], 2)  # f32[s0, s1, 16]
  %13 = aten.slice.Tensor(%a3, 1, 0, 9223372036854775807, 2)  # f32[s0, 8]
  %14 = aten.slice.Tensor(%a3, 1, 1, 9223372036854775807, 2)  # f32[s0, 8]
  %15 = aten.cat.default([%13, %14], 1)  # f32[s0, 16]
  %16 = aten.slice.Tensor(%a5, 1, 0, 9223372036854775807, 2)  # f32[s0, 8]
  %17 = aten.slice.Tensor(%a5, 1, 1, 9223372036854775807, 2)  # f32[s0, 8]
  %18 = aten.cat.default([%16, %17], 1)  # f32[s0, 16]
  %19 = dzc.varlen_attention.default(%9, %12, %a7, %a9, %6, 0.25, %15, %18)  # f32[s0, s1, 16]
  %20 = aten.permute.default(%19, [1, 0, 2])  # f32[s1, s0, 16]
  %21 = aten.clone.default(%20, memory_format=torch.contiguous_format)  # f32[s1, s0, 16]
  %22 = aten.permute.default(%21, [1, 0, 2])  # f32[s0, s1, 16]
  return (%22,)
"""


def test_golden_interleaved_rotary_folds_in_half_split_order(options, seed):
    """q, k, cos, sin handed to the op with their columns reordered evens-then-odds: the op's half-split rotary
    on them is the interleaved rotary reordered, and q.k (so the attention) does not see the order; v keeps it."""
    inputs = _interleaved_pack([5, 11, 8])
    module = InterleavedRotaryAttention("mask", sdpa=True, pairs="slice")
    compiled, out = _compile(module, options, *inputs)
    stages = dict(compiled.report.graphs[0].stages)
    assert "aten.neg" in stages["capture"]
    after = stages["fuse_vision_attention"]
    assert after.endswith(AFTER_INTERLEAVED_ROTARY), after
    assert "aten.neg" not in after and "aten.mul" not in after
    assert compiled.report.passes["fuse_vision_attention"] == 1
    assert_close_for_dtype(out, module(*inputs))


@pytest.mark.parametrize("pair_repeated", [True, False])
@pytest.mark.parametrize("rotary", ["slice", "unbind", "reshape"])
def test_interleaved_rotary_folds_and_matches(rotary, pair_repeated, options, seed):
    """Every spelling of the pairs; cos/sin need not be pair-repeated (the reordering is exact for any)."""
    inputs = _interleaved_pack([3, 9, 5], pair_repeated)
    module = InterleavedRotaryAttention("mask", sdpa=False, pairs=rotary)
    compiled, out = _compile(module, options, *inputs)
    after = dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]
    [op_line] = [line for line in after.splitlines() if "dzc.varlen_attention" in line]
    assert "None" not in op_line and "aten.neg" not in after
    assert compiled.report.passes["fuse_vision_attention"] == 1
    assert_close_for_dtype(out, module(*inputs))


def test_interleaved_rotary_per_image_split_in_bf16(options, seed):
    inputs = _interleaved_pack([4, 12], dtype=torch.bfloat16)
    module = InterleavedRotaryAttention("split", sdpa=True, pairs="unbind")
    compiled, out = _compile(module, options, *inputs)
    after = dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]
    [op_line] = [line for line in after.splitlines() if "dzc.varlen_attention" in line]
    assert "None" not in op_line and "aten.neg" not in after
    torch.testing.assert_close(out.float(), module(*inputs).float(), atol=2e-2, rtol=2e-2)


def test_mixed_rotaries_are_not_folded(options, seed):
    """Interleaved on q, half-split on k: no one column order makes both the op's rotary. The attention is still
    fused, on the q and k the model rotated itself."""
    inputs = _interleaved_pack([3, 9, 5])
    module = InterleavedRotaryAttention("mask", sdpa=False, pairs="mixed")
    compiled, out = _compile(module, options, *inputs)
    after = dict(compiled.report.graphs[0].stages)["fuse_vision_attention"]
    [op_line] = [line for line in after.splitlines() if "dzc.varlen_attention" in line]
    assert op_line.rstrip().split("  #")[0].endswith("None, None)") and "aten.neg" in after
    assert compiled.report.passes["fuse_vision_attention"] == 1
    assert_close_for_dtype(out, module(*inputs))


class NotASoftmax(nn.Module):
    """Per image, exp(s - shift) / sum(exp(s - shift)) with a shift that varies along the keys (softmax(s - shift),
    not softmax(s)), or exp(s - max) over the sum of another exp; "softmax" is the real one, spelled the same way.
    The look-alikes have the decomposed softmax's shape."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v, cu_seqlens, cos, sin):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        outs = []
        for a, b, c in zip(*(torch.split(t, lengths, dim=1) for t in (q, k, v))):
            scores = (a @ b.transpose(1, 2)) * 0.25
            if self.spelling == "shift-per-key":
                shift = scores.amax(-1, keepdim=True) + torch.arange(scores.shape[-1], dtype=scores.dtype)
            else:
                shift = scores.amax(-1, keepdim=True)
            numerator = torch.exp(scores - shift)
            denominator = torch.exp((scores - shift) * 0.5) if self.spelling == "other-denominator" else numerator
            outs.append((numerator / denominator.sum(-1, keepdim=True)) @ c)
        return torch.cat(outs, dim=1).transpose(0, 1)


@pytest.mark.parametrize("spelling", ["softmax", "shift-per-key", "other-denominator"])
def test_look_alike_softmax_is_left_alone(spelling, options, seed):
    inputs = _pack([5, 7])
    module = NotASoftmax(spelling)
    compiled, out = _compile(module, options, *inputs)
    assert compiled.report.passes["fuse_vision_attention"] == (spelling == "softmax")
    torch.testing.assert_close(out, module(*inputs))
