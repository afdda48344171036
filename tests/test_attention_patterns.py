"""attention_patterns' mask reader: the segment (block-diagonal, packed images) term in each spelling the reader
knows, the masks it must not read as one; the attention reader (read_attention) on exact and look-alike softmaxes;
and the list patterns of passes/patterns.py that the rotary reader uses."""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dzc.passes.attention_patterns import NotAMask, additive_terms, read_attention, read_masked, split_masked
from dzc.passes.patterns import Op, Var

aten = torch.ops.aten
LOWEST = torch.finfo(torch.float32).min


def _segments(cu, tokens, right=True):
    seg = torch.searchsorted(cu, torch.arange(tokens, dtype=torch.int32), right=right)
    return seg[:, None] == seg[None, :]


SPELLINGS = {
    "additive": lambda s, cu: s + torch.where(_segments(cu, s.shape[-1]), 0.0, float("-inf")),
    "additive-drop": lambda s, cu: s + torch.where(~_segments(cu, s.shape[-1]), LOWEST, 0.0),
    "zeros-masked-fill": lambda s, cu: s + torch.zeros(s.shape[-2:]).masked_fill(~_segments(cu, s.shape[-1]), LOWEST),
    "masked-fill": lambda s, cu: s.masked_fill(~_segments(cu, s.shape[-1]), LOWEST),
    "where-scores": lambda s, cu: torch.where(_segments(cu, s.shape[-1]), s, LOWEST),
}


def _masked(spelling, tokens=6):
    """The graph's masked scores node (its output), and the cu_seqlens placeholder."""
    scores, cu = torch.randn(2, tokens, tokens), torch.tensor([0, 2, tokens], dtype=torch.int32)
    gm = make_fx(lambda s, c: SPELLINGS[spelling](s, c), decomposition_table=select_decomp_table(),
                 tracing_mode="fake")(scores, cu)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return gm.graph.output_node().args[0], placeholders


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_segment_term_in_every_spelling(spelling):
    masked, (scores, cu) = _masked(spelling)
    inner, terms, masks = read_masked(masked, keep_where=True)
    assert inner is scores and [term[0] for term in terms] == ["segment"] and len(masks) == 1
    (_, term_cu, eq), = terms
    assert term_cu is cu and eq.target is aten.eq.Tensor


def test_where_selecting_scores_is_read_only_when_asked():
    """where(m, s, M) is the vision pass's spelling; the decoder passes' split_masked leaves it unread."""
    masked, (scores, _) = _masked("where-scores")
    assert split_masked(masked) == (masked, [])


def test_segments_counted_left_are_not_the_packs_segments():
    """searchsorted(right=False) puts token cu[j] in the segment before it: no segment term."""
    def left(s, cu):
        return s + torch.where(_segments(cu, s.shape[-1], right=False), 0.0, float("-inf"))

    gm = make_fx(left, decomposition_table=select_decomp_table(), tracing_mode="fake")(
        torch.randn(2, 6, 6), torch.tensor([0, 2, 6], dtype=torch.int32))
    with pytest.raises(NotAMask, match="is not a causal, top-k or window keep mask"):
        additive_terms(_mask_of(gm))


def test_two_different_segmentations_compared_are_not_a_segment_term():
    def crossed(s, cu):
        a = torch.searchsorted(cu, torch.arange(s.shape[-1], dtype=torch.int32), right=True)
        b = torch.searchsorted(cu, torch.arange(s.shape[-1], dtype=torch.int32) + 1, right=True)
        return s + torch.where(a[:, None] == b[None, :], 0.0, float("-inf"))

    gm = make_fx(crossed, decomposition_table=select_decomp_table(), tracing_mode="fake")(
        torch.randn(2, 6, 6), torch.tensor([0, 2, 6], dtype=torch.int32))
    with pytest.raises(NotAMask, match="is not a causal, top-k or window keep mask"):
        additive_terms(_mask_of(gm))


def _mask_of(gm):
    """The additive mask of `scores + mask`, the graph's output."""
    return gm.graph.output_node().args[0].args[1]


def _softmax_attention(shift: str, mask: bool = False):
    """softmax(q k^T / 4 [masked to the segments]) v spelled exp(s - shift) / sum(..), the probabilities returned
    too: "max" (the decomposition), "max-with-column" (a softmax over a data-dependent key count: the max of the
    scores and a -inf column), "per-key" (a shift varying along the keys: not softmax(s))."""
    def attention(q, k, v, cu):
        s = q @ k.transpose(1, 2) * 0.25
        if mask:
            s = torch.where(_segments(cu, s.shape[-1]), s, LOWEST)
        row_max = s.amax(-1, keepdim=True)
        if shift == "max-with-column":
            row_max = torch.cat([s, torch.full_like(s[..., :1], float("-inf"))], -1).amax(-1, keepdim=True)
        elif shift == "per-key":
            row_max = row_max + torch.arange(s.shape[-1], dtype=s.dtype)
        e = torch.exp(s - row_max)
        p = e / e.sum(-1, keepdim=True)
        return p @ v, p

    gm = make_fx(attention, decomposition_table=select_decomp_table(), tracing_mode="fake")(
        *(torch.randn(2, 6, 8) for _ in range(3)), torch.tensor([0, 2, 6], dtype=torch.int32))
    pv = [n for n in gm.graph.nodes if n.target is aten.bmm.default][-1]
    return read_attention(pv), [n for n in gm.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("shift", ["max", "max-with-column"])
def test_attention_is_read_whatever_else_uses_its_probabilities(shift):
    core, (q, k, v, _) = _softmax_attention(shift)
    assert (core.q, core.k, core.v, core.scale, core.masks, core.terms) == (q, k, v, 0.25, [], [])


def test_attention_mask_is_read_as_terms():
    core, (q, _, _, cu) = _softmax_attention("max", mask=True)
    assert core.q is q and [term[0] for term in core.terms] == ["segment"] and core.terms[0][1] is cu


def test_softmax_shifted_along_the_keys_is_not_an_attention():
    core, _ = _softmax_attention("per-key")
    assert core is None


def test_list_patterns_match_element_by_element():
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    cat = graph.call_function(aten.cat.default, ([a, b], -1))
    graph.output(cat)
    assert Op(aten.cat.default, [Var("x"), Var("y")], -1).match(cat).bindings == {"x": a, "y": b}
    assert Op(aten.cat.default, [Var("x"), Var("x")], -1).match(cat) is None
    assert Op(aten.cat.default, [Var("x")], -1).match(cat) is None  # one pattern for two tensors


def test_a_scalar_mask_term_is_refused_not_a_crash():
    """A 0-d tensor added to the scores (transformers 5.17's GptOss graph has one) is no mask the readers know:
    NotAMask, which the passes turn into a refusal (it raised IndexError, failing the whole pass: session 44)."""
    gm = make_fx(lambda s, m: s + m, decomposition_table=select_decomp_table(),
                 tracing_mode="fake")(torch.randn(2, 6, 6), torch.tensor(-1.0))
    scalar_mask = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    with pytest.raises(NotAMask, match="is not a causal, top-k or window additive mask"):
        additive_terms(scalar_mask)
