"""Capture entries of the warm-compile cache (dzc/compile_cache.py): a second compile of the same Dynamo capture
skips AOTAutograd, the passes and the rewrite check, and still writes the inputs the model writes (bumping their
version counters, as AOTAutograd's wrapper does); graphs AOTAutograd's wrapper does more for, and entries whose
shape guards do not hold, go through AOTAutograd; an unreadable capture entry is rebuilt with a warning."""

import pickle

import pytest
import torch
from conftest import assert_add_rms_norm_matches_eager

import dzc
from dzc import compile_cache
from dzc.models.decoder import AddRMSNorm


class _AroundANorm(torch.nn.Module):
    """An add+RMSNorm (fuse_residual_norm fires) with something around it, in each subclass's forward."""

    def __init__(self):
        super().__init__()
        self.norm = AddRMSNorm()


class WritesACache(_AroundANorm):
    """An add+RMSNorm that also writes its input into a cache argument (as attention layers write KV caches)."""

    def forward(self, x, residual, cache):
        cache[:, : x.shape[1]].copy_(x)
        return self.norm(x, residual)


class ReturnsAView(_AroundANorm):
    """Its second output aliases its input: AOTAutograd's wrapper regenerates that view at every call."""

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        return y, x.view(-1)


class AddsAConstant(_AroundANorm):
    """A tensor made in forward: AOTAutograd lifts it into a constant the graph reads (get_attr)."""

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        return y, h + torch.tensor([0.5, -1.0] * 32, dtype=h.dtype)


@pytest.fixture
def cached_options(options, monkeypatch):
    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    monkeypatch.setenv("DZC_FRAME_CACHE", "0")  # capture entries as a capture meets them (frame entries skip it)
    return options


def _random_weights(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(1.0, 0.1)
    return model


def _inputs(seed, tokens=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, tokens, 64, generator=generator).to(torch.bfloat16) for _ in range(2)]



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_second_compile_skips_aot_autograd_and_still_writes_the_cache(cached_options, seed, device):
    """On the GPU the cache write is left to Inductor (the fallback there), which compiles again from its FX graph
    cache on the hit."""
    model = _random_weights(WritesACache().to(device, torch.bfloat16), seed)
    x, residual = (t.to(device) for t in _inputs(seed))
    graphs = []
    for _ in range(2):
        compiled = dzc.compile(model, "cuda", cached_options)
        for _call in range(2):  # the first call of the cold compile is its rewrite check: the second is the graph's
            cache = torch.full((2, 16, 64), float("nan"), dtype=torch.bfloat16, device=device)
            before = cache._version
            with torch.no_grad():
                y, h = compiled(x, residual, cache)
            assert_add_rms_norm_matches_eager(model.norm, x, residual, y, h)
            assert torch.equal(cache[:, :5], x) and cache[:, 5:].isnan().all(), "the cache write"
        [graph] = compiled.report.graphs
        graphs.append((graph, cache._version - before))
        assert compiled.report.fired().get("fuse_residual_norm") == 1, compiled.report.fired()
    (cold, cold_bumps), (warm, warm_bumps) = graphs
    # The version counter goes up as much without AOTAutograd's wrapper as with it (autograd and the CUDA-graph
    # runner read it).
    assert warm_bumps == cold_bumps > 0, (cold_bumps, warm_bumps)
    assert cold.compile_cache == "miss" and warm.compile_cache == "hit", (cold.compile_cache, warm.compile_cache)
    assert "aot_autograd" in cold.compile_seconds and "aot_autograd" not in warm.compile_seconds
    assert warm.rewrite_check.endswith("(when the compile cache entry was built)"), warm.rewrite_check


def test_a_graph_whose_wrapper_replays_an_alias_goes_through_aot_autograd(cached_options, seed):
    model = _random_weights(ReturnsAView().to(torch.bfloat16), seed)
    x, residual = _inputs(seed)
    states = []
    for _ in range(2):
        compiled = dzc.compile(model, "cuda", cached_options)
        with torch.no_grad():
            y, flat = compiled(x, residual)
        assert flat._base is x or flat.data_ptr() == x.data_ptr(), "the output is a view of the input"
        [graph] = compiled.report.graphs
        states.append((graph.compile_cache, "aot_autograd" in graph.compile_seconds))
    assert states[0] == ("miss", True), states
    assert states[1][0].startswith("hit after AOTAutograd (no capture entry: AOTAutograd's wrapper is needed")
    assert states[1][1], states


def _capture_entries(options):
    return sorted((compile_cache.CompileCache(options.resolved_cache_dir()).directory / "capture").glob("*.pkl"))


def test_an_entry_whose_shape_guards_fail_is_a_miss(cached_options, seed):
    model = _random_weights(AddRMSNorm().to(torch.bfloat16), seed)
    x, residual = _inputs(seed)
    with torch.no_grad():
        dzc.compile(model, "cuda", cached_options)(x, residual)
    [path] = _capture_entries(cached_options)
    stored = pickle.loads(path.read_bytes())
    assert stored["entry"].guards, "dynamic token sizes: the entry has shape guards"
    stored["entry"].guards = "L['t0'] > 1000000"  # false for these sizes
    path.write_bytes(pickle.dumps(stored))
    compiled = dzc.compile(model, "cuda", cached_options)
    with torch.no_grad():
        y, h = compiled(x, residual)
    assert_add_rms_norm_matches_eager(model, x, residual, y, h)
    [graph] = compiled.report.graphs
    assert "aot_autograd" in graph.compile_seconds and graph.compile_cache == "hit", graph.compile_cache


def test_an_unreadable_capture_entry_is_rebuilt_with_a_warning(cached_options, seed):
    model = _random_weights(AddRMSNorm().to(torch.bfloat16), seed)
    x, residual = _inputs(seed)
    with torch.no_grad():
        dzc.compile(model, "cuda", cached_options)(x, residual)
    [path] = _capture_entries(cached_options)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.warns(RuntimeWarning, match="compile cache entry .* is unreadable"):
        compiled = dzc.compile(model, "cuda", cached_options)
        with torch.no_grad():
            compiled(x, residual)
    [graph] = compiled.report.graphs
    assert "aot_autograd" in graph.compile_seconds
    compiled = dzc.compile(model, "cuda", cached_options)
    with torch.no_grad():
        y, h = compiled(x, residual)
    assert_add_rms_norm_matches_eager(model, x, residual, y, h)
    [graph] = compiled.report.graphs
    assert "aot_autograd" not in graph.compile_seconds and graph.compile_cache == "hit"


def test_a_graph_with_tensor_constants_is_cached_with_them(cached_options, seed):
    model = _random_weights(AddsAConstant().to(torch.bfloat16), seed)
    x, residual = _inputs(seed)
    offset = torch.tensor([0.5, -1.0] * 32, dtype=torch.bfloat16)
    states = []
    for _ in range(2):
        compiled = dzc.compile(model, "cuda", cached_options)
        with torch.no_grad():
            y, shifted = compiled(x, residual)
            _, h = model.norm(x, residual)
        torch.testing.assert_close(shifted, h + offset, rtol=0, atol=float(torch.finfo(torch.bfloat16).eps) * 8)
        [graph] = compiled.report.graphs
        states.append((graph.compile_cache, "aot_autograd" in graph.compile_seconds))
    assert states == [("miss", True), ("hit", False)], states
