"""fuse_sparse_attention: DSA as dense masked attention  =>  dzc.dsa_indexer + aten.topk + dzc.sparse_attention

Upstream DSA code (DeepSeek's reference, HF transformers' DeepseekV32) scores every key with the lightning
indexer, takes the top-k, scatters them into a mask over the whole context and runs dense attention under it:
O(queries x context) memory and compute. This pass matches that subgraph and replaces it with ops that touch only
the selected keys.

Before (ATen, after capture; [B, S] queries, context T, H heads; `[...]` = view/expand/clone plumbing):

    # indexer: per-head ReLU(q.k), weighted, summed over heads, causal mask, top-k
    %s   = aten.bmm(%q_index[...], %k_index^T[...])                   # [B*S, Hi, T]
    %r   = aten.relu(aten.mul(%s[...], scale)?)                         # [B, S, Hi, T]
    %l   = aten.bmm(%weights[...], %r[...])[...]                        # [B, S, T]
    %top = aten.topk(%l + causal_mask, k)[1]                           # or where(~keep, -inf, %l)
    # the sparse mask, scattered from the indices, merged with the causal mask or added separately
    %m   = aten.scatter(full(-inf), -1, %top, 0) (+ causal_mask)
           # HF eager: where(scatter(full(True), -1, %top, False), finfo.min, causal); SDPA: causal & ~scatter(..)
    # dense attention (eager matmul/softmax, or SDPA's math decomposition with a float/bool mask)
    %p   = softmax(aten.bmm(%q[...], %k^T[...]) * scale + %m[...])       # [B, H, S, T]
    %o   = aten.bmm(%p[...], %v[...])                                   # [B, H, S, Dv]

After:

    %logits = dzc.dsa_indexer(%q_index, %weights * scale, %index_keys, %block_table, %seq_lens, %query_seq,
                              %query_pos, T)                             # [B*S, T]: the only [queries x T] tensor
    %top    = aten.topk(%logits, k)[1]                                   # the model's own k and op
    %idx    = where(%top > %query_pos, -1, %top)                         # [B*S, k] int32
    %o      = dzc.sparse_attention(%q, %k_cache, %v_cache or None, %block_table, %seq_lens, %query_seq, %idx,
                                   scale, Dv[, %query_pos or None, %sinks or None, W])  # [B*S, H, Dv], viewed back

The selection: a lightning indexer under the causal mask (above) is fused with the attention. Any other top-k
selection of the attention's keys (another scorer, an indexer spelled otherwise, all-reduced otherwise, read
elsewhere) is kept as the model computes it and only the attention is rewritten, over the model's own top-k
indices; the rewrite's site says why the selection was kept ("(the model's own selection: <reason>)").

What the next releases add to the same idea is recognised and handed to the op's own arguments:
    local window   the mask keeps the selected keys or the last W positions: causal & (selected | k > q - W)
                   (also spelled k >= q - W + 1, or as the drop mask ~selected & k <= q - W)  =>  query_pos, window=W
    sinks          gpt-oss's per-head sinks: softmax(cat([scores, sinks[h] broadcast], -1) [- its max])[..., :T]
                   =>  sinks = the [H] logits (fp32)
    blocks         block-sparse selection (NSA's selection branch, MoBA): the top-k ranks [B, S, U] block scores,
                   its scatter is repeated B times along the keys (unsqueeze/expand/reshape, or
                   repeat_interleave) and cut to T  =>  index_block = B, query_pos (the query's own block is
                   causal within); a selection per head (a [B, H, S, U] top-k) is not what the op expresses: refused

Caches: when the keys are a paged read `cache[block_table].flatten(1, 2)` (dzc.models.dsa over
dzc.kv_cache.PagedKVCache; for the FP8 indexer pool, `values[block_table].float() * scales[block_table][..., None]`
of two views of one uint8 pool), the ops get the cache and its block table and read the selected rows in place;
otherwise (HF's DynamicCache) the dense [B, T, ...] keys are a cache of B pages of T tokens with block table
arange(B)[:, None]. V that is a prefix of K's last dim (MLA's latent) becomes v_cache=None, d_v.
Tensor parallel: an indexer whose heads are split across ranks sums its partial scores with an all-reduce
before the mask (`wait_tensor(all_reduce(%l, 'sum', group))`); the rewrite keeps that all-reduce, over the
dsa_indexer logits of the rank's own heads. A replicated indexer (DeepSeek-V3.2's reference) needs nothing.
Positions: the causal mask must be `key_position <= query_position` with key positions arange(T); the query
positions it compares with become query_pos, and seq_lens = T (keys past a sequence's end are later positions,
so causality hides them). HF's mask without a cache (packed-sequence ids over the positions it computes as
arange(S)) arrives here as that causal mask: canonicalize_graph proves it (fold_known_index). Position ids the
caller passes may pack sequences; their mask is not causal and the site is refused.
Selection: the model's top-k op, k and device, over logits that order the keys as the model's scores do (-inf
where the causal mask hides a key, as its finfo.min/-inf ties them below every visible one). Where scores tie at
the k-th place, torch.topk keeps its own choice (on the CPU not the smaller position; ReLU scores a key that every
index head rates <= 0 exactly 0, so tiny models tie often): another top-k (dzc.dsa_topk) would pick other keys.
A hidden key it takes when fewer than k are visible is hidden in the model's mask too: it becomes -1.

Conditions checked on the graph (else a refusal with the reason): the indexer is [B*S, Hi, Di] x [B, T, Di] ReLU
scores summed over Hi with a positive scale inside the ReLU; its mask is exactly causal (arange(T) along the last
dim against one query position per row); the top-k is over the last dim, largest, of those [B, S, T] scores; the
attention is [B, H, S, D] x [B, 1 or H, T, D] scores, softmax over T, times [B, 1 or H, T, Dv]; its mask is
exactly causal (the same query positions) + a scatter of this top-k's indices.

Refusals (recorded with the reason, graph untouched at that site): an attention mask that is not exactly causal +
top-k (+ a local window beside it: a padding mask, a window intersected with the selection, a window relative to
other positions than the causal mask's), top-k indices or the sparse mask or the scores with another use, a
selection per head, sinks per query, float64 attention. An indexer the pass cannot fuse (a scale that is not a
positive constant, a mask that is not exactly causal, another scorer) is not a refusal: the model's selection is
kept and the attention fused, the site saying why. A dense attention without a top-k mask has no topk node and is
never looked at; a top-k scattered into a mask that reaches no softmax (a group-limited MoE router's expert mask)
is not a candidate either: neither is reported.

Ordering: runs on the captured ATen graph, before lowering. It does not depend on fuse_residual_norm.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx

from dzc.passes.attention_patterns import (SHAPE_ONLY, Attention, Builder, NotAMask, bmm_operands, check_private,
                                          erase_replaced, feeds_exp, flat_query_positions, fp32_sinks,
                                          match_attention, one_position_per_query, query_positions, same, shape_is,
                                          softmax_output, split_masked, strip, strip_casts, transposed,
                                          whole_dim_slice)
from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call, location_of

aten = torch.ops.aten
prims = torch.ops.prims
_c10d = torch.ops._c10d_functional
dzc = torch.ops.dzc

NAME = "fuse_sparse_attention"

def _uint8_pages(node):
    """The uint8 page pool a typed view of part of it comes from (slice of the page bytes, view as another dtype,
    reshape to [pages, page, ...]), else None."""
    pool = None
    while is_call(node, aten.view.default, aten.view.dtype, aten.alias.default, aten.slice.Tensor,
                  aten.reshape.default):
        rank = fake_value(node.args[0]).dim()
        if is_call(node, aten.slice.Tensor) and node.args[1] % rank != rank - 1 and not whole_dim_slice(node):
            return None  # only slices of the bytes within a page (and whole-dim slices, which dynamic sizes keep)
        node = node.args[0]
        if fake_value(node).dtype == torch.uint8 and fake_value(node).dim() == 2:
            pool = node  # keep going: the values and the scales are slices of the same pool
    return pool


def _fp8_paged_source(dense):
    """dense = (values[block_table].float() * scales[block_table][..., None]).flatten(1, 2), values and scales views
    of one uint8 FP8 index page pool (dzc.kv_cache.gather_index_keys) -> (pool, block_table), else None."""
    node = strip_casts(dense)
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    product = node.args[0]
    if not is_call(product, aten.mul.Tensor):
        return None
    values, scales = (strip(strip_casts(a), SHAPE_ONLY) for a in product.args[:2])
    if not (is_call(values, aten.index.Tensor) and is_call(scales, aten.index.Tensor)):
        return None
    if fake_value(values).dim() < fake_value(scales).dim():
        values, scales = scales, values
    table = strip_casts(values.args[1][0])
    pool = _uint8_pages(values.args[0])
    if pool is None or pool is not _uint8_pages(scales.args[0]) or strip_casts(scales.args[1][0]) is not table:
        return None
    if fake_value(values.args[0]).dtype != torch.float8_e4m3fn or fake_value(scales.args[0]).dtype != torch.float32:
        return None
    return pool, table


def _paged_source(dense):
    """dense [B, P * page, ...] = cache[block_table].flatten(1, 2) -> (cache, block_table int32 node), else None."""
    fp8 = _fp8_paged_source(dense)
    if fp8 is not None:
        return fp8
    node = strip_casts(dense)
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    gathered = strip_casts(node.args[0])
    cast = gathered is not node.args[0] or node is not dense
    if not is_call(gathered, aten.index.Tensor) or len(gathered.args[1]) != 1:
        return None
    cache, table = gathered.args[0], gathered.args[1][0]
    cache_val, gathered_val, dense_val = fake_value(cache), fake_value(gathered), fake_value(node)
    if gathered_val.dim() != cache_val.dim() + 1 or dense_val.dim() != cache_val.dim():
        return None
    if not same(dense_val.shape[1], gathered_val.shape[1] * gathered_val.shape[2]):
        return None
    table = strip_casts(table)
    if fake_value(table) is None or fake_value(table).dim() != 2 or fake_value(table).dtype.is_floating_point:
        return None
    if fake_value(cache).dtype != fake_value(dense).dtype and not cast:
        return None
    return cache, table


@dataclass
class _Indexer:
    q: torch.fx.Node  # [B*S, Hi, Di] before any upcast
    weights: torch.fx.Node  # [B*S, 1, Hi] as the bmm reads it
    weight_scale: float
    keys: torch.fx.Node  # [B, T, Di]
    logits: torch.fx.Node  # [B, S, T]
    nodes: list  # the scoring subgraph (dead after the rewrite)
    # The process group of a sum all-reduce over the ranks' logits (an indexer whose heads are split across
    # ranks: each rank scores its own heads and the partial head sums are added), None for one device.
    summed_over: str | None = None


def _match_indexer(logits) -> _Indexer:
    """logits [B, S, T] = sum_h w[h] * relu(scale * q[h] . k) as matmuls (HF / upstream bf16 spelling)."""
    outer = bmm_operands(logits)
    if outer is None:
        raise Refusal("the top-k input is not a weighted head sum of indexer scores")
    weights, relu_operand, outer_scale = outer
    relu = strip(relu_operand)
    if not is_call(relu, aten.relu.default):
        raise Refusal("the indexer scores are not ReLU(q.k)")
    inner = bmm_operands(relu.args[0])
    if inner is None:
        raise Refusal("the indexer scores are not a q.k matmul")
    q, k_operand, inner_scale = inner
    if inner_scale <= 0:
        raise Refusal("the indexer's score scale is not a positive constant")
    k4 = strip(k_operand)
    if is_call(k4, aten.unsqueeze.default):
        k4 = k4.args[0]
    if (is_call(k4, prims.convert_element_type.default) and transposed(k4.args[0]) is not None
            and fake_value(k4.args[0]).dtype in (torch.bfloat16, torch.float16)):
        k4 = k4.args[0]  # k.transpose(-1, -2).float(): as k.float() below, the op upcasts the keys itself
    keys = transposed(k4)
    if keys is None or fake_value(keys).dim() != 3:
        raise Refusal("the indexer keys are not one [B, T, D] key per token")
    if (is_call(keys, prims.convert_element_type.default)
            and fake_value(keys.args[0]).dtype in (torch.bfloat16, torch.float16) and _paged_source(keys) is None):
        keys = keys.args[0]  # HF's k.float(): the op reads bf16 keys and computes in fp32 itself
    source = strip(q)
    if is_call(source, prims.convert_element_type.default) and fake_value(source.args[0]).dtype in (torch.bfloat16,
                                                                                          torch.float16):
        q = source.args[0]  # the upcast of HF's q.float() happens inside the op
    # What the rewrite reads is what the matmuls compute: rows N = B*S in (b, s) order, Hi heads of Di reduced
    # over Di, the head sum reduced over Hi, one key of Di per position of the T the top-k ranks.
    batch, context, head_dim = fake_value(keys).shape
    rows, heads = fake_value(weights).shape[0], fake_value(weights).shape[-1]
    if not (shape_is(weights, rows, 1, heads) and shape_is(relu_operand, rows, heads, context)
            and shape_is(inner[0], rows, heads, head_dim) and shape_is(k_operand, rows, head_dim, context)
            and fake_value(logits).dim() == 3 and shape_is(logits, batch, None, context)
            and same(rows, batch * fake_value(logits).shape[1])
            and same(fake_value(q).shape[-2], heads) and same(fake_value(q).shape[-1], head_dim)
            and same(fake_value(q).numel(), rows * heads * head_dim)):
        raise Refusal("the indexer matmuls are not [B*S, Hi, Di] queries against [B, T, Di] keys summed over the "
                      "Hi heads into [B, S, T]")
    paged = _paged_source(keys)
    key_dtype = fake_value(paged[0] if paged is not None else keys).dtype
    if key_dtype != torch.uint8 and key_dtype != fake_value(q).dtype:
        # dsa_indexer multiplies in one dtype, or reads the uint8 FP8 pool. Dense keys in another dtype than q are
        # a spelling this pass does not know (an FP8 pool read it could not trace back, say): keep it as written.
        raise Refusal(f"the indexer keys ({key_dtype}) and q ({fake_value(q).dtype}) differ in dtype and are not "
                      "the FP8 index page pool")
    return _Indexer(q, weights, inner_scale * outer_scale, keys, logits, [relu])


def _all_reduced_sum(logits):
    """(partial logits, group) when logits = wait_tensor(all_reduce(partial, "sum", group)), read only by the
    mask: the head sum of an indexer whose heads are split across ranks; else (logits, None)."""
    if not (is_call(logits, _c10d.wait_tensor.default) and is_call(logits.args[0], _c10d.all_reduce.default)):
        return logits, None
    reduce = logits.args[0]
    if reduce.args[1] != "sum":
        raise Refusal(f"the indexer scores are all-reduced with {reduce.args[1]!r}, not summed over the ranks")
    if len(reduce.users) != 1 or len(logits.users) != 1:
        raise Refusal("the all-reduced indexer scores have another use")
    return reduce.args[0], reduce.args[2]


def _is_prefix(v, k) -> bool:
    """v = k[..., :d_v] (also when both are the same unsqueeze of a [B, T, D] latent and its slice)."""
    while is_call(v, aten.unsqueeze.default) and is_call(k, aten.unsqueeze.default) and v.args[1] == k.args[1]:
        v, k = v.args[0], k.args[0]
    if not is_call(v, aten.slice.Tensor) or v.args[0] is not k or v.args[2] != 0:
        return False
    return v.args[1] % fake_value(k).dim() == fake_value(k).dim() - 1


def _rewrite(graph, topk, match: _Match, fake_mode):
    indexer, attention = match.indexer, match.attention
    build = Builder(graph, attention.out, attention.out.meta.get("stack_trace"), fake_mode)
    q4, out4 = attention.q, attention.out
    batch, heads, queries = build.size(q4, 0), build.size(q4, 1), build.size(q4, 2)

    # Which sequence each query row belongs to, and its position (from the causal mask).
    query_pos = flat_query_positions(build, query_positions(attention.terms, "attention"), batch, queries)
    # query_seq contiguous too (a reshape of an expand can be a stride-0 view at batch 1; kernels index it flat).
    sequence = build(prims.iota.default, batch, start=0, step=1, dtype=torch.int32, device=fake_value(q4).device,
                     requires_grad=False)
    query_seq = build(aten.clone.default, build(aten.reshape.default, build(
        aten.expand.default, build(aten.unsqueeze.default, sequence, 1), [batch, queries]), [-1]),
        memory_format=torch.contiguous_format)

    # Caches: paged reads keep their block table; dense keys are B pages of T tokens.
    dense_table = build(aten.unsqueeze.default, sequence, 1)

    def cache_of(rows):
        paged = _paged_source(rows)
        if paged is None:
            return rows, dense_table
        cache, table = paged
        if fake_value(table).dtype != torch.int32:
            table = build(prims.convert_element_type.default, table, torch.int32)
        return cache, table

    def rows_of(heads_first):  # [B, H, T, D] -> [B, T, H, D], looking through the model's own transpose
        if is_call(heads_first, aten.permute.default) and list(heads_first.args[1]) == [0, 2, 1, 3]:
            return heads_first.args[0]
        return build(aten.permute.default, heads_first, [0, 2, 1, 3])

    context = build.size(attention.k, 2)
    seq_lens = build(aten.full.default, [batch], context, dtype=torch.int32, device=fake_value(q4).device)

    if indexer is not None:
        ranked = _fused_selection(build, topk, indexer, cache_of, seq_lens, query_seq, query_pos, context)
    else:  # the model's own top-k indices, a row per query
        ranked = build(aten.reshape.default, match.indices, [-1, build.size(match.indices, -1)])
    if match.block == 1:
        # A hidden key the top-k takes (fewer visible keys than k) is hidden by the model's mask too: it becomes
        # -1, which sparse_attention skips. where(hidden, -1, ranked), as AOTAutograd decomposes masked_fill: the
        # graph goes to Inductor after the passes, and Inductor refuses ops it decomposes (aten.masked_fill.Scalar
        # failed there on the H200).
        hidden = build(aten.gt.Tensor, ranked, build(aten.unsqueeze.default, query_pos, 1))
        minus_one = build(aten.scalar_tensor.default, -1, dtype=fake_value(ranked).dtype,
                          device=fake_value(ranked).device)
        ranked = build(aten.where.self, hidden, minus_one, ranked)
    indices = build(prims.convert_element_type.default, ranked, torch.int32)

    # Attention: [B, H, S, D] -> [B*S, H, D]; keys [B, Hkv, T, D] -> cache [pages, page, Hkv, D].
    q = build(aten.reshape.default, build(aten.permute.default, q4, [0, 2, 1, 3]), [-1, heads, build.size(q4, 3)])
    k_cache, k_table = cache_of(rows_of(attention.k))
    v = attention.v
    d_v = fake_value(v).shape[-1]
    if _is_prefix(v, attention.k):
        v_cache = None  # V = K[..., :d_v] (MLA's latent); sparse_attention reads it from the K rows
    else:
        v_cache, v_table = cache_of(rows_of(v))
        if v_table is not k_table:  # one paged, the other dense: read both dense
            k_cache, k_table = rows_of(attention.k), dense_table
            v_cache = rows_of(v)
    # A local window beside the selected keys: the op attends it itself, relative to the query positions.
    window = next((term[2] for term in attention.terms if term[0] == "any" for term in term[1]
                   if term[0] == "window"), 0)
    sinks = fp32_sinks(build, attention.sinks)
    # Blocks: the positions of the query's own block past it are hidden by the causal mask (the op's query_pos).
    causal = window or match.block > 1
    extras = (query_pos if causal else None, sinks, window, match.block) \
        if causal or sinks is not None else ()
    out = build(dzc.sparse_attention.default, q, k_cache, v_cache, k_table, seq_lens, query_seq, indices,
                attention.scale, d_v, *extras)
    out = build(aten.permute.default, build(aten.view.default, out, [batch, queries, heads, d_v]), [0, 2, 1, 3])
    if fake_value(out).dtype != fake_value(out4).dtype:
        out = build(prims.convert_element_type.default, out, fake_value(out4).dtype)
    out4.replace_all_uses_with(out)
    return out


def _fused_selection(build, topk, indexer: _Indexer, cache_of, seq_lens, query_seq, query_pos, context):
    """dzc.dsa_indexer's logits, ranked by the model's own top-k -> the selected positions [B*S, k]."""
    index_cache, index_table = cache_of(indexer.keys)
    index_q = build(aten.reshape.default, indexer.q, [-1, build.size(indexer.q, -2), build.size(indexer.q, -1)])
    weights = build(aten.reshape.default, indexer.weights, [-1, build.size(indexer.weights, -1)])
    if fake_value(weights).dtype != torch.float32:
        weights = build(prims.convert_element_type.default, weights, torch.float32)
    if indexer.weight_scale != 1.0:
        weights = build(aten.mul.Tensor, weights, indexer.weight_scale)
    logits = build(dzc.dsa_indexer.default, index_q, weights, index_cache, index_table, seq_lens, query_seq,
                   query_pos, context)
    if indexer.summed_over is not None:
        # This rank's heads, hidden keys at -inf on every rank; summed as the model sums its partial scores (the
        # model adds its causal mask after the sum: -inf either way, the visible keys' sums equal).
        logits = build(_c10d.wait_tensor.default, build(_c10d.all_reduce.default, logits, "sum",
                                                        indexer.summed_over))
    # The selection is the model's own top-k (same k, same device) over the fused logits. Where scores tie at the
    # k-th place (ReLU makes a key scored <= 0 by every index head exactly 0), torch.topk's choice is its own
    # (on the CPU a partial sort's, not the smaller position): only the same op over the same order of values
    # picks the same keys. The logits order keys as the model's scores do, and the keys the causal mask hides
    # are -inf here, tied below every visible key as finfo.min is there.
    return build(operator.getitem, build(aten.topk.default, logits, topk.args[1]), 1)


def _match(topk):
    """topk -> _Match; None if this top-k does not select the keys of an attention."""
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    indices = next((u for u in topk.users if is_call(u, operator.getitem) and u.args[1] == 1), None)
    if indices is None:
        return None
    scatters, other_uses = [], 0
    pending = [indices]
    while pending:
        node = pending.pop()
        for user in node.users:
            if is_call(user, prims.convert_element_type.default):
                pending.append(user)
            elif is_call(user, aten.scatter.value) and user.args[2] is node:
                scatters.append(user)
            else:
                other_uses += 1
    if not scatters:  # a top-k that builds no mask (an MoE router, say) is not a DSA candidate: nothing to report
        return None
    # The attention: the add (or where) of the mask into scores that feeds a softmax. A top-k mask that reaches no
    # softmax (a group-limited MoE router's expert mask, say) is not a DSA candidate either.
    masked = near = None
    frontier, seen = [scatters[0]], set()
    for _ in range(10):
        following = []
        for node in frontier:
            for user in node.users:
                if user in seen:
                    continue
                seen.add(user)
                if is_call(user, aten.add.Tensor, aten.where.self):
                    if softmax_output(user) is not None:
                        masked = masked or user
                    elif feeds_exp(user):
                        near = near or user  # a softmax this pass does not read (sinks it cannot express, say)
                following.append(user)
        frontier = following
    if masked is None and near is not None:
        raise Refusal("the masked scores do not feed a softmax")
    if masked is None:
        return None
    if other_uses:
        raise Refusal("the top-k indices have another use than the sparse mask")
    if len(scatters) != 1:
        raise Refusal("the top-k indices build more than one mask")
    if dim not in (-1, fake_value(topk.args[0]).dim() - 1) or not largest:
        raise Refusal("the top-k is not over the largest scores of the last dim")
    if any(u.args[1] == 0 and u.users for u in topk.users if is_call(u, operator.getitem)):
        raise Refusal("the top-k values are used")

    # The selection: a DSA lightning indexer under the causal mask is fused too; any other scorer (block scores,
    # an indexer spelled otherwise) is kept as the model computes it, and only the attention is rewritten.
    try:
        indexer, index_positions = _match_indexer_selection(topk)
    except (Refusal, NotAMask) as why:
        indexer, index_positions, own_selection = None, None, str(why)
    else:
        own_selection = None

    try:
        attention = match_attention(masked)
    except NotAMask as why:
        raise Refusal(f"the attention mask is not causal + top-k: {why}") from None
    terms = [t for term in attention.terms for t in (term[1] if term[0] == "any" else [term])]  # unions opened
    kinds = sorted(term[0] for term in attention.terms)
    selected = next((term for term in terms if term[0] == "topk"), None)
    if kinds not in (["causal", "topk"], ["any", "causal"]) or selected[1] is not indices:
        raise Refusal(f"the attention mask is not exactly causal + this top-k (+ a local window) (terms: {kinds})")
    positions = strip(query_positions(attention.terms, "attention"), SHAPE_ONLY)
    if indexer is not None and index_positions is not positions:
        raise Refusal("the indexer and the attention use different query positions")
    if any(term[0] == "window" and strip(term[1], SHAPE_ONLY) is not positions for term in terms):
        raise Refusal("the local window is not relative to the causal mask's query positions")
    # The top-k ranks units of the keys, one row per query ([B, S, U]): positions (B = 1), or blocks of B positions
    # whose mask is cut to the T keys (a block past them selects nothing, in the model and in the op alike).
    _, _, block, width, scatter = selected
    batch, _, queries, context = fake_value(masked).shape
    ranked = fake_value(topk.args[0])
    if not (ranked.dim() == 3 and same(ranked.shape[0], batch) and same(ranked.shape[1], queries)
            and shape_is(scatter, batch, queries, None) and same(width, context)
            and one_position_per_query(query_positions(attention.terms, "attention"), batch, queries)):
        raise Refusal("the top-k does not rank [B, S, units] scores, one row per query, whose units (positions or "
                      "blocks of them) cover the keys")
    if indexer is not None and block != 1:
        raise Refusal("an indexer's top-k positions are repeated in blocks")
    # Ancestors of the masked scores from the scatter on: a node on a path from the scatter lies after it (walking
    # every ancestor went through all earlier layers, quadratic in the model's depth).
    ancestors, pending = set(), [masked]
    while pending:
        for node in pending.pop().all_input_nodes:
            if node not in ancestors and not node < scatters[0]:
                ancestors.add(node)
                pending.append(node)
    mask_chain = (seen | {scatters[0]}) & ancestors  # from the scatter to the masked scores
    if any(user not in mask_chain and user is not masked for node in mask_chain for user in node.users):
        raise Refusal("the sparse mask has another use")
    check_private(masked)
    return _Match(indexer, attention, indices, block, own_selection)


@dataclass
class _Match:
    indexer: _Indexer | None  # None: the model's own selection is kept
    attention: Attention
    indices: torch.fx.Node  # the model's top-k indices [B, S, k]
    block: int  # positions one index selects
    own_selection: str | None  # why the selection is kept as the model computes it


def _match_indexer_selection(topk):
    """The top-k's scores as a DSA lightning indexer under the causal mask -> (indexer, its query positions);
    raises Refusal / NotAMask with the reason otherwise."""
    logits, index_terms = split_masked(topk.args[0])
    if [term[0] for term in index_terms] != ["causal"]:
        raise Refusal("the indexer mask is not exactly causal")
    partial, group = _all_reduced_sum(logits)
    indexer = _match_indexer(partial)
    indexer.summed_over = group
    # The top-k ranks the T keys of each query row: the masked logits are the [B, S, T] scores, not a broadcast
    # of them.
    if not shape_is(topk.args[0], *fake_value(logits).shape):
        raise Refusal("the top-k does not rank the [B, S, T] indexer scores")
    return indexer, strip(query_positions(index_terms, "indexer"), SHAPE_ONLY)


def fuse_sparse_attention(graph: torch.fx.Graph) -> PassResult:
    """Rewrite every DSA top-k masked attention into dsa_indexer + top-k + sparse_attention."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    topks = [n for n in graph.nodes if is_call(n, aten.topk.default)]
    fake_mode = None  # the graph's, as Builder finds it (once)
    with _cached_fake_values(fake_value(topks[0].args[0]) if topks else None):
        for topk in topks:
            if topk.graph is not graph:
                continue
            try:
                match = _match(topk)
            except (Refusal, NotAMask) as refusal:
                result.refused(location_of(topk), str(refusal))
                continue
            if match is None:
                continue
            where = location_of(match.attention.out)
            if fake_mode is None:
                fake_mode = Builder(graph, match.attention.out, None).fake_mode
            _rewrite(graph, topk, match, fake_mode)
            if match.indexer is not None:
                erase_replaced(graph, [match.attention.out, topk, match.indexer.logits])
            else:
                erase_replaced(graph, [match.attention.out])
                where += f" (the model's own selection: {match.own_selection})"
            result.rewrote(where)
    return result


@contextlib.contextmanager
def _cached_fake_values(value):
    """Torch's cache of fake tensor dispatch on in the fake mode of `value` (a node's fake value, or None): every
    layer's site builds the same ops over values of the same sizes, and an op's meta function (symbolic reshapes:
    ~2 ms each) then runs for the first site only; the others' values are made from the cached metadata (a view:
    its input's storage at the cached sizes and strides). dzc.compile turns the cache off process-wide for capture
    (dzc/api.py)."""
    mode = getattr(value, "fake_mode", None)
    if mode is None:
        yield
        return
    enabled = mode.cache_enabled
    mode.cache_enabled = True
    try:
        yield
    finally:
        mode.cache_enabled = enabled
