"""DSA prefill without a cache (issue 13, point 4): HF builds the packed-sequence mask from positions it computes as
arange(S) (`ids = cumsum(diff(pos) != 1)`, keep where pos[kv] <= pos[q] and ids[q] == ids[kv]); canonicalize_graph
proves it is the causal mask (fold_known_index, fold_and_true) and fuse_sparse_attention fuses as with a cache.
Position ids the caller passes may pack sequences: nothing is folded, the pass refuses, the output stays eager's.
Canonicalization alone changes no number (bit for bit)."""

import contextlib

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import dzc
from dzc import ir
from dzc.models.dsa import build_hf_deepseek_v32
from dzc.passes.canonicalize_graph import canonicalize_graph
from dzc.pipeline import run_pipeline
from dzc.targets import resolve_target

pytest.importorskip("transformers")

FOLDS = ["fold_and_true", "fold_and_true", "fold_known_index", "fold_known_index"]


def _pipeline_backend(stages, exact=None):
    """A torch.compile backend: dzc's capture and pass pipeline, then the graph runs as is (dzc ops with their
    references). `exact` (a list): also run the captured graph and canonicalize_graph's alone on every call and
    record whether they agree bit for bit."""
    def compile_graph(gm, _):
        graph, graph_stages = run_pipeline(gm.graph, resolve_target("cuda"))
        stages.append((graph, graph_stages))
        fused = torch.fx.GraphModule(gm, graph)
        if exact is None:
            return fused
        canonical = torch.fx.GraphModule(gm, canonicalize_graph(gm.graph).graph)

        def run(*args):
            captured, folded = gm(*args), canonical(*args)
            exact.append(all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                             for a, b in zip(captured, folded, strict=True)))
            return fused(*args)

        return run

    return aot_autograd(fw_compiler=compile_graph, inference_compiler=compile_graph,
                        decompositions=select_decomp_table())


def _pass(graph_stages, name):
    return next(stage.result for stage in graph_stages if stage.name == name)


def _rules(result):
    return sorted(site.split(":")[0] for site in result.rewrites)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_hf_deepseek_v32_prefill_without_cache_fuses_and_matches_eager(attn_implementation):
    """fp32 (the existing HF tests' tolerance, 1e-5), two lengths: the second a dynamic-shape graph."""
    model, (tokens,) = build_hf_deepseek_v32(attn_implementation=attn_implementation)
    stages, exact = [], []
    compiled = torch.compile(model, backend=_pipeline_backend(stages, exact))
    with torch.no_grad():
        for length in (6, 9):
            ids = torch.randint(0, model.config.vocab_size, (2, length),
                                generator=torch.Generator().manual_seed(length))
            expected = model(ids, use_cache=False).logits
            actual = compiled(ids, use_cache=False).logits
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert len(stages) == 2 and exact == [True, True]
    site = "sdpa_attention.py" if attn_implementation == "sdpa" else "modeling_deepseek_v32.py"
    for graph, graph_stages in stages:
        assert _rules(_pass(graph_stages, "canonicalize_graph")) == FOLDS
        fused = _pass(graph_stages, "fuse_sparse_attention")
        assert [where.split(":")[0] for where in fused.rewrites] == [site], fused.refusals
        assert not fused.refusals
        assert not any(n.target is torch.ops.aten.cumsum.default for n in graph.nodes)  # the packed ids are gone


def test_user_position_ids_which_may_pack_sequences_are_not_folded():
    """position_ids from the caller: row 0 packs two sequences of 3, which must not see each other. Nothing is
    proved, the pass refuses with its reason and the output is eager's (a causal fold would let row 0's second
    sequence attend to the first)."""
    model, (tokens,) = build_hf_deepseek_v32(attn_implementation="eager")
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    stages = []
    compiled = torch.compile(model, backend=_pipeline_backend(stages))
    with torch.no_grad():
        expected = model(tokens, position_ids=positions, use_cache=False).logits
        actual = compiled(tokens, position_ids=positions, use_cache=False).logits
        # The packing matters: row 0's second sequence, positioned alike, reads other keys than the causal mask's.
        causal = model(tokens, position_ids=positions, attention_mask=torch.ones_like(tokens), use_cache=False).logits
    assert not torch.allclose(causal[0, 3:], expected[0, 3:], atol=1e-3)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    (graph, graph_stages), = stages
    # Only HF's literal `True & mask` goes; the packed ids and the comparison of positions stay.
    assert _rules(_pass(graph_stages, "canonicalize_graph")) == ["fold_and_true"]
    assert any(n.target is torch.ops.aten.cumsum.default for n in graph.nodes)
    fused = _pass(graph_stages, "fuse_sparse_attention")
    assert not fused.rewrites
    assert [reason for _, reason in fused.refusals] == [
        "the attention mask is not causal + top-k: a comparison of key positions with something other than the "
        "query position (+ a constant)"]


def _compiled_bf16_prefill_without_cache(options, device):
    """dzc.compile (the kernels), bf16: the compile report says the rewrite fired; the logits match eager within the
    zoo's bf16 tolerance (4e-2 of the largest), but for top-k near-ties (at most one row in 16, tools/zoo.py)."""
    model, (tokens,) = build_hf_deepseek_v32(attn_implementation="eager")
    model, tokens = model.to(device, torch.bfloat16), tokens.to(device)
    compiled = dzc.compile(model, "cuda", options)
    with torch.no_grad():
        expected = model(tokens, use_cache=False).logits.float()
        actual = compiled(tokens, use_cache=False).logits.float()
    report = compiled.report
    # The folds depend on the device's spelling (CUDA lifts the mask's 0-d fill; the H200 run: 3 folds, CPU: 4).
    assert report.passes["fuse_sparse_attention"] == 1 and report.passes["canonicalize_graph"] >= 3
    assert {k.op for k in report.kernels} >= {"dsa_indexer", "sparse_attention"}
    rows_off = ((actual - expected).abs().amax(-1) > 4e-2 * expected.abs().max()).sum()
    assert rows_off <= max(1, expected[..., 0].numel() // 16), f"{rows_off} rows over the bf16 tolerance"
    return report


def test_compiled_hf_deepseek_v32_bf16_prefill_without_cache(options):
    _compiled_bf16_prefill_without_cache(options, "cpu")


@pytest.mark.gpu
def test_compiled_hf_deepseek_v32_bf16_prefill_without_cache_on_gpu(options):
    report = _compiled_bf16_prefill_without_cache(options, "cuda")
    assert all(k.execution == "cuda" for k in report.kernels), [k.execution for k in report.kernels]


# ---------------------------------------------------------------------------------------------------------------
# The rules on small graphs: golden IR, bit-exact, and what they must leave alone.


def _packed_mask(positions, scores):
    """HF's packed-sequence causal mask (masking_utils' find_packed_sequence_indices and mask functions) over
    [B, S] positions, applied to [B, S, S] scores."""
    batch, length = positions.shape
    ids = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1).ne(1).cumsum(-1)
    b = torch.arange(batch)[:, None, None]
    q, kv = torch.arange(length)[None, :, None], torch.arange(length)[None, None, :]
    keep = torch.ones((), dtype=torch.bool) & (positions[b, kv] <= positions[b, q]) & (ids[b, q] == ids[b, kv])
    return (scores.masked_fill(~keep, float("-inf")),)


def _fold(fn, *inputs, fake_mode=False):
    """(graph text after canonicalize_graph, its rewrite rules), asserting that the outputs are the same bits."""
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)
    with FakeTensorMode() if fake_mode else contextlib.nullcontext():
        result = canonicalize_graph(gm.graph)
    ir.verify(result.graph)
    for expected, actual in zip(gm(*inputs), torch.fx.GraphModule(gm, result.graph)(*inputs), strict=True):
        assert expected.dtype == actual.dtype and torch.equal(expected, actual), "canonicalization changed a number"
    return ir.print_graph(result.graph), _rules(result)


def test_golden_packed_mask_over_arange_positions_is_the_causal_mask(seed):
    scores = torch.randn(2, 5, 5)
    text, rules = _fold(lambda s: _packed_mask(torch.arange(5).expand(2, -1), s), scores)
    assert rules == FOLDS
    assert text == """\
graph(%a0: f32[2, 5, 5]):
  %0 = prims.iota.default(5, device='cpu', dtype=i64, requires_grad=False, start=0, step=1)  # i64[5]
  %1 = aten.expand.default(%0, [2, 1, 5])  # i64[2, 1, 5]
  %2 = prims.iota.default(5, device='cpu', dtype=i64, requires_grad=False, start=0, step=1)  # i64[5]
  %3 = aten.unsqueeze.default(%2, -1)  # i64[5, 1]
  %4 = aten.expand.default(%3, [2, 5, 1])  # i64[2, 5, 1]
  %5 = aten.le.Tensor(%1, %4)  # bool[2, 5, 5]
  %6 = aten.bitwise_not.default(%5)  # bool[2, 5, 5]
  %7 = aten.scalar_tensor.default(-inf, device='cpu', dtype=f32, layout=torch.strided)  # f32[]
  %8 = aten.where.self(%6, %7, %a0)  # f32[2, 5, 5]
  return (%8,)
"""


def test_positions_from_an_input_or_not_provably_in_bounds_are_left_alone(seed):
    scores = torch.randn(2, 6, 6)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    text, rules = _fold(_packed_mask, packed, scores)
    assert rules == ["fold_and_true"] and "aten.cumsum" in text  # only the literal `True & mask`
    # Positions stepping by 2: every token its own sequence. The ids are a proved arange (cumsum of ones), which
    # is folded where read, but the mask they make is not a constant: it stays, with the same values.
    _, rules = _fold(lambda s: _packed_mask(torch.arange(0, 12, 2).expand(2, -1), s), scores)
    assert "fold_and_true" in rules and "fold_known_index" in rules
    # A negative index reads from the end: not proved, not folded.
    text, rules = _fold(lambda s: (s[:, torch.arange(6) - 1],), scores)
    assert rules == [] and "aten.index.Tensor" in text


def _packed_mask_over_arange(positions, scores):
    """The same mask as HF builds it on CUDA (torch 2.11): the causal term over aranges, True & it first, the
    packed ids after, and a lifted 0-d tensor as the fill where a key is visible."""
    batch, length = positions.shape
    ids = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1).ne(1).cumsum(-1)
    b = torch.arange(batch)[:, None, None, None]
    q, kv = torch.arange(length)[None, None, :, None], torch.arange(length)[None, None, None, :]
    keep = (torch.ones((), dtype=torch.bool) & (kv <= q)) & (ids[b, q] == ids[b, kv])
    return (scores + torch.where(keep, torch.tensor(0.0), torch.finfo(torch.float32).min),)


def test_golden_mask_with_a_lifted_fill_and_a_broadcast_true(seed):
    """The spelling the H200 run met (session 11): `True & causal` folds although True's [B, 1, S, S] broadcasts
    the [1, 1, S, S] causal term (=> expand), and the lifted 0-d fill becomes full([], 0.0)."""
    scores = torch.randn(2, 1, 5, 5)
    # Under a fake mode, as dzc.compile runs its passes: the constant's value is read outside it.
    text, rules = _fold(lambda s: _packed_mask_over_arange(torch.arange(5).expand(2, -1), s), scores, fake_mode=True)
    assert rules.count("fold_scalar_constant") == 1 and "fold_and_true" in rules, rules
    # A constant of more than one element stays as captured.
    text_1d, rules_1d = _fold(lambda s: (s + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]),), scores)
    assert rules_1d == [] and "lift_fresh_copy" in text_1d
    assert text == """\
graph(%a0: f32[2, 1, 5, 5]):
  %0 = prims.iota.default(5, device='cpu', dtype=i64, requires_grad=False, start=0, step=1)  # i64[5]
  %1 = aten.unsqueeze.default(%0, 0)  # i64[1, 5]
  %2 = aten.unsqueeze.default(%1, 1)  # i64[1, 1, 5]
  %3 = aten.unsqueeze.default(%2, 3)  # i64[1, 1, 5, 1]
  %4 = prims.iota.default(5, device='cpu', dtype=i64, requires_grad=False, start=0, step=1)  # i64[5]
  %5 = aten.unsqueeze.default(%4, 0)  # i64[1, 5]
  %6 = aten.unsqueeze.default(%5, 1)  # i64[1, 1, 5]
  %7 = aten.unsqueeze.default(%6, 2)  # i64[1, 1, 1, 5]
  %8 = aten.le.Tensor(%7, %3)  # bool[1, 1, 5, 5]
  %9 = aten.expand.default(%8, [2, 1, 5, 5])  # bool[2, 1, 5, 5]
  %10 = aten.full.default([], 0.0, device='cpu', dtype=f32, layout=torch.strided, pin_memory=False)  # f32[]
  %11 = aten.scalar_tensor.default(-3.4028234663852886e+38, device='cpu', dtype=f32, layout=torch.strided)  # f32[]
  %12 = aten.where.self(%9, %10, %11)  # f32[2, 1, 5, 5]
  %13 = aten.add.Tensor(%a0, %12)  # f32[2, 1, 5, 5]
  return (%13,)
"""
