"""canonicalize_graph: golden IR per rule, that canonicalization alone changes no numbers (bit for bit), the cases
each rule must leave alone, and the matcher it is written in (passes/patterns.py)."""

import operator

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dzc import ir
from dzc.passes.canonicalize_graph import canonicalize_graph
from dzc.passes.graph_pass import copy_graph, note_scalar_constants
from dzc.passes.patterns import Cast, Op, Scalar, Var

aten = torch.ops.aten
prims = torch.ops.prims


def _capture(fn, *inputs) -> torch.fx.GraphModule:
    """The ATen graph of fn(*inputs) as capture hands it to the passes (Inductor's decompositions, fake values)."""
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)


def _canonical_and_exact(fn, *inputs):
    """(graph text before, after, the pass result); asserts that the canonical graph computes the same bits."""
    gm = _capture(fn, *inputs)
    before = ir.print_graph(gm.graph)
    result = canonicalize_graph(gm.graph)
    assert ir.print_graph(gm.graph) == before, "the pass mutated its input"
    ir.verify(result.graph)
    canonical = torch.fx.GraphModule(gm, result.graph)
    expected, actual = gm(*inputs), canonical(*inputs)
    for e, a in zip(expected, actual, strict=True):
        assert e.dtype == a.dtype and torch.equal(e, a), "canonicalization changed a number"
    return before, ir.print_graph(result.graph), result


def casts_everywhere(weight, x):
    """The upcast written twice (variance and normalised value), and a bf16 -> fp32 -> bf16 round trip."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    normed = (x.to(torch.float32) * torch.rsqrt(variance + 1e-6)).to(torch.bfloat16)
    return (weight * normed.float().to(torch.bfloat16),)


def test_golden_duplicate_and_round_trip_casts(seed):
    before, after, result = _canonical_and_exact(casts_everywhere, torch.randn(64).bfloat16(),
                                                 torch.randn(4, 64).bfloat16())
    assert before.count("convert_element_type") == 5
    assert after == """\
graph(%a0: bf16[64], %a1: bf16[4, 64]):
  %0 = prims.convert_element_type.default(%a1, f32)  # f32[4, 64]
  %1 = aten.pow.Tensor_Scalar(%0, 2)  # f32[4, 64]
  %2 = aten.mean.dim(%1, [-1], True)  # f32[4, 1]
  %3 = aten.add.Tensor(%2, 1e-06)  # f32[4, 1]
  %4 = aten.rsqrt.default(%3)  # f32[4, 1]
  %5 = aten.mul.Tensor(%0, %4)  # f32[4, 64]
  %6 = prims.convert_element_type.default(%5, bf16)  # bf16[4, 64]
  %7 = aten.mul.Tensor(%a0, %6)  # bf16[4, 64]
  return (%7,)
"""
    assert sorted(site.split(":")[0] for site in result.rewrites) == ["dedupe_cast", "fold_round_trip_cast"]


def promoted_operand(h):
    """`h * rsqrt(var)` on the bf16 h, with the variance over an upcast copy of h (T5's spelling)."""
    variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (h * torch.rsqrt(variance + 1e-6),)


def test_golden_promoted_operand_reads_the_existing_upcast(seed):
    before, after, _ = _canonical_and_exact(promoted_operand, torch.randn(4, 64).bfloat16())
    assert "aten.mul.Tensor(%a0, %4)" in before
    assert after == """\
graph(%a0: bf16[4, 64]):
  %0 = prims.convert_element_type.default(%a0, f32)  # f32[4, 64]
  %1 = aten.pow.Tensor_Scalar(%0, 2)  # f32[4, 64]
  %2 = aten.mean.dim(%1, [-1], True)  # f32[4, 1]
  %3 = aten.add.Tensor(%2, 1e-06)  # f32[4, 1]
  %4 = aten.rsqrt.default(%3)  # f32[4, 1]
  %5 = aten.mul.Tensor(%0, %4)  # f32[4, 64]
  return (%5,)
"""


def inexact_casts(x, y):
    """Round trips that change values: fp32 -> bf16 -> fp32 rounds; bf16 -> fp16 -> bf16 can overflow or lose
    low bits; a promotion with no upcast of the operand in the graph."""
    return x.bfloat16().float(), y.half().bfloat16(), y * x


def test_inexact_round_trips_and_promotions_without_an_upcast_are_left_alone(seed):
    before, after, result = _canonical_and_exact(inexact_casts, torch.randn(4, 64) * 1e5,
                                                 torch.randn(4, 64).bfloat16() * 1e5)
    assert after == before and result.rewrites == []


def _graph_with_noop_cast(returned: bool):
    """x: bf16 -> convert(x, bf16) -> neg, optionally returning the cast itself too."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16)
    cast = graph.call_function(prims.convert_element_type.default, (x, torch.bfloat16))
    cast.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16)
    neg = graph.call_function(aten.neg.default, (cast,))
    neg.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16)
    graph.output((neg, cast) if returned else (neg,))
    return graph


def test_noop_cast_is_folded_unless_the_graph_returns_it():
    folded = canonicalize_graph(_graph_with_noop_cast(returned=False))
    assert ir.print_graph(folded.graph) == """\
graph(%a0: bf16[4, 8]):
  %0 = aten.neg.default(%a0)  # bf16[4, 8]
  return (%0,)
"""
    assert [site.split(":")[0] for site in folded.rewrites] == ["fold_noop_cast"]
    # Returning x itself would make the output alias the input where it did not.
    kept = canonicalize_graph(_graph_with_noop_cast(returned=True))
    assert kept.rewrites == [] and "convert_element_type" in ir.print_graph(kept.graph)


def test_patterns_bind_names_to_one_value_and_backtrack():
    """mul(v, v) needs one v; a commutative Op tries both orders; a cast's inner pattern sees the cast's input."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    square = graph.call_function(aten.mul.Tensor, (a, a))
    product = graph.call_function(aten.mul.Tensor, (a, b))
    scaled = graph.call_function(aten.mul.Tensor, (2.0, square))
    cast = graph.call_function(prims.convert_element_type.default, (scaled, torch.float32))
    graph.output((product, cast))
    same = Op(aten.mul.Tensor, Var("v"), Var("v"))
    assert same.match(square)["v"] is a and same.match(product) is None
    scaled_square = Op(aten.mul.Tensor, same, Scalar("k"), commutative=True, name="scaled")
    match = Cast(scaled_square, name="cast").match(cast)
    assert (match["k"], match["v"], match["scaled"], match["cast"]) == (2.0, a, scaled, cast)
    assert match.nodes == [cast, scaled, square]
    assert Op(aten.mul.Tensor, same, Scalar("k")).match(scaled) is None  # the scalar is first: not without swapping
    assert Op(aten.mul.Tensor, Var("x"), Var("y"), kwargs={"alpha": 1}).match(product) is None


def test_literal_arguments_must_match():
    graph = torch.fx.Graph()
    pair = graph.placeholder("pair")
    first = graph.call_function(operator.getitem, (pair, 0))
    graph.output(first)
    assert Op(operator.getitem, Var("p"), 0).match(first)["p"] is pair
    assert Op(operator.getitem, Var("p"), 1).match(first) is None
    assert Op(operator.getitem, Var("p"), False).match(first) is None  # False == 0, but a flag is not an index


def test_scalar_constants_fold_in_a_copy_without_the_module(seed):
    """regions.flatten's graph is a copy, without the module holding the graph's constants: the values noted on the
    captured graph before (graph_pass.note_scalar_constants, which run_pipeline calls) fold there too. transformers
    5.17's GptOss builds its mask's fill as such a constant in the root graph, its layers region bodies: the
    windowed attention was refused there (session 44)."""
    def masked(s):
        return (torch.where(s > 0, torch.tensor(0.0), torch.tensor(-1e30)),)

    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
    gm = _capture(masked, x)
    assert ir.print_graph(gm.graph).count("aten.lift_fresh_copy.default") == 2
    bare = canonicalize_graph(copy_graph(gm.graph))
    assert not any("fold_scalar_constant" in site for site in bare.rewrites), bare.rewrites
    note_scalar_constants(gm.graph, gm)
    result = canonicalize_graph(copy_graph(gm.graph))
    assert sum("fold_scalar_constant" in site for site in result.rewrites) == 2, result.rewrites
    assert "lift_fresh_copy" not in ir.print_graph(result.graph)
    assert torch.equal(torch.fx.GraphModule(gm, result.graph)(x)[0], gm(x)[0])
