"""CompileOptions.check_rewrites: each graph's first call also runs the graph as captured, and a rewrite whose
results differ is dropped (warned, reported) while the call returns the right answer.

The wrong rewrites here are the real fuse_residual_norm with one mistake put into its result (the norm's eps
made 1.0): the fusion fires and the report says so, exactly as a pass that misread a structure would."""

import functools
import warnings

import pytest
import torch
from torch import nn

import dzc
import dzc.capture
import dzc.pipeline
from dzc import config, pinned_selections
from dzc.capture import _difference
from dzc.lowering import dzc_op_name
from dzc.models.decoder import AddRMSNorm


def _wrong_eps(graph_pass):
    """graph_pass, whose add_rms_norm nodes then normalise with eps=1.0 (the model's is 1e-6)."""

    @functools.wraps(graph_pass)
    def wrong(graph):
        result = graph_pass(graph)
        for node in result.graph.nodes:
            if dzc_op_name(node) == "add_rms_norm":
                node.update_arg(3, 1.0)
        return result

    return wrong


def _inputs(tokens=7, hidden=64, dtype=torch.float32):
    return torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype)


def _assert_matches_eager(model, outputs, x, residual):
    expected_y, expected_h = model(x, residual)
    torch.testing.assert_close(outputs[0], expected_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs[1], expected_h, atol=0, rtol=0)


def test_a_passing_check_is_recorded(options, seed):
    torch._dynamo.reset()
    model = AddRMSNorm(64)
    compiled = dzc.compile(model, "cuda", options)
    x, residual = _inputs()
    _assert_matches_eager(model, compiled(x, residual), x, residual)
    report = compiled.report
    assert report.fired() == {"fuse_residual_norm": 1} and not report.dropped_rewrites
    assert report.graphs[0].rewrite_check.startswith("passed (relative L2 error ")
    assert "rewrite check: passed" in str(report)


def test_a_wrong_rewrite_is_dropped_reported_and_the_output_is_eager(options, seed, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", _wrong_eps(dzc.pipeline.fuse_residual_norm))
    model = AddRMSNorm(64)
    compiled = dzc.compile(model, "cuda", options)
    x, residual = _inputs()
    with pytest.warns(RuntimeWarning, match=r"dropped the rewrites of fuse_residual_norm .*relative L2 error"):
        first = compiled(x, residual)
    _assert_matches_eager(model, first, x, residual)
    x, residual = _inputs(tokens=11)  # the rebuilt graph, not the check, runs from now on
    _assert_matches_eager(model, compiled(x, residual), x, residual)
    report = compiled.report
    assert report.compiles == 1 and report.fired() == {}
    [dropped] = report.dropped_rewrites
    assert dropped["pass"] == "fuse_residual_norm" and dropped["graph"] == "0/0" and len(dropped["sites"]) == 1
    assert "relative L2 error" in dropped["error"] and "float32" in dropped["error"]
    assert report.graphs[0].rewrite_check.startswith("dropped fuse_residual_norm")
    assert "add_rms_norm" not in dict(report.graphs[0].stages)["lowered"]
    assert not report.kernels  # the dropped rewrite's kernel left the report with it
    assert "REWRITE DROPPED: fuse_residual_norm in graph 0/0" in str(report)


class _UpcastOutput(nn.Module):
    """A bf16 add + RMSNorm whose result the model then computes on in fp32 (as logits are upcast): the fused
    kernel rounds in bf16 elsewhere than the model, which shows in the fp32 output at bf16's scale."""

    def __init__(self):
        super().__init__()
        self.norm = AddRMSNorm(64)

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        return (y.float() * 2 + 1).sigmoid(), h


@pytest.mark.parametrize("wrong", [False, True])
def test_an_fp32_output_of_bf16_compute_is_judged_at_bf16_precision(options, seed, monkeypatch, wrong):
    torch._dynamo.reset()
    if wrong:
        monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", _wrong_eps(dzc.pipeline.fuse_residual_norm))
    model = _UpcastOutput().to(torch.bfloat16)
    with torch.no_grad():
        model.norm.norm.weight.normal_(1.0, 0.1)
    compiled = dzc.compile(model, "cuda", options)
    x, residual = _inputs(dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        compiled(x, residual)
    check = compiled.report.graphs[0].rewrite_check
    if wrong:  # eps 1.0 instead of 1e-6 is still far outside bf16's bounds
        assert check.startswith("dropped fuse_residual_norm") and "computed in bfloat16" in check, check
    else:
        assert check.startswith("passed"), check
        assert compiled.report.fired() == {"fuse_residual_norm": 1}


class _NormThenCacheWrite(nn.Module):
    """A residual add + RMSNorm (fuse_residual_norm), a cache row written in place and read back
    (reinplace_cache_writes) and a step counter bumped in place: two passes fire, and two inputs are written."""

    def __init__(self, hidden=64):
        super().__init__()
        self.block = AddRMSNorm(hidden)

    def forward(self, x, residual, cache, slots, steps):
        y, h = self.block(x, residual)
        cache[slots] = h
        steps.add_(1)
        return y + cache.sum(0), steps * 2


def _cache_call(model):
    """A call's inputs for _NormThenCacheWrite, the caches' copies for eager, and eager's outputs on them."""
    x, residual = _inputs(tokens=3)
    cache, slots, steps = torch.randn(16, 64), torch.tensor([5, 2, 9]), torch.zeros((), dtype=torch.int64)
    expected_cache, expected_steps = cache.clone(), steps.clone()
    expected = model(x, residual, expected_cache, slots, expected_steps)
    return x, residual, cache, slots, steps, expected_cache, expected_steps, expected


def test_only_the_pass_at_fault_is_dropped_and_written_inputs_get_one_update(options, seed, monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", _wrong_eps(dzc.pipeline.fuse_residual_norm))
    model = _NormThenCacheWrite()
    compiled = dzc.compile(model, "cuda", options)
    x, residual, cache, slots, steps, expected_cache, expected_steps, expected = _cache_call(model)
    with pytest.warns(RuntimeWarning, match="dropped the rewrites of fuse_residual_norm"):
        actual = compiled(x, residual, cache, slots, steps)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache)
    assert steps.item() == 1, "the caller's input was written more (or less) than once"
    report = compiled.report
    assert [d["pass"] for d in report.dropped_rewrites] == ["fuse_residual_norm"]
    assert report.fired() == {"reinplace_cache_writes": 1}, report.passes
    lowered = dict(report.graphs[0].stages)["lowered"]
    assert "add_rms_norm" not in lowered and "index_put_" in lowered
    # The rebuilt graph on the next step: still eager's answer and one more write.
    actual = compiled(x, residual, cache, torch.tensor([1, 0, 3]), steps)
    expected = model(x, residual, expected_cache, torch.tensor([1, 0, 3]), expected_steps)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache) and steps.item() == 2


def test_a_graph_writing_inputs_too_large_to_copy_is_not_checked(options, seed, monkeypatch):
    """The check copies the inputs a graph writes twice; a KV cache at long context can be most of the device's
    memory. Where two copies would take over a quarter of what is free, the graph runs unchecked, and the report
    says why (here the host reports 8 KiB available: the 16 x 64 fp32 cache needs 2 x 4 KiB plus the counter)."""
    torch._dynamo.reset()
    page = 4096
    monkeypatch.setattr(dzc.capture.os, "sysconf", lambda name: 2 if name == "SC_AVPHYS_PAGES" else page)
    model = _NormThenCacheWrite()
    compiled = dzc.compile(model, "cuda", options)
    x, residual, cache, slots, steps, expected_cache, expected_steps, expected = _cache_call(model)
    actual = compiled(x, residual, cache, slots, steps)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache) and steps.item() == 1
    [graph] = compiled.report.graphs
    assert graph.rewrite_check.startswith("skipped: the inputs the graph writes") and "too large" in \
        graph.rewrite_check, graph.rewrite_check


class _NoisyNorm(AddRMSNorm):
    def forward(self, x, residual):
        y, h = super().forward(x, residual)
        return y + 1e-3 * torch.rand_like(y), h


def test_graphs_that_draw_random_numbers_are_not_checked(options, seed):
    torch._dynamo.reset()
    compiled = dzc.compile(_NoisyNorm(64), "cuda", options)
    compiled(*_inputs())
    report = compiled.report
    assert report.fired() == {"fuse_residual_norm": 1}
    assert report.graphs[0].rewrite_check == "skipped: the graph draws random numbers (aten.rand.default)"


def test_the_check_can_be_turned_off(options, seed, monkeypatch):
    """Off (option or DZC_CHECK_REWRITES=0), the wrong rewrite runs: the check is what caught it above."""
    monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", _wrong_eps(dzc.pipeline.fuse_residual_norm))
    model = AddRMSNorm(64)
    x, residual = _inputs()
    for switch in ({"check_rewrites": False}, {}):
        torch._dynamo.reset()
        with config.scope(DZC_CHECK_REWRITES="0"):
            compiled = dzc.compile(model, "cuda", dzc.CompileOptions(**{**vars(options), **switch}))
        y, _ = compiled(x, residual)
        assert not torch.allclose(y, model(x, residual)[0], atol=1e-2)
        assert compiled.report.fired() == {"fuse_residual_norm": 1} and not compiled.report.dropped_rewrites
        # (the second compile is built from the first one's compile cache entries: the same check, off)
        assert compiled.report.graphs[0].rewrite_check.startswith("skipped: off (CompileOptions.check_rewrites)")
    with config.scope(DZC_CHECK_REWRITES="yes"), pytest.raises(ValueError, match="DZC_CHECK_REWRITES"):
        dzc.compile(model, "cuda", options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tolerances_pass_rounding_and_catch_wrong_values(dtype, seed):
    expected = torch.randn(64, 256).to(dtype)
    # Every element an ulp away (the other rounding of a fused kernel)
    one_ulp = (expected.float() + torch.finfo(dtype).eps * expected.float().abs()).to(dtype)
    assert (one_ulp != expected).float().mean() > 0.9
    assert _difference([expected], [one_ulp], True)[0] is None
    dropped_rows = expected.clone()
    dropped_rows[:16] = 0  # a quarter of the rows lost (a mask that drops a segment)
    scaled = (expected.float() * 1.1).to(dtype)  # everything off by a tenth (a wrong scale or eps)
    for wrong in (dropped_rows, scaled):
        why = _difference([expected], [wrong], True)[0]
        assert why is not None and f"result 0 ({str(dtype)[6:]} [64, 256]): relative L2 error" in why
    nan = expected.clone()
    nan[0, 0] = float("nan")
    assert "NaN" in _difference([expected], [nan], True)[0]
    indices = torch.randint(0, 9, (5, 4))
    assert "elements differ" in _difference([indices], [indices.flip(0)], True)[0]
    assert _difference([indices], [indices.flip(0)], False)[0] is None  # top-k ties may order them otherwise


@pytest.mark.gpu
def test_a_wrong_rewrite_is_dropped_with_the_inductor_fallback(tmp_path, seed, monkeypatch):
    """On a GPU the rest of the graph goes to Inductor: the graph rebuilt without the pass at fault is compiled by
    Inductor at the first call (under the capture's tracing context), and keeps its symbolic token count."""
    torch._dynamo.reset()
    monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", _wrong_eps(dzc.pipeline.fuse_residual_norm))
    model = AddRMSNorm(64).cuda()
    options = dzc.CompileOptions(cache_dir=str(tmp_path), autotune=False, cuda_graph_max_tokens=0)
    compiled = dzc.compile(model, "cuda", options)
    with pytest.warns(RuntimeWarning, match="dropped the rewrites of fuse_residual_norm"):
        first = compiled(*(t.cuda() for t in _inputs()))
    assert first[0].is_cuda
    for tokens in (7, 300, 9):
        x, residual = (t.cuda() for t in _inputs(tokens))
        _assert_matches_eager(model, compiled(x, residual), x, residual)
    report = compiled.report
    assert report.compiles == 1 and report.graphs[0].fallback == "inductor" and report.fired() == {}


def test_a_near_tie_top_k_row_takes_the_captured_picks_and_no_other(seed):
    """dzc/pinned_selections.py on its own: the captured run's picks, then a rewritten run's scores where row 0's
    fourth and fifth place swapped by a hair (a near-tie: pinned) and row 1's first pick fell below every other score
    (a real difference: kept, for the outputs to show)."""
    scores = torch.randn(6, 16)
    with pinned_selections.Recorded(budget=1 << 20) as recorded:
        _, captured = torch.topk(scores, 4)
    assert len(recorded.picks) == 1 and not recorded.over_budget
    order = scores.argsort(-1, descending=True)
    rewritten = scores.clone()
    rewritten[0, order[0, 4]] = scores[0, order[0, 3]] + 1e-4 * scores[0].abs().max()
    rewritten[1, captured[1, 0]] = scores[1].min() - 1
    with pinned_selections.Pinned(recorded.picks, tolerance=2 ** -5) as pins:
        values, indices = torch.topk(rewritten, 4)
    assert pins.pinned == 1 and not pins.mismatch and pins.calls == 1
    assert torch.equal(indices[0], captured[0]) and torch.equal(values[0], rewritten[0, captured[0]])
    assert captured[1, 0] not in indices[1] and torch.equal(indices[1], order[1, 1:5])
    assert torch.equal(indices[2:], captured[2:])
    with pinned_selections.Pinned(recorded.picks, tolerance=2 ** -5) as pins:  # another size: not paired
        torch.topk(rewritten[:3], 4)
    assert pins.mismatch.startswith("top-k call 0 ((3, 4)) does not pair") and pins.pinned == 0
    with pinned_selections.Recorded(budget=16) as recorded:  # 24 int64 picks: over 16 bytes
        torch.topk(scores, 4)
    assert recorded.over_budget and not recorded.picks


class _NormThenRouter(nn.Module):
    """A bf16 residual add + RMSNorm feeding a top-2 router over 8 experts (an MoE router's selection in bf16):
    the fused norm rounds elsewhere than the model, which can flip a near-tie between two experts."""

    def __init__(self, hidden=64, experts=8):
        super().__init__()
        self.norm = AddRMSNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        weights, ids = self.router(y).float().softmax(-1).topk(2, dim=-1)
        return weights, ids, h


@pytest.mark.parametrize("wrong", [False, True])
def test_a_graph_selecting_in_bf16_is_checked_with_its_near_ties_pinned(options, seed, monkeypatch, wrong):
    """Before pinning such a graph was not checked at all ("selects among values ... not comparable")."""
    torch._dynamo.reset()
    if wrong:
        monkeypatch.setattr(dzc.pipeline, "fuse_residual_norm", _wrong_eps(dzc.pipeline.fuse_residual_norm))
    model = _NormThenRouter().to(torch.bfloat16)
    compiled = dzc.compile(model, "cuda", options)
    x, residual = _inputs(tokens=512, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        compiled(x, residual)
    check = compiled.report.graphs[0].rewrite_check
    if wrong:
        assert check.startswith("dropped fuse_residual_norm"), check
    else:
        assert check.startswith("passed (relative L2 error"), check
        assert compiled.report.fired() == {"fuse_residual_norm": 1}
