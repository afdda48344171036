"""Matchers for attention subgraphs in captured ATen graphs, shared by the attention passes (fuse_sparse_attention,
fuse_windowed_attention, fuse_vision_attention): what a mask means, the softmax (attention sinks included), the q.k
and p.v matmuls, and node builders that keep fake values.

Masks: an additive float mask, or a boolean keep/drop mask, is decomposed into terms (below) that must all hold
for a key to be visible; the passes decide which combinations they can rewrite. Attention: `read_attention(node)`
reads one attention at its p.v matmul or fused SDPA op into an `AttentionCore` (q, k, v, scale, output, mask
operands and their terms), whatever else uses its intermediates; `match_attention(masked)` reads
`softmax(q.k * scale + mask) . v` (eager matmul/softmax, SDPA's math decomposition, gpt-oss's sink column) from the
masked scores into an `Attention` for the decoder passes, with their checks: anything else raises Refusal with the
reason, and a mask part that is not one of the terms raises NotAMask. Both read the q.k scores with `read_scores`.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

from dzc.passes.graph_pass import Refusal, fake_value, is_call
from dzc.passes.patterns import is_last_dim

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that only re-view a value; the matchers look through them.
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
         aten.clone.default, aten.alias.default)
SHAPE_ONLY = VIEWS + (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default)
# SDPA as capture keeps it (the generic op, or its CPU / GPU kernels' ops): read from its arguments.
SDPA_OPS = (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default)
ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what dzc's attention ops take
# Anything at or below this is a "masked out" additive value: -inf, or finfo(dtype).min (HF; fp16's is -65504).
MASKED = -65504.0
WHOLE = 9223372036854775807  # the end of an open slice `x[a:]`


def strip(node, ops=VIEWS):
    while is_call(node, *ops):
        node = node.args[0]
    return node


def strip_casts(node):
    while is_call(node, prims.convert_element_type.default):
        node = node.args[0]
    return node


def scalar(node):
    """The value of a constant scalar (a Python number, or a 0-d full/scalar_tensor node), else None."""
    if isinstance(node, (int, float)):
        return float(node)
    node = strip(node)
    if is_call(node, aten.scalar_tensor.default):
        return float(node.args[0])
    if is_call(node, aten.full.default) and all(s == 1 for s in node.args[0]):
        return float(node.args[1])
    return None


def fill_value(node):
    """The value a full(...) tensor (any shape) is filled with, else None."""
    node = strip(node)
    if is_call(node, aten.full.default):
        return float(node.args[1])
    return scalar(node)


def same(a, b) -> bool:
    return a is b or statically_known_true(a == b)


def shape_is(node, *dims) -> bool:
    """node's value has exactly these sizes (ints or SymInts; None: any)."""
    shape = fake_value(node).shape
    return len(shape) == len(dims) and all(d is None or same(s, d) for s, d in zip(shape, dims))


def is_whole_slice(node) -> bool:
    """x[..., 0:end] with end past the dim's size: the same values (HF slices its masks to the key length)."""
    if not is_call(node, aten.slice.Tensor) or len(node.args) < 4:
        return False
    dim, start, end = node.args[1:4]
    size = fake_value(node.args[0]).shape[dim]
    end = fake_value(end) if isinstance(end, torch.fx.Node) else end
    return start in (0, None) and (end == WHOLE or same(end, size) or statically_known_true(end >= size))


def unpadded_bias(node):
    """x where node is x padded at the end of its last dim and sliced back to x's length (what SDPA does to a bias
    whose rows do not meet its memory-efficient kernel's alignment, on GPUs): the same values; else None."""
    if not is_call(node, aten.slice.Tensor) or len(node.args) < 4 or node.args[2] not in (0, None) \
            or (len(node.args) > 4 and node.args[4] != 1):
        return None
    padded = node.args[0]
    if not is_call(padded, aten.constant_pad_nd.default):
        return None
    rank = fake_value(padded).dim()
    pad = list(padded.args[1])
    if node.args[1] not in (-1, rank - 1) or len(pad) != 2 or pad[0] != 0:
        return None  # a pad before the data, or of another dim, moves or adds values
    x = padded.args[0]
    end = fake_value(node.args[3]) if isinstance(node.args[3], torch.fx.Node) else node.args[3]
    return x if same(end, fake_value(x).shape[-1]) else None


# ----------------------------------------------------------------------------------------------------------------
# Masks: an additive float mask, or a boolean keep/drop mask, is decomposed into terms, all of which must hold
# for a key to be visible:
#   ("causal", query_positions)     keys at positions <= the query's position are visible
#   ("topk", indices, B, width, scatter)  the keys at these indices are visible (B > 1: index i makes the block of
#                                   positions [i*B, i*B + B) visible: a scatter's units repeated B times); width:
#                                   the columns of the term's mask (checked to be the keys')
#   ("window", query_positions, W)  keys at positions > the query's position - W are visible (a local window)
#   ("any", [term, term])           either term holds (the selected keys beside a local window)
#   ("segment", cu_seqlens, mask)   keys in the query's segment of a pack are visible: mask = eq(seg[:, None],
#                                   seg[None, :]) (either order) of one seg = searchsorted(cu_seqlens, arange(T),
#                                   right=True)
#                                   (block-diagonal, packed images); mask: the eq node, whose shape the pass checks
# Anything else (padding, a mask from a model input) is not an attention mask these passes know.


class NotAMask(Exception):
    pass


def describe_mask_part(node) -> str:
    """A mask part as a reason names it: a model input (a padding mask, say) or the op computing it."""
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        return f"a mask the model is given ({node.name})"
    return f"{node.target}" if isinstance(node, torch.fx.Node) else repr(node)


def topk_indices(node):
    node = strip_casts(node)
    if is_call(node, operator.getitem) and node.args[1] == 1 and is_call(node.args[0], aten.topk.default):
        return node
    raise NotAMask("scatter indices do not come from a top-k")


def key_positions(node):
    """The arange(T) that node broadcasts (HF's [..., kv_offset:] slices with offset 0 and + 0 looked through),
    else None."""
    node = strip(node, SHAPE_ONLY)
    while is_whole_slice(node):
        node = strip(node.args[0], SHAPE_ONLY)
    if is_call(node, aten.add.Tensor) and node.args[1] == 0:
        node = node.args[0]
    if is_call(node, prims.iota.default) and node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1:
        return node
    return None


def causal_term(keys, queries):
    """('causal', q) when keys is arange(T) broadcast along the last dim and queries is constant along it."""
    iota = key_positions(keys)
    if iota is None:
        raise NotAMask("the causal comparison is not against key positions arange(T)")
    if not (isinstance(queries, torch.fx.Node) and fake_value(queries).dim() >= 1 and fake_value(keys).dim() >= 1
            and same(fake_value(queries).shape[-1], 1)
            and same(fake_value(keys).shape[-1], fake_value(iota).shape[0])):
        raise NotAMask("the causal comparison does not run the key positions along the last dim")
    return [("causal", queries)]


def _offset(node):
    """node = base + c, c an int constant (adds and subtractions of ints, nested; none: c = 0) -> (base, c)."""
    offset = 0
    while is_call(node, aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2 and not node.kwargs \
            and isinstance(node.args[1], int) and not isinstance(node.args[1], bool):
        offset += node.args[1] if node.target is aten.add.Tensor else -node.args[1]
        node = node.args[0]
    return node, offset


_NEGATED = {aten.gt.Tensor: aten.le.Tensor, aten.le.Tensor: aten.gt.Tensor, aten.ge.Tensor: aten.lt.Tensor,
            aten.lt.Tensor: aten.ge.Tensor}
_MIRRORED = {aten.gt.Tensor: aten.lt.Tensor, aten.lt.Tensor: aten.gt.Tensor, aten.ge.Tensor: aten.le.Tensor,
             aten.le.Tensor: aten.ge.Tensor}
# A comparison with a Python number, as the Tensor comparison it stands for.
_SCALAR_COMPARISONS = {aten.gt.Scalar: aten.gt.Tensor, aten.le.Scalar: aten.le.Tensor,
                       aten.ge.Scalar: aten.ge.Tensor, aten.lt.Scalar: aten.lt.Tensor}


def _key_comparison(node):
    """node compares the key positions k with the query positions q -> (keys, compare, queries, c) meaning
    `k compare q + c` (compare a Tensor comparison, c an int): either side may hold k, either side may add or
    subtract int constants (k + a < q + b: k < q + b - a), and the distance may be compared with an int
    (q - k < W: k > q - W; k - q >= c: k >= q + c; HF's sliding-window masks spell q - k < W)."""
    if node.target in _SCALAR_COMPARISONS:
        compare, difference, bound = _SCALAR_COMPARISONS[node.target], node.args[0], node.args[1]
        if not (is_call(difference, aten.sub.Tensor) and len(difference.args) == 2 and not difference.kwargs
                and isinstance(bound, int) and not isinstance(bound, bool)):
            raise NotAMask(f"{describe_mask_part(node)} compares something other than a difference of positions "
                           "with an int")
        left, right = difference.args
        if key_positions(right) is not None:  # q - k compare c: k (compare mirrored) q - c
            return right, _MIRRORED[compare], left, -bound
        if key_positions(left) is not None:  # k - q compare c: k compare q + c
            return left, compare, right, bound
        raise NotAMask(f"{describe_mask_part(node)} subtracts no key positions arange(T)")
    compare = node.target
    (left, left_offset), (right, right_offset) = _offset(node.args[0]), _offset(node.args[1])
    if key_positions(left) is not None:
        return left, compare, right, right_offset - left_offset
    if key_positions(right) is not None:
        return right, _MIRRORED[compare], left, left_offset - right_offset
    raise NotAMask("a comparison of key positions with something other than the query position (+ a constant)")


def _integral(node) -> bool:
    value = fake_value(node) if isinstance(node, torch.fx.Node) else None
    return value is not None and not value.dtype.is_floating_point and not value.dtype.is_complex


def _comparison_terms(node, keep: bool):
    """A comparison of the key positions k with the query positions q (_key_comparison's forms), True where a key
    is visible (keep) or hidden: k <= q is causal; k > q - W is a local window of W keys. On integer positions
    (checked: both sides' dtypes) k < q + c is k <= q + c - 1 and k >= q + c is k > q + c - 1."""
    keys, compare, queries, offset = _key_comparison(node)
    if not keep:
        compare = _NEGATED[compare]
    if compare in (aten.lt.Tensor, aten.ge.Tensor):
        if not (_integral(keys) and _integral(queries)):
            raise NotAMask(f"{describe_mask_part(node)}: a bound moved by one (k < q + c as k <= q + c - 1) on "
                           "positions that are not integers")
        compare, offset = (aten.le.Tensor if compare is aten.lt.Tensor else aten.gt.Tensor), offset - 1
    if compare is aten.le.Tensor:
        if offset != 0:
            raise NotAMask(f"keys up to the query position {offset:+d} (not the query's own: not causal)")
        return causal_term(keys, queries)
    if offset > -1:
        raise NotAMask(f"keys past the query position {offset:+d}: not a local window")
    (_, queries), = causal_term(keys, queries)
    return [("window", queries, -offset)]


def _either(left: list, right: list):
    """The union of two single terms: the selected keys and a local window (any other union is not a DSA mask)."""
    if len(left) != 1 or len(right) != 1 or sorted(term[0] for term in left + right) != ["topk", "window"]:
        raise NotAMask("a union of mask terms other than the selected keys and a local window")
    return [("any", left + right)]


_COMPARISONS = (aten.le.Tensor, aten.ge.Tensor, aten.lt.Tensor, aten.gt.Tensor, *_SCALAR_COMPARISONS)


def _block_expansion(node):
    """node = x [..., U] with each unit repeated B times along the last dim, [..., U*B] (optionally sliced to its
    first T columns): x.unsqueeze(-1).expand(..., U, B).reshape(..., U*B)[..., :T], which repeat_interleave(B, -1)
    also decomposes to -> (x, B), else None."""
    if is_call(node, aten.slice.Tensor) and node.args[1] % fake_value(node).dim() == fake_value(node).dim() - 1 \
            and node.args[2] in (0, None) and (len(node.args) < 5 or node.args[4] == 1):
        node = node.args[0]
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    expanded = strip(node.args[0], (aten.clone.default,))
    if not (is_call(expanded, aten.expand.default) and is_call(expanded.args[0], aten.unsqueeze.default)):
        return None
    source = expanded.args[0].args[0]
    rank = fake_value(source).dim()
    if expanded.args[0].args[1] % (rank + 1) != rank:
        return None
    units, block = fake_value(expanded).shape[-2:]
    if not (isinstance(block, int) and block > 1 and same(units, fake_value(source).shape[-1])
            and fake_value(node).dim() == rank and same(fake_value(node).shape[-1], units * block)
            and all(same(a, b) for a, b in zip(fake_value(node).shape[:-1], fake_value(source).shape[:-1]))):
        return None
    return source, block


def _selected_terms(node, form: str):
    """[("topk", ...)] when node is a scatter of top-k indices into a mask of units, repeated per block or not, in
    the `form` "keep" (True where selected), "drop" (False there) or "additive" (0 there, -inf/finfo.min
    elsewhere); else None."""
    value = fake_value(node) if isinstance(node, torch.fx.Node) else None
    if value is not None and value.dim() == 0:  # a scalar term (transformers 5.17's GptOss masks have one)
        return None
    width = value.shape[-1] if value is not None else None
    expansion = _block_expansion(node)
    block = 1
    if expansion is not None:
        node, block = expansion
    while is_call(node, *SHAPE_ONLY) or (form == "additive" and is_call(node, prims.convert_element_type.default)):
        node = node.args[0]  # the scatter's own views ([B, S, U] unsqueezed for the heads, say)
    if not (is_call(node, aten.scatter.value) and node.args[1] == -1):
        return None
    fill, value = fill_value(node.args[0]), node.args[3]
    if (form == "keep" and value is True and fill == 0.0) or (form == "drop" and value is False and fill == 1.0) \
            or (form == "additive" and value == 0 and (fill or 0.0) <= MASKED):
        # width: the mask's columns (units x block, or what the expansion kept of them), checked to be the keys
        return [("topk", topk_indices(node.args[2]), block, width if block > 1 else fake_value(node).shape[-1],
                 node)]
    return None


def keep_terms(node):
    """Terms of a boolean mask that is True where a key is visible."""
    return _boolean_terms(node, keep=True)


def drop_terms(node):
    """Terms of a boolean mask that is True where a key is hidden."""
    return _boolean_terms(node, keep=False)


def segment_term(node):
    """[("segment", cu, node)] when node = eq(seg[:, None], seg[None, :]) of one seg = searchsorted(cu, arange(T),
    right=True) (or bucketize(arange(T), cu, right=True), the same), cu 1-D (whole slices looked through; seg[i] is
    the segment of token i, so key j is visible to query i exactly when both lie in one segment); else None. The
    sides may come in either order: eq(seg[None, :], seg[:, None]) is the same mask (both sides are one seg, and
    equality is symmetric)."""
    if not is_call(node, aten.eq.Tensor):
        return None
    sides, units = [], []
    for side in node.args[:2]:
        unsqueezed = None
        while is_call(side, aten.unsqueeze.default) or is_whole_slice(side):
            if is_call(side, aten.unsqueeze.default):
                unsqueezed = side.args[1] % 2
            side = side.args[0]
        sides.append(side)
        units.append(unsqueezed)
    if set(units) != {0, 1}:  # one side a column, the other a row
        return None
    seg = sides[0]
    if sides[1] is not seg or not is_call(seg, aten.searchsorted.Tensor, aten.bucketize.Tensor) \
            or len(seg.args) != 2 or not set(seg.kwargs) <= {"right", "side", "out_int32"} \
            or not (seg.kwargs.get("right") is True or seg.kwargs.get("side") == "right"):
        return None  # right=False counts cu entries below i: token cu[j] would join the segment before it
    # bucketize(positions, cu, right=True) is searchsorted(cu, positions, right=True), its arguments swapped
    cu, positions = seg.args if seg.target is aten.searchsorted.Tensor else seg.args[::-1]
    if is_call(positions, prims.iota.default):  # arange, as capture decomposes it
        if positions.kwargs.get("start") != 0 or positions.kwargs.get("step") != 1:
            return None
    elif not is_call(positions, aten.arange.default, aten.arange.start, aten.arange.start_step) \
            or (is_call(positions, aten.arange.start, aten.arange.start_step) and positions.args[0] != 0) \
            or (is_call(positions, aten.arange.start_step) and positions.args[2] != 1):
        return None
    if fake_value(cu) is None or fake_value(cu).dim() != 1:
        return None
    return [("segment", cu, node)]


_AND = (aten.bitwise_and.Tensor, aten.logical_and.default)
_OR = (aten.bitwise_or.Tensor, aten.logical_or.default)


def _boolean_terms(node, keep: bool):
    """keep_terms (keep=True) and drop_terms: one walk, De Morgan's duals. Every term must hold for a key to be
    visible, so a keep mask's `and` and a drop mask's `or` concatenate terms, the other connective is _either's,
    and `not` turns one form into the other."""
    form = "keep" if keep else "drop"
    selected = _selected_terms(node, form)
    if selected is not None:
        return selected
    if is_call(node, *SHAPE_ONLY, aten.select.int) or is_whole_slice(node):
        return _boolean_terms(node.args[0], keep)
    if is_call(node, *(_AND if keep else _OR)):
        return _boolean_terms(node.args[0], keep) + _boolean_terms(node.args[1], keep)
    if is_call(node, *(_OR if keep else _AND)):
        return _either(_boolean_terms(node.args[0], keep), _boolean_terms(node.args[1], keep))
    if is_call(node, aten.bitwise_not.default, aten.logical_not.default):
        return _boolean_terms(node.args[0], not keep)
    if is_call(node, *_COMPARISONS):
        return _comparison_terms(node, keep=keep)
    segment = segment_term(node) if keep else None
    if segment is not None:
        return segment
    raise NotAMask(f"{describe_mask_part(node)} is not a causal, top-k or window {form} mask")


def additive_terms(node):
    """Terms of a float mask that is 0 where a key is visible and -inf (or finfo.min) where hidden."""
    if fill_value(node) == 0.0:
        return []  # 0, or zeros of any shape (`zeros(..).masked_fill(~m, M)`)
    selected = _selected_terms(node, "additive")
    if selected is not None:
        return selected
    if is_call(node, *SHAPE_ONLY, aten.select.int, prims.convert_element_type.default) or is_whole_slice(node):
        return additive_terms(node.args[0])
    unpadded = unpadded_bias(node)
    if unpadded is not None:
        return additive_terms(unpadded)
    if is_call(node, aten.add.Tensor):
        return additive_terms(node.args[0]) + additive_terms(node.args[1])
    if is_call(node, aten.where.self):
        condition, if_true, if_false = node.args
        if (scalar(if_true) or 0.0) <= MASKED and scalar(if_true) is not None:
            return drop_terms(condition) + additive_terms(if_false)
        if scalar(if_false) is not None and scalar(if_false) <= MASKED:
            return keep_terms(condition) + additive_terms(if_true)
    if is_call(node, aten.masked_fill.Scalar) and node.args[2] <= MASKED:
        return drop_terms(node.args[1]) + additive_terms(node.args[0])
    raise NotAMask(f"{describe_mask_part(node)} is not a causal, top-k or window additive mask")


def split_masked(node):
    """node = x masked by a DSA mask -> (x, terms); x is the operand that is not a mask."""
    inner, terms, _ = read_masked(node)
    return inner, terms


def read_masked(node, keep_where: bool = False):
    """node = x masked -> (x, terms, the mask operands node reads: additive masks, bool conditions); x is the
    operand that is not a mask. keep_where: also where(m, x, M) (a keep mask selecting the scores), a spelling
    the decoder passes have not met and do not read."""
    if is_call(node, aten.add.Tensor):
        for value, mask in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            try:
                terms = additive_terms(mask)
            except NotAMask:
                continue
            inner, more, masks = read_masked(value, keep_where)
            return inner, terms + more, [mask, *masks]
    if is_call(node, aten.where.self) and scalar(node.args[1]) is not None and scalar(node.args[1]) <= MASKED:
        inner, more, masks = read_masked(node.args[2], keep_where)
        return inner, drop_terms(node.args[0]) + more, [node.args[0], *masks]
    if keep_where and is_call(node, aten.where.self) and scalar(node.args[2]) is not None \
            and scalar(node.args[2]) <= MASKED:
        inner, more, masks = read_masked(node.args[1], keep_where)
        return inner, keep_terms(node.args[0]) + more, [node.args[0], *masks]
    if is_call(node, aten.masked_fill.Scalar) and node.args[2] <= MASKED:
        inner, more, masks = read_masked(node.args[0], keep_where)
        return inner, drop_terms(node.args[1]) + more, [node.args[1], *masks]
    return node, [], []


def mask_problem(scores) -> str | None:
    """What in the mask is not a known term, where split_masked left `scores` = q.k scores + a mask it could not
    read; None otherwise."""
    if not is_call(scores, aten.add.Tensor):
        return None
    mask = next((a for a in scores.args if isinstance(a, torch.fx.Node) and bmm_operands(a) is None), None)
    if mask is None:
        return None
    try:
        additive_terms(mask)
    except NotAMask as why:
        return str(why)
    return None


def query_positions(terms, what: str):
    causal = [term[1] for term in terms if term[0] == "causal"]
    if not causal:
        raise Refusal(f"the {what} mask has no causal term (key position <= query position)")
    first = strip(causal[0], SHAPE_ONLY)
    if any(strip(q, SHAPE_ONLY) is not first for q in causal[1:]):
        raise Refusal(f"the {what} mask compares with different query positions")
    return causal[0]


# ----------------------------------------------------------------------------------------------------------------
# The pieces of the pattern.


def bmm_operands(node):
    """node = view(bmm(a, b)) (optionally times constant scales) -> (a, b, scale)."""
    scale = 1.0
    while is_call(node, aten.mul.Tensor, aten.mul.Scalar) and scalar(node.args[1]) is not None:
        scale *= scalar(node.args[1])
        node = node.args[0]
    node = strip(node, SHAPE_ONLY)
    if not is_call(node, aten.bmm.default):
        return None
    return node.args[0], node.args[1], scale


def _peel_scale(node, scale: float):
    """mul(x, c) / mul(c, x) with a scalar c, repeated: (x, scale * the c's); anything else: (node, scale)."""
    while is_call(node, aten.mul.Tensor, aten.mul.Scalar):
        a, b = node.args[:2]
        if scalar(b) is not None:
            node, scale = a, scale * scalar(b)
        elif scalar(a) is not None:
            node, scale = b, scale * scalar(a)
        else:
            break
    return node, scale


def _unscaled(node, scale: float, views=VIEWS):
    """node with views and scalar multiples looked through, alternately -> (source, scale * the multiples)."""
    while True:
        node = strip(node, views)
        source, scale = _peel_scale(node, scale)
        if source is node:
            return node, scale
        node = source


def read_scores(node):
    """The q.k scores: node = bmm(q, k^T), each of the three seen through views and scalar multiples (eager scales
    the scores, SDPA's math form scales q and k^T by sqrt(scale) each) -> (the bmm, q, k or None where the second
    operand is not a transpose, the product of the multiples); None when node is not a bmm's product."""
    node, scale = _unscaled(node, 1.0, SHAPE_ONLY)
    if not is_call(node, aten.bmm.default):
        return None
    q, scale = _unscaled(node.args[0], scale)
    k_t, scale = _unscaled(node.args[1], scale)
    return node, q, transposed(k_t), scale


def transposed(node):
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


def whole_dim_slice(node) -> bool:
    """aten.slice(x, dim, 0, INT64_MAX) with step 1: a no-op, which captures with symbolic sizes keep in the graph."""
    start, end, step = (list(node.args[2:]) + [0, WHOLE, 1][len(node.args[2:]):])[:3]
    return start in (0, None) and end in (None, WHOLE) and step == 1


@dataclass
class Attention:
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
    sinks = strip(broadcast, SHAPE_ONLY)
    if not (len(shape) == 4 and same(shape[1], heads) and all(same(d, 1) for i, d in enumerate(shape) if i != 1)
            and same(fake_value(parts[1]).shape[1], heads) and fake_value(sinks).dim() == 1
            and same(fake_value(sinks).shape[0], heads)):
        return None
    return cat, sinks


def softmax_output(masked):
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
        users = list(start.users)
        if len(users) == 1 and is_call(users[0], prims.convert_element_type.default):
            start = users[0]  # a 16-bit softmax runs in fp32 (its decomposition upcasts here, after the cat)
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
    # The key columns: probs[..., :T] (":-1" or ":T"), the sink's column dropped (after the cast back to 16 bits).
    keys = list(probs.users)
    if len(keys) == 1 and is_call(keys[0], prims.convert_element_type.default):
        keys = list(keys[0].users)
    context = fake_value(masked).shape[-1]
    if len(keys) != 1 or not is_call(keys[0], aten.slice.Tensor) or keys[0].args[1] % 4 != 3 \
            or keys[0].args[2] not in (0, None) or not shape_is(keys[0], *fake_value(masked).shape) \
            or (len(keys[0].args) > 4 and keys[0].args[4] != 1):
        return None
    return (keys[0], sinks) if same(fake_value(keys[0]).shape[-1], context) else None


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
        if is_call(user, prims.convert_element_type.default, *VIEWS):
            node = user
            continue
        if is_call(user, aten.where.self) and user.args[2] is node and fill_value(user.args[1]) == 0.0:
            node = user  # SDPA: rows with every key masked give 0 instead of NaN
            continue
        return None


def match_attention(masked) -> Attention:
    scores, terms = split_masked(masked)
    read = read_scores(scores)
    problem = mask_problem(scores) if read is None else None
    if problem is not None:
        raise Refusal(f"the attention mask is not causal + top-k: {problem}")
    if read is None:
        raise Refusal("the masked values are not q.k scores")
    products, q, k, scale = read
    q_operand, k_operand = products.args[:2]
    if k is None or fake_value(q).dim() != 4 or fake_value(k).dim() != 4:
        raise Refusal("the attention operands are not [B, H, S, D] queries and transposed [B, H, T, D] keys")
    softmax = softmax_output(masked)
    if softmax is None:
        raise Refusal("the masked scores do not feed a softmax")
    probs, sinks = softmax
    pv = _probabilities_consumer(probs)
    if pv is None:
        raise Refusal("the attention probabilities have another use than the matmul with V")
    # V as the [B, Hkv, T, Dv] the model made: its views looked through, but not HF's repeat_kv (a reshape of a
    # 5-d expand, which the attention passes read themselves).
    v = pv.args[1]
    while is_call(v, *VIEWS) and fake_value(v.args[0]).dim() == 4:
        v = v.args[0]
    out = next(iter(pv.users), None)
    if (len(pv.users) != 1 or not is_call(out, aten.view.default, aten._unsafe_view.default)
            or fake_value(out).dim() != 4 or fake_value(v).dim() != 4):
        raise Refusal("the attention output is not [B, H, S, Dv]")
    # The matmuls reduce over D (scores) and T (output), each query row over its own batch's keys; K and V heads
    # are 1 (shared, MLA's latent) or H (sparse_attention's two layouts), not broadcast over the batch.
    batch, heads, queries, head_dim = fake_value(q).shape
    context, d_v = fake_value(k).shape[2], fake_value(v).shape[3]
    kv_heads = fake_value(k).shape[1]
    if not (shape_is(q_operand, batch * heads, queries, head_dim)
            and same(fake_value(q).numel(), fake_value(q_operand).numel())
            and shape_is(k_operand, batch * heads, head_dim, context)
            and shape_is(k, batch, kv_heads, context, head_dim) and (same(kv_heads, 1) or same(kv_heads, heads))
            and shape_is(v, batch, kv_heads, context, d_v)
            and shape_is(pv.args[0], batch * heads, queries, context) and shape_is(out, batch, heads, queries, d_v)
            and same(fake_value(masked).shape[-2], queries) and same(fake_value(masked).shape[-1], context)):
        raise Refusal("the attention is not [B, H, S, D] queries over [B, 1 or H, T, D] keys and values, softmax "
                      "over T")
    if fake_value(q).dtype not in ATTENTION_DTYPES:
        raise Refusal(f"{fake_value(q).dtype} attention: dzc's attention ops take bf16, fp16 and fp32 (a float64 "
                      "model keeps its precision, unfused)")
    return Attention(q, k, v, scale, out, masked, terms, sinks)


# ----------------------------------------------------------------------------------------------------------------
# One attention, read at its p.v matmul or fused SDPA op. What else uses its intermediates is each pass's to check.


@dataclass
class AttentionCore:
    """One attention: softmax(q k^T * scale [+ mask]) v over the last two dims of q, k, v."""

    q: torch.fx.Node  # [..., tokens, head_dim] as the model computed it (before any view the attention made)
    k: torch.fx.Node
    v: torch.fx.Node
    scale: float
    out: torch.fx.Node  # the attention's result, [..., tokens, head_dim]
    masks: list  # the mask operands the attention reads (additive masks, bool conditions); [] without a mask
    terms: list | None  # what they mean (the terms above), None: a mask the reader does not know
    causal: bool = False
    dropout: bool = False
    anchor: torch.fx.Node | None = None  # where the model source line is


def read_attention(node) -> AttentionCore | None:
    """The attention whose p.v bmm (eager matmuls, SDPA's math decomposition) or fused SDPA op is node, else None:

        bmm(softmax(bmm(q, k^T) * scale [+ mask]), v)  or  SDPA(q, k, v, attn_mask, scale=...)
          =>  AttentionCore(q, k, v, scale, out, masks, terms)
    """
    return _read_math(node) or _read_sdpa(node)


def _read_math(pv) -> AttentionCore | None:
    if not is_call(pv, aten.bmm.default):
        return None
    probs = strip_casts(strip(pv.args[0]))
    if is_call(probs, aten.where.self) and _is_full_row_guard(probs.args[0]) and fill_value(probs.args[1]) == 0.0:
        probs = strip_casts(probs.args[2])
    logits = softmax_input(probs)
    if logits is None:
        return None
    scores, terms, masks = read_mask(strip_casts(logits))
    read = read_scores(scores)
    if read is None or read[2] is None:
        return None  # another additive bias (relative positions, a mask above MASKED): not an attention we know
    _, q, k, scale = read
    k, scale = _peel_scale(k, scale)
    v = strip(pv.args[1])
    out = pv
    while len(out.users) == 1 and is_call(next(iter(out.users)), aten.view.default, aten._unsafe_view.default):
        out = next(iter(out.users))
    return AttentionCore(q, k, v, scale, out, masks, terms, anchor=out)


def _is_full_row_guard(cond) -> bool:
    """SDPA's decomposition zeroes fully masked rows: where(logical_not(any(logical_not(eq(s, -inf)))), 0, p)."""
    return is_call(cond, aten.logical_not.default) and is_call(cond.args[0], aten.any.dim)


def softmax_input(probs):
    """probs = softmax(x) over the last dim -> x, else None: aten._softmax(x, -1), or exp(x - shift) / total where
    total sums this exp over the last dim, kept as a column, and the shift is one value per row (a column of x's
    rank, or a number): any such shift cancels (amax(x), or amax(cat([x, -inf column])) = amax(x) of a softmax over
    a data-dependent key count). Another denominator, or a shift varying along the keys, is not softmax(x)."""
    if is_call(probs, aten._softmax.default):
        logits = probs.args[0]
        return logits if probs.args[1] in (-1, fake_value(logits).dim() - 1) else None
    if not (is_call(probs, aten.div.Tensor) and is_call(probs.args[0], aten.exp.default)
            and is_call(probs.args[0].args[0], aten.sub.Tensor) and is_call(probs.args[1], aten.sum.dim_IntList)):
        return None
    exp, total = probs.args[:2]
    logits, shift = exp.args[0].args[:2]
    rank = fake_value(logits).dim()

    def is_column(value) -> bool:  # a literal 1 (a symbolic size is not known to be 1)
        return value.dim() == rank and isinstance(value.shape[-1], int) and value.shape[-1] == 1

    row_constant = not isinstance(shift, torch.fx.Node) or is_column(fake_value(shift))
    if list(total.args[1]) in ([-1], [rank - 1]) and total.args[0] is exp and is_column(fake_value(total)) \
            and row_constant:
        return logits
    return None


def read_mask(logits):
    """logits = scores masked -> (scores, terms, mask operands) by the mask reader above (where(m, s, M) included);
    a bool mask m it does not know (added as where(m, 0, M) or where(~m, M, 0), where(m, M, s), where(m, s, M),
    masked_fill(s, m, M), M at or below MASKED) -> (scores, None, [the mask operand]), so that a pass can refuse
    an attention under it as masked; no mask -> (logits, [], [])."""
    try:
        scores, terms, masks = read_masked(logits, keep_where=True)
    except NotAMask:
        scores, terms, masks = logits, None, []
    if masks:
        return scores, terms, masks
    if is_call(logits, aten.add.Tensor):
        bias = logits.args[1]
        if is_call(bias, aten.where.self) and any(_is_masked_value(a) for a in bias.args[1:]):
            return logits.args[0], None, [bias]
    elif is_call(logits, aten.where.self):
        condition, if_true, if_false = logits.args
        if _is_masked_value(if_true):
            return if_false, None, [condition]
        if _is_masked_value(if_false):
            return if_true, None, [condition]
    elif is_call(logits, aten.masked_fill.Scalar):
        return logits.args[0], None, [logits.args[1]]
    return logits, [], []


def _is_masked_value(node) -> bool:
    return scalar(node) is not None and scalar(node) <= MASKED


def _read_sdpa(node) -> AttentionCore | None:
    """A fused SDPA op (what capture keeps on GPUs): its normalised arguments; None for a float bias that is not a
    mask (relative positions, a mask above MASKED), or a kernel op whose output is not read by one getitem."""
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
    masks, terms = [], []
    if mask is not None:
        masks, boolean = [mask], fake_value(mask).dtype == torch.bool
        try:
            terms = keep_terms(mask) if boolean else additive_terms(mask)
        except NotAMask:
            if not boolean:
                return None
            terms = None
    if node.target is aten.scaled_dot_product_attention.default:
        out = node
    else:
        outs = [u for u in node.users if is_call(u, operator.getitem) and u.args[1] == 0]
        if len(outs) != 1:
            return None
        out = outs[0]
    return AttentionCore(q, k, v, float(scale), out, masks, terms, causal=bool(kwargs.get("is_causal", False)),
                         dropout=float(kwargs.get("dropout_p", 0.0)) != 0.0, anchor=node)


# ----------------------------------------------------------------------------------------------------------------
# The rewrite.


def new_node(graph: torch.fx.Graph, target, args, kwargs=None) -> torch.fx.Node:
    """A node at the graph's insertion point, its fake value computed from its arguments' fake values."""
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


class Builder:
    """Inserts nodes before `anchor`, each with meta['val'] computed from its arguments' fake values."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, stack_trace, fake_mode=None):
        """fake_mode: the graph's, where the caller has it (else found among every node's value: O(nodes))."""
        self.graph, self.anchor, self.stack_trace = graph, anchor, stack_trace
        if fake_mode is None:
            values = [n.meta.get("val") for n in graph.nodes]
            fake_mode = torch._guards.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        self.fake_mode = fake_mode

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


def one_position_per_query(positions, batch, queries) -> bool:
    """The causal mask's query positions (a node of [..., S, 1]) are one per query row: [S] shared by the batch,
    or [B, S]."""
    rows = fake_value(positions)
    return (rows.dim() >= 2 and same(rows.shape[-2], queries) and same(rows.shape[-1], 1)
            and (same(rows.numel(), queries) or same(rows.numel(), batch * queries)))


def flat_query_positions(build: Builder, positions, batch, queries):
    """Those positions as the ops take them: int32 [B*S], contiguous (a reshape of an expand can be a stride-0
    view at batch 1, and kernels index it flat)."""
    positions = build(aten.expand.default, build(aten.view.default, positions, [-1, queries]), [batch, queries])
    return build(aten.clone.default, build(prims.convert_element_type.default,
                                           build(aten.reshape.default, positions, [-1]), torch.int32),
                 memory_format=torch.contiguous_format)


def fp32_sinks(build: Builder, sinks):
    """The [H] sink logits as the ops take them (fp32), or None."""
    if sinks is not None and fake_value(sinks).dtype != torch.float32:
        sinks = build(prims.convert_element_type.default, sinks, torch.float32)
    return sinks


def erase_replaced(graph, roots) -> None:
    """Erase the replaced subgraph: the roots and whatever they alone used (never unrelated dead code)."""
    pending, erased = list(roots), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op != "call_function":
            continue
        pending.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def feeds_exp(node, steps: int = 6) -> bool:
    """An exp within `steps` uses of node: the masked scores of a softmax spelled some other way."""
    frontier = [node]
    for _ in range(steps):
        frontier = [user for n in frontier for user in n.users]
        if any(is_call(n, aten.exp.default) for n in frontier):
            return True
    return False


def check_private(masked) -> None:
    """The masked scores feed only the softmax pattern (another use would keep the dense attention alive)."""
    users = list(masked.users)
    if len(users) == 1 and is_call(users[0], prims.convert_element_type.default, aten.cat.default):
        users = list(users[0].users)  # a cast, or the sink column's cat
    if any(not is_call(u, aten.amax.default, aten.max.dim, aten.sub.Tensor, aten.eq.Scalar) for u in users):
        raise Refusal("the masked attention scores have another use")
