"""attention_patterns' mask reader: the segment (block-diagonal, packed images) term in each spelling the reader
knows, the masks it must not read as one, and the list patterns of passes/patterns.py that the rotary reader uses."""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dzc.passes.attention_patterns import NotAMask, additive_terms, read_masked, split_masked
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


def test_list_patterns_match_element_by_element():
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    cat = graph.call_function(aten.cat.default, ([a, b], -1))
    graph.output(cat)
    assert Op(aten.cat.default, [Var("x"), Var("y")], -1).match(cat).bindings == {"x": a, "y": b}
    assert Op(aten.cat.default, [Var("x"), Var("x")], -1).match(cat) is None
    assert Op(aten.cat.default, [Var("x")], -1).match(cat) is None  # one pattern for two tensors
