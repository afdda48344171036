"""The warm-compile cache (dzc/compile_cache.py): a fresh process over the same cache directory hits it, runs the
same rewritten graph (the same outputs, the fusion still in the report), and any component of the key that changes
(an option, the pass list, a version) misses; an unreadable entry is rebuilt with a warning."""

import dataclasses
import json
import operator
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import assert_add_rms_norm_matches_eager
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx.experimental.proxy_tensor import make_fx

import dzc
from dzc import compile_cache, frame_cache
from dzc.models.decoder import AddRMSNorm
from dzc.pipeline import build_pipeline
from dzc.targets import resolve_target

_WORKER = """
import json, sys, torch, dzc
from dzc.models.decoder import AddRMSNorm
cache, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = AddRMSNorm().to(torch.bfloat16)
x, residual = torch.randn(2, 7, 64, dtype=torch.bfloat16), torch.randn(2, 7, 64, dtype=torch.bfloat16)
compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=cache, autotune=False))
with torch.no_grad():
    y, h = compiled(x, residual)
torch.save({"y": y, "h": h, "x": x, "residual": residual, "weight": model.norm.weight}, out)
report = compiled.report
from torch._dynamo.utils import counters
print("RESULTS " + json.dumps({"cache": [g.compile_cache for g in report.graphs], "fired": report.fired(),
                               "frame": report.frame_cache, "traced": counters["frames"]["total"],
                               "summary": str(report), "stages": [sorted(g.compile_seconds) for g in report.graphs],
                               "check": [g.rewrite_check for g in report.graphs]}))
"""


def _run_worker(cache, out):
    env = dict(os.environ, DZC_COMPILE_CACHE="1")
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(cache), str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


def test_a_fresh_process_hits_the_cache_and_computes_the_same(tmp_path):
    cold = _run_worker(tmp_path / "cache", tmp_path / "cold.pt")
    warm = _run_worker(tmp_path / "cache", tmp_path / "warm.pt")
    frames = not frame_cache._unsupported_torch()  # (torch 2.13 keeps Dynamo's work: dzc/frame_cache.py)
    hit = "hit (frame entry: Dynamo and AOTAutograd skipped)" if frames else "hit"
    assert cold["cache"] == ["miss"] and warm["cache"] == [hit], (cold["cache"], warm["cache"])
    assert "compile cache: hit" in warm["summary"] and "compile time" in warm["summary"]
    if frames:  # Dynamo's bytecode and guards came from the frame entry: the warm process traced nothing.
        assert (cold["frame"], cold["traced"]) == ("stored", 1) and warm["traced"] == 0, (cold["frame"], warm["traced"])
        assert warm["frame"].startswith("hit (1 graph") and "frame entry: hit" in warm["summary"], warm["frame"]
        assert "dynamo" in cold["stages"][0] and "dynamo" not in warm["stages"][0], warm["stages"]
    assert cold["fired"] == warm["fired"] and warm["fired"].get("fuse_residual_norm") == 1, warm["fired"]
    # The whole compile came from the cache: no AOTAutograd trace, no pass, no second rewrite check (the cold
    # compile's passed; its first call returned the graph as captured, the warm one the fused kernel's results).
    assert "aot_autograd" in cold["stages"][0] and "aot_autograd" not in warm["stages"][0], warm["stages"]
    assert not any(stage.startswith("pass ") for stage in warm["stages"][0]), warm["stages"]
    assert cold["check"][0].startswith("passed") and warm["check"] == [cold["check"][0] + " (when the compile "
                                                                       "cache entry was built)"], warm["check"]
    second = torch.load(tmp_path / "warm.pt")
    model = AddRMSNorm().to(torch.bfloat16)
    with torch.no_grad():
        model.norm.weight.copy_(second["weight"])
    assert_add_rms_norm_matches_eager(model, second["x"], second["residual"], second["y"], second["h"])


def _compile_once(options, x, residual, model):
    compiled = dzc.compile(model, "cuda", options)
    with torch.no_grad():
        y, h = compiled(x, residual)
    assert_add_rms_norm_matches_eager(model, x, residual, y, h)
    [graph] = compiled.report.graphs
    return graph.compile_cache


@pytest.fixture
def norm_case(seed, monkeypatch):
    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    monkeypatch.setenv("DZC_FRAME_CACHE", "0")  # the graph and capture entries (frame entries: test_frame_cache)
    model = AddRMSNorm().to(torch.bfloat16)
    return model, torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)


def test_a_change_of_any_key_component_misses(options, norm_case, monkeypatch):
    model, x, residual = norm_case
    assert _compile_once(options, x, residual, model) == "miss"
    assert _compile_once(options, x, residual, model) == "hit"
    # an option
    assert _compile_once(dataclasses.replace(options, moe_fp8_activations=True), x, residual, model) == "miss"
    # the pass list
    disabled = dataclasses.replace(options, disable_passes=("reinplace_cache_writes",))
    assert _compile_once(disabled, x, residual, model) == "miss"
    # a version string
    versions = compile_cache.versions
    monkeypatch.setattr(compile_cache, "versions", lambda: {**versions(), "torch": "0.0.0-other"})
    assert _compile_once(options, x, residual, model) == "miss"
    monkeypatch.setattr(compile_cache, "versions", versions)
    assert _compile_once(options, x, residual, model) == "hit"
    # the cache directory is not part of the key: a copied directory hits
    copied = options.resolved_cache_dir() + "-copy"
    shutil.copytree(options.resolved_cache_dir(), copied)
    assert _compile_once(dataclasses.replace(options, cache_dir=copied), x, residual, model) == "hit"


def test_the_key_holds_every_component(options):
    """entry_key differs when any one component differs (the graph, input metadata, target, options, passes,
    versions) and not when only the cache directory does."""
    gm = torch.fx.symbolic_trace(lambda a: a + 1)
    target = resolve_target("cuda")
    passes = build_pipeline(target, options)
    inputs = [torch.empty(4, 8)]

    def key(text="graph", inputs=inputs, target=target, options=options, passes=passes, extra=None):
        return compile_cache.entry_key(text, gm, inputs, target, options, passes, extra)[0]

    base = key()
    assert key(options=dataclasses.replace(options, cache_dir="/elsewhere")) == base
    variants = [key(text="graph2"), key(inputs=[torch.empty(4, 8, dtype=torch.float16)]),
                key(inputs=[torch.empty(8, 4).t()]), key(target=resolve_target("musa")),
                key(options=dataclasses.replace(options, codegen="triton")), key(passes=passes[:-1]),
                key(extra={"triton": "other"}), key(extra={"dzc": "other"})]
    assert len({base, *variants}) == len(variants) + 1


def test_a_corrupted_entry_is_rebuilt_with_a_warning(options, norm_case):
    model, x, residual = norm_case
    assert _compile_once(options, x, residual, model) == "miss"
    [entry] = (compile_cache.CompileCache(options.resolved_cache_dir()).directory).glob("*.pkl")
    entry.write_bytes(entry.read_bytes()[: len(entry.read_bytes()) // 2])  # a write cut short
    with pytest.warns(RuntimeWarning, match="compile cache entry .* is unreadable"):
        state = _compile_once(options, x, residual, model)
    assert state.startswith("corrupted entry rebuilt"), state
    assert _compile_once(options, x, residual, model) == "hit"  # the rebuilt entry replaced it


def test_a_graph_pickles_to_the_bytes_graphpickler_writes():
    """pickle_graph makes GraphPickler's records itself (node arguments mapped without torch's pytree, the module's
    code generated once): the bytes GraphPickler.dumps writes, for nodes nested in lists, tuples, dicts, slices and
    FX's immutable containers, with fake values and symbolic sizes."""

    class Reference(GraphPickler):  # GraphPickler as compile_cache uses it, before its own records
        def reducer_override(self, obj):
            if isinstance(obj, FakeTensorMode):
                return compile_cache._no_mode, ()
            return super().reducer_override(obj)

    def f(x, y):
        n = x.shape[0]
        return torch.cat([x, y * 2], 0)[: n + 1].sum(0), x.view(-1)

    graph = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 3), torch.randn(2, 3)).graph
    x = next(iter(graph.nodes))
    with graph.inserting_before(graph.output_node()):
        nested = graph.call_function(operator.getitem, ((x, [x, {"a": (x, slice(None, x, 2))}]), 0))
        graph.call_function(torch.ops.aten.cat.default, (torch.fx.immutable_collections.immutable_list([x, nested]),),
                            torch.fx.immutable_collections.immutable_dict({"dim": 0}))
    root = torch.nn.Module()
    options = Options(ops_filter=None, node_metadata_key_filter=compile_cache._KEPT_METADATA.__contains__)
    with compile_cache._slice_as_pytree_node():
        expected = Reference.dumps(torch.fx.GraphModule(root, graph), options)
    assert compile_cache.pickle_graph(graph, root) == expected


def test_a_stored_graph_loads_as_graphpickler_loads_it():
    """The cache rebuilds a stored graph's nodes itself (compile_cache._NodeData, not through torch's pytree): the
    same graph as GraphPickler.loads makes, with nodes nested in lists, tuples, dicts and slices."""
    graph = torch.fx.Graph()
    x, n = graph.placeholder("x"), graph.placeholder("n")
    cat = graph.call_function(torch.ops.aten.cat.default, ([x, x],), {"dim": 0})
    item = graph.call_function(operator.getitem, (cat, (slice(None, n, None), 0)))
    graph.output({"item": (item, [cat, n])})
    data = compile_cache.pickle_graph(graph, torch.nn.Module())
    loaded = []
    for load in (GraphPickler.loads, compile_cache._load_graph_module):
        fake_mode = FakeTensorMode()
        with fake_mode, compile_cache._slice_as_pytree_node():
            loaded.append(load(data, fake_mode).graph)
    expected, actual = loaded
    assert actual.python_code("self").src == expected.python_code("self").src
    for want, got in zip(expected.nodes, actual.nodes, strict=True):
        assert (got.op, got.target, got.name, repr(got.args), repr(got.kwargs)) == \
            (want.op, want.target, want.name, repr(want.args), repr(want.kwargs))
        assert [type(a) for a in got.args] == [type(a) for a in want.args]
        assert [n.name for n in got.all_input_nodes] == [n.name for n in want.all_input_nodes]
