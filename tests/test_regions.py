"""Nested compile regions (dzc/regions.py, opt-in): repeated layers captured once fuse as a plain capture does
and match eager, the report says the regions were used, a capture with regions that fails or cannot be trusted is
refused and captured again without them, the knob and the option turn them on, and the warm-compile cache still
hits."""

import copy
import dataclasses
import gc
import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import dzc
from dzc import config, regions
from dzc.models import build_model
from dzc.models.decoder import DecoderConfig, HFLayer

# As test_models.py: the fused kernels round like eager, in another reduction order, which the layers amplify.
_BF16_LOGITS = 1.25e-1


def _compile_llama(options, nested: bool, layers: int):
    model, (tokens,) = build_model("llama_decoder", layers=layers)
    return model, tokens, dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=nested))


def test_repeated_layers_fuse_as_without_regions_and_match_eager(options):
    fired = {}
    for nested in (False, True):
        torch._dynamo.reset()
        model, tokens, compiled = _compile_llama(options, nested, layers=4)
        for seq in (16, 9):
            tokens = torch.randint(0, 256, (2, seq))
            expected = model(tokens)
            torch.testing.assert_close(compiled(tokens).float(), expected.float(), atol=_BF16_LOGITS,
                                       rtol=_BF16_LOGITS)
        report = compiled.report
        fired[nested] = report.fired()
        assert report.compiles == 1, "a new sequence length recompiled"
    # 4 layers: each layer's second norm (inside the body) and each residual add into the next layer's first norm
    # or the final norm (across the bodies' boundaries, found in the flat graph): as many as without regions.
    assert fired[True] == fired[False] == {"fuse_residual_norm": 8}, fired
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
    """Its whole prefill: torch 2.13's Dynamo fails in the stamp-out of the second vision block (KeyError: 2: the
    patch positions' (row, column) dim, marked dynamic, is specialised inside the first block), so dzc takes that
    dim's hint off and captures again; then the reuse check of the vision blocks guards cu_seqlens' size against
    cu_window_seqlens' (one window block, one full-attention block), so dzc keeps only the decoder layers marked.
    Same fusions and results as without regions, one graph. (The decoder layers write the paged cache: AOTAutograd
    inlines their bodies, so Dynamo traces one layer, AOTAutograd every layer.)"""
    fired, logits = {}, {}
    for nested in (False, True):
        torch._dynamo.reset()
        model, inputs = build_model("multimodal")  # seeded: the same weights and inputs each time
        compiled = dzc.compile(model, "cuda", dataclasses.replace(options, nested_regions=nested))
        with torch.no_grad():
            logits[nested] = compiled(*inputs)
        fired[nested] = compiled.report.fired()
        assert compiled.report.compiles == 1
    assert fired[True] == fired[False], fired
    torch.testing.assert_close(logits[True], logits[False], atol=0, rtol=0)
    report = compiled.report
    assert report.nested_regions.startswith("language.layers: 2 x DecoderLayer (narrowed: region calls compare "
                                            "inputs of other dynamic sizes"), report.nested_regions
    assert len(report.region_retries) == 2, report.region_retries
    assert "KeyError: 2" in report.region_retries[0] and "L['patch_positions'].size()[1]" in report.region_retries[0]
    assert report.region_retries[1].startswith("vision.blocks: 2 x VisionBlock, language.layers: 2 x DecoderLayer "
                                               "narrowed to language.layers: 2 x DecoderLayer")
    assert all(type(block).__name__ == "VisionBlock" and "_dzc_region_of" not in vars(type(block))
               for block in model.vision.blocks)


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
    assert report.nested_regions == "language.layers: 2 x DecoderLayer"
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


def test_region_calls_reading_another_layers_parameters_are_refused(seed):
    """Wrapping each instance's bound forward (not its class) makes torch 2.13's Dynamo stamp out every call with
    the first layer's parameters: the check dzc's backend runs on Dynamo's graph names it."""
    model = _Stack(lambda: HFLayer(DecoderConfig()))
    for layer in model.layers:
        layer.forward = types.MethodType(torch.compiler.nested_compile_region(HFLayer.forward), layer)
    marking = regions.Marking([("layers", "HFLayer", list(model.layers))])
    found = []

    def backend(gm, example_inputs):
        found.append(regions.misplaced_parameters(gm, example_inputs, marking))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 5, 64))
    assert found and "both read the parameters of layers.0" in found[0], found


def test_regions_are_off_by_default_and_the_knob_or_the_option_turns_them_on(options):
    model, (tokens,) = build_model("llama_decoder")
    compiled = dzc.compile(model, "cuda", options)
    compiled(tokens)
    assert compiled.report.nested_regions == "off"
    assert "invoke_subgraph" not in dict(compiled.report.graphs[0].stages)["capture"]
    assert all(type(layer) is HFLayer for layer in model.layers)
    assert not options.resolved_nested_regions()
    assert dataclasses.replace(options, nested_regions=True).resolved_nested_regions()
    with config.scope(DZC_NESTED_REGIONS="1"):
        assert options.resolved_nested_regions()
        assert not dataclasses.replace(options, nested_regions=False).resolved_nested_regions()  # the option wins
        torch._dynamo.reset()
        model, (tokens,) = build_model("llama_decoder")
        compiled = dzc.compile(model, "cuda", options)
        compiled(tokens)
        assert compiled.report.nested_regions == "layers: 2 x HFLayer"
        assert "invoke_subgraph" in dict(compiled.report.graphs[0].stages)["capture"]


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
    assert cold["cache"] == ["miss"] and warm["cache"] == ["hit"], (cold["cache"], warm["cache"])
    assert cold["fired"] == warm["fired"] == {"fuse_residual_norm": 6}, (cold["fired"], warm["fired"])
    assert cold["regions"] == warm["regions"] == [["body repeated_subgraph0 called 3 times: fuse_residual_norm 1 site"]]
    assert warm["nested"] == "layers: 3 x HFLayer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cold_logits, warm_logits = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    # The cold call returns the captured graph's results (the rewrite check), the warm one the fused kernels'.
    torch.testing.assert_close(warm_logits.float(), cold_logits.float(), atol=_BF16_LOGITS, rtol=_BF16_LOGITS)


def test_window_and_full_attention_blocks_keep_the_window_blocks_marked(options):
    """HF Qwen2.5-VL's vision tower: window blocks take cu_window_seqlens, full-attention blocks cu_seqlens. Dynamo's
    reuse check of region calls would guard the two sizes' relation (a recompile where it flips, which a plain
    capture does not have): dzc marks the window blocks only. One graph over packs of other sizes, as eager."""
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
    assert report.nested_regions.startswith("blocks: 4 x Qwen2_5_VLVisionBlock (narrowed"), report.nested_regions
    assert report.graphs[0].regions[0].startswith("body repeated_subgraph0 called 4 times"), report.graphs[0].regions
    assert [type(block).__name__ for block in model.blocks] == ["Qwen2_5_VLVisionBlock"] * 6
    assert ["_dzc_region_of" in vars(type(block)) for block in model.blocks] == [True, True, False, True, True, False]
