"""fuse_windowed_attention: causal attention with a local window or sinks -> dzc.varlen_attention. Golden IR, each
spelling (bool keep / additive masks, window bounds >/>=, repeat_kv'd grouped heads, gpt-oss's sink column),
what is left alone (plain causal, top-k masks) and what is refused; transformers' sliding-window and sink models
compiled unchanged with the kernels."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_pass_on_capture
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import dzc
from dzc import ir
from dzc.passes.fuse_windowed_attention import fuse_windowed_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import zoo  # noqa: E402

NEG = torch.finfo(torch.float32).min


def _fuse(module, *inputs):
    """fuse_windowed_attention on module's captured graph: (captured GraphModule, PassResult, fused output, eager
    output)."""
    return run_pass_on_capture(fuse_windowed_attention, module, *inputs)


class LocalAttention(nn.Module):
    """A decoder attention as transformers writes it: positions arange(S) offset by a cache of `past` keys, GQA
    through repeat_kv, a causal mask with a sliding window (HF's overlay kv > q - W), optional gpt-oss sinks.
    `spelling`: "keep" (where(keep, 0, min)), "ge" (kv >= q - W + 1), "drop" (masked_fill of the drop mask),
    "causal" (no window), "padding" (a padding mask the caller gives, and-ed in: must be refused), "non-causal"
    (a window without the causal bound: not what the op expresses), "strict" (kv < q: each query hides its own key,
    not the op's causal bound either). The same window spelled by distances: "distance" (q - kv < W, as HF's
    sliding-window overlay may), "distance-le" (q - kv <= W - 1), "key-distance" (kv - q <= 0 & kv - q > -W),
    "reversed" (q >= kv & q < kv + W); "distance-strict" (q - kv > 0: the query's own key hidden again) and
    "float-distance" (float query positions, q - kv <= W - 1: the bound is q - kv < W only on integers) must not
    fuse."""

    def __init__(self, window=4, sinks=True, spelling="keep", heads=4, kv_heads=2):
        super().__init__()
        self.window, self.spelling, self.kv_heads = window, spelling, kv_heads
        generator = torch.Generator().manual_seed(3)
        self.sinks = nn.Parameter(torch.randn(heads, generator=generator)) if sinks else None

    def forward(self, q, k, v, past, padding=None):
        batch, heads, queries, _ = q.shape
        context = k.shape[2]
        q_idx = (torch.arange(queries) + past.shape[0])[:, None]  # cache_position
        kv_idx = torch.arange(context)[None, :]
        causal = kv_idx <= q_idx
        if self.spelling == "ge":
            keep = causal & (kv_idx >= q_idx - (self.window - 1))
        elif self.spelling == "non-causal":
            keep = kv_idx > q_idx - self.window
        elif self.spelling == "causal":
            keep = causal
        elif self.spelling == "strict":
            keep = (kv_idx < q_idx) & (kv_idx > q_idx - self.window)
        elif self.spelling == "distance":
            keep = causal & (q_idx - kv_idx < self.window)
        elif self.spelling == "distance-le":
            keep = causal & (q_idx - kv_idx <= self.window - 1)
        elif self.spelling == "key-distance":
            keep = (kv_idx - q_idx <= 0) & (kv_idx - q_idx > -self.window)
        elif self.spelling == "reversed":
            keep = (q_idx >= kv_idx) & (q_idx < kv_idx + self.window)
        elif self.spelling == "distance-strict":
            keep = (q_idx - kv_idx > 0) & (q_idx - kv_idx < self.window)
        elif self.spelling == "float-distance":
            q_idx = q_idx.float()
            keep = (kv_idx <= q_idx) & (q_idx - kv_idx <= self.window - 1)
        else:
            keep = causal & (kv_idx > q_idx - self.window)
        if padding is not None:
            keep = keep & padding[:, None, None, :]
        group = heads // self.kv_heads
        k = k[:, :, None].expand(batch, self.kv_heads, group, context, k.shape[-1]).reshape(batch, heads, context, -1)
        v = v[:, :, None].expand(batch, self.kv_heads, group, context, v.shape[-1]).reshape(batch, heads, context, -1)
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.25
        if self.spelling == "drop":
            scores = scores.masked_fill(~keep, NEG)
        elif self.spelling.startswith("tensor-constants"):  # transformers 5.17's GptOss: torch.tensor fill values
            hidden = -1.0 if self.spelling.endswith("soft") else NEG
            scores = scores + torch.where(keep, torch.tensor(0.0), torch.tensor(hidden))
        else:
            scores = scores + torch.where(keep, 0.0, NEG)
        if self.sinks is not None:
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(batch, -1, queries, -1)
            combined = torch.cat([scores, sinks], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        else:
            probs = scores.softmax(-1)
        return torch.matmul(probs, v)


def _inputs(queries=6, past=5, seed=0, batch=2, heads=4, kv_heads=2):
    generator = torch.Generator().manual_seed(seed)
    context = queries + past
    q = torch.randn(batch, heads, queries, 16, generator=generator)
    k, v = (torch.randn(batch, kv_heads, context, 16, generator=generator) for _ in range(2))
    return q, k, v, torch.zeros(past)


def _op_call(result) -> str:
    after = ir.print_graph(result.graph)
    assert "aten.bmm.default" not in after and "aten.exp.default" not in after and "aten.cat.default" not in after, \
        after
    return next(line for line in after.splitlines() if "dzc.varlen_attention" in line)


def test_golden_window_and_sinks_over_grouped_heads():
    gm, result, actual, expected = _fuse(LocalAttention(4, True), *_inputs())
    assert len(result.rewrites) == 1 and not result.refusals, result.refusals
    before = ir.print_graph(gm.graph)
    assert before.count("aten.bmm.default") == 2 and "aten.cat.default" in before
    call = _op_call(result)
    # q [B*S, H, D]; k, v [B*T, Hkv=2, D] before repeat_kv; S=6 queries over T=11 keys; window 4; the sinks
    # parameter (placeholder %a3) as it is (already fp32).
    arguments = call.split("(", 1)[1].split(")  #")[0].split(", ")
    assert arguments[4] == "6" and arguments[5] == "0.25" and arguments[6:8] == ["None", "None"], call
    assert arguments[-2:] == ["4", "%a3"] and call.endswith("# f32[12, 4, 16]"), call
    shapes = {line.split(" = ")[0].strip(): line.rsplit("# ", 1)[-1] for line in ir.print_graph(
        result.graph).splitlines() if " = " in line}
    assert shapes[arguments[1]] == shapes[arguments[2]] == "f32[22, 2, 16]", (arguments, shapes)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, sinks, spelling", [(4, False, "keep"), (3, True, "ge"), (2, False, "drop"),
                                                     (None, True, "causal"), (100, False, "keep"),
                                                     (4, True, "distance"), (3, False, "distance-le"),
                                                     (2, True, "key-distance"), (4, False, "reversed")])
def test_spellings_fuse_and_match(window, sinks, spelling):
    gm, result, actual, expected = _fuse(LocalAttention(window, sinks, spelling), *_inputs(seed=1))
    assert len(result.rewrites) == 1 and not result.refusals, result.refusals
    arguments = _op_call(result).split("(", 1)[1].split(")  #")[0].split(", ")
    assert arguments[-2] == str(window or 0) and (arguments[-1] != "None") is sinks
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def _sliding_window(queries, past, context, window):
    """Keep mask [queries, context] of queries at positions past, past + 1, ...: causal, within `window`."""
    q_idx = (torch.arange(queries) + past)[:, None]
    kv_idx = torch.arange(context)[None, :]
    return (kv_idx <= q_idx) & (kv_idx > q_idx - window)


class EfficientSdpaForm(nn.Module):
    """A windowed decoder attention in the form CUDA SDPA's memory-efficient choice leaves in a captured graph
    (ATen's attention.cpp: the bool mask turned into a -inf / 0 bias, padded to a multiple of 8 columns and sliced
    back, expanded to [B, H, S, T], then _scaled_dot_product_efficient_attention), written out so that a CPU
    capture sees it; eager runs F.scaled_dot_product_attention on the bool mask, which that form computes."""

    def __init__(self, window=3, pad=True):
        super().__init__()
        self.window, self.pad = window, pad

    def forward(self, q, k, v, past):
        batch, heads, queries, _ = q.shape
        context = k.shape[2]
        keep = _sliding_window(queries, past.shape[0], context, self.window)
        if not torch.compiler.is_compiling():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.25)
        bias = torch.where(keep.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=q.dtype))
        if self.pad:
            bias = F.pad(bias, (0, 8 - context % 8))[..., :context]
        bias = bias.expand(batch, heads, queries, context)
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, scale=0.25)[0]


@pytest.mark.parametrize("pad", [True, False])
def test_cuda_sdpa_form_with_a_padded_bias_fuses(pad):
    """The bias SDPA pads for its GPU kernel reads as the mask it was (before, such a site stayed as it was: HF
    Mistral on the H200 fused nothing)."""
    gm, result, actual, expected = _fuse(EfficientSdpaForm(pad=pad), *_inputs(seed=5, kv_heads=4))
    before = ir.print_graph(gm.graph)
    assert "_scaled_dot_product_efficient_attention" in before and ("constant_pad_nd" in before) is pad, before
    assert len(result.rewrites) == 1 and not result.refusals, result.refusals
    assert "efficient_attention" not in ir.print_graph(result.graph)
    assert _op_call(result).split("(", 1)[1].split(")  #")[0].split(", ")[-2:] == ["3", "None"]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_bias_padded_before_its_data_is_not_read_as_the_mask():
    """Padding at the start of the key dim shifts the bias: not the mask it came from (no site, nothing wrong)."""

    def shifted_bias(q, k, v):
        keep = _sliding_window(q.shape[2], 5, k.shape[2], 3)
        bias = torch.where(keep.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=q.dtype))
        bias = F.pad(bias, (1, 0))[..., :k.shape[2]].expand(*q.shape[:3], k.shape[2])
        return (torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, scale=0.25)[0],)

    q, k, v, _ = _inputs(seed=6, kv_heads=4)
    gm = make_fx(shifted_bias, tracing_mode="fake")(q, k, v)  # the GPU op has no CPU kernel: capture only
    assert "constant_pad_nd" in ir.print_graph(gm.graph)
    result = fuse_windowed_attention(gm.graph)
    assert not result.rewrites and not result.refusals
    assert ir.print_graph(result.graph) == ir.print_graph(gm.graph)


def test_plain_causal_attention_is_left_to_the_fallback():
    gm, result, _, _ = _fuse(LocalAttention(None, False, "causal"), *_inputs(seed=2))
    assert not result.rewrites and not result.refusals
    assert ir.print_graph(result.graph) == ir.print_graph(gm.graph)


def test_refuses_padding_and_a_window_without_the_causal_bound():
    padding = torch.ones(2, 11, dtype=torch.bool)
    padding[0, :2] = False
    gm, result, _, _ = _fuse(LocalAttention(4, True, "padding"), *_inputs(seed=3), padding)
    assert not result.rewrites and len(result.refusals) == 1
    assert result.refusals[0][1].startswith("the mask beside the sinks is not causal (+ a local window): "
                                            "a mask the model is given"), result.refusals
    gm, result, _, _ = _fuse(LocalAttention(4, False, "non-causal"), *_inputs(seed=3))
    assert not result.rewrites and [why for _, why in result.refusals] == [
        "the mask is not exactly causal (+ a local window) (terms: ['window'])"]
    assert ir.print_graph(result.graph) == ir.print_graph(gm.graph)


@pytest.mark.parametrize("spelling, why", [("strict", "keys up to the query position -1"),
                                           ("distance-strict", "keys up to the query position -1"),
                                           ("float-distance", "on positions that are not integers")])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_mask_hiding_each_querys_own_key_is_not_fused(sinks, spelling, why):
    """Off by one, or not provably on: each query's own key hidden (kv < q, or q - kv > 0), and a strict distance
    bound on float query positions (q - kv <= W - 1 is q - kv < W only on integers). Left unfused (with sinks the
    site is refused, with the reason) and the same output as eager."""
    gm, result, fused, eager = _fuse(LocalAttention(4, sinks, spelling), *_inputs(seed=4))
    assert not result.rewrites and len(result.refusals) == sinks, result.refusals
    assert not sinks or why in result.refusals[0][1], result.refusals
    assert ir.print_graph(result.graph) == ir.print_graph(gm.graph)
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)


def _compiled_and_checked(model, inputs, options):
    """dzc.compile(model) run twice (the first call returns the captured graph's result) and checked against eager;
    its report."""
    compiled = dzc.compile(model, "cuda", options)
    with torch.no_grad():
        expected = model(*inputs)
        for _ in range(2):
            actual = compiled(*inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    return compiled.report


def test_window_and_sinks_compile_with_the_kernel(options):
    """dzc.compile end to end (Triton through the interpreter on the CPU): the varlen kernel takes the window, the
    sinks, the grouped heads and the keys of a cache longer than the queries."""
    report = _compiled_and_checked(LocalAttention(4, True), _inputs(queries=7, past=20, seed=4), options)
    assert report.passes["fuse_windowed_attention"] == 1
    attention = next(k for k in report.kernels if k.op == "varlen_attention")
    assert attention.codegen == "triton" and "causal+window sinks grouped kv own key segments" in attention.spec


@pytest.mark.parametrize("spelling, fires", [("tensor-constants", True), ("tensor-constants-soft", False)])
def test_fill_values_given_as_tensor_constants_are_read(spelling, fires, options):
    """A mask whose fill values are 0-d tensor constants (the module's attributes after capture, read
    through their values: graph_pass.CONSTANT) is the same mask as with Python numbers; a constant above MASKED
    (-1.0: hidden keys keep some weight) is no mask, and the attention is left alone."""
    report = _compiled_and_checked(LocalAttention(4, True, spelling), _inputs(queries=7, past=20, seed=5), options)
    assert report.passes["fuse_windowed_attention"] == int(fires), report.refusals


# On the CPU, GptOss in fp32 is test_model_zoo's GptOss-fp32 row: the same model compiled unchanged, at these 20
# tokens among its three lengths, checked against upstream eager with the same tolerance, and its fusions asserted
# (fuse_windowed_attention 4 over its 2 graphs of 2 layers: 2 in each, as here). It runs here on a GPU only (CUDA
# SDPA's captured form), where the zoo does not run.
_ZOO_ON_THE_CPU = pytest.mark.skipif(not torch.cuda.is_available(),
                                     reason="on the CPU: test_model_zoo.py's GptOss-fp32 row covers it")


@pytest.mark.anydevice
@pytest.mark.parametrize("name, dtype, sites", [pytest.param("GptOss", torch.float32, 2, marks=_ZOO_ON_THE_CPU),
                                                ("GptOss", torch.bfloat16, 2), ("Mistral", torch.float32, 1)])
def test_hf_sliding_window_and_sink_models_fuse_unchanged(name, dtype, sites, options):
    """transformers' GptOss (sinks on every layer, a sliding window on every other; in bf16 its softmax runs in
    fp32 between casts) and Mistral (a sliding window, SDPA), tiny random configs, compiled unchanged: every
    layer's attention fires and the logits match eager (the zoo's tolerances) past the tiny configs' window. On a
    GPU the models' attention is CUDA SDPA's, whose captured form the pass must recognise too."""
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    entry = zoo.ZOO[name]
    model = entry.build().eval().to(device=device, dtype=dtype)
    compiled = dzc.compile(model, "cuda", options)
    args, kwargs = entry.inputs(2, dtype)  # 20 tokens, past the window of 8
    args, kwargs = tuple(a.to(device) for a in args), {k: v.to(device) for k, v in kwargs.items()}
    with torch.no_grad():
        expected = entry.outputs(model(*args, **kwargs))
        compiled(*args, **kwargs)  # the first call returns the captured graph's result
        actual = entry.outputs(compiled(*args, **kwargs))
    tolerance = zoo.TOLERANCE[dtype]
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.float(), e.float(), atol=tolerance * e.float().abs().max().item(), rtol=0)
    assert compiled.report.passes["fuse_windowed_attention"] == sites, compiled.report.refusals
