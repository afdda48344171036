"""Nested compile regions (dzc/regions.py, on by default): repeated layers captured once fuse as a plain capture
does and match eager, the report says the regions were used, layers writing their caches stay regions, calls given
inputs of other sizes get a body each, a capture with regions that fails or cannot be trusted is refused and
captured again without them, the knob and the option turn them off, and the warm-compile cache still hits."""

import copy
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import dzc
from dzc import config, frame_cache, regions
from dzc.models import build_model
from dzc.models.decoder import DecoderConfig, HFLayer

# As test_models.py: the fused kernels round like eager, in another reduction order, which the layers amplify.
_BF16_LOGITS = 1.25e-1


def _compile_llama(options, nested: bool, layers: int):
    model, (tokens,) = build_model("llama_decoder", layers=layers)
    return model, tokens, dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=nested))


def test_repeated_layers_fuse_as_without_regions_and_match_eager(options):
    fired, body_runs = {}, {}
    metrics = torch._dynamo.utils.compilation_time_metrics  # Dynamo's timings, one entry per run
    for nested in (False, True):
        torch._dynamo.reset()
        model, tokens, compiled = _compile_llama(options, nested, layers=4)
        runs_before = len(metrics.get("invoke_subgraph_fake_tensor", ()))
        for seq in (16, 9):
            tokens = torch.randint(0, 256, (2, seq))
            expected = model(tokens)
            torch.testing.assert_close(compiled(tokens).float(), expected.float(), atol=_BF16_LOGITS,
                                       rtol=_BF16_LOGITS)
        body_runs[nested] = len(metrics.get("invoke_subgraph_fake_tensor", ())) - runs_before
        report = compiled.report
        fired[nested] = report.fired()
        assert report.compiles == 1, "a new sequence length recompiled"
    # 4 layers: each layer's second norm (inside the body) and each residual add into the next layer's first norm
    # or the final norm (across the bodies' boundaries, found in the flat graph): as many as without regions.
    assert fired[True] == fired[False] == {"fuse_residual_norm": 8}, fired
    # The body's fake outputs are cached (regions._cache_region_calls_fake_outputs, though dzc turns fake tensors'
    # cache off): AOTAutograd runs it through fake tensors 4 times, not twice a call (8, its metadata pass and trace).
    assert 0 < body_runs[True] < 8, body_runs
    assert report.nested_regions == "layers: 4 x HFLayer"
    assert report.graphs[0].regions == ["body repeated_subgraph0 called 4 times: fuse_residual_norm 1 site"]
    stages = dict(report.graphs[0].stages)
    assert stages["capture"].count("invoke_subgraph") == 4 and "# body repeated_subgraph0" in stages["capture"]
    assert "invoke_subgraph" not in stages["inline_regions"] and "invoke_subgraph" not in stages["lowered"]
    assert "repeated_subgraph0.fuse_residual_norm" in stages
    sites = report.pass_sites["fuse_residual_norm"]
    assert sum("[body repeated_subgraph0]" in site for site in sites) == 4, sites
    assert "region body repeated_subgraph0 called 4 times: fuse_residual_norm 1 site" in str(report)
    # The marks last while the compiled model does; then the layers' classes are the model's own again.
    assert type(model.layers[0]) is not HFLayer and isinstance(model.layers[0], HFLayer)
    del compiled
    gc.collect()
    assert all(type(layer) is HFLayer for layer in model.layers)


def test_the_multimodal_model_fuses_as_without_regions(options):
    """Its whole prefill, 3 vision blocks (the second one full-attention) and 3 decoder layers, all marked. The
    first block's body specialises the patch positions' (row, column) dim, marked dynamic, yet takes its symbol as
    an input: torch 2.13's stamp-out of that body for the third block failed (KeyError: 2) and Dynamo's whole trace
    was thrown away. dzc's reuse check points the stamp-out back at the symbol the first call passed: the two window
    blocks share one body, traced once, no retry. The full-attention block gets a body of its own (its cu_seqlens
    are of another size than the window blocks' cu_window_seqlens: no guard relates them, no block is unmarked),
    called once: Dynamo inlines it. The decoder layers differ in their attention's layer index (their cache slot,
    which Dynamo guards): their children are marked instead, each kind sharing one body (the two norms of a layer
    one), the attention marked whole and traced per call, layers 1 and 2 sharing one body: it writes the caches,
    AOTAutograd keeps its calls functionalized and dzc inlines them with the writes of a plain capture. Same
    fusions and results as without regions, one graph."""
    fired, logits = {}, {}
    for nested in (False, True):
        torch._dynamo.reset()
        model, inputs = build_model("multimodal", layers=3)  # seeded: the same weights and inputs each time
        compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=nested))
        with torch.no_grad():
            logits[nested] = compiled(*inputs)
        fired[nested] = compiled.report.fired()
        assert compiled.report.compiles == 1
    assert fired[True] == fired[False], fired
    torch.testing.assert_close(logits[True], logits[False], atol=0, rtol=0)
    report = compiled.report
    children = ", ".join(f"language.layers.*.{path}: 3 x {name}" for path, name in (
        ("input_layernorm", "HFRMSNorm"),
        ("attn", "DSAAttention (each call traced: instances differ in int attribute layer)"),
        ("post_attention_layernorm", "HFRMSNorm"), ("mlp", "MoEBlock")))
    assert report.nested_regions == (
        f"vision.blocks: 3 x VisionBlock, {children}; not marked: language.layers: DecoderLayer (instances differ in "
        "int attribute attn.layer: marked its repeated children instead)"), report.nested_regions
    assert report.region_retries == [], report.region_retries
    assert report.graphs[0].regions == [
        "body repeated_subgraph0 called 2 times: fuse_residual_norm 1 site, fuse_vision_attention 1 site",
        "body repeated_subgraph1 called 6 times: nothing fused",
        "body repeated_subgraph2 called 3 times: fuse_mxfp4_experts 1 site"], report.graphs[0].regions
    capture = dict(report.graphs[0].stages)["capture"]
    assert re.search(r"# body auto_functionalized_\w+ \(\w+\), called 2 times", capture), capture[-2000:]
    assert all("_dzc_region_of" in vars(type(block)) for block in model.vision.blocks)


def test_a_pickled_graph_does_not_recompile_region_calls(options):
    """Dynamo guards pytree's registry (its dict version) where a region call takes a kwarg or an object, and
    torch's GraphPickler registers `slice` there while it runs; dzc's compile cache pickles each graph it
    compiles. The decoder step (its layers take the paged cache) then recompiled at every call; now prefill and
    decode take one graph each, as without regions."""
    from dzc.models.multimodal import CONFIGS, DecoderStep, build_multimodal, new_cache
    from dzc.models.dsa import DSASession

    cfg = CONFIGS["tiny"]
    model = build_multimodal(cfg)
    cache = new_cache(cfg, max_pages=3, batch=2, fp8_index=False, dtype=torch.bfloat16)
    compiled = dzc.compile(DecoderStep(model.language, cache), "cuda",
                           dataclasses.replace(options, nested_regions=True, check_rewrites=False))
    pages = DSASession(cache)
    with torch.no_grad():
        for sequence, length in ((0, 5), (1, 7), (0, 1), (1, 1), (0, 1)):
            compiled(*pages.inputs(torch.randn(1, length, cfg.hidden, dtype=torch.bfloat16), [sequence])[:4])
    report = compiled.report
    assert report.nested_regions.startswith("language.layers.*.input_layernorm: 2 x HFRMSNorm"), report.nested_regions
    assert report.compiles == 2 and report.recompiles == 1, [g.dynamic_sizes for g in report.graphs]


class _PrintingLayer(nn.Module):
    """A layer whose forward breaks the graph (print): Dynamo cannot split a nested compile region."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        print("layer")
        return torch.relu(self.linear(x))


class _Stack(nn.Module):
    def __init__(self, layer=_PrintingLayer, count: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(count))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_graph_break_inside_a_layer_refuses_regions(options, seed):
    model = _Stack()
    compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=True))
    x = torch.randn(4, 16)
    with pytest.warns(RuntimeWarning, match="nested compile regions refused"):
        actual = compiled(x)
    torch.testing.assert_close(actual, model(x))
    report = compiled.report
    assert report.nested_regions.startswith("refused for layers: 3 x _PrintingLayer (UncapturedHigherOrderOpError"), \
        report.nested_regions
    assert all(type(layer) is _PrintingLayer for layer in model.layers)  # put back at the refusal
    assert not any(g.regions for g in report.graphs)


class _CacheWriter(nn.Module):
    """A layer that writes rows `slots` of its input `cache`, as a decoder layer writes its KV cache."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x, cache, slots):
        cache.index_copy_(0, slots, x)
        return torch.relu(self.linear(x)) + cache.sum(0)


class _CacheWriters(nn.Module):
    """Three cache writers, each given a cache of its own, or (shared) its row of one cache: a view."""

    def __init__(self, shared: bool):
        super().__init__()
        self.layers = nn.ModuleList(_CacheWriter() for _ in range(3))
        self.shared = shared
        self.register_buffer("caches", torch.zeros(3, 8, 16))
        self.own = nn.ModuleList(nn.Module() for _ in range(3))
        for holder in self.own:
            holder.register_buffer("cache", torch.zeros(8, 16))

    def forward(self, x, slots):
        for index, layer in enumerate(self.layers):
            x = layer(x, self.caches[index] if self.shared else self.own[index].cache, slots)
        return x


def _run_cache_writers(options, shared: bool, nested: bool):
    """The report of _CacheWriters compiled and called twice, its outputs and caches checked against eager."""
    torch.manual_seed(0)
    model = _CacheWriters(shared)
    eager = copy.deepcopy(model)
    compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=nested))
    with torch.no_grad():
        for slots in (torch.tensor([1, 3, 5, 7]), torch.tensor([0, 2, 4, 6])):
            x = torch.randn(4, 16)
            torch.testing.assert_close(compiled(x, slots), eager(x, slots))
    for (name, written), (_, expected) in zip(model.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(written, expected, msg=name)
    return compiled.report


def test_layers_writing_their_caches_share_a_body_and_write_as_a_plain_capture(options):
    """Layers that write an input of their own (decoder layers writing their KV caches) stay regions: AOTAutograd
    keeps their calls as auto_functionalized_v2 of one body, traced once, and dzc inlines them with the writes of a
    plain capture (the new rows copied into the caches at the graph's end), without a retry. Outputs and caches
    as eager; the rewrite check runs the inlined graph."""
    flat = {}
    for nested in (False, True):
        torch._dynamo.reset()
        report = _run_cache_writers(options, shared=False, nested=nested)
        stages = dict(report.graphs[0].stages)
        flat[nested] = stages["inline_regions" if nested else "capture"]
        assert report.compiles == 1 and report.graphs[0].rewrite_check.startswith("passed"), report.graphs[0]
    assert report.nested_regions == "layers: 3 x _CacheWriter" and report.region_retries == []
    assert "auto_functionalized_v2" in stages["capture"] and "called 3 times" in stages["capture"]
    for op in ("aten.index_copy.default", "aten.copy_.default", "auto_functionalized", "invoke_subgraph"):
        assert flat[True].count(op) == flat[False].count(op), op
    assert flat[True].count("aten.copy_.default") == 3


def test_a_layer_writing_a_view_is_inlined_in_dynamos_graph_and_traced_again(options):
    """Where a written input is a view of another tensor (each layer writes its row of one cache), dzc does not
    inline AOTAutograd's functionalized calls: it inlines the calls in Dynamo's graph and AOTAutograd traces again,
    once, and the report says so. Outputs and the cache as eager."""
    report = _run_cache_writers(options, shared=True, nested=True)
    assert report.compiles == 1 and report.nested_regions == "layers: 3 x _CacheWriter"
    assert report.region_retries == ["AOTAutograd functionalized region calls that write their inputs (subgraph_0): "
                                     "inlined in Dynamo's graph, AOTAutograd traced again"], report.region_retries
    assert "auto_functionalized" not in dict(report.graphs[0].stages)["capture"]


class _LayerCaches:
    """One cache tensor per layer, in a list, passed to the layers as an object (as dzc's PagedKVCache is)."""

    def __init__(self, layers: int):
        self.rows = [torch.zeros(8, 16) for _ in range(layers)]


class _IndexedAttention(nn.Module):
    """Writes and reads the cache its int attribute `layer` picks (a decoder layer's KV cache slot)."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.proj = nn.Linear(16, 16)

    def forward(self, x, cache: _LayerCaches, slots):
        rows = cache.rows[self.layer]
        rows.index_copy_(0, slots, self.proj(x))
        return rows.sum(0) * 0.1


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _IndexedLayer(nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.attn = _IndexedAttention(layer)
        self.mlp = _Mlp()
        self.first = layer == 0  # a bool that differs: no int, no reason to descend

    def forward(self, x, cache: _LayerCaches, slots):
        x = x + self.attn(x, cache, slots)
        return x + self.mlp(x)


class _IndexedLayers(nn.Module):
    def __init__(self, layers: int = 3, layer_of=lambda index: index):
        super().__init__()
        self.layers = nn.ModuleList(_IndexedLayer(layer_of(index)) for index in range(layers))

    def forward(self, x, cache: _LayerCaches, slots):
        for layer in self.layers:
            x = layer(x, cache, slots)
        return x


def test_layers_differing_in_an_int_attribute_have_their_children_marked(options, seed):
    """Dynamo guards the int each layer reads to pick its cache, and refuses to reuse one layer's body for another
    (rightly: the stamped-out layer would write layer 0's cache): whole-layer marks would trace every layer. Their
    children are marked instead: the MLPs share one body, traced once and called 3 times. The attention modules
    differ in their own int alone: marked whole, each call traced by Dynamo, which finds the three bodies equal
    (each reads its cache as an input) and installs one, AOTAutograd tracing it once. Outputs and the caches written
    in place as eager."""
    model = _IndexedLayers()
    eager = copy.deepcopy(model)
    compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=True))
    caches, eager_caches = _LayerCaches(3), _LayerCaches(3)
    with torch.no_grad():
        for slots in (torch.tensor([1, 3, 5, 7]), torch.tensor([0, 2, 4, 6])):
            x = torch.randn(4, 16)
            torch.testing.assert_close(compiled(x, caches, slots), eager(x, eager_caches, slots))
    for index, (written, expected) in enumerate(zip(caches.rows, eager_caches.rows)):
        torch.testing.assert_close(written, expected, msg=f"cache of layer {index}")
    report = compiled.report
    assert report.compiles == 1 and report.region_retries == [], report
    assert report.nested_regions == (
        "layers.*.attn: 3 x _IndexedAttention (each call traced: instances differ in int attribute layer), "
        "layers.*.mlp: 3 x _Mlp; not marked: layers: _IndexedLayer (instances differ in int attribute attn.layer: "
        "marked its repeated children instead)"), report.nested_regions
    # The attention's body writes its cache: AOTAutograd keeps its calls functionalized, which the passes see
    # inlined (no line of their own).
    assert [line.split(":")[0] for line in report.graphs[0].regions] == ["body repeated_subgraph0 called 3 times"], \
        report.graphs[0].regions
    # Layers 1 and 2 share that body; layer 0's trace differs from theirs, its body called once: torch inlines it.
    capture = dict(report.graphs[0].stages)["capture"]
    assert re.search(r"# body auto_functionalized_\w+ \(\w+\), called 2 times", capture), capture
    # The functionalized calls name their operator, not its address: the text is a compile-cache key.
    assert "auto_functionalized_v2(torch.ops.higher_order.invoke_subgraph, " in capture and " at 0x" not in capture
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["_Mlp"] * 3
    assert all("_dzc_region_of" in vars(type(layer.mlp)) and "_dzc_region_of" not in vars(type(layer))
               for layer in model.layers)


class _ReadingAttention(_IndexedAttention):
    """An attention whose child reads a cache of its own by the same layer index (an indexer, say)."""

    def __init__(self, layer: int):
        super().__init__(layer)
        self.reader = _IndexedAttention(layer)


def test_a_child_group_holding_its_own_differing_int_is_marked_whole_its_layers_never():
    """The attention holds the layer index and so does its child: the attention is marked whole (its child inside
    it); the layers, which hold it only through the attention, are descended into. Layers holding it themselves are
    descended into too (their other children stay stamped out): here those children are torch's Linears."""
    model = _IndexedLayers()
    for index, layer in enumerate(model.layers):
        layer.attn = _ReadingAttention(index)
    marking = regions.mark_repeated_layers(model)
    try:
        assert marking.describe() == (
            "layers.*.attn: 3 x _ReadingAttention (each call traced: instances differ in int attribute layer, "
            "reader.layer), layers.*.mlp: 3 x _Mlp"), marking.describe()
    finally:
        marking.restore()
    flat = nn.ModuleList(_IndexedAttention(index) for index in range(3))
    marking = regions.mark_repeated_layers(nn.Sequential(flat))
    assert not marking and marking.refused == ["0: _IndexedAttention (instances differ in int attribute layer: no "
                                               "child marked)"], marking.refused


def test_layers_agreeing_on_their_int_attributes_are_marked_whole():
    """The same layers, each given the same int (and a bool that differs, which is no int here): marked whole."""
    model = _IndexedLayers(layer_of=lambda index: 0)
    marking = regions.mark_repeated_layers(model)
    try:
        assert marking.describe() == "layers: 3 x _IndexedLayer" and marking.refused == []
        assert marking.owners()[id(model.layers[2].mlp.up.weight)] == "layers.2"
    finally:
        marking.restore()
    assert all(type(layer) is _IndexedLayer for layer in model.layers)


class _SizeReader(nn.Module):
    """A layer whose output depends on the size of its input `offsets`."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x, offsets):
        return torch.relu(self.linear(x)) * offsets.shape[0]


class _TwoKindsOfCalls(nn.Module):
    """Four layers; the third is given `images`, the others `windows`: integer inputs of other dynamic sizes, as
    full-attention and window vision blocks are given cu_seqlens and cu_window_seqlens."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_SizeReader() for _ in range(4))

    def forward(self, x, windows, images):
        for index, layer in enumerate(self.layers):
            x = layer(x, images if index == 2 else windows)
        return x


def _run_two_kinds_of_calls(options):
    """The report of _TwoKindsOfCalls compiled with regions, called where the sizes differ, then where they are
    equal (a guard relating them would recompile there), checked against eager."""
    model = _TwoKindsOfCalls()
    compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=True))
    with torch.no_grad():
        for windows, images in ((5, 3), (4, 4)):
            x, inputs = torch.randn(4, 16), (torch.arange(windows), torch.arange(images))
            torch.testing.assert_close(compiled(x, *inputs), model(x, *inputs))
    return compiled.report


@pytest.fixture
def torch_reuse_check(monkeypatch):
    """Region calls checked for reuse by torch's own check, as where dzc's could not take its place."""
    from torch._dynamo.variables import invoke_subgraph as dynamo_regions

    monkeypatch.setattr(regions, "_reuse_only_calls_of_the_same_sizes", lambda: None)
    monkeypatch.setattr(dynamo_regions, "is_reusable", getattr(dynamo_regions.is_reusable, "__wrapped__",
                                                               dynamo_regions.is_reusable))


def test_calls_given_inputs_of_other_sizes_reuse_no_body_of_the_other_size(options, seed):
    """The layers given `windows` share a body, the odd one is traced apart: all marked, no guard relating the two
    sizes (the second call, where they are equal, runs the same graph), no retry."""
    report = _run_two_kinds_of_calls(options)
    assert report.compiles == 1, [g.dynamic_sizes for g in report.graphs]
    assert report.nested_regions == "layers: 4 x _SizeReader" and report.region_retries == []
    assert report.graphs[0].regions == ["body repeated_subgraph0 called 3 times: nothing fused"]


def test_where_the_reuse_check_relates_sizes_regions_are_refused(options, seed, torch_reuse_check):
    """torch's own reuse check guards the relation of the two sizes (Ne(s34, s58)): dzc's backend finds the guard
    and, no group of calls standing apart (the odd call is no region call), captures again without regions."""
    with pytest.warns(RuntimeWarning, match="nested compile regions refused"):
        report = _run_two_kinds_of_calls(options)
    assert report.compiles == 1, [g.dynamic_sizes for g in report.graphs]
    assert report.nested_regions.startswith("refused for layers: 4 x _SizeReader (region calls compare inputs of "
                                            "other dynamic sizes"), report.nested_regions


@pytest.mark.parametrize("child", ["", "mlp"])
def test_region_calls_reading_another_layers_parameters_are_refused(seed, child):
    """Wrapping each instance's bound forward (not its class) makes torch 2.13's Dynamo stamp out every call with
    the first layer's parameters: the check dzc's backend runs on Dynamo's graph names it, for marked layers as
    for a marked child of each layer (a group `layers.*.mlp`)."""
    model = _Stack(lambda: HFLayer(DecoderConfig()))
    marked = [getattr(layer, child) if child else layer for layer in model.layers]
    for module in marked:
        module.forward = types.MethodType(torch.compiler.nested_compile_region(type(module).forward), module)
    marking = regions.Marking([("layers.*." + child if child else "layers", type(marked[0]).__name__, marked)])
    found = []

    def backend(gm, example_inputs):
        found.append(regions.misplaced_parameters(gm, example_inputs, marking))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 5, 64))
    assert found and f"both read the parameters of {'layers.0.' + child if child else 'layers.0'}" in found[0], found


def test_regions_are_on_by_default_and_the_knob_or_the_option_turns_them_off(options, monkeypatch):
    monkeypatch.delenv("DZC_NESTED_REGIONS", raising=False)
    model, (tokens,) = build_model("llama_decoder")
    compiled = dzc.compile(model, "cuda", options)
    compiled(tokens)
    assert compiled.report.nested_regions == "layers: 2 x HFLayer"
    assert "invoke_subgraph" in dict(compiled.report.graphs[0].stages)["capture"]
    assert options.resolved_nested_regions()
    assert not dataclasses.replace(options, nested_regions=False).resolved_nested_regions()
    with config.scope(DZC_NESTED_REGIONS="0"):
        assert not options.resolved_nested_regions()
        assert dataclasses.replace(options, nested_regions=True).resolved_nested_regions()  # the option wins
        torch._dynamo.reset()
        model, (tokens,) = build_model("llama_decoder")
        compiled = dzc.compile(model, "cuda", options)
        compiled(tokens)
        assert compiled.report.nested_regions == "off"
        assert "invoke_subgraph" not in dict(compiled.report.graphs[0].stages)["capture"]
        assert all(type(layer) is HFLayer for layer in model.layers)


_WORKER = """
import json, sys, torch, dzc
from dzc.models import build_model
model, (tokens,) = build_model("llama_decoder", layers=3)
compiled = dzc.compile(model, "cuda", dzc.CompileOptions(cache_dir=sys.argv[1], autotune=False, nested_regions=True))
with torch.no_grad():
    logits = compiled(tokens)
torch.save(logits, sys.argv[2])
report = compiled.report
print("RESULTS " + json.dumps({"cache": [g.compile_cache for g in report.graphs], "fired": report.fired(),
                               "regions": [g.regions for g in report.graphs], "nested": report.nested_regions}))
"""


def test_a_fresh_process_hits_the_compile_cache_with_regions(tmp_path):
    def run(out):
        proc = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path / "cache"), str(tmp_path / out)],
                              capture_output=True, text=True, env=dict(os.environ, DZC_COMPILE_CACHE="1"),
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
        return json.loads(line.removeprefix("RESULTS "))

    cold, warm = run("cold.pt"), run("warm.pt")
    # (the warm process traced nothing where torch keeps Dynamo's work: its frame entry names the marked layers'
    # classes, found by name)
    hit = "hit" if frame_cache._unsupported_torch() else "hit (frame entry: Dynamo and AOTAutograd skipped)"
    assert cold["cache"] == ["miss"] and warm["cache"] == [hit], (cold["cache"], warm["cache"])
    assert cold["fired"] == warm["fired"] == {"fuse_residual_norm": 6}, (cold["fired"], warm["fired"])
    assert cold["regions"] == warm["regions"] == [["body repeated_subgraph0 called 3 times: fuse_residual_norm 1 site"]]
    assert warm["nested"] == "layers: 3 x HFLayer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cold_logits, warm_logits = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    # The cold call returns the captured graph's results (the rewrite check), the warm one the fused kernels'.
    torch.testing.assert_close(warm_logits.float(), cold_logits.float(), atol=_BF16_LOGITS, rtol=_BF16_LOGITS)


def _compile_qwen2_5_vl_vision_tower(options):
    """(model, report) of HF Qwen2.5-VL's vision tower, 6 blocks (2 full-attention), compiled with regions and
    called on packs of other sizes, checked against eager."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from dzc.hf_attention import qwen2_5_vl_vision_inputs, use_dzc_attention

    config = transformers.Qwen2_5_VLConfig().vision_config.__class__(
        depth=6, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=2, temporal_patch_size=1,
        window_size=8, out_hidden_size=24, fullatt_block_indexes=[2, 5], in_channels=3)
    config._attn_implementation = "sdpa"
    eager = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    model = copy.deepcopy(eager)
    use_dzc_attention(model)
    compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=True, check_rewrites=False))
    for grids in ([[1, 2, 2], [1, 4, 2]], [[1, 2, 4], [1, 2, 2], [1, 2, 2]], [[1, 8, 8], [1, 2, 2]]):
        grid_thw = torch.tensor(grids)
        pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 2)
        with torch.no_grad():
            actual = compiled(pixels, grid_thw, **qwen2_5_vl_vision_inputs(model.config, grid_thw))
            expected = eager(pixels, grid_thw)
        torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    report = compiled.report
    assert report.compiles == 1 and report.recompiles == 0
    assert [type(block).__name__ for block in model.blocks] == ["Qwen2_5_VLVisionBlock"] * 6
    return model, report


def test_window_and_full_attention_blocks_get_a_body_each(options):
    """HF Qwen2.5-VL's vision tower: window blocks take cu_window_seqlens, full-attention blocks cu_seqlens. Dynamo's
    reuse check of region calls would guard the two sizes' relation (a recompile where it flips, which a plain
    capture does not have); dzc's check compares the sizes' expressions first, so the window blocks share one body
    and the full-attention blocks another, all marked, captured once."""
    _, report = _compile_qwen2_5_vl_vision_tower(options)
    assert report.nested_regions == "blocks: 6 x Qwen2_5_VLVisionBlock" and report.region_retries == []
    assert [line.split(":")[0] for line in report.graphs[0].regions] == [
        "body repeated_subgraph0 called 4 times", "body repeated_subgraph1 called 2 times"], report.graphs[0].regions


def test_where_the_reuse_check_relates_sizes_the_window_blocks_stay_marked(options, torch_reuse_check):
    """With torch's own reuse check, the guard relating the two sizes is made: dzc's backend finds it, puts the
    full-attention blocks' classes back (the window blocks are the most common kind of call) and captures again."""
    model, report = _compile_qwen2_5_vl_vision_tower(options)
    assert report.nested_regions.startswith("blocks: 4 x Qwen2_5_VLVisionBlock (narrowed"), report.nested_regions
    assert report.graphs[0].regions[0].startswith("body repeated_subgraph0 called 4 times"), report.graphs[0].regions
    assert ["_dzc_region_of" in vars(type(block)) for block in model.blocks] == [True, True, False, True, True, False]


def test_a_bodys_schema_is_worked_out_once_not_per_call(options, monkeypatch):
    """AOTAutograd functionalizes every region call; the call's schema (what it mutates and aliases) comes from
    tracing the body again (invoke_subgraph.gen_schema). torch 2.13 caches it per body; before that torch worked it
    out per call (6 layers: 6 re-traces a pass), which regions._cache_region_calls_schemas backports: the full-depth
    multimodal compile ran past 560 s on the GPU host's torch 2.11 with it missing."""
    hop_type = type(regions.INVOKE_SUBGRAPH)
    worked_out = []
    gen_schema = hop_type.gen_schema

    def counting(self, subgraph, identifier, *operands):
        worked_out.append(identifier)
        return gen_schema(self, subgraph, identifier, *operands)

    monkeypatch.setattr(hop_type, "gen_schema", counting)
    torch._dynamo.reset()
    model, tokens, compiled = _compile_llama(options, True, layers=6)
    torch.testing.assert_close(compiled(tokens).float(), model(tokens).float(), atol=_BF16_LOGITS, rtol=_BF16_LOGITS)
    assert compiled.report.graphs[0].regions == ["body repeated_subgraph0 called 6 times: fuse_residual_norm 1 site"]
    assert 0 < len(worked_out) < 6, worked_out


class _RoutedLayer(nn.Module):
    """A top-2 MoE layer written as a loop over experts (torch.where per expert, index_add_ of the rows): each
    call's rows per expert are data-dependent sizes (unbacked symbols), different from one layer to the next."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.router = nn.Parameter(torch.randn(experts, 16))
        self.up = nn.Parameter(torch.randn(experts, 32, 16) / 4)
        self.down = nn.Parameter(torch.randn(experts, 16, 32) / 4)

    def forward(self, x):
        weights, ids = torch.topk(torch.nn.functional.linear(x, self.router).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.router.shape[0]):
            tokens, slots = torch.where(ids == e)
            y = torch.nn.functional.silu(x[tokens] @ self.up[e].t()) @ self.down[e].t()
            out.index_add_(0, tokens, y * weights[tokens, slots, None])
        return x + out


class _Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_RoutedLayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_each_inlined_call_binds_data_dependent_sizes_of_its_own(options, seed, tmp_path, monkeypatch):
    """The three layers share one body; inlined at each call, each copy's rows per expert get symbols of their own
    (regions.flatten). With the body's symbols in every copy, Inductor took the layers' counts for one size and
    gave layer 2 the buffers of layer 1's rows (a heap overflow on the CPU, index_add_ given more indices than rows
    on the GPU: session 43). Inductor compiles it here (its C++ backend), with an empty cache of its own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = _Routed()
    compiled = dzc.compile(model, "cuda", dataclasses.replace(options, fallback="inductor", nested_regions=True))
    with torch.no_grad():
        for tokens in (37, 21, 50):
            x = torch.randn(tokens, 16)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert compiled.report.nested_regions == "layers: 3 x _RoutedLayer", compiled.report.nested_regions
    [graph] = compiled.report.graphs
    flat = dict(graph.stages)["inline_regions"]
    counts = re.findall(r"aten\.nonzero\.default\(.*\)  # i64\[(s\d+), 2\]", flat)  # (ir names each symbol sN)
    assert len(counts) == 12 and len(set(counts)) == 12, counts  # 3 layers x 4 experts, each its own symbol


class _Sieve(nn.Module):
    def forward(self, x):
        rows = x[x[:, 0] > 0]
        return x * 2, rows


class _Sieves(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Sieve() for _ in range(3))

    def forward(self, x):
        total = x.new_zeros(())
        for layer in self.layers:
            x, rows = layer(x)
            total = total + rows.sum()
        return x, total


def test_a_body_giving_its_caller_a_data_dependent_size_refuses_regions(options, seed):
    """Each call gives its caller rows of a data-dependent count: the graph after the call would read the body's
    symbol for every call's count, so the capture is refused and made again without regions."""
    model = _Sieves()
    compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=True))
    x = torch.randn(12, 4)
    with pytest.warns(RuntimeWarning, match="nested compile regions refused"), torch.no_grad():
        actual = compiled(x)
    torch.testing.assert_close(actual, model(x))
    assert "gives values of data-dependent sizes" in compiled.report.nested_regions, compiled.report.nested_regions
