"""rotary_patterns: the rotary embedding read in each spelling (half-split; interleaved pairs by slice, unbind or
reshape) and the look-alikes it must not read as one; the fold into dzc.varlen_attention is tested through
fuse_vision_attention's golden IR (tests/test_fuse_vision_attention.py)."""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dzc.ops.varlen_attention import apply_vision_rotary
from dzc.passes.rotary_patterns import match_rotary
from tests.test_fuse_vision_attention import apply_interleaved_rotary


def _read(fn, dtype=torch.bfloat16):
    """match_rotary on the output of fn(x [tokens, heads, dim], cos, sin [tokens, dim]), and the placeholders."""
    inputs = (torch.randn(5, 2, 16).to(dtype), torch.randn(5, 16), torch.randn(5, 16))
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)
    return match_rotary(gm.graph.output_node().args[0]), [n for n in gm.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_half_split_rotary(dtype):
    rotary, (x, cos, sin) = _read(apply_vision_rotary, dtype)
    assert (rotary.x, rotary.cos, rotary.sin, rotary.interleaved) == (x, cos, sin, False)


@pytest.mark.parametrize("pairs", ["slice", "unbind", "reshape"])
def test_interleaved_rotary(pairs):
    rotary, (x, cos, sin) = _read(lambda x, cos, sin: apply_interleaved_rotary(x, cos, sin, pairs))
    assert (rotary.x, rotary.cos, rotary.sin, rotary.interleaved) == (x, cos, sin, True)


def _rotate_off_middle(x):
    return torch.cat([-x[..., 6:], x[..., :6]], -1)


def _rotate_other(x):
    shifted = x + 1
    return torch.cat([-shifted[..., 8:], shifted[..., :8]], -1)


@pytest.mark.parametrize("rotate", [_rotate_off_middle, _rotate_other], ids=["off-middle", "other-tensor"])
def test_look_alikes_are_not_rotaries(rotate):
    """A split off the middle, or the rotation of another tensor than the one multiplied by cos."""
    def fn(x, cos, sin):
        x32 = x.float()
        return (x32 * cos.unsqueeze(-2) + rotate(x32) * sin.unsqueeze(-2)).to(x.dtype)

    assert _read(fn)[0] is None


def test_rotary_computed_in_16_bits_is_not_read():
    """The op rotates in fp32: a rotary rounded at each step is another computation."""
    def fn(x, cos, sin):
        cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)
        return x * cos + torch.cat([-x[..., 8:], x[..., :8]], -1) * sin

    assert _read(fn)[0] is None
