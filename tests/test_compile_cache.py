"""compile_cache.graph_function: the eager fallback's generated code, its bytecode kept in the cache directory."""

import torch
import torch.fx

from dzc import compile_cache


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))

    def forward(self, x):
        return torch.relu(x * self.scale) + 1


def test_graph_function_runs_as_graph_module_and_keeps_its_bytecode(tmp_path):
    traced = torch.fx.symbolic_trace(_Scaled())
    x = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])
    expected = torch.fx.GraphModule(traced, traced.graph)(x)
    first = compile_cache.graph_function(traced, traced.graph, tmp_path)
    stored = list((tmp_path / "compile" / "code").iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".marshal", stored
    written = stored[0].stat().st_mtime_ns
    second = compile_cache.graph_function(traced, traced.graph, tmp_path)  # loaded: the file is not written again
    assert stored[0].stat().st_mtime_ns == written
    assert torch.equal(first(x), expected) and torch.equal(second(x), expected)
    # A damaged file is compiled again and replaced; no cache directory compiles in memory only.
    stored[0].write_bytes(b"not bytecode")
    assert torch.equal(compile_cache.graph_function(traced, traced.graph, tmp_path)(x), expected)
    assert stored[0].read_bytes() != b"not bytecode"
    assert torch.equal(compile_cache.graph_function(traced, traced.graph, None)(x), expected)


def test_inductors_cache_key_changes_with_dzcs_source(tmp_path, monkeypatch):
    """Inductor's FX-graph cache key does not see node metadata, which dzc decides too (the symbols of a region
    body's data-dependent sizes, session 43): the module dzc hands Inductor carries dzc's source hash, so the
    same graph compiled by another dzc misses, and by the same dzc hits."""
    import dzc
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(4, 8)
    outcomes = []
    for run, source in enumerate(("a", "a", "b")):
        monkeypatch.setattr(compile_cache, "dzc_source_hash", lambda source=source: source)
        torch._dynamo.reset()
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=str(tmp_path / f"dzc{run}"),
                                                                 autotune=False, fallback="inductor"))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        outcomes.append((counters["inductor"]["fxgraph_cache_hit"] - hits,
                         counters["inductor"]["fxgraph_cache_miss"] - misses))
    # (a hit in every run too: nn.Sequential's guards cannot be saved in a frame entry, so dzc captures the model
    # again without one, and that second compile finds the first's artifact)
    assert [misses for _, misses in outcomes] == [1, 0, 1] and outcomes[1][0] >= 1, outcomes
