"""fuse_vision_attention: attention over packed images, however upstream spells it  =>  one dzc.varlen_attention

A vision encoder packs the patches of all images of a request into one sequence; attention is non-causal and
restricted to each image (or to windows inside it), delimited by `cu_seqlens`. Spellings this pass recognises
(each with `F.scaled_dot_product_attention` — decomposed to math on CPU, a fused SDPA op on GPUs — or eager
matmul/softmax/matmul, in any dtype):

1. Per-image loop (transformers' Qwen2/2.5-VL, GLM-4V non-flash path), which Dynamo unrolls once scalar outputs
   are captured:

    %d = aten.sub.Tensor(aten.slice(%cu, 0, 1, end), aten.slice(%cu, 0, 0, -1))   # lengths
    %u_i = aten._local_scalar_dense.default(aten.select.int(%d, 0, i))            # lengths.tolist()
    %qs = aten.split_with_sizes.default(%q, [%u_0, ..., %u_B-1], dim)             # same for k, v
    %o_i = <attention(%qs[i], %ks[i], %vs[i]) for i < B>                           # no mask, not causal
    %o = aten.cat.default([layout(%o_0), ..., layout(%o_B-1)], dim)

2. Block-diagonal mask over the whole pack, built from cu_seqlens by segment ids:

    %seg = aten.searchsorted.Tensor(%cu, aten.arange(tokens), right=True)
    %m = aten.eq.Tensor(unsqueeze(%seg, 1), unsqueeze(%seg, 0))                   # bool [tokens, tokens]
    %o = <attention(%q, %k, %v) with %m as additive (where(%m, 0, -inf)) or masked_fill(~%m, -inf) mask>

   The masked value may be finfo(dtype).min instead of -inf (HF's masks: where(%m, 0, finfo.min), masked_fill(~%m,
   finfo.min), where(%m, s, finfo.min)): anything at or below attention_patterns.MASKED counts as masked. Exact
   because no query row is fully masked: %m is [tokens, tokens] (checked) of one %seg compared with itself, so
   query i always sees key i, the row's max is a visible score, and exp(masked - max) underflows to 0 as with
   -inf (unless scores reach ~65000 in magnitude, fp16's finfo.min: the bound every attention pass takes). A fully
   masked row would differ (finfo.min: uniform; -inf: NaN, or 0 through SDPA; the op: 0), and cannot occur here.

3. dzc.varlen_attention already in the graph (HF models entered through dzc's AttentionInterface function,
   dzc.hf_attention, or code calling the op): only the rotary fold below applies.

Window attention is the same spellings with `cu_window_seqlens` in place of cu_seqlens.

After:

    %o = dzc.varlen_attention.default(%q', %k', %v', %cu, %max_seqlen, scale, %cos, %sin)  # [tokens, heads, dim]
    (+ permute/unsqueeze/clone back to the layout the old output had)

where %q' is %q brought to [tokens, heads, head_dim], max_seqlen is sym_max of the unrolled lengths (spelling 1)
or computed in the graph from cu_seqlens (spelling 2). Rotary fold: when q and k are both HF's vision rotary
embedding — `(x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)` with the same fp32 cos/sin [tokens,
head_dim] — the op takes the unrotated q, k and cos, sin, and applies the rotation as it loads q and k.

Interleaved (pairwise) rotary, rot = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) (or the pairs read by
select/unbind of x viewed as [..., head_dim/2, 2]), rotates pairs (2i, 2i+1) where the op rotates (i, i + d/2):

    %r = (x * cos + rot(x) * sin).to(dtype)  for q and k, same cos, sin
  =>
    %x' = aten.cat.default([aten.slice(%x, -1, 0, end, 2), aten.slice(%x, -1, 1, end, 2)], -1)  # q, k, cos, sin
    dzc.varlen_attention.default(%q', %k', %v, ..., %cos', %sin')

Exact for any cos, sin (no pair-repeat needed): with P the column order [0, 2, .., d-2, 1, 3, .., d-1],
rotate_half(x[P]) = rot(x)[P], so rope_half(x[P], cos[P], sin[P]) = rope_interleaved(x, cos, sin)[P], element
by element the same fp32 products and sum; and the scores sum q.k over the head dim, which the same P on q and k
leaves unchanged (up to summation order, as any kernel). v, and so the output, keep their order.

Refusals (reported): causal or dropout attention over a split; a split whose pieces are not all attended in order
and concatenated along the token dim in the same order; an intermediate of an attention with a use outside it;
a layout the pass cannot map to [tokens, heads, head_dim]; a block-diagonal mask not [tokens, tokens] over the
attended tokens. Silently skipped (not packed attention): attention without a split by cu_seqlens lengths or a
block-diagonal cu_seqlens mask — a causal text attention, a plain ViT attention over one image — or with a bias
above MASKED (-1e4: hidden keys keep some weight). Not folded (the op gets the model's rotated q, k): rotaries of
other spellings, or q and k rotated by different spellings or tables.

Ordering: after fuse_residual_norm (independent patterns; the norm pass never touches attention), before
lowering. It needs Dynamo's capture_scalar_outputs (dzc's default) for spelling 1 to be one graph at all.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings
from torch.fx.operator_schemas import normalize_function

from dzc.passes.attention_patterns import (MASKED, SDPA_OPS, VIEWS, fill_value, is_whole_slice, scalar,
                                           unpadded_bias)
from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call, location_of
from dzc.passes.patterns import remove_dead

aten = torch.ops.aten
prims = torch.ops.prims
dzc = torch.ops.dzc

NAME = "fuse_vision_attention"
_END = 9223372036854775807  # aten.slice's "to the end"


def _same_size(a, b) -> bool:
    """Size equality without guarding: symbolic sizes compare by expression (unbacked ones cannot be guarded)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def _cast_dtype(node):
    if is_call(node, prims.convert_element_type.default):
        return node.args[1]
    if is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        return node.kwargs.get("dtype")
    return None


def _skip(node, *targets):
    while is_call(node, *targets):
        node = node.args[0]
    return node


def _skip_casts(node):
    while _cast_dtype(node) is not None:
        node = node.args[0]
    return node


def _scalar(node) -> float | None:
    """The value of a Python scalar or a 0-d constant tensor made by aten.scalar_tensor / aten.full([])."""
    if isinstance(node, (int, float)):
        return float(node)
    if is_call(node, aten.scalar_tensor.default):
        return float(node.args[0])
    if is_call(node, aten.full.default) and len(node.args[0]) == 0:
        return float(node.args[1])
    return None


def _peel_scale(node, scale: float):
    """mul(x, c) / mul(c, x) with a scalar c: (x, scale * c); anything else: (node, scale)."""
    while is_call(node, aten.mul.Tensor, aten.mul.Scalar):
        a, b = node.args[:2]
        if _scalar(b) is not None:
            node, scale = a, scale * _scalar(b)
        elif _scalar(a) is not None:
            node, scale = b, scale * _scalar(a)
        else:
            break
    return node, scale


@dataclass
class _Core:
    """One attention: softmax(q k^T * scale [+ mask]) v over the last two dims of q, k, v."""

    q: torch.fx.Node  # [..., tokens, head_dim] as the model computed it (before any view the core made)
    k: torch.fx.Node
    v: torch.fx.Node
    scale: float
    out: torch.fx.Node  # the attention's result, [..., tokens, head_dim]
    mask: torch.fx.Node | None  # the bool mask (True = attend), or None
    mask_use: torch.fx.Node | None = None  # the node the attention reads the mask through (additive or bool)
    causal: bool = False
    dropout: bool = False
    anchor: torch.fx.Node | None = None  # where the model source line is


def _is_full_row_guard(cond) -> bool:
    """SDPA's decomposition zeroes fully masked rows: where(logical_not(any(logical_not(eq(s, -inf)))), 0, p)."""
    return is_call(cond, aten.logical_not.default) and is_call(cond.args[0], aten.any.dim)


def _mask_values(mask):
    """The node whose values `mask` has: through views, unsqueezes, slices over whole dims and the padding SDPA adds
    for its GPU kernel (each checked to keep the values where they were; a slice of part of a dim is not)."""
    while True:
        if is_call(mask, *VIEWS, aten.unsqueeze.default) or is_whole_slice(mask):
            mask = mask.args[0]
        elif (unpadded := unpadded_bias(mask)) is not None:
            mask = unpadded
        else:
            return mask


def _is_masked_value(node) -> bool:
    """node is a constant at or below attention_patterns.MASKED: -inf, or finfo(dtype).min of a float dtype (also
    cast: a cast of such a value to a float dtype stays at or below it, or becomes -inf)."""
    value = scalar(_skip_casts(node))
    return value is not None and value <= MASKED


def _is_zero(node) -> bool:
    """node is a constant 0: a scalar, or a full(shape, 0) (torch.zeros(..).masked_fill(..)), also cast."""
    return fill_value(_skip_casts(node)) == 0.0


def _bool_mask_of(mask) -> torch.fx.Node | None:
    """The bool mask m behind an additive mask: where(m, 0, M) (SDPA's CPU decomposition, HF) or where(~m, M, 0)
    (SDPA's own conversion of a bool mask, zeros().masked_fill(~m, M) in user code), M -inf or finfo.min (see
    _is_masked_value), also as SDPA pads it for its GPU kernel; None if it is not one."""
    mask = _mask_values(mask)
    if not is_call(mask, aten.where.self):
        return None
    condition, if_true, if_false = mask.args[:3]
    if _is_zero(if_true) and _is_masked_value(if_false):
        return condition
    if _is_masked_value(if_true) and _is_zero(if_false) \
            and is_call(condition, aten.logical_not.default, aten.bitwise_not.default):
        return condition.args[0]
    return None


def _match_math_core(pv) -> _Core | None:
    """Match an attention written as bmm(softmax(bmm(q, k^T) * scale + mask), v), as capture decomposes both
    eager attention and CPU SDPA. pv is the second bmm."""
    if not is_call(pv, aten.bmm.default):
        return None
    probs = _skip_casts(_skip(pv.args[0], *VIEWS))
    if is_call(probs, aten.where.self) and _is_full_row_guard(probs.args[0]) and _scalar(probs.args[1]) is None:
        probs = _skip_casts(probs.args[2])
    if is_call(probs, aten._softmax.default):
        logits = probs.args[0]
        if probs.args[1] not in (-1, fake_value(logits).dim() - 1):
            return None
    elif (is_call(probs, aten.div.Tensor) and is_call(probs.args[0], aten.exp.default)
          and is_call(probs.args[0].args[0], aten.sub.Tensor) and is_call(probs.args[1], aten.sum.dim_IntList)):
        shifted = probs.args[0].args[0]
        logits = shifted.args[0]
        if list(probs.args[1].args[1]) not in ([-1], [fake_value(logits).dim() - 1]):
            return None
    else:
        return None
    logits = _skip_casts(logits)
    mask = mask_use = None
    if is_call(logits, aten.add.Tensor):
        mask, mask_use = _bool_mask_of(logits.args[1]), logits.args[1]
        if mask is None:
            return None  # another additive bias (relative positions, a causal mask): not ours
        logits = logits.args[0]
    elif is_call(logits, aten.where.self) and _is_masked_value(logits.args[1]):
        keep = logits.args[0]  # masked_fill(~m, M) = where(~m, M, s), M -inf or finfo.min
        if not is_call(keep, aten.bitwise_not.default, aten.logical_not.default):
            return None
        mask, mask_use, logits = keep.args[0], keep, logits.args[2]
    elif is_call(logits, aten.where.self) and _is_masked_value(logits.args[2]):
        mask = mask_use = logits.args[0]  # where(m, s, M)
        logits = logits.args[1]
    logits, scale = _peel_scale(_skip(logits, *VIEWS), 1.0)
    logits = _skip(logits, *VIEWS)
    if not is_call(logits, aten.bmm.default):
        return None
    q, scale = _peel_scale(_skip(logits.args[0], *VIEWS), scale)
    k_t, scale = _peel_scale(_skip(logits.args[1], *VIEWS), scale)
    rank = fake_value(k_t).dim()
    if is_call(k_t, aten.permute.default) and list(k_t.args[1]) == [*range(rank - 2), rank - 1, rank - 2]:
        k = k_t.args[0]
    elif is_call(k_t, aten.transpose.int) and sorted(d % rank for d in k_t.args[1:3]) == [rank - 2, rank - 1]:
        k = k_t.args[0]
    else:
        return None
    k, scale = _peel_scale(k, scale)
    v = _skip(pv.args[1], *VIEWS)
    q, k, v = (_skip_upcast(n) for n in (q, k, v))
    out = pv
    while len(out.users) == 1 and is_call(next(iter(out.users)), aten.view.default, aten._unsafe_view.default):
        out = next(iter(out.users))
    if len(out.users) == 1 and _cast_dtype(next(iter(out.users))) == fake_value(q).dtype != fake_value(out).dtype:
        out = next(iter(out.users))  # attention computed in fp32 on bf16/fp16 inputs, rounded back once
    if fake_value(out).dtype != fake_value(q).dtype:
        return None  # the result stays in a wider dtype than q's: the op could not produce it
    return _Core(q, k, v, scale, out, mask, mask_use, anchor=out)


def _skip_upcast(node):
    """x for x.float() with x in a 16-bit float dtype (SDPA's CPU decomposition computes in fp32), else node."""
    if _cast_dtype(node) == torch.float32 and fake_value(node.args[0]).dtype in (torch.float16, torch.bfloat16):
        return node.args[0]
    return node


def _match_sdpa_core(node) -> _Core | None:
    """A fused SDPA op (what capture keeps on GPUs): its normalised arguments."""
    if not is_call(node, *SDPA_OPS):
        return None
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return None
    kwargs = normalized.kwargs
    q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
    scale = kwargs.get("scale")
    if scale is None:
        scale = fake_value(q).shape[-1] ** -0.5
    mask = kwargs.get("attn_mask", kwargs.get("attn_bias"))
    bool_mask = None
    if mask is not None:
        bool_mask = _bool_mask_of(mask)
        if bool_mask is None:
            mask_node = _skip(mask, *VIEWS)
            if fake_value(mask_node) is None or fake_value(mask_node).dtype != torch.bool:
                return None
            bool_mask = mask_node
    if node.target is aten.scaled_dot_product_attention.default:
        out = node
    else:
        outs = [u for u in node.users if is_call(u, operator.getitem) and u.args[1] == 0]
        if len(outs) != 1:
            return None
        out = outs[0]
    return _Core(q, k, v, float(scale), out, bool_mask, mask, causal=bool(kwargs.get("is_causal", False)),
                 dropout=float(kwargs.get("dropout_p", 0.0)) != 0.0, anchor=node)


def _match_core(node) -> _Core | None:
    return _match_math_core(node) or _match_sdpa_core(node)


# --- layouts: which dim of a tensor holds tokens (T), heads (H), head_dim (D), or a unit batch (1) ---------------

def _labels(shape, heads) -> list[str] | None:
    """Labels of an attention operand [..., tokens, head_dim] whose leading dims multiply to `heads`."""
    labels = []
    for size in shape[:-2]:
        if _same_size(size, 1):
            labels.append("1")
        elif _same_size(size, heads) and "H" not in labels:
            labels.append("H")
        else:
            return None
    if "H" not in labels:
        if not labels or not _same_size(heads, 1):
            return None
        labels[-1] = "H"  # one head: the unit dim right before the tokens
    return labels + ["T", "D"]


def _forward_labels(node, labels):
    """Labels after one layout op applied to a tensor with `labels`; None if the op is not a pure layout change."""
    if is_call(node, aten.clone.default, aten.alias.default) or _cast_dtype(node) is not None:
        return labels
    if is_call(node, aten.permute.default):
        return [labels[d % len(labels)] for d in node.args[1]]
    if is_call(node, aten.transpose.int):
        a, b = (d % len(labels) for d in node.args[1:3])
        labels = list(labels)
        labels[a], labels[b] = labels[b], labels[a]
        return labels
    if is_call(node, aten.unsqueeze.default):
        labels = list(labels)
        labels.insert(node.args[1] % (len(labels) + 1), "1")
        return labels
    if is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
                aten.squeeze.dims, aten.squeeze.default):
        # Only inserting or removing unit dims keeps the labels meaningful.
        source = [(label, size) for label, size in zip(labels, fake_value(node.args[0]).shape)
                  if not _same_size(size, 1)]
        shape = fake_value(node).shape
        target = [size for size in shape if not _same_size(size, 1)]
        if len(source) != len(target) or not all(_same_size(a[1], b) for a, b in zip(source, target)):
            return None
        kept = iter(label for label, _ in source)
        out = ["1" if _same_size(size, 1) else next(kept) for size in shape]
        return out if {"H", "T", "D"} <= set(out) else None
    return None


def _call(graph, target, args, kwargs=None):
    """A new node with its fake value computed from its arguments' fake values."""
    node = graph.call_function(target, args, kwargs or {})
    fake_args = torch.fx.node.map_arg(args, fake_value)
    fake_kwargs = torch.fx.node.map_arg(kwargs or {}, fake_value)
    tensors = [a for a in torch.utils._pytree.tree_leaves((fake_args, fake_kwargs)) if isinstance(a, torch.Tensor)]
    shape_env = tensors[0].fake_mode.shape_env if tensors else None
    # Computing the fake value must not add guards to the captured graph: e.g. slicing cu_seqlens asks whether
    # the slice has one element (for its strides), which would specialise the graph on the image count.
    with shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext():
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def _to_thd(graph, node, labels):
    """node (with labels) -> a [tokens, heads, head_dim] node."""
    unit_dims = [d for d, label in enumerate(labels) if label == "1"]
    if unit_dims:
        node = _call(graph, aten.squeeze.dims, (node, unit_dims))
        labels = [label for label in labels if label != "1"]
    order = [labels.index(role) for role in "THD"]
    if order == [0, 1, 2]:
        return node
    if is_call(node, aten.permute.default) and [node.args[1][o] % 3 for o in order] == [0, 1, 2]:
        return node.args[0]  # undoes the model's own permute: take what it permuted
    return _call(graph, aten.permute.default, (node, order))


def _from_thd(graph, node, labels):
    """A [tokens, heads, head_dim] node -> a contiguous tensor laid out by labels (the replaced output's layout)."""
    roles = [label for label in labels if label != "1"]
    order = ["THD".index(role) for role in roles]
    if order != [0, 1, 2]:
        node = _call(graph, aten.permute.default, (node, order))
        node = _call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    for d, label in enumerate(labels):
        if label == "1":
            node = _call(graph, aten.unsqueeze.default, (node, d))
    return node


def _layout_source(node):
    """(root, mapping): node equals root re-laid out; mapping[i] = root dim of node's dim i (None: added unit)."""
    mapping = list(range(fake_value(node).dim()))
    current = node
    while True:
        arg = current.args[0] if current.op == "call_function" and current.args else None
        if not isinstance(arg, torch.fx.Node) or fake_value(arg) is None:
            return current, mapping
        rank = fake_value(arg).dim()
        if is_call(current, aten.permute.default):
            step = [d % rank for d in current.args[1]]
        elif is_call(current, aten.transpose.int):
            a, b = (d % rank for d in current.args[1:3])
            step = list(range(rank))
            step[a], step[b] = b, a
        elif is_call(current, aten.unsqueeze.default):
            position = current.args[1] % (rank + 1)
            step = [i if i < position else i - 1 for i in range(rank + 1)]
            step[position] = None
        elif is_call(current, aten.select.int) and current.args[2] in (0, -1) \
                and _same_size(fake_value(arg).shape[current.args[1] % rank], 1):
            removed = current.args[1] % rank
            step = [i for i in range(rank) if i != removed]
        elif is_call(current, aten.squeeze.dim, aten.squeeze.dims):
            asked = current.args[1] if isinstance(current.args[1], (list, tuple)) else [current.args[1]]
            removed = {d % rank for d in asked if _same_size(fake_value(arg).shape[d % rank], 1)}
            step = [i for i in range(rank) if i not in removed]
        elif is_call(current, aten.clone.default, aten.alias.default):
            step = list(range(rank))
        else:
            return current, mapping
        mapping = [step[d] if d is not None else None for d in mapping]
        current = arg


# --- the rotary embedding -----------------------------------------------------------------------------------------

def _rotate_half_input(node) -> torch.fx.Node | None:
    """x for cat([-x[..., h:], x[..., :h]], -1), else None."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    rank = fake_value(node).dim()
    if (node.args[1] if len(node.args) > 1 else 0) % rank != rank - 1:
        return None
    negated, low = node.args[0]
    if not is_call(negated, aten.neg.default):
        return None
    high = negated.args[0]
    if not (is_call(high, aten.slice.Tensor) and is_call(low, aten.slice.Tensor)) or high.args[0] is not low.args[0]:
        return None
    x = high.args[0]
    half = fake_value(x).shape[-1] // 2
    if any(s.args[1] % rank != rank - 1 for s in (high, low)):
        return None
    if (tuple(high.args[2:4]) not in ((half, _END), (half, fake_value(x).shape[-1]))
            or tuple(low.args[2:4]) != (0, half)):
        return None
    return x


def _pair_column(node, rank):
    """(x, p) for node = x[..., p::2] (p 0 or 1), x [..., d] with d even, read as aten.slice(x, -1, p, end, 2) or as
    select / unbind of x viewed as [..., d/2, 2] at p; else None."""
    if is_call(node, aten.slice.Tensor) and len(node.args) == 5 and node.args[4] == 2:
        x, dim, start, end = node.args[:4]
        width = fake_value(x).shape[-1]
        if fake_value(x).dim() != rank or dim % rank != rank - 1 or start not in (0, 1) \
                or not isinstance(width, int) or width % 2 \
                or not (end == _END or (isinstance(end, int) and end >= width)):
            return None
        return x, start
    if is_call(node, aten.select.int):
        pairs, dim, parity = node.args[:3]
    elif is_call(node, operator.getitem) and is_call(node.args[0], aten.unbind.int):
        pairs, dim = node.args[0].args[0], node.args[0].args[1] if len(node.args[0].args) > 1 else 0
        parity = node.args[1]
    else:
        return None
    if not is_call(pairs, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    x = pairs.args[0]
    shape, pair_shape = fake_value(x).shape, fake_value(pairs).shape
    if len(shape) != rank or len(pair_shape) != rank + 1 or dim % (rank + 1) != rank or parity not in (0, 1, -1, -2) \
            or not _same_size(pair_shape[-1], 2) or not isinstance(shape[-1], int) \
            or not _same_size(pair_shape[-2], shape[-1] // 2) or shape[-1] % 2 \
            or not all(_same_size(a, b) for a, b in zip(shape[:-1], pair_shape[:-2])):
        return None  # not the last dim split into pairs (a view keeps the row-major order: pair i = (2i, 2i+1))
    return x, parity % 2


def _rotate_pairs_input(node) -> torch.fx.Node | None:
    """x for the interleaved rotation stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) (pair (2i, 2i+1) ->
    (-x[2i+1], x[2i])), capture spelling the stack as a cat of unsqueezes along a new last dim, the flatten as a
    view; else None."""
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    stacked, shape = node.args[0], fake_value(node).shape
    rank = len(shape)
    stacked_shape = fake_value(stacked).shape
    if len(stacked_shape) != rank + 1 or not _same_size(stacked_shape[-1], 2) \
            or not all(_same_size(a, b) for a, b in zip(shape[:-1], stacked_shape[:-2])) \
            or not isinstance(shape[-1], int) or not _same_size(stacked_shape[-2] * 2, shape[-1]):
        return None  # not the flatten of [..., d/2, 2] into [..., d]
    dim = stacked.args[1] if len(stacked.args) > 1 else 0
    if is_call(stacked, aten.stack.default) and dim % (rank + 1) == rank:
        parts = list(stacked.args[0])
    elif is_call(stacked, aten.cat.default) and dim % (rank + 1) == rank \
            and all(is_call(p, aten.unsqueeze.default) and p.args[1] % (rank + 1) == rank for p in stacked.args[0]):
        parts = [p.args[0] for p in stacked.args[0]]
    else:
        return None
    if len(parts) != 2 or not is_call(parts[0], aten.neg.default):
        return None
    odd, even = _pair_column(parts[0].args[0], rank), _pair_column(parts[1], rank)
    if odd is None or even is None or odd[0] is not even[0] or (odd[1], even[1]) != (1, 0):
        return None
    x = odd[0]
    if not all(_same_size(a, b) for a, b in zip(fake_value(x).shape, shape)):
        return None
    return x


def _table(node):
    """cos/sin [tokens, head_dim] behind its fp32, head-broadcast form unsqueeze(cos, -2).float()."""
    node = _skip_casts(node)
    if not is_call(node, aten.unsqueeze.default):
        return None
    table = _skip_casts(node.args[0])
    if fake_value(table).dim() != 2 or node.args[1] % 3 != 1:
        return None
    return table


def _match_rotary(node):
    """(x, cos, sin, interleaved) if node = (x.float() * cos + rot(x.float()) * sin).to(x.dtype) in fp32, rot
    rotate_half (interleaved False) or the interleaved pairs rotation (True), else None."""
    out_dtype = fake_value(node).dtype
    total = node.args[0] if _cast_dtype(node) is not None else node
    if not is_call(total, aten.add.Tensor) or fake_value(total).dtype != torch.float32:
        return None
    for direct, rotated in (total.args[:2], total.args[1::-1]):
        if not (is_call(direct, aten.mul.Tensor) and is_call(rotated, aten.mul.Tensor)):
            continue
        for x32, cos in (direct.args[:2], direct.args[1::-1]):
            for rot, sin in (rotated.args[:2], rotated.args[1::-1]):
                interleaved = _rotate_half_input(rot) is not x32
                if (interleaved and _rotate_pairs_input(rot) is not x32) or fake_value(x32).dtype != torch.float32:
                    continue
                cos_table, sin_table = _table(cos), _table(sin)
                if cos_table is None or sin_table is None or fake_value(cos).dtype != torch.float32 \
                        or fake_value(sin).dtype != torch.float32:
                    continue
                x = x32.args[0] if _cast_dtype(x32) == torch.float32 else x32
                if fake_value(x).dtype != out_dtype or fake_value(x).dim() != 3:
                    continue
                return x, cos_table, sin_table, interleaved
    return None


def _half_split_order(graph, node):
    """node [..., d] with its columns in the order [0, 2, .., d-2, 1, 3, .., d-1]: the even columns, then the odd."""
    rank = fake_value(node).dim()
    columns = [_call(graph, aten.slice.Tensor, (node, rank - 1, start, _END, 2)) for start in (0, 1)]
    return _call(graph, aten.cat.default, (columns, rank - 1))


def _fold_rotary(graph, op) -> bool:
    """Give dzc.varlen_attention node `op` the unrotated q, k and cos, sin when both are HF's vision rotary; when
    both are the interleaved rotary, q, k, cos and sin in half-split column order (exact: module docstring)."""
    q, k, v, cu, max_seqlen, scale, cos, sin = op.args[:8]
    if cos is not None:
        return False
    found = []
    for operand in (q, k):
        root, mapping = _layout_source(operand)
        rotary = _match_rotary(root) if fake_value(root).dim() == 3 and mapping == [0, 1, 2] else None
        if rotary is None:
            return False
        found.append(rotary)
    (q_x, q_cos, q_sin, q_pairs), (k_x, k_cos, k_sin, k_pairs) = found
    if q_cos is not k_cos or q_sin is not k_sin or q_pairs != k_pairs:
        return False
    if q_pairs:
        with graph.inserting_before(op):
            q_x, k_x, q_cos, q_sin = (_half_split_order(graph, n) for n in (q_x, k_x, q_cos, q_sin))
    op.args = (q_x, k_x, v, cu, max_seqlen, scale, q_cos, q_sin, *op.args[8:])
    return True


# --- where the segments come from ---------------------------------------------------------------------------------

def _lengths_source(sizes) -> torch.fx.Node | None:
    """cu_seqlens if sizes are [_local_scalar_dense(select((cu[1:] - cu[:-1]), 0, i)) for i < len(cu) - 1]."""
    diffs = set()
    for index, size in enumerate(sizes):
        if not is_call(size, aten._local_scalar_dense.default):
            return None
        select = size.args[0]
        if not is_call(select, aten.select.int) or tuple(select.args[1:]) != (0, index):
            return None
        diffs.add(select.args[0])
    if len(diffs) != 1:
        return None
    diff = diffs.pop()
    if not is_call(diff, aten.sub.Tensor):
        return None
    upper, lower = diff.args[:2]
    if not (is_call(upper, aten.slice.Tensor) and is_call(lower, aten.slice.Tensor)):
        return None
    cu = upper.args[0]
    if lower.args[0] is not cu or tuple(upper.args[1:4]) not in ((0, 1, _END),) or tuple(lower.args[1:4]) != (0, 0, -1):
        return None
    if not _same_size(fake_value(cu).shape[0] - 1, len(sizes)) or fake_value(cu).dtype != torch.int32:
        return None
    return cu


def _mask_source(mask) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(cu_seqlens, mask nodes) if mask = eq(seg[:, None], seg[None, :]), seg = searchsorted(cu, arange, right)."""
    if not is_call(mask, aten.eq.Tensor):
        return None
    nodes = [mask]
    sides = []
    for side, position in zip(mask.args[:2], (1, 0)):
        unsqueezed = None
        while is_call(side, aten.slice.Tensor, aten.unsqueeze.default):
            if is_call(side, aten.slice.Tensor) and tuple(side.args[2:4]) != (0, _END):
                return None
            if is_call(side, aten.unsqueeze.default):
                unsqueezed = side.args[1] % 2
            nodes.append(side)
            side = side.args[0]
        if unsqueezed != position:
            return None
        sides.append(side)
    seg = sides[0]
    if sides[1] is not seg or not is_call(seg, aten.searchsorted.Tensor) or not seg.kwargs.get("right", False):
        return None
    cu, positions = seg.args[:2]
    if is_call(positions, prims.iota.default):  # arange, as capture decomposes it
        if positions.kwargs.get("start") != 0 or positions.kwargs.get("step") != 1:
            return None
    elif not is_call(positions, aten.arange.default, aten.arange.start, aten.arange.start_step):
        return None
    if is_call(positions, aten.arange.start, aten.arange.start_step) and positions.args[0] != 0:
        return None
    if is_call(positions, aten.arange.start_step) and positions.args[2] != 1:
        return None
    if fake_value(cu).dtype != torch.int32 or fake_value(cu).dim() != 1:
        return None
    return cu, nodes + [seg, positions]


# --- the rewrite --------------------------------------------------------------------------------------------------

@dataclass
class _Packed:
    cores: list[_Core]
    cu: torch.fx.Node
    q: torch.fx.Node  # the whole pack's q, k, v (the split inputs, or the masked attention's operands)
    k: torch.fx.Node
    v: torch.fx.Node
    out: torch.fx.Node  # replaced by the fused op's result
    out_labels: list[str]
    operand_labels: list[list[str]]  # labels of q, k, v
    heads: int
    max_seqlen: list[torch.fx.Node] | None  # the unrolled lengths (spelling 1), or None (computed from cu)
    region: set[torch.fx.Node] = field(default_factory=set)  # replaced: erased once the fused op stands
    leftovers: set[torch.fx.Node] = field(default_factory=set)  # may serve others: erased only when unused


def _heads_of(core: _Core):
    shape = fake_value(core.q).shape
    lead = [s for s in shape[:-2] if not _same_size(s, 1)]
    if len(lead) > 1:
        return None
    return lead[0] if lead else 1


def _region(out, stops) -> set[torch.fx.Node]:
    """Every node between stops and out (out included), walking arguments back from out."""
    seen, todo = set(), [out]
    while todo:
        node = todo.pop()
        if node in seen or node in stops or node.op != "call_function":
            continue
        if not isinstance(fake_value(node), (torch.Tensor, tuple, list)):
            continue  # sizes (SymInts) stay: the rest of the graph may use them
        seen.add(node)
        todo.extend(n for n in node.all_input_nodes)
    return seen


def _check_closed(region, keep, what):
    """Every node of the region but `keep` is used only inside it."""
    for node in region:
        if node in keep:
            continue
        outside = [u for u in node.users if u not in region]
        if outside:
            raise Refusal(f"{node.name} inside the {what} has a use outside it ({outside[0].name})")


def _operand_labels(core: _Core, heads):
    labels = [_labels(fake_value(n).shape, heads) for n in (core.q, core.k, core.v)]
    if any(label is None for label in labels):
        raise Refusal("q, k, v are not laid out as [heads, tokens, head_dim] with unit batch dims")
    return labels


def _match_split(core: _Core, by_q: dict) -> _Packed | None:
    """Spelling 1: core is one image's attention of an unrolled per-image loop; collects all of them."""
    pieces = []
    for operand in (core.q, core.k, core.v):
        if not (is_call(operand, operator.getitem) and is_call(operand.args[0], aten.split_with_sizes.default)):
            return None
        pieces.append(operand)
    splits = [p.args[0] for p in pieces]
    cu = _lengths_source(splits[0].args[1])
    if cu is None:
        return None
    for split in splits[1:]:
        if list(split.args[1]) != list(splits[0].args[1]):
            raise Refusal("q, k and v are split by different lengths")
    count = len(splits[0].args[1])
    per_image = {}
    for item in splits[0].users:
        if not is_call(item, operator.getitem):
            raise Refusal("the split q is used whole")
        if item in by_q:
            per_image[item.args[1]] = by_q[item]
    if sorted(per_image) != list(range(count)):
        raise Refusal("not every image of the split is attended")
    cores = [per_image[i] for i in range(count)]
    for i, c in enumerate(cores):
        for operand, split in zip((c.q, c.k, c.v), splits):
            if not (is_call(operand, operator.getitem) and operand.args[0] is split and operand.args[1] == i):
                raise Refusal("image i's q, k, v are not the i-th pieces of their splits")
        if c.causal or c.dropout or c.mask is not None:
            raise Refusal("causal, masked or dropout attention inside an image")
        if c.scale != core.scale:
            raise Refusal("the images are attended with different scales")
    heads = _heads_of(core)
    if heads is None:
        raise Refusal("more than one non-unit dim before the tokens")
    operand_labels = _operand_labels(core, heads)
    for split, labels in zip(splits, operand_labels):
        if labels[split.args[2] % len(labels)] != "T":
            raise Refusal("the split is not along the token dim")
    # Follow each image's output through layout ops to one cat along the token dim.
    cat, out_labels, chain = None, None, set()
    for c in cores:
        node, labels = c.out, _labels(fake_value(c.out).shape, heads)
        if labels is None:
            raise Refusal("an image's attention output is not [heads, tokens, head_dim]")
        while len(node.users) == 1 and not is_call(next(iter(node.users)), aten.cat.default):
            user = next(iter(node.users))
            labels = _forward_labels(user, labels)
            if labels is None:
                raise Refusal(f"{user.name} between an image's attention and the cat is not a layout op")
            chain.add(user)
            node = user
        users = list(node.users)
        if len(users) != 1 or not is_call(users[0], aten.cat.default):
            raise Refusal("an image's attention output is not concatenated (alone) with the others")
        if cat is not None and users[0] is not cat:
            raise Refusal("the images' outputs go to different cats")
        cat = users[0]
        if out_labels is not None and labels != out_labels:
            raise Refusal("the images' outputs are laid out differently")
        out_labels = labels
    inputs = list(cat.args[0])
    if len(inputs) != count or (cat.args[1] if len(cat.args) > 1 else 0) % len(out_labels) != out_labels.index("T"):
        raise Refusal("the cat is not exactly the images' outputs along the token dim")
    for i, (c, item) in enumerate(zip(cores, inputs)):
        # inputs[i] must come from core i (follow back through the chain)
        node = item
        while node is not c.out and node in chain:
            node = node.args[0]
        if node is not c.out:
            raise Refusal("the cat does not keep the images in order")
    stops = {p for c in cores for p in (c.q, c.k, c.v)}
    region = set(chain) | {cat}
    for c in cores:
        region |= _region(c.out, stops)
    region |= {p for c in cores for p in (c.q, c.k, c.v)} | set(splits)
    _check_closed(region, {cat}, "per-image attention")
    return _Packed(cores, cu, *(s.args[0] for s in splits), cat, out_labels, operand_labels, heads,
                   list(splits[0].args[1]), region)


def _match_masked(core: _Core) -> _Packed | None:
    """Spelling 2: one attention over the pack with a block-diagonal mask built from cu_seqlens."""
    if core.mask is None:
        return None
    found = _mask_source(core.mask)
    if found is None:
        return None
    cu, mask_nodes = found
    if core.causal or core.dropout:
        raise Refusal("causal or dropout attention with a block-diagonal mask")
    # [tokens, tokens] over q's and k's tokens, as the attention reads it too: then query i sees key i (every row
    # sees a key, which masking by finfo.min needs to be exact) and the mask's segments are the op's.
    tokens = (fake_value(core.q).shape[-2], fake_value(core.k).shape[-2])
    for shape in (fake_value(core.mask).shape, fake_value(core.mask_use).shape):
        if len(shape) < 2 or not all(_same_size(a, b) for a, b in zip(shape[-2:], tokens)):
            raise Refusal("the block-diagonal mask is not [tokens, tokens] over the attended tokens")
    heads = _heads_of(core)
    if heads is None:
        raise Refusal("more than one non-unit dim before the tokens")
    operand_labels = _operand_labels(core, heads)
    out_labels = _labels(fake_value(core.out).shape, heads)
    if out_labels is None:
        raise Refusal("the attention output is not [heads, tokens, head_dim]")
    # The mask may be built once and shared by every layer: it is not part of the attention, and is removed
    # only once no attention uses it.
    region = _region(core.out, {core.q, core.k, core.v, core.mask_use})
    _check_closed(region, {core.out}, "masked attention")
    packed = _Packed([core], cu, core.q, core.k, core.v, core.out, out_labels, operand_labels, heads, None, region)
    packed.leftovers = set(mask_nodes) | _region(core.mask_use, {core.mask})
    return packed


def _max_seqlen(graph, packed: _Packed):
    """The longest segment: sym_max of the unrolled lengths, or read from cu_seqlens in the graph."""
    if packed.max_seqlen is not None:
        longest = packed.max_seqlen[0]
        for length in packed.max_seqlen[1:]:
            node = graph.call_function(torch.sym_max, (longest, length))
            node.meta["val"] = torch.sym_max(fake_value(longest), fake_value(length))
            longest = node
        return longest
    cu = packed.cu
    upper = _call(graph, aten.slice.Tensor, (cu, 0, 1, _END))
    lower = _call(graph, aten.slice.Tensor, (cu, 0, 0, -1))
    lengths = _call(graph, aten.sub.Tensor, (upper, lower))
    longest = _call(graph, aten.max.default, (lengths,))
    shape_env = fake_value(cu).fake_mode.shape_env
    node = graph.call_function(aten._local_scalar_dense.default, (longest,))
    with fake_value(cu).fake_mode, shape_env.suppress_guards():
        node.meta["val"] = aten._local_scalar_dense.default(fake_value(longest))
    bindings = compute_unbacked_bindings(shape_env, node.meta["val"])
    if bindings:
        node.meta["unbacked_bindings"] = bindings
    return node


def _rewrite(graph, packed: _Packed) -> torch.fx.Node:
    first = min(packed.region, key=list(graph.nodes).index)
    with graph.inserting_before(first):
        operands = [_to_thd(graph, node, labels) for node, labels in zip((packed.q, packed.k, packed.v),
                                                                          packed.operand_labels)]
        max_seqlen = _max_seqlen(graph, packed)
    with graph.inserting_before(packed.out):
        fused = _call(graph, dzc.varlen_attention.default,
                      (*operands, packed.cu, max_seqlen, packed.cores[0].scale, None, None))
        fused.meta["stack_trace"] = packed.cores[0].anchor.meta.get("stack_trace")
        result = _from_thd(graph, fused, packed.out_labels)
    packed.out.replace_all_uses_with(result)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(packed.region, key=order.__getitem__, reverse=True):  # users before what they use
        if not node.users:
            graph.erase_node(node)
    # The model's own re-layouts of q, k, v (which the op no longer reads) and the mask, once nothing uses them.
    remove_dead(set(packed.leftovers) | {packed.q, packed.k, packed.v})
    return fused


def fuse_vision_attention(graph: torch.fx.Graph) -> PassResult:
    """Rewrite attention over packed images into dzc.varlen_attention; returns a new graph and a report."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    existing = [n for n in graph.nodes if is_call(n, dzc.varlen_attention.default)]
    cores = [core for core in map(_match_core, list(graph.nodes)) if core is not None]
    by_q = {core.q: core for core in cores}
    done: set[int] = set()
    fused_ops = []
    for core in cores:
        if id(core) in done:
            continue
        try:
            packed = _match_split(core, by_q) or _match_masked(core)
        except Refusal as refusal:
            result.refused(location_of(core.anchor), str(refusal))
            done.add(id(core))
            continue
        if packed is None:
            continue
        done.update(id(c) for c in packed.cores)
        where = location_of(packed.cores[0].anchor)
        fused_ops.append(_rewrite(graph, packed))
        result.rewrote(where)
    # The rotary fold: on the ops just made, and on ops already in the graph (dzc's HF attention function, model
    # code calling the op), where it is the whole rewrite.
    for op in fused_ops + existing:
        old_q, old_k = op.args[:2]
        if not _fold_rotary(graph, op):
            continue
        if op in existing:
            result.rewrote(f"{location_of(op)} (rotary folded)")
        remove_dead(_region(old_q, set(op.all_input_nodes)) | _region(old_k, set(op.all_input_nodes)))
    return result
