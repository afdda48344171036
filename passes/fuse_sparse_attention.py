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

Refusals (recorded with the reason, graph untouched at that site): a mask that is not exactly causal + top-k (+ a
local window beside it: a padding mask, a window intersected with the selection, a window relative to other
positions than the causal mask's), top-k indices or the sparse mask or the scores with another use, an indexer
scale that is not a positive constant, a top-k over something other than an indexer score. A dense attention
without a top-k mask has no topk node and is never looked at; a top-k scattered into a mask that reaches no
softmax (a group-limited MoE router's expert mask) is not a candidate either: neither is reported.

Ordering: runs on the captured ATen graph, before lowering. It does not depend on fuse_residual_norm.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call, location_of
from dzc.passes.patterns import is_last_dim

aten = torch.ops.aten
prims = torch.ops.prims
_c10d = torch.ops._c10d_functional
dzc = torch.ops.dzc

NAME = "fuse_sparse_attention"

# Ops that only re-view a value; the matcher looks through them.
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
          aten.clone.default, aten.alias.default)
_SHAPE_ONLY = _VIEWS + (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default)
_ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what dzc.sparse_attention takes
# Anything at or below this is a "masked out" additive value: -inf, or finfo(dtype).min (HF; fp16's is -65504).
_MASKED = -65504.0
_WHOLE = 9223372036854775807  # the end of an open slice `x[a:]`




def _strip(node, ops=_VIEWS):
    while is_call(node, *ops):
        node = node.args[0]
    return node


def _strip_casts(node):
    while is_call(node, prims.convert_element_type.default):
        node = node.args[0]
    return node


def _scalar(node):
    """The value of a constant scalar (a Python number, or a 0-d full/scalar_tensor node), else None."""
    if isinstance(node, (int, float)):
        return float(node)
    node = _strip(node)
    if is_call(node, aten.scalar_tensor.default):
        return float(node.args[0])
    if is_call(node, aten.full.default) and all(s == 1 for s in node.args[0]):
        return float(node.args[1])
    return None


def _fill(node):
    """The value a full(...) tensor (any shape) is filled with, else None."""
    node = _strip(node)
    if is_call(node, aten.full.default):
        return float(node.args[1])
    return _scalar(node)


def _same(a, b) -> bool:
    return a is b or statically_known_true(a == b)


def _shape_is(node, *dims) -> bool:
    """node's value has exactly these sizes (ints or SymInts; None: any)."""
    shape = fake_value(node).shape
    return len(shape) == len(dims) and all(d is None or _same(s, d) for s, d in zip(shape, dims))


def _is_whole_slice(node) -> bool:
    """x[..., 0:end] with end past the dim's size: the same values (HF slices its masks to the key length)."""
    if not is_call(node, aten.slice.Tensor) or len(node.args) < 4:
        return False
    dim, start, end = node.args[1:4]
    size = fake_value(node.args[0]).shape[dim]
    end = fake_value(end) if isinstance(end, torch.fx.Node) else end
    return start in (0, None) and (end == _WHOLE or _same(end, size) or statically_known_true(end >= size))


# ----------------------------------------------------------------------------------------------------------------
# Masks: an additive float mask, or a boolean keep/drop mask, is decomposed into terms, all of which must hold
# for a key to be visible:
#   ("causal", query_positions)     keys at positions <= the query's position are visible
#   ("topk", indices, B, width, scatter)  the keys at these indices are visible (B > 1: index i makes the block of
#                                   positions [i*B, i*B + B) visible: a scatter's units repeated B times); width:
#                                   the columns of the term's mask (checked to be the keys')
#   ("window", query_positions, W)  keys at positions > the query's position - W are visible (a local window)
#   ("any", [term, term])           either term holds (the selected keys beside a local window)
# Anything else (padding, a mask from a model input) is not a DSA mask.


class _NotAMask(Exception):
    pass


def _describe(node) -> str:
    """A mask part as a reason names it: a model input (a padding mask, say) or the op computing it."""
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        return f"a mask the model is given ({node.name})"
    return f"{node.target}" if isinstance(node, torch.fx.Node) else repr(node)


def _topk_indices(node):
    node = _strip_casts(node)
    if is_call(node, operator.getitem) and node.args[1] == 1 and is_call(node.args[0], aten.topk.default):
        return node
    raise _NotAMask("scatter indices do not come from a top-k")


def _key_positions(node):
    """The arange(T) that node broadcasts (HF's [..., kv_offset:] slices with offset 0 and + 0 looked through),
    else None."""
    node = _strip(node, _SHAPE_ONLY)
    while _is_whole_slice(node):
        node = _strip(node.args[0], _SHAPE_ONLY)
    if is_call(node, aten.add.Tensor) and node.args[1] == 0:
        node = node.args[0]
    if is_call(node, prims.iota.default) and node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1:
        return node
    return None


def _causal(keys, queries):
    """('causal', q) when keys is arange(T) broadcast along the last dim and queries is constant along it."""
    iota = _key_positions(keys)
    if iota is None:
        raise _NotAMask("the causal comparison is not against key positions arange(T)")
    if not (isinstance(queries, torch.fx.Node) and fake_value(queries).dim() >= 1 and fake_value(keys).dim() >= 1
            and _same(fake_value(queries).shape[-1], 1)
            and _same(fake_value(keys).shape[-1], fake_value(iota).shape[0])):
        raise _NotAMask("the causal comparison does not run the key positions along the last dim")
    return [("causal", queries)]


def _window(keys, shifted, wider: int):
    """('window', q, W) when shifted = q - W' (W' a positive integer constant) and W = W' + wider."""
    if is_call(shifted, aten.sub.Tensor) and isinstance(shifted.args[1], int):
        queries, width = shifted.args[0], shifted.args[1] + wider
    elif is_call(shifted, aten.add.Tensor) and isinstance(shifted.args[1], int):
        queries, width = shifted.args[0], -shifted.args[1] + wider
    else:
        raise _NotAMask("a comparison of key positions with something other than the query position (- a constant)")
    if width < 1:
        raise _NotAMask(f"a local window of {width} keys")
    (_, queries), = _causal(keys, queries)
    return [("window", queries, width)]


_NEGATED = {aten.gt.Tensor: aten.le.Tensor, aten.le.Tensor: aten.gt.Tensor, aten.ge.Tensor: aten.lt.Tensor,
            aten.lt.Tensor: aten.ge.Tensor}
_MIRRORED = {aten.gt.Tensor: aten.lt.Tensor, aten.lt.Tensor: aten.gt.Tensor, aten.ge.Tensor: aten.le.Tensor,
             aten.le.Tensor: aten.ge.Tensor}


def _comparison_terms(node, keep: bool):
    """A comparison of the key positions k with the query positions q, True where a key is visible (keep) or
    hidden: k <= q is causal; k > q - W (or k >= q - W + 1) is a local window of W keys. Either side may hold k."""
    compare, keys, other = node.target, node.args[0], node.args[1]
    if _key_positions(keys) is None:
        compare, keys, other = _MIRRORED[compare], other, keys
    if not keep:
        compare = _NEGATED[compare]
    if compare is aten.le.Tensor:
        return _causal(keys, other)
    if compare is aten.gt.Tensor:
        return _window(keys, other, 0)
    if compare is aten.ge.Tensor:
        return _window(keys, other, 1)
    raise _NotAMask("key positions < query positions (the query's own key hidden) is not causal")


def _either(left: list, right: list):
    """The union of two single terms: the selected keys and a local window (any other union is not a DSA mask)."""
    if len(left) != 1 or len(right) != 1 or sorted(term[0] for term in left + right) != ["topk", "window"]:
        raise _NotAMask("a union of mask terms other than the selected keys and a local window")
    return [("any", left + right)]


_COMPARISONS = (aten.le.Tensor, aten.ge.Tensor, aten.lt.Tensor, aten.gt.Tensor)


def _block_expansion(node):
    """node = x [..., U] with each unit repeated B times along the last dim, [..., U*B] (optionally sliced to its
    first T columns): x.unsqueeze(-1).expand(..., U, B).reshape(..., U*B)[..., :T], which repeat_interleave(B, -1)
    also decomposes to -> (x, B), else None."""
    if is_call(node, aten.slice.Tensor) and node.args[1] % fake_value(node).dim() == fake_value(node).dim() - 1 \
            and node.args[2] in (0, None) and (len(node.args) < 5 or node.args[4] == 1):
        node = node.args[0]
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    expanded = _strip(node.args[0], (aten.clone.default,))
    if not (is_call(expanded, aten.expand.default) and is_call(expanded.args[0], aten.unsqueeze.default)):
        return None
    source = expanded.args[0].args[0]
    rank = fake_value(source).dim()
    if expanded.args[0].args[1] % (rank + 1) != rank:
        return None
    units, block = fake_value(expanded).shape[-2:]
    if not (isinstance(block, int) and block > 1 and _same(units, fake_value(source).shape[-1])
            and fake_value(node).dim() == rank and _same(fake_value(node).shape[-1], units * block)
            and all(_same(a, b) for a, b in zip(fake_value(node).shape[:-1], fake_value(source).shape[:-1]))):
        return None
    return source, block


def _selected_terms(node, form: str):
    """[("topk", ...)] when node is a scatter of top-k indices into a mask of units, repeated per block or not, in
    the `form` "keep" (True where selected), "drop" (False there) or "additive" (0 there, -inf/finfo.min
    elsewhere); else None."""
    width = fake_value(node).shape[-1] if isinstance(node, torch.fx.Node) and fake_value(node) is not None else None
    expansion = _block_expansion(node)
    block = 1
    if expansion is not None:
        node, block = expansion
    while is_call(node, *_SHAPE_ONLY) or (form == "additive" and is_call(node, prims.convert_element_type.default)):
        node = node.args[0]  # the scatter's own views ([B, S, U] unsqueezed for the heads, say)
    if not (is_call(node, aten.scatter.value) and node.args[1] == -1):
        return None
    fill, value = _fill(node.args[0]), node.args[3]
    if (form == "keep" and value is True and fill == 0.0) or (form == "drop" and value is False and fill == 1.0) \
            or (form == "additive" and value == 0 and (fill or 0.0) <= _MASKED):
        # width: the mask's columns (units x block, or what the expansion kept of them), checked to be the keys
        return [("topk", _topk_indices(node.args[2]), block, width if block > 1 else fake_value(node).shape[-1],
                 node)]
    return None


def _keep_terms(node):
    """Terms of a boolean mask that is True where a key is visible."""
    selected = _selected_terms(node, "keep")
    if selected is not None:
        return selected
    if is_call(node, *_SHAPE_ONLY, aten.select.int) or _is_whole_slice(node):
        return _keep_terms(node.args[0])
    if is_call(node, aten.bitwise_and.Tensor, aten.logical_and.default):
        return _keep_terms(node.args[0]) + _keep_terms(node.args[1])
    if is_call(node, aten.bitwise_or.Tensor, aten.logical_or.default):
        return _either(_keep_terms(node.args[0]), _keep_terms(node.args[1]))
    if is_call(node, aten.bitwise_not.default, aten.logical_not.default):
        return _drop_terms(node.args[0])
    if is_call(node, *_COMPARISONS):
        return _comparison_terms(node, keep=True)
    raise _NotAMask(f"{_describe(node)} is not a causal, top-k or window keep mask")


def _drop_terms(node):
    """Terms of a boolean mask that is True where a key is hidden."""
    selected = _selected_terms(node, "drop")
    if selected is not None:
        return selected
    if is_call(node, *_SHAPE_ONLY, aten.select.int) or _is_whole_slice(node):
        return _drop_terms(node.args[0])
    if is_call(node, aten.bitwise_or.Tensor, aten.logical_or.default):
        return _drop_terms(node.args[0]) + _drop_terms(node.args[1])
    if is_call(node, aten.bitwise_and.Tensor, aten.logical_and.default):
        return _either(_drop_terms(node.args[0]), _drop_terms(node.args[1]))
    if is_call(node, aten.bitwise_not.default, aten.logical_not.default):
        return _keep_terms(node.args[0])
    if is_call(node, *_COMPARISONS):
        return _comparison_terms(node, keep=False)
    raise _NotAMask(f"{_describe(node)} is not a causal, top-k or window drop mask")


def _additive_terms(node):
    """Terms of a float mask that is 0 where a key is visible and -inf (or finfo.min) where hidden."""
    value = _scalar(node)
    if value == 0.0:
        return []
    selected = _selected_terms(node, "additive")
    if selected is not None:
        return selected
    if is_call(node, *_SHAPE_ONLY, aten.select.int, prims.convert_element_type.default) or _is_whole_slice(node):
        return _additive_terms(node.args[0])
    if is_call(node, aten.add.Tensor):
        return _additive_terms(node.args[0]) + _additive_terms(node.args[1])
    if is_call(node, aten.where.self):
        condition, if_true, if_false = node.args
        if (_scalar(if_true) or 0.0) <= _MASKED and _scalar(if_true) is not None:
            return _drop_terms(condition) + _additive_terms(if_false)
        if _scalar(if_false) is not None and _scalar(if_false) <= _MASKED:
            return _keep_terms(condition) + _additive_terms(if_true)
    if is_call(node, aten.masked_fill.Scalar) and node.args[2] <= _MASKED:
        return _drop_terms(node.args[1]) + _additive_terms(node.args[0])
    raise _NotAMask(f"{_describe(node)} is not a causal, top-k or window additive mask")


def _split_masked(node):
    """node = x masked by a DSA mask -> (x, terms); x is the operand that is not a mask."""
    if is_call(node, aten.add.Tensor):
        for value, mask in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            try:
                terms = _additive_terms(mask)
            except _NotAMask:
                continue
            inner, more = _split_masked(value)
            return inner, terms + more
    if is_call(node, aten.where.self) and _scalar(node.args[1]) is not None and _scalar(node.args[1]) <= _MASKED:
        inner, more = _split_masked(node.args[2])
        return inner, _drop_terms(node.args[0]) + more
    if is_call(node, aten.masked_fill.Scalar) and node.args[2] <= _MASKED:
        inner, more = _split_masked(node.args[0])
        return inner, _drop_terms(node.args[1]) + more
    return node, []


def _query_positions(terms, what: str):
    causal = [term[1] for term in terms if term[0] == "causal"]
    if not causal:
        raise Refusal(f"the {what} mask has no causal term (key position <= query position)")
    first = _strip(causal[0], _SHAPE_ONLY)
    if any(_strip(q, _SHAPE_ONLY) is not first for q in causal[1:]):
        raise Refusal(f"the {what} mask compares with different query positions")
    return causal[0]


# ----------------------------------------------------------------------------------------------------------------
# The pieces of the pattern.


def _bmm_operands(node):
    """node = view(bmm(a, b)) (optionally times constant scales) -> (a, b, scale)."""
    scale = 1.0
    while is_call(node, aten.mul.Tensor, aten.mul.Scalar) and _scalar(node.args[1]) is not None:
        scale *= _scalar(node.args[1])
        node = node.args[0]
    node = _strip(node, _SHAPE_ONLY)
    if not is_call(node, aten.bmm.default):
        return None
    return node.args[0], node.args[1], scale


def _scaled_source(node):
    """Strip view plumbing and constant multiplies (SDPA's math form scales q and k by sqrt(scale) each)."""
    scale = 1.0
    node = _strip(node)
    while is_call(node, aten.mul.Tensor, aten.mul.Scalar) and _scalar(node.args[1]) is not None:
        scale *= _scalar(node.args[1])
        node = _strip(node.args[0])
    return node, scale


def _transposed(node):
    """node = K^T over the last two dims -> K, else None."""
    if is_call(node, aten.permute.default):
        dims = [d % len(node.args[1]) for d in node.args[1]]
        rank = len(dims)
        if dims == list(range(rank - 2)) + [rank - 1, rank - 2]:
            return node.args[0]
    if is_call(node, aten.transpose.int):
        rank = fake_value(node).dim()
        if sorted(d % rank for d in node.args[1:3]) == [rank - 2, rank - 1]:
            return node.args[0]
    return None


def _whole_slice(node) -> bool:
    """aten.slice(x, dim, 0, INT64_MAX) with step 1: a no-op, which captures with symbolic sizes keep in the graph."""
    start, end, step = (list(node.args[2:]) + [0, _WHOLE, 1][len(node.args[2:]):])[:3]
    return start in (0, None) and end in (None, _WHOLE) and step == 1


def _uint8_pages(node):
    """The uint8 page pool a typed view of part of it comes from (slice of the page bytes, view as another dtype,
    reshape to [pages, page, ...]), else None."""
    pool = None
    while is_call(node, aten.view.default, aten.view.dtype, aten.alias.default, aten.slice.Tensor,
                  aten.reshape.default):
        rank = fake_value(node.args[0]).dim()
        if is_call(node, aten.slice.Tensor) and node.args[1] % rank != rank - 1 and not _whole_slice(node):
            return None  # only slices of the bytes within a page (and whole-dim slices, which dynamic sizes keep)
        node = node.args[0]
        if fake_value(node).dtype == torch.uint8 and fake_value(node).dim() == 2:
            pool = node  # keep going: the values and the scales are slices of the same pool
    return pool


def _fp8_paged_source(dense):
    """dense = (values[block_table].float() * scales[block_table][..., None]).flatten(1, 2), values and scales views
    of one uint8 FP8 index page pool (dzc.kv_cache.gather_index_keys) -> (pool, block_table), else None."""
    node = _strip_casts(dense)
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    product = node.args[0]
    if not is_call(product, aten.mul.Tensor):
        return None
    values, scales = (_strip(_strip_casts(a), _SHAPE_ONLY) for a in product.args[:2])
    if not (is_call(values, aten.index.Tensor) and is_call(scales, aten.index.Tensor)):
        return None
    if fake_value(values).dim() < fake_value(scales).dim():
        values, scales = scales, values
    table = _strip_casts(values.args[1][0])
    pool = _uint8_pages(values.args[0])
    if pool is None or pool is not _uint8_pages(scales.args[0]) or _strip_casts(scales.args[1][0]) is not table:
        return None
    if fake_value(values.args[0]).dtype != torch.float8_e4m3fn or fake_value(scales.args[0]).dtype != torch.float32:
        return None
    return pool, table


def _paged_source(dense):
    """dense [B, P * page, ...] = cache[block_table].flatten(1, 2) -> (cache, block_table int32 node), else None."""
    fp8 = _fp8_paged_source(dense)
    if fp8 is not None:
        return fp8
    node = _strip_casts(dense)
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    gathered = _strip_casts(node.args[0])
    cast = gathered is not node.args[0] or node is not dense
    if not is_call(gathered, aten.index.Tensor) or len(gathered.args[1]) != 1:
        return None
    cache, table = gathered.args[0], gathered.args[1][0]
    cache_val, gathered_val, dense_val = fake_value(cache), fake_value(gathered), fake_value(node)
    if gathered_val.dim() != cache_val.dim() + 1 or dense_val.dim() != cache_val.dim():
        return None
    if not _same(dense_val.shape[1], gathered_val.shape[1] * gathered_val.shape[2]):
        return None
    table = _strip_casts(table)
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
    outer = _bmm_operands(logits)
    if outer is None:
        raise Refusal("the top-k input is not a weighted head sum of indexer scores")
    weights, relu_operand, outer_scale = outer
    relu = _strip(relu_operand)
    if not is_call(relu, aten.relu.default):
        raise Refusal("the indexer scores are not ReLU(q.k)")
    inner = _bmm_operands(relu.args[0])
    if inner is None:
        raise Refusal("the indexer scores are not a q.k matmul")
    q, k_operand, inner_scale = inner
    if inner_scale <= 0:
        raise Refusal("the indexer's score scale is not a positive constant")
    k4 = _strip(k_operand)
    if is_call(k4, aten.unsqueeze.default):
        k4 = k4.args[0]
    if (is_call(k4, prims.convert_element_type.default) and _transposed(k4.args[0]) is not None
            and fake_value(k4.args[0]).dtype in (torch.bfloat16, torch.float16)):
        k4 = k4.args[0]  # k.transpose(-1, -2).float(): as k.float() below, the op upcasts the keys itself
    keys = _transposed(k4)
    if keys is None or fake_value(keys).dim() != 3:
        raise Refusal("the indexer keys are not one [B, T, D] key per token")
    if (is_call(keys, prims.convert_element_type.default)
            and fake_value(keys.args[0]).dtype in (torch.bfloat16, torch.float16) and _paged_source(keys) is None):
        keys = keys.args[0]  # HF's k.float(): the op reads bf16 keys and computes in fp32 itself
    source = _strip(q)
    if is_call(source, prims.convert_element_type.default) and fake_value(source.args[0]).dtype in (torch.bfloat16,
                                                                                          torch.float16):
        q = source.args[0]  # the upcast of HF's q.float() happens inside the op
    # What the rewrite reads is what the matmuls compute: rows N = B*S in (b, s) order, Hi heads of Di reduced
    # over Di, the head sum reduced over Hi, one key of Di per position of the T the top-k ranks.
    batch, context, head_dim = fake_value(keys).shape
    rows, heads = fake_value(weights).shape[0], fake_value(weights).shape[-1]
    if not (_shape_is(weights, rows, 1, heads) and _shape_is(relu_operand, rows, heads, context)
            and _shape_is(inner[0], rows, heads, head_dim) and _shape_is(k_operand, rows, head_dim, context)
            and fake_value(logits).dim() == 3 and _shape_is(logits, batch, None, context)
            and _same(rows, batch * fake_value(logits).shape[1])
            and _same(fake_value(q).shape[-2], heads) and _same(fake_value(q).shape[-1], head_dim)
            and _same(fake_value(q).numel(), rows * heads * head_dim)):
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


@dataclass
class _Attention:
    q: torch.fx.Node  # [B, H, S, Dqk]
    k: torch.fx.Node  # [B, Hkv, T, Dqk]
    v: torch.fx.Node  # [B, Hkv, T, Dv]
    scale: float
    out: torch.fx.Node  # [B, H, S, Dv], replaced
    scores: torch.fx.Node  # the masked scores (dead after the rewrite)
    terms: list
    sinks: torch.fx.Node | None  # [H] logits joining each softmax (attention sinks), or None


def _reduces_last_dim(node) -> bool:
    """node = amax/sum/max(x, dims, keepdim=True) over x's last dim only."""
    rank = fake_value(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else dims  # max.dim takes one dim
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return dims is not None and is_last_dim(dims, rank) and keepdim


def _sink_column(masked):
    """masked's only user cat([masked, sinks], -1) with sinks a [H] vector broadcast to one column [.., H, .., 1]
    -> (cat, the [H] vector), else None: attention sinks (a per-head logit in each softmax, no value)."""
    users = list(masked.users)
    if len(users) != 1 or not is_call(users[0], aten.cat.default):
        return None
    cat = users[0]
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    rank = fake_value(masked).dim()
    if len(parts) != 2 or parts[0] is not masked or dim % rank != rank - 1 or rank != 4:
        return None
    heads = fake_value(masked).shape[1]
    # The column broadcasts a tensor whose only non-1 dim is the heads' (dim 1 once right-aligned to 4 dims):
    # element [b, h, s, 0] is then sinks[h], whatever views made that tensor from the [H] vector.
    broadcast = parts[1]
    while is_call(broadcast, aten.expand.default):
        broadcast = broadcast.args[0]
    shape = [1] * (4 - fake_value(broadcast).dim()) + list(fake_value(broadcast).shape)
    sinks = _strip(broadcast, _SHAPE_ONLY)
    if not (len(shape) == 4 and _same(shape[1], heads) and all(_same(d, 1) for i, d in enumerate(shape) if i != 1)
            and _same(fake_value(parts[1]).shape[1], heads) and fake_value(sinks).dim() == 1
            and _same(fake_value(sinks).shape[0], heads)):
        return None
    return cat, sinks


def _softmax_output(masked):
    """masked -> (the probabilities of softmax over its last dim (the keys), the [H] sink logits or None), else
    None. Softmax: exp(x - amax(x)) / sum(exp(..)), both reductions over the last dim (the amax/sub/exp/sum/div
    decomposition). With sinks (gpt-oss's spelling): the softmax runs over cat([x, sinks], -1), optionally less its
    max first (no change to a softmax), and the probabilities are its first T columns."""
    start = masked
    users = list(start.users)
    if len(users) == 1 and is_call(users[0], prims.convert_element_type.default):
        start = users[0]
    sinks = None
    with_sinks = _sink_column(start)
    if with_sinks is not None:
        start, sinks = with_sinks
        shifted = [u for u in start.users if is_call(u, aten.sub.Tensor) and u.args[0] is start
                   and is_call(u.args[1], operator.getitem) and u.args[1].args[1] == 0
                   and is_call(u.args[1].args[0], aten.max.dim) and u.args[1].args[0].args[0] is start
                   and _reduces_last_dim(u.args[1].args[0])]
        if shifted:
            start = shifted[0]
    amax = next((u for u in start.users if is_call(u, aten.amax.default) and _reduces_last_dim(u)), None)
    sub = next((u for u in start.users if is_call(u, aten.sub.Tensor) and u.args[0] is start and u.args[1] is amax),
               None)
    if amax is None or sub is None:
        return None
    exp = next(iter(sub.users), None)
    if not is_call(exp, aten.exp.default):
        return None
    probs = next((u for u in exp.users if is_call(u, aten.div.Tensor) and u.args[0] is exp
                  and is_call(u.args[1], aten.sum.dim_IntList) and u.args[1].args[0] is exp
                  and _reduces_last_dim(u.args[1])), None)
    if probs is None or sinks is None:
        return probs and (probs, None)
    # The key columns: probs[..., :T] (":-1" or ":T"), the sink's column dropped.
    keys = list(probs.users)
    context = fake_value(masked).shape[-1]
    if len(keys) != 1 or not is_call(keys[0], aten.slice.Tensor) or keys[0].args[1] % 4 != 3 \
            or keys[0].args[2] not in (0, None) or not _shape_is(keys[0], *fake_value(masked).shape) \
            or (len(keys[0].args) > 4 and keys[0].args[4] != 1):
        return None
    return (keys[0], sinks) if _same(fake_value(keys[0]).shape[-1], context) else None


def _probabilities_consumer(probs):
    """Follow probs through casts, SDPA's all-masked-row fixup and views to the bmm with V."""
    node = probs
    while True:
        users = [u for u in node.users]
        if len(users) != 1:
            return None
        user = users[0]
        if is_call(user, aten.bmm.default) and user.args[0] is node:
            return user
        if is_call(user, prims.convert_element_type.default, *_VIEWS):
            node = user
            continue
        if is_call(user, aten.where.self) and user.args[2] is node and _fill(user.args[1]) == 0.0:
            node = user  # SDPA: rows with every key masked give 0 instead of NaN
            continue
        return None


def _match_attention(masked) -> _Attention:
    scores, terms = _split_masked(masked)
    operands = _bmm_operands(scores)
    if operands is None and is_call(scores, aten.add.Tensor):
        # q.k scores plus a mask that is not causal + top-k (+ a window): say what in the mask is not
        mask = next((a for a in scores.args if isinstance(a, torch.fx.Node) and _bmm_operands(a) is None), None)
        try:
            _additive_terms(mask)
        except _NotAMask as why:
            raise Refusal(f"the attention mask is not causal + top-k: {why}") from None
    if operands is None:
        raise Refusal("the masked values are not q.k scores")
    q_operand, k_operand, scale = operands
    q, q_scale = _scaled_source(q_operand)
    k_t, k_scale = _scaled_source(k_operand)
    k = _transposed(k_t)
    if k is None or fake_value(q).dim() != 4 or fake_value(k).dim() != 4:
        raise Refusal("the attention operands are not [B, H, S, D] queries and transposed [B, H, T, D] keys")
    softmax = _softmax_output(masked)
    if softmax is None:
        raise Refusal("the masked scores do not feed a softmax")
    probs, sinks = softmax
    pv = _probabilities_consumer(probs)
    if pv is None:
        raise Refusal("the attention probabilities have another use than the matmul with V")
    v = _strip(pv.args[1])
    out = next(iter(pv.users), None)
    if (len(pv.users) != 1 or not is_call(out, aten.view.default, aten._unsafe_view.default)
            or fake_value(out).dim() != 4 or fake_value(v).dim() != 4):
        raise Refusal("the attention output is not [B, H, S, Dv]")
    # The matmuls reduce over D (scores) and T (output), each query row over its own batch's keys; K and V heads
    # are 1 (shared, MLA's latent) or H (sparse_attention's two layouts), not broadcast over the batch.
    batch, heads, queries, head_dim = fake_value(q).shape
    context, d_v = fake_value(k).shape[2], fake_value(v).shape[3]
    kv_heads = fake_value(k).shape[1]
    if not (_shape_is(q_operand, batch * heads, queries, head_dim)
            and _same(fake_value(q).numel(), fake_value(q_operand).numel())
            and _shape_is(k_operand, batch * heads, head_dim, context)
            and _shape_is(k, batch, kv_heads, context, head_dim) and (_same(kv_heads, 1) or _same(kv_heads, heads))
            and _shape_is(v, batch, kv_heads, context, d_v)
            and _shape_is(pv.args[0], batch * heads, queries, context) and _shape_is(out, batch, heads, queries, d_v)
            and _same(fake_value(masked).shape[-2], queries) and _same(fake_value(masked).shape[-1], context)):
        raise Refusal("the attention is not [B, H, S, D] queries over [B, 1 or H, T, D] keys and values, softmax "
                      "over T")
    if fake_value(q).dtype not in _ATTENTION_DTYPES:
        raise Refusal(f"{fake_value(q).dtype} attention: dzc.sparse_attention takes bf16, fp16 and fp32 (a float64 "
                      "model keeps its precision, unfused)")
    return _Attention(q, k, v, scale * q_scale * k_scale, out, masked, terms, sinks)


# ----------------------------------------------------------------------------------------------------------------
# The rewrite.


class _Builder:
    """Inserts nodes before `anchor`, each with meta['val'] computed from its arguments' fake values."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, stack_trace):
        self.graph, self.anchor, self.stack_trace = graph, anchor, stack_trace
        values = [n.meta.get("val") for n in graph.nodes]
        self.fake_mode = torch._guards.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])

    def __call__(self, target, *args, **kwargs):
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        node.meta["stack_trace"] = self.stack_trace
        return node

    def size(self, node, dim):
        """A dim of node's value: an int, or a node computing the symbolic size. An existing node holding the same
        size is preferred, so that the tensors this rewrite makes dead do not stay alive for their sizes."""
        size = node.meta["val"].shape[dim]
        if isinstance(size, int):
            return size
        for candidate in self.graph.nodes:
            if candidate is self.anchor:
                break
            value = candidate.meta.get("val")
            if isinstance(value, torch.SymInt) and candidate.op in ("placeholder", "call_function") \
                    and str(value.node.expr) == str(size.node.expr):
                return candidate
        return self(aten.sym_size.int, node, dim)


def _is_prefix(v, k) -> bool:
    """v = k[..., :d_v] (also when both are the same unsqueeze of a [B, T, D] latent and its slice)."""
    while is_call(v, aten.unsqueeze.default) and is_call(k, aten.unsqueeze.default) and v.args[1] == k.args[1]:
        v, k = v.args[0], k.args[0]
    if not is_call(v, aten.slice.Tensor) or v.args[0] is not k or v.args[2] != 0:
        return False
    return v.args[1] % fake_value(k).dim() == fake_value(k).dim() - 1


def _rewrite(graph, topk, match: _Match):
    indexer, attention = match.indexer, match.attention
    build = _Builder(graph, attention.out, attention.out.meta.get("stack_trace"))
    q4, out4 = attention.q, attention.out
    batch, heads, queries = build.size(q4, 0), build.size(q4, 1), build.size(q4, 2)

    # Which sequence each query row belongs to, and its position (from the causal mask).
    positions = _query_positions(attention.terms, "attention")
    positions = build(aten.view.default, positions, [-1, queries])
    positions = build(aten.expand.default, positions, [batch, queries])
    # Contiguous copies: a reshape of an expand can be a stride-0 view (batch 1), and kernels index these flat.
    query_pos = build(aten.clone.default, build(prims.convert_element_type.default,
                                                build(aten.reshape.default, positions, [-1]), torch.int32),
                      memory_format=torch.contiguous_format)
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
    sinks = attention.sinks
    if sinks is not None and fake_value(sinks).dtype != torch.float32:
        sinks = build(prims.convert_element_type.default, sinks, torch.float32)
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


def _remove_dead(graph, roots) -> None:
    """Erase the replaced subgraph: the roots and whatever they alone used (never unrelated dead code)."""
    pending, erased = list(roots), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op != "call_function":
            continue
        pending.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


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
                    if _softmax_output(user) is not None:
                        masked = masked or user
                    elif _feeds_exp(user):
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
    except (Refusal, _NotAMask) as why:
        indexer, index_positions, own_selection = None, None, str(why)
    else:
        own_selection = None

    try:
        attention = _match_attention(masked)
    except _NotAMask as why:
        raise Refusal(f"the attention mask is not causal + top-k: {why}") from None
    terms = [t for term in attention.terms for t in (term[1] if term[0] == "any" else [term])]  # unions opened
    kinds = sorted(term[0] for term in attention.terms)
    selected = next((term for term in terms if term[0] == "topk"), None)
    if kinds not in (["causal", "topk"], ["any", "causal"]) or selected[1] is not indices:
        raise Refusal(f"the attention mask is not exactly causal + this top-k (+ a local window) (terms: {kinds})")
    positions = _strip(_query_positions(attention.terms, "attention"), _SHAPE_ONLY)
    if indexer is not None and index_positions is not positions:
        raise Refusal("the indexer and the attention use different query positions")
    if any(term[0] == "window" and _strip(term[1], _SHAPE_ONLY) is not positions for term in terms):
        raise Refusal("the local window is not relative to the causal mask's query positions")
    # The top-k ranks units of the keys, one row per query ([B, S, U]): positions (B = 1), or blocks of B positions
    # whose mask is cut to the T keys (a block past them selects nothing, in the model and in the op alike).
    _, _, block, width, scatter = selected
    batch, _, queries, context = fake_value(masked).shape
    ranked = fake_value(topk.args[0])
    query_rows = fake_value(_query_positions(attention.terms, "attention"))
    if not (ranked.dim() == 3 and _same(ranked.shape[0], batch) and _same(ranked.shape[1], queries)
            and _shape_is(scatter, batch, queries, None) and _same(width, context) and query_rows.dim() >= 2 and _same(query_rows.shape[-2], queries) and _same(query_rows.shape[-1], 1)
            and (_same(query_rows.numel(), queries) or _same(query_rows.numel(), batch * queries))):
        raise Refusal("the top-k does not rank [B, S, units] scores, one row per query, whose units (positions or "
                      "blocks of them) cover the keys")
    if indexer is not None and block != 1:
        raise Refusal("an indexer's top-k positions are repeated in blocks")
    ancestors, pending = set(), [masked]
    while pending:
        for node in pending.pop().all_input_nodes:
            if node not in ancestors:
                ancestors.add(node)
                pending.append(node)
    mask_chain = (seen | {scatters[0]}) & ancestors  # from the scatter to the masked scores
    if any(user not in mask_chain and user is not masked for node in mask_chain for user in node.users):
        raise Refusal("the sparse mask has another use")
    _check_private(masked)
    return _Match(indexer, attention, indices, block, own_selection)


@dataclass
class _Match:
    indexer: _Indexer | None  # None: the model's own selection is kept
    attention: _Attention
    indices: torch.fx.Node  # the model's top-k indices [B, S, k]
    block: int  # positions one index selects
    own_selection: str | None  # why the selection is kept as the model computes it


def _match_indexer_selection(topk):
    """The top-k's scores as a DSA lightning indexer under the causal mask -> (indexer, its query positions);
    raises Refusal / _NotAMask with the reason otherwise."""
    logits, index_terms = _split_masked(topk.args[0])
    if [term[0] for term in index_terms] != ["causal"]:
        raise Refusal("the indexer mask is not exactly causal")
    partial, group = _all_reduced_sum(logits)
    indexer = _match_indexer(partial)
    indexer.summed_over = group
    # The top-k ranks the T keys of each query row: the masked logits are the [B, S, T] scores, not a broadcast
    # of them.
    if not _shape_is(topk.args[0], *fake_value(logits).shape):
        raise Refusal("the top-k does not rank the [B, S, T] indexer scores")
    return indexer, _strip(_query_positions(index_terms, "indexer"), _SHAPE_ONLY)


def _feeds_exp(node, steps: int = 6) -> bool:
    """An exp within `steps` uses of node: the masked scores of a softmax spelled some other way."""
    frontier = [node]
    for _ in range(steps):
        frontier = [user for n in frontier for user in n.users]
        if any(is_call(n, aten.exp.default) for n in frontier):
            return True
    return False


def _check_private(masked) -> None:
    """The masked scores feed only the softmax pattern (another use would keep the dense attention alive)."""
    users = list(masked.users)
    if len(users) == 1 and is_call(users[0], prims.convert_element_type.default, aten.cat.default):
        users = list(users[0].users)  # a cast, or the sink column's cat
    if any(not is_call(u, aten.amax.default, aten.max.dim, aten.sub.Tensor, aten.eq.Scalar) for u in users):
        raise Refusal("the masked attention scores have another use")


def fuse_sparse_attention(graph: torch.fx.Graph) -> PassResult:
    """Rewrite every DSA top-k masked attention into dsa_indexer + top-k + sparse_attention."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    for topk in [n for n in graph.nodes if is_call(n, aten.topk.default)]:
        if topk.graph is not graph:
            continue
        try:
            match = _match(topk)
        except (Refusal, _NotAMask) as refusal:
            result.refused(location_of(topk), str(refusal))
            continue
        if match is None:
            continue
        where = location_of(match.attention.out)
        _rewrite(graph, topk, match)
        if match.indexer is not None:
            _remove_dead(graph, [match.attention.out, topk, match.indexer.logits])
        else:
            _remove_dead(graph, [match.attention.out])
            where += f" (the model's own selection: {match.own_selection})"
        result.rewrote(where)
    return result
