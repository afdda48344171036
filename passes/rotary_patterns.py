"""rotary_patterns: the rotary embedding as attention passes meet it, and its fold into dzc.varlen_attention.

A rotary (RoPE) computed in fp32 and rounded back once, with cos, sin [tokens, head_dim] tables broadcast over
the heads, in its two column orders:

    half-split   (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)
                 rotate_half(x) = cat([-x[..., d/2:], x[..., :d/2]], -1)
    interleaved  (x.float() * cos + rot(x.float()) * sin).to(x.dtype)
                 rot(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2), the pairs also read by select /
                 unbind of x viewed as [..., d/2, 2]; capture spells the stack as a cat of unsqueezes

`match_rotary(node)` reads either into a `Rotary` (x, cos, sin, interleaved). `fold_rotary(graph, op)`: before ⇒
after, for a dzc.varlen_attention node whose q and k are the same rotary (same tables, same order), seen
through pure re-layouts:

    dzc.varlen_attention(rotary(q), rotary(k), v, cu, max_seqlen, scale, None, None)
  ⇒ dzc.varlen_attention(q, k, v, cu, max_seqlen, scale, cos, sin)          # the op rotates as it loads q, k

with q, k, cos and sin taken in half-split column order [0, 2, .., d-2, 1, 3, .., d-1] for the interleaved
rotary. Exact for any cos, sin: with P that order, rotate_half(x[P]) = rot(x)[P], so rope_half(x[P], cos[P],
sin[P]) = rope_interleaved(x, cos, sin)[P], element by element the same fp32 products and sum; and the scores sum
q.k over the head dim, which the same P on q and k leaves unchanged (up to summation order, as any kernel). v,
and so the output, keep their order. Not folded: q and k rotated by different spellings or tables, rotaries of
other spellings, an op already given cos, sin.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from dzc.passes.attention_patterns import WHOLE, new_node, same, strip_casts
from dzc.passes.graph_pass import fake_value, is_call
from dzc.passes.patterns import Cast, Op, Var, cast_dtype, maybe

aten = torch.ops.aten

_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)

# rotate_half(x) = cat([-x[..., h:], x[..., :h]], dim): the slices' dims, ends and the cat's dim checked below.
ROTATE_HALF = Op(aten.cat.default, [Op(aten.neg.default, Op(aten.slice.Tensor, Var("x32"), Var("high_dim"),
                                                            Var("half"), Var("high_end"), name="high")),
                                    Op(aten.slice.Tensor, Var("x32"), Var("low_dim"), 0, Var("low_end"))],
                 Var("cat_dim"), name="rotated")

# rot(x) = stack((-odd, even), -1).flatten(-2), odd/even the columns x[..., 1::2], x[..., ::2] (_pair_column).
_NEG_ODD = Op(aten.neg.default, Var("odd"))
ROTATE_PAIRS = Op(_RESHAPES, Op(aten.stack.default, [_NEG_ODD, Var("even")], Var("stack_dim"), name="stacked")
                  | Op(aten.cat.default, [Op(aten.unsqueeze.default, _NEG_ODD, Var("odd_dim")),
                                          Op(aten.unsqueeze.default, Var("even"), Var("even_dim"))],
                       Var("stack_dim"), name="stacked"),
                  Var("shape"), name="rotated")

# x32 * cos + rot(x32) * sin, in either operand order, optionally cast back to x's dtype.
ROTARY = maybe(lambda p: Cast(p, name="out_cast"),
               Op(aten.add.Tensor, Op(aten.mul.Tensor, Var("x32"), Var("cos"), commutative=True),
                  Op(aten.mul.Tensor, ROTATE_HALF | ROTATE_PAIRS, Var("sin"), commutative=True),
                  commutative=True, name="total"))


@dataclass
class Rotary:
    x: torch.fx.Node  # the unrotated input, in the rotary's output dtype
    cos: torch.fx.Node  # [tokens, head_dim] tables
    sin: torch.fx.Node
    interleaved: bool  # the pairs (2i, 2i+1) rotate, not (i, i + d/2)


def _is_last(dim, rank) -> bool:
    return isinstance(dim, int) and dim % rank == rank - 1


def _rotates_half(match) -> bool:
    """ROTATE_HALF's slices are x's last dim split at its middle: [h:] (to the end) and [:h]."""
    x, rotated = match["x32"], match["rotated"]
    rank, width = fake_value(rotated).dim(), fake_value(x).shape[-1]
    half = width // 2
    return (all(_is_last(match[d], rank) for d in ("cat_dim", "high_dim", "low_dim"))
            and match["half"] == half and match["high_end"] in (WHOLE, width) and match["low_end"] == half)


def _pair_column(node, rank):
    """(x, p) for node = x[..., p::2] (p 0 or 1), x [..., d] with d even, read as aten.slice(x, -1, p, end, 2) or as
    select / unbind of x viewed as [..., d/2, 2] at p; else None."""
    if is_call(node, aten.slice.Tensor) and len(node.args) == 5 and node.args[4] == 2:
        x, dim, start, end = node.args[:4]
        width = fake_value(x).shape[-1]
        if fake_value(x).dim() != rank or dim % rank != rank - 1 or start not in (0, 1) \
                or not isinstance(width, int) or width % 2 \
                or not (end == WHOLE or (isinstance(end, int) and end >= width)):
            return None
        return x, start
    if is_call(node, aten.select.int):
        pairs, dim, parity = node.args[:3]
    elif is_call(node, operator.getitem) and is_call(node.args[0], aten.unbind.int):
        pairs, dim = node.args[0].args[0], node.args[0].args[1] if len(node.args[0].args) > 1 else 0
        parity = node.args[1]
    else:
        return None
    if not is_call(pairs, *_RESHAPES):
        return None
    x = pairs.args[0]
    shape, pair_shape = fake_value(x).shape, fake_value(pairs).shape
    if len(shape) != rank or len(pair_shape) != rank + 1 or dim % (rank + 1) != rank or parity not in (0, 1, -1, -2) \
            or not same(pair_shape[-1], 2) or not isinstance(shape[-1], int) \
            or not same(pair_shape[-2], shape[-1] // 2) or shape[-1] % 2 \
            or not all(same(a, b) for a, b in zip(shape[:-1], pair_shape[:-2])):
        return None  # not the last dim split into pairs (a view keeps the row-major order: pair i = (2i, 2i+1))
    return x, parity % 2


def _rotates_pairs(match) -> bool:
    """ROTATE_PAIRS flattens [..., d/2, 2] pairs (-x[2i+1], x[2i]) of x's last dim back into [..., d]."""
    node, stacked = match["rotated"], match["stacked"]
    shape, stacked_shape = fake_value(node).shape, fake_value(stacked).shape
    rank = len(shape)
    if len(stacked_shape) != rank + 1 or not same(stacked_shape[-1], 2) \
            or not all(same(a, b) for a, b in zip(shape[:-1], stacked_shape[:-2])) \
            or not isinstance(shape[-1], int) or not same(stacked_shape[-2] * 2, shape[-1]):
        return False  # not the flatten of [..., d/2, 2] into [..., d]
    if match["stack_dim"] % (rank + 1) != rank \
            or any(match.get(d, rank) % (rank + 1) != rank for d in ("odd_dim", "even_dim")):
        return False
    odd, even = _pair_column(match["odd"], rank), _pair_column(match["even"], rank)
    x = match["x32"]
    return (odd is not None and even is not None and odd[0] is x and even[0] is x and (odd[1], even[1]) == (1, 0)
            and all(same(a, b) for a, b in zip(fake_value(x).shape, shape)))


def _table(node):
    """cos/sin [tokens, head_dim] behind its fp32, head-broadcast form unsqueeze(cos, -2).float()."""
    node = strip_casts(node)
    if not is_call(node, aten.unsqueeze.default):
        return None
    table = strip_casts(node.args[0])
    if fake_value(table).dim() != 2 or node.args[1] % 3 != 1:
        return None
    return table


def match_rotary(node) -> Rotary | None:
    """node = (x.float() * cos + rot(x.float()) * sin).to(x.dtype) computed in fp32, x [tokens, heads, head_dim], rot
    rotate_half or the interleaved pairs rotation -> Rotary; else None."""
    for match in ROTARY.matches(node):
        interleaved = "stacked" in match.bindings  # ROTATE_PAIRS' node
        if not (_rotates_pairs(match) if interleaved else _rotates_half(match)):
            continue
        x32, cos, sin = match["x32"], match["cos"], match["sin"]
        if any(fake_value(n).dtype != torch.float32 for n in (match["total"], x32, cos, sin)):
            continue
        cos_table, sin_table = _table(cos), _table(sin)
        if cos_table is None or sin_table is None:
            continue
        x = x32.args[0] if cast_dtype(x32) == torch.float32 else x32
        if fake_value(x).dtype != fake_value(node).dtype or fake_value(x).dim() != 3:
            continue
        return Rotary(x, cos_table, sin_table, interleaved)
    return None


def layout_source(node):
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
                and same(fake_value(arg).shape[current.args[1] % rank], 1):
            removed = current.args[1] % rank
            step = [i for i in range(rank) if i != removed]
        elif is_call(current, aten.squeeze.dim, aten.squeeze.dims):
            asked = current.args[1] if isinstance(current.args[1], (list, tuple)) else [current.args[1]]
            removed = {d % rank for d in asked if same(fake_value(arg).shape[d % rank], 1)}
            step = [i for i in range(rank) if i not in removed]
        elif is_call(current, aten.clone.default, aten.alias.default):
            step = list(range(rank))
        else:
            return current, mapping
        mapping = [step[d] if d is not None else None for d in mapping]
        current = arg


def half_split_order(graph, node):
    """node [..., d] with its columns in the order [0, 2, .., d-2, 1, 3, .., d-1]: the even columns, then the odd."""
    rank = fake_value(node).dim()
    columns = [new_node(graph, aten.slice.Tensor, (node, rank - 1, start, WHOLE, 2)) for start in (0, 1)]
    return new_node(graph, aten.cat.default, (columns, rank - 1))


def fold_rotary(graph, op) -> bool:
    """Give dzc.varlen_attention node `op` the unrotated q, k and cos, sin when both are one rotary (module
    docstring); whether it did."""
    q, k, v, cu, max_seqlen, scale, cos, sin = op.args[:8]
    if cos is not None:
        return False
    found = []
    for operand in (q, k):
        root, mapping = layout_source(operand)
        rotary = match_rotary(root) if fake_value(root).dim() == 3 and mapping == [0, 1, 2] else None
        if rotary is None:
            return False
        found.append(rotary)
    q_rot, k_rot = found
    if q_rot.cos is not k_rot.cos or q_rot.sin is not k_rot.sin or q_rot.interleaved != k_rot.interleaved:
        return False
    q_x, k_x, cos, sin = q_rot.x, k_rot.x, q_rot.cos, q_rot.sin
    if q_rot.interleaved:
        with graph.inserting_before(op):
            q_x, k_x, cos, sin = (half_split_order(graph, n) for n in (q_x, k_x, cos, sin))
    op.args = (q_x, k_x, v, cu, max_seqlen, scale, cos, sin, *op.args[8:])
    return True
