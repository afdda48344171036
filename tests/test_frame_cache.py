"""Frame entries (dzc/frame_cache.py): a later compile of the same model code over the same cache directory installs
Dynamo's saved bytecode and guards and builds its graphs from their capture entries, so Dynamo traces nothing while
the guards hold; guards that reject a call still make Dynamo compile (and the entry grows); a guard torch cannot
save on an object not found by name refuses the frame entry; a damaged entry is replaced."""

import dataclasses
import gc
import itertools
import pickle
import re

import pytest
import torch
from conftest import assert_add_rms_norm_matches_eager, assert_warm_values_rebuilt
from torch._dynamo.utils import counters

import dzc
from dzc import capture, compile_cache, frame_cache, regions
from dzc.models import build_model
from dzc.models.decoder import AddRMSNorm
from dzc.targets import triton_codegen

HIT = "hit (frame entry: Dynamo and AOTAutograd skipped)"
pytestmark = pytest.mark.skipif(bool(frame_cache._unsupported_torch()), reason=frame_cache._unsupported_torch())


@pytest.fixture
def norm(seed, monkeypatch):
    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    monkeypatch.setenv("DZC_FRAME_CACHE", "1")
    model = AddRMSNorm().to(torch.bfloat16)
    with torch.no_grad():
        model.norm.weight.normal_(1.0, 0.1)
    generator = torch.Generator().manual_seed(seed)
    return model, [torch.randn(2, 5, 64, generator=generator).bfloat16() for _ in range(2)]


def _frames_directory(options):
    return compile_cache.CompileCache(options.resolved_cache_dir()).frame_path("").parent


def _compile_and_run(model, options, inputs):
    """(report, outputs of the second call, frames Dynamo tried during both) of a fresh dzc.compile called twice
    (a cold compile's first call runs the graph as captured, for its rewrite check)."""
    compiled = dzc.compile(model, "cuda", options)
    frames = counters["frames"]["total"]
    with torch.no_grad():
        for _ in range(2):
            outputs = compiled(*[t.clone() for t in inputs])  # (a compile marks its first inputs' dims dynamic)
    report = compiled.report
    del compiled
    gc.collect()  # the graphs Dynamo installed go with the compiled model (a later load may install them again)
    return report, outputs, counters["frames"]["total"] - frames


def test_a_second_compile_skips_dynamo_and_computes_the_same(options, norm):
    model, inputs = norm
    cold, cold_out, cold_frames = _compile_and_run(model, options, inputs)
    assert cold.frame_cache == "stored" and cold_frames == 1, cold.frame_cache
    warm, warm_out, warm_frames = _compile_and_run(model, options, inputs)
    assert warm.frame_cache.startswith("hit (1 graph"), warm.frame_cache
    assert warm_frames == 0, "Dynamo traced the model"
    [graph] = warm.graphs
    assert graph.compile_cache == HIT and "dynamo" not in graph.compile_seconds, graph.compile_seconds
    assert warm.fired() == cold.fired() and warm.fired().get("fuse_residual_norm") == 1, warm.fired()
    assert all(torch.equal(a, b) for a, b in zip(cold_out, warm_out)), "the same rewritten graph computes the same"
    assert_add_rms_norm_matches_eager(model, *inputs, *warm_out)


def test_a_call_the_guards_reject_is_compiled_and_the_entry_grows(options, norm):
    model, inputs = norm
    _compile_and_run(model, options, inputs)
    compiled = dzc.compile(model, "cuda", options)
    wider = [torch.randn(3, 64).bfloat16() for _ in range(2)]  # another rank: the saved guards reject it
    with torch.no_grad():
        compiled(*[t.clone() for t in inputs])
        frames = counters["frames"]["total"]
        y, h = compiled(*wider)
    assert counters["frames"]["total"] > frames, "Dynamo compiled the call the guards rejected"
    assert_add_rms_norm_matches_eager(model, *wider, y, h)
    assert [g.compile_cache == HIT for g in compiled.report.graphs] == [True, False], compiled.report.graphs
    del compiled
    gc.collect()
    # Both graphs are in the entry now: a third compile traces neither call.
    compiled = dzc.compile(model, "cuda", options)
    frames = counters["frames"]["total"]
    with torch.no_grad():
        compiled(*[t.clone() for t in inputs])
        compiled(*[t.clone() for t in wider])
    assert counters["frames"]["total"] == frames and compiled.report.frame_cache.startswith("hit (2 graphs")


def test_a_deep_models_warm_load_repeats_no_per_layer_work(options, monkeypatch):
    """A warm load's work grows with the model's depth only through the graph's nodes: each distinct kernel is
    loaded once however many layers run it, the graph's Python code is generated once (the eager fallback's), and
    Python's cyclic GC is paused while the entry loads (its full collections scanned the whole heap, more of them
    the deeper the model)."""
    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    monkeypatch.setenv("DZC_FRAME_CACHE", "1")
    model, (tokens,) = build_model("llama_decoder", layers=4)
    cold, cold_out, _ = _compile_and_run(model, options, [tokens])
    assert cold.frame_cache == "stored", cold.frame_cache
    loaded, generated, collecting = [], [], []
    load, python_code, install = triton_codegen.load, torch.fx.Graph.python_code, frame_cache.FrameCache._install

    def counted_load(family, path, spec, profile):
        loaded.append(str(path))
        return load(family, path, spec, profile)

    def counted_python_code(graph, *args, **kwargs):
        generated.append(len(graph.nodes))
        return python_code(graph, *args, **kwargs)

    def install_seeing_gc(frames, stored):
        collecting.append(gc.isenabled())
        return install(frames, stored)

    monkeypatch.setattr(triton_codegen, "load", counted_load)
    monkeypatch.setattr(torch.fx.Graph, "python_code", counted_python_code)
    monkeypatch.setattr(frame_cache.FrameCache, "_install", install_seeing_gc)
    warm, warm_out, frames = _compile_and_run(model, options, [tokens])
    assert warm.frame_cache.startswith("hit (1 graph") and frames == 0, warm.frame_cache
    assert warm.fired() == cold.fired() == {"fuse_residual_norm": 8}, warm.fired()
    kernels = [k for k in warm.kernels if k.codegen == "triton"]
    assert any(k.uses > 1 for k in kernels), [(k.kernel_id, k.uses) for k in kernels]  # shared by the layers
    assert sorted(loaded) == sorted(k.source_path for k in kernels), loaded
    assert len(generated) == 1, generated
    assert collecting == [False] and gc.isenabled()
    assert "dynamo guards" in warm.graphs[0].compile_seconds, warm.graphs[0].compile_seconds
    assert all(torch.equal(a, b) for a, b in zip(cold_out, warm_out))


def test_a_warm_load_rebuilds_no_fake_values(options, monkeypatch):
    """A frame entry's graph comes back without its fake values (rebuilding them through torch's MetaConverter was
    most of a warm load): lowering reads the specs stored beside the graph, the lowered graph's text comes from the
    types stored there, its coverage and host syncs are the cold build's, and the report says what it said."""
    monkeypatch.setenv("DZC_COMPILE_CACHE", "1")
    monkeypatch.setenv("DZC_FRAME_CACHE", "1")
    model, (tokens,) = build_model("llama_decoder", layers=2)
    cold, cold_out, _ = _compile_and_run(model, options, [tokens])
    assert cold.frame_cache == "stored", cold.frame_cache
    loads, coverage = [], []
    deferred_values, graph_coverage = compile_cache._DeferredValues, capture.graph_coverage

    def kept(*args):
        loads.append(deferred_values(*args))
        return loads[-1]

    monkeypatch.setattr(compile_cache, "_DeferredValues", kept)
    monkeypatch.setattr(capture, "graph_coverage", lambda *a: coverage.append(a) or graph_coverage(*a))
    warm, warm_out, frames = _compile_and_run(model, options, [tokens])
    assert warm.frame_cache.startswith("hit (1 graph") and frames == 0, warm.frame_cache
    [values] = loads
    tensors = [item for items in values.storages.values() for item in items]
    rebuilt = [item for item in tensors if item.value is not None]
    assert len(rebuilt) == 1 and len(tensors) > 50, (len(rebuilt), len(tensors))  # the first input's (its device)
    assert coverage == [], "coverage was computed again"
    [cold_graph], [warm_graph] = cold.graphs, warm.graphs
    assert warm_graph.host_syncs == cold_graph.host_syncs
    assert warm_graph.coverage == dataclasses.replace(cold_graph.coverage, compile_id=warm_graph.compile_id)
    scope = re.compile(r"\.m\d+\b")  # each compiled model's kernel table (capture.DzcBackend.kernels)
    lowered = [scope.sub("", dict(g.stages)["lowered"]) for g in (cold_graph, warm_graph)]
    assert lowered[0] == lowered[1]
    assert all(torch.equal(a, b) for a, b in zip(cold_out, warm_out))


def test_a_warm_hit_lowered_otherwise_computes_its_analyses_again(options, norm, monkeypatch):
    """Where the hit's lowered graph is not the one the entry's coverage and host syncs were worked out on (another
    lowering outcome), every value is rebuilt and both are computed again."""
    model, inputs = norm
    cold, cold_out, _ = _compile_and_run(model, options, inputs)
    loads, coverage = [], []
    deferred_values, graph_coverage = compile_cache._DeferredValues, capture.graph_coverage
    monkeypatch.setattr(compile_cache, "_DeferredValues",
                        lambda *args: loads.append(deferred_values(*args)) or loads[-1])
    monkeypatch.setattr(capture, "graph_coverage", lambda *a: coverage.append(a) or graph_coverage(*a))
    monkeypatch.setattr(compile_cache, "lowering_outcome", lambda graph: "another outcome")
    warm, warm_out, frames = _compile_and_run(model, options, inputs)
    assert warm.frame_cache.startswith("hit (1 graph") and frames == 0, warm.frame_cache
    [values] = loads
    assert len(coverage) == 1 and values.pending == {}
    [cold_graph], [warm_graph] = cold.graphs, warm.graphs
    assert warm_graph.host_syncs == cold_graph.host_syncs
    assert warm_graph.coverage == dataclasses.replace(cold_graph.coverage, compile_id=warm_graph.compile_id)
    assert all(torch.equal(a, b) for a, b in zip(cold_out, warm_out))


@pytest.mark.parametrize("inductor_cache", [True, False])
def test_a_warm_hit_compiled_by_inductor_rebuilds_values_only_where_inductor_compiles(options, norm, monkeypatch,
                                                                                    inductor_cache):
    """Inductor reads every node's value where it compiles the graph: a hit whose fallback it compiles (forced
    here, on the CPU) rebuilds the inputs' and outputs' values only where Inductor's FX graph cache hits (the cold
    compile's artifacts), and every value first where that cache is off (or misses); both compute what the cold
    compile did."""
    _, inputs = norm
    model = LeavesOpsToInductor().to(torch.bfloat16)
    options = dataclasses.replace(options, fallback="inductor")
    # The kernel ids in the graph Inductor hashes name the compiled model's serial: as in a second process, the
    # warm compile's is the cold one's.
    monkeypatch.setattr(capture, "_BACKEND_SERIAL", itertools.count(1000))
    cold, cold_out, _ = _compile_and_run(model, options, inputs)
    loads, deferred_values = [], compile_cache._DeferredValues
    monkeypatch.setattr(compile_cache, "_DeferredValues",
                        lambda *args: loads.append(deferred_values(*args)) or loads[-1])
    monkeypatch.setattr(capture, "_BACKEND_SERIAL", itertools.count(1000))
    with torch._inductor.config.patch(fx_graph_cache=inductor_cache):
        warm, warm_out, frames = _compile_and_run(model, options, inputs)
    assert cold.frame_cache == "stored" and warm.frame_cache.startswith("hit (1 graph") and frames == 0, \
        (cold.frame_cache, warm.frame_cache)
    assert warm.graphs[0].fallback == "inductor" and warm.graphs[0].compile_cache == HIT, warm.graphs[0].fallback
    [values] = loads
    assert_warm_values_rebuilt(values, inductor_cache)
    assert all(torch.equal(a, b) for a, b in zip(cold_out, warm_out))


def test_another_option_or_the_knob_off_misses(options, norm, monkeypatch):
    model, inputs = norm
    _compile_and_run(model, options, inputs)
    other, _, frames = _compile_and_run(model, dataclasses.replace(options, moe_fp8_activations=True), inputs)
    assert other.frame_cache == "stored" and frames == 1, other.frame_cache
    monkeypatch.setenv("DZC_FRAME_CACHE", "0")
    off, _, frames = _compile_and_run(model, options, inputs)
    assert off.frame_cache.startswith("off") and frames == 1, off.frame_cache


def test_an_unreadable_entry_is_replaced(options, norm):
    model, inputs = norm
    _compile_and_run(model, options, inputs)
    [path] = _frames_directory(options).glob("*.pkl")
    path.write_bytes(path.read_bytes()[:100])
    damaged, outputs, frames = _compile_and_run(model, options, inputs)
    assert damaged.frame_cache.startswith("stored (entry unreadable, replaced") and frames == 1, damaged.frame_cache
    assert_add_rms_norm_matches_eager(model, *inputs, *outputs)
    warm, _, frames = _compile_and_run(model, options, inputs)
    assert warm.frame_cache.startswith("hit") and frames == 0, warm.frame_cache


def _make_scale(factor):
    def scale(t):
        return t * factor
    return scale


SCALE = _make_scale(2)  # a function made by a factory: not found by name in another process


class CallsAMadeFunction(AddRMSNorm):
    def forward(self, x, residual):
        y, h = super().forward(x, residual)
        return SCALE(y), h


def test_a_guard_on_an_object_not_found_by_name_refuses_the_entry(options, norm):
    _, inputs = norm
    model = CallsAMadeFunction().to(torch.bfloat16)
    compiled = dzc.compile(model, "cuda", options)
    with torch.no_grad():
        y, h = compiled(*inputs)
        expected_y, expected_h = model(*inputs)
    report = compiled.report
    assert report.frame_cache.startswith("off (a CLOSURE_MATCH guard on G['SCALE']"), report.frame_cache
    assert len(report.graphs) == 1 and report.fired().get("fuse_residual_norm") == 1, report.graphs
    torch.testing.assert_close(h, expected_h, rtol=0, atol=2 ** -6)
    torch.testing.assert_close(y, expected_y, rtol=2 ** -6, atol=2 ** -5)
    assert not list(_frames_directory(options).glob("*.pkl"))


def test_a_model_with_hooks_has_no_frame_entry(options, norm):
    model, inputs = norm
    model.register_forward_hook(lambda module, args, output: None)
    report, _, _ = _compile_and_run(model, options, inputs)
    assert report.frame_cache == "off (it has forward hooks (dzc would compile forward alone))"


def module_function():
    return 1


def test_objects_found_by_name():
    assert frame_cache._by_name(torch) == "torch"
    assert frame_cache._by_name(torch.ops.dzc) == "torch:ops.dzc"
    assert frame_cache._by_name(torch.ops.dzc.add_rms_norm) == "torch:ops.dzc.add_rms_norm"
    assert frame_cache._by_name(torch.zeros_like) == "torch:zeros_like"  # a C builtin, by its module's name
    assert frame_cache._by_name(module_function) == f"{__name__}:module_function"
    assert frame_cache._by_name(SCALE) is None and frame_cache._by_name(torch.nn.Linear(2, 2)) is None
    assert frame_cache._holds("torch:ops.dzc") and not frame_cache._holds("torch:no_such_attribute")


def test_marked_layer_classes_pickle_as_themselves():
    """Dynamo's guards on a marked layer's type are saved by reference (dzc/regions.py names the subclass)."""
    marked = regions._region_class(AddRMSNorm)
    assert marked.__name__ == "AddRMSNorm" and pickle.loads(pickle.dumps(marked)) is marked


class LeavesOpsToInductor(AddRMSNorm):
    """An add+RMSNorm with elementwise ops after it: on a GPU the fallback compiles them with Inductor."""

    def forward(self, x, residual):
        y, h = super().forward(x, residual)
        return torch.relu(y) * 2 + 1, h


@pytest.mark.gpu
def test_a_frame_entry_on_the_gpu_builds_its_inductor_fallback(options, norm):
    """The graph of a frame entry is built outside Dynamo's trace: Inductor compiles its leftovers there too."""
    _, inputs = norm
    model = LeavesOpsToInductor().to("cuda", torch.bfloat16)
    inputs = [t.cuda() for t in inputs]
    cold, cold_out, _ = _compile_and_run(model, options, inputs)
    warm, warm_out, frames = _compile_and_run(model, options, inputs)
    assert cold.frame_cache == "stored" and warm.frame_cache.startswith("hit (1 graph") and frames == 0, \
        (cold.frame_cache, warm.frame_cache)
    [graph] = warm.graphs
    assert graph.fallback == "inductor" and graph.compile_cache == HIT, (graph.fallback, graph.compile_cache)
    assert all(torch.equal(a, b) for a, b in zip(cold_out, warm_out))
