"""fuse_windowed_attention: causal attention with a local window or attention sinks  =>  dzc.varlen_attention

Text decoders with sliding-window layers (Mistral, Gemma 2/3, gpt-oss) and per-head attention sinks (gpt-oss)
reach the captured graph as dense attention under a materialised [S, T] mask, with the sinks as one more softmax
column: O(S x T) scores where each query sees at most `window` keys. This pass gives such a site to
dzc.varlen_attention, whose kernel visits only the key blocks a query block sees.

Before (ATen, after capture; [B, H, S, D] queries over T keys; `[...]` = view/expand/clone plumbing; k and v may
be HF's repeat_kv of [B, Hkv, T, D]: unsqueeze(2), expand to [B, Hkv, H/Hkv, T, D], reshape to [B, H, T, D]):

    %m = causal [& window]             # bool keep/drop or additive (where(m, 0, finfo.min)): k <= q [& k > q - W]
    %s = aten.bmm(%q[...], %k^T[...]) * scale + %m[...]                   # [B, H, S, T]
    %p = softmax(%s)                                                      # or, with sinks (gpt-oss):
         softmax(cat([%s, %sinks.view(1, H, 1, 1).expand(B, H, S, 1)], -1) [- its max])[..., :T]
    %o = aten.bmm(%p[...], %v[...])                                       # [B, H, S, D], viewed back

After:

    %o = dzc.varlen_attention(%q [B*S, H, D], %k [B*T, Hkv, D], %v [B*T, Hkv, D], arange(B+1)*S (int32), S, scale,
                              None, None, arange(B+1)*T, %query_pos [B*S] int32, W or 0, %sinks fp32 or None)
         # [B*S, H, D], viewed and permuted back to [B, H, S, D]

Which sites: a causal mask (key positions arange(T) <= the query positions, one per query row) with a local
window (k > q - W, or as attention_patterns reads the same bounds: k >= q - W + 1, q - k < W, q < k + W, ...), or
with sinks, or both. Plain causal attention without either is left alone: the fallback runs it as SDPA, whose
flash/cuDNN kernels already skip the masked half (not a refusal). A top-k term in the mask is
fuse_sparse_attention's (it runs first and says why it refused, if it did).

Conditions checked on the graph (else a refusal with the reason, graph untouched at that site): the mask is
exactly causal (+ a window relative to the same query positions); the scores are [B, H, S, D] x [B, 1 or H, T, D]
(through repeat_kv: KV heads dividing H, the same for k and v), softmax over T, times V; the sinks (if any) are a
[H] vector broadcast to one column; the masked scores have no other use; bf16/fp16/fp32.
SDPA as capture keeps it is read from its arguments (a causal + window mask as attn_mask / attn_bias, no dropout,
no is_causal on top): the CPU's flash op, and the GPUs' efficient op, whose bias SDPA pads to an aligned width and
slices back (read through that; the H200 run of HF Mistral found the pass blind to it before). Eager attention
(gpt-oss's default) and SDPA's math form are matched too.

Ordering: after fuse_sparse_attention (an attention under a top-k mask is its), before lowering.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from dzc.passes.attention_patterns import (ATTENTION_DTYPES, SDPA_OPS, SHAPE_ONLY, Attention, Builder, NotAMask,
                                          additive_terms, check_private, erase_replaced, flat_query_positions,
                                          fp32_sinks, is_whole_slice, keep_terms, mask_problem, match_attention,
                                          one_position_per_query, query_positions, same, softmax_output,
                                          split_masked, strip)
from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call, location_of

aten = torch.ops.aten
prims = torch.ops.prims
dzc = torch.ops.dzc

NAME = "fuse_windowed_attention"


@dataclass
class _Site:
    attention: Attention
    positions: torch.fx.Node  # the causal mask's query positions ([..., S, 1], one per query row)
    window: int  # 0: none
    k: torch.fx.Node  # [B, Hkv, T, D] (before any repeat_kv)
    v: torch.fx.Node


def _repeated_kv(node):
    """HF's repeat_kv: x [B, Hkv, T, D] -> x[:, :, None].expand(B, Hkv, G, T, D).reshape(B, Hkv*G, T, D) -> x;
    else node itself (already one KV head per query head, or one head for all)."""
    view = node
    if not is_call(view, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return node
    expanded = strip(view.args[0], (aten.clone.default,))
    if not is_call(expanded, aten.expand.default):
        return node
    source = expanded.args[0]
    while is_whole_slice(source):
        source = source.args[0]
    if not (is_call(source, aten.unsqueeze.default) and source.args[1] in (2, -3)):
        return node
    source = source.args[0]
    while is_whole_slice(source):
        source = source.args[0]
    kv, out = fake_value(source), fake_value(view)
    if kv.dim() != 4 or out.dim() != 4 or not all(same(kv.shape[i], out.shape[i]) for i in (0, 2, 3)):
        return node
    return source


def _match(masked) -> _Site | None:
    """A causal attention with a window or sinks whose masked scores are `masked`; None when it is not one."""
    _, sinks = softmax_output(masked)
    try:
        scores, terms = split_masked(masked)
        problem = mask_problem(scores)
    except NotAMask as why:
        problem = str(why)
    if problem is not None:
        if sinks is None:
            return None  # a mask this pass cannot read, and nothing says it is a decoder's windowed attention
        raise Refusal(f"the mask beside the sinks is not causal (+ a local window): {problem}")
    kinds = sorted(term[0] for term in terms)
    if "topk" in kinds or "any" in kinds:
        return None  # fuse_sparse_attention's site
    window = next((term[2] for term in terms if term[0] == "window"), 0)
    if kinds not in (["causal"], ["causal", "window"]):
        if sinks is None and not window:
            return None  # not causal: another pass's kind of attention, if any
        raise Refusal(f"the mask is not exactly causal (+ a local window) (terms: {kinds})")
    if not window and sinks is None:
        return None  # plain causal attention: the fallback's SDPA kernels take it (see the docstring)
    attention = match_attention(masked)
    check_private(masked)
    return _site(attention, terms, window)


def _site(attention: Attention, terms: list, window: int) -> _Site:
    """The checks both spellings share: one query position per query row, the window relative to it, KV heads
    (through repeat_kv) that divide the query heads."""
    positions = query_positions(attention.terms, "attention")
    if any(term[0] == "window" and strip(term[1], SHAPE_ONLY) is not strip(positions, SHAPE_ONLY) for term in terms):
        raise Refusal("the local window is not relative to the causal mask's query positions")
    batch, heads, queries, _ = fake_value(attention.q).shape
    if not one_position_per_query(positions, batch, queries):
        raise Refusal("the causal mask does not compare one query position per query row")
    k, v = _repeated_kv(attention.k), _repeated_kv(attention.v)
    kv_heads = fake_value(k).shape[1]
    if not (same(fake_value(v).shape[1], kv_heads) and heads % kv_heads == 0):
        raise Refusal("the keys and values have other KV heads, or KV heads that do not divide the query heads")
    return _Site(attention, positions, window, k, v)


def _match_sdpa(node) -> _Site | None:
    """A fused SDPA op under a causal + local window mask; None when it is not one (plain causal: is_causal or a
    causal mask alone, which the op's own kernels take)."""
    arguments = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if arguments is None:
        return None
    arguments = arguments.kwargs
    mask = arguments.get("attn_mask", arguments.get("attn_bias"))
    if mask is None:
        return None
    try:
        terms = keep_terms(mask) if fake_value(mask).dtype == torch.bool else additive_terms(mask)
    except NotAMask:
        return None  # not a decoder's window mask: nothing says this attention is one
    kinds = sorted(term[0] for term in terms)
    if kinds != ["causal", "window"]:
        return None  # plain causal, or a top-k / other mask (not this pass's)
    if arguments.get("dropout_p", 0.0) or arguments.get("is_causal", False):
        raise Refusal("dropout, or is_causal on top of the mask")
    q, k, v = arguments["query"], arguments["key"], arguments["value"]
    if node.target is aten.scaled_dot_product_attention.default:
        out = node
    else:
        outs = [u for u in node.users if is_call(u, operator.getitem)]
        if len(outs) != 1 or outs[0].args[1] != 0:
            raise Refusal("the attention's log-sum-exp or other outputs are used")
        out = outs[0]
    if not all(fake_value(x).dim() == 4 for x in (q, k, v)) or fake_value(q).dtype not in ATTENTION_DTYPES:
        raise Refusal("the attention is not [B, H, S, D] queries over [B, Hkv, T, D] keys in bf16/fp16/fp32")
    scale = arguments.get("scale")
    scale = fake_value(q).shape[-1] ** -0.5 if scale is None else float(scale)
    attention = Attention(q, k, v, scale, out, node, terms, None)
    return _site(attention, terms, window=next(term[2] for term in terms if term[0] == "window"))


def _rewrite(graph: torch.fx.Graph, site: _Site) -> None:
    attention = site.attention
    build = Builder(graph, attention.out, attention.out.meta.get("stack_trace"))
    q4, out4 = attention.q, attention.out
    batch, heads, queries, head_dim = (build.size(q4, d) for d in range(4))
    context = build.size(site.k, 2)
    device = fake_value(q4).device

    def tokens_first(x):  # [B, H, L, D] -> [B*L, H, D]
        return build(aten.reshape.default, build(aten.permute.default, x, [0, 2, 1, 3]),
                     [-1, build.size(x, 1), build.size(x, 3)])

    def segment_starts(length):  # arange(B + 1) * length, int32
        count = batch + 1 if isinstance(batch, int) else build(operator.add, batch, 1)
        starts = build(prims.iota.default, count, start=0, step=1, dtype=torch.int64, device=device,
                       requires_grad=False)
        return build(prims.convert_element_type.default, build(aten.mul.Tensor, starts, length), torch.int32)

    query_pos = flat_query_positions(build, site.positions, batch, queries)
    sinks = fp32_sinks(build, attention.sinks)
    out = build(dzc.varlen_attention.default, tokens_first(q4), tokens_first(site.k), tokens_first(site.v),
                segment_starts(queries), queries, attention.scale, None, None, segment_starts(context), query_pos,
                site.window, sinks)
    out = build(aten.permute.default, build(aten.view.default, out, [batch, queries, heads, head_dim]), [0, 2, 1, 3])
    if fake_value(out).dtype != fake_value(out4).dtype:
        out = build(prims.convert_element_type.default, out, fake_value(out4).dtype)
    out4.replace_all_uses_with(out)


def fuse_windowed_attention(graph: torch.fx.Graph) -> PassResult:
    """Rewrite every causal attention with a local window or sinks into dzc.varlen_attention."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    candidates = [n for n in graph.nodes if (is_call(n, aten.add.Tensor, aten.where.self, aten.masked_fill.Scalar)
                                             and softmax_output(n) is not None) or is_call(n, *SDPA_OPS)]
    for candidate in candidates:
        if candidate.graph is not graph or not candidate.users:  # erased with an earlier site
            continue
        try:
            site = _match_sdpa(candidate) if is_call(candidate, *SDPA_OPS) else _match(candidate)
        except (Refusal, NotAMask) as refusal:
            result.refused(location_of(candidate), str(refusal))
            continue
        if site is None:
            continue
        where = location_of(site.attention.out)
        _rewrite(graph, site)
        erase_replaced(graph, [site.attention.out])
        result.rewrote(where)
    return result
