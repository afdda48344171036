"""fuse_residual_norm: h = x + residual; y = norm(h) * weight  =>  y, h = dzc.add_rms_norm | dzc.add_layer_norm(...)

Before (HF transformers RMSNorm; the DeepSeek reference adds `x.float() + residual.float()` instead and casts h):

    %h = aten.add.Tensor(%x, %residual)                      # bf16: the residual stream of the next layer
    %v = prims.convert_element_type.default(%h, f32)     # capture applies Inductor's decompositions
    %p = aten.pow.Tensor_Scalar(%v, 2)                       # or aten.mul.Tensor(%v, %v)
    %m = aten.mean.dim(%p, [-1], True)
    %r = aten.rsqrt.default(aten.add(%m, eps))
    %n = aten.mul.Tensor(%v, %r)
    %y = aten.mul.Tensor(%weight, prims.convert_element_type(%n, bf16))  # casts before/after the mul vary

After:

    %f = dzc.add_rms_norm.default(%x, %residual, %weight, eps, sum_in_fp32, cast_before_weight, y_dtype, h_dtype)
    %y = %f[0]
    %h = %f[1]                                               # serves every other use of the sum

LayerNorm (vision encoders: SigLIP / MoonViT blocks, patch mergers), as capture decomposes torch.nn.LayerNorm:

    %vm = aten.var_mean.correction(%v, [-1], correction=0, keepdim=True)   # %v: the (upcast) sum, as above
    %n = aten.mul.Tensor(aten.sub.Tensor(%v, %vm[1]), aten.rsqrt.default(aten.add(%vm[0], eps)))
    %y = prims.convert_element_type(aten.add(aten.mul(%n, %weight), %bias), bf16)   # weight, bias optional
  =>
    %f = dzc.add_layer_norm.default(%x, %residual, %weight, %bias, eps, sum_in_fp32, y_dtype, h_dtype)

The sum feeds the next layer's residual too; the fused op returns it, so the add is fused across the layer
boundary. The pass refuses (and says why in its report) when an intermediate of the norm, or the fp32 sum of
the DeepSeek spelling, has a use the fused op cannot serve, when the add broadcasts, when the hidden size is
symbolic, or when the weight is computed after the add.

Ordering: runs on the ATen graph from capture, before lowering (which picks the kernel for the new op).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from dzc.passes.graph_pass import PassResult, copy_graph, location_of

aten = torch.ops.aten
prims = torch.ops.prims
dzc = torch.ops.dzc

NAME = "fuse_residual_norm"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _cast_dtype(node) -> torch.dtype | None:
    """The target dtype if node is a plain dtype cast (`.to(dtype)`, `.float()`), else None."""
    if _is_call(node, prims.convert_element_type.default):
        return node.args[1]
    if not _is_call(node, aten._to_copy.default) or "dtype" not in node.kwargs:
        return None
    source = _val(node.args[0])
    for key, value in node.kwargs.items():
        if key == "layout" and value not in (None, torch.strided):
            return None
        if key == "device" and value is not None and source is not None and torch.device(value) != source.device:
            return None
        if key not in ("dtype", "layout", "device"):
            return None
    return node.kwargs["dtype"]


def _is_dtype_cast(node) -> bool:
    return _cast_dtype(node) is not None


def _other_operand(mul, node):
    """For mul(a, b) with node among its operands, the other one (None if node is not an operand)."""
    a, b = mul.args[:2]
    if a is node:
        return b
    if b is node:
        return a
    return None


def _single_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


@dataclass
class _Match:
    x: torch.fx.Node
    residual: torch.fx.Node
    weight: torch.fx.Node
    eps: float
    sum_in_fp32: bool
    cast_before_weight: bool
    y: torch.fx.Node  # the norm's result, replaced by output 0
    h: torch.fx.Node | None  # the node whose value is the residual sum in sum_dtype, replaced by output 1
    sum_node: torch.fx.Node  # the add; the fused op is placed here
    sum_dtype: torch.dtype
    chain: list[torch.fx.Node] = field(default_factory=list)  # intermediates that must have no other users
    kind: str = "rms"  # "rms" -> dzc.add_rms_norm, "layer" -> dzc.add_layer_norm
    bias: torch.fx.Node | None = None  # LayerNorm's bias


class _Refusal(Exception):
    pass


def _match_norm(rsqrt: torch.fx.Node) -> _Match | None:
    """Match the norm around an rsqrt; None if it is not an RMSNorm; _Refusal if it is one that cannot fuse."""
    add_eps = rsqrt.args[0]
    if not _is_call(add_eps, aten.add.Tensor, aten.add.Scalar):
        return None
    mean, eps = add_eps.args[:2]
    if not isinstance(eps, (int, float)) or not _is_call(mean, aten.mean.dim):
        return None
    square, dims = mean.args[:2]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if _is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2:
        v = square.args[0]
    elif _is_call(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
        v = square.args[0]
    else:
        return None
    v_val = _val(v)
    if v_val is None or v_val.dtype != torch.float32 or not keepdim:
        return None
    if list(dims) not in ([-1], [v_val.dim() - 1]):
        return None
    # normed = v * rsqrt(...)
    normed = next((u for u in rsqrt.users if _is_call(u, aten.mul.Tensor) and _other_operand(u, rsqrt) is v), None)
    if normed is None:
        return None
    chain = [square, mean, add_eps, rsqrt, normed]
    # Optional cast of the normalised value, then the weight multiply, then an optional cast of the result.
    after = _single_user(normed)
    cast_before = None
    if _is_dtype_cast(after):
        cast_before = after
        chain.append(after)
        after = _single_user(after)
    scaled_input = cast_before if cast_before is not None else normed
    if after is None or not _is_call(after, aten.mul.Tensor):
        raise _Refusal("RMSNorm without a weight multiply")
    weight = _other_operand(after, scaled_input)
    hidden = v_val.shape[-1]
    weight_val = _val(weight)
    if weight_val is None or tuple(weight_val.shape) != (hidden,):
        raise _Refusal("the weight is not a 1-D tensor of the hidden size")
    if not isinstance(hidden, int):
        raise _Refusal("the hidden size is symbolic")
    y = after
    final_cast = _single_user(after)
    if _is_dtype_cast(final_cast):
        chain.append(after)
        y = final_cast

    x, residual, sum_node, sum_in_fp32, h, sum_dtype = _residual_sum(v, {square, normed}, chain, y, [weight])
    if cast_before is not None and _cast_dtype(cast_before) != sum_dtype:
        raise _Refusal("the normalised value is cast to a dtype other than the norm input's")
    return _Match(x, residual, weight, float(eps), sum_in_fp32, cast_before is not None, y, h, sum_node,
                  sum_dtype, chain)


def _residual_sum(v, readers, chain, y, parameters):
    """Where the norm's input v comes from: (x, residual, sum_node, sum_in_fp32, h, sum_dtype); _Refusal when
    it is not a residual add the fused op can take. readers: the norm's nodes that read v; chain: the norm's
    intermediates (extended here with the sum's upcast); parameters: the weight (and bias) tensors."""
    v_val = _val(v)
    # Where v comes from: the HF spelling upcasts the sum; the DeepSeek spelling adds upcast operands.
    if _is_dtype_cast(v) and _is_call(v.args[0], aten.add.Tensor):
        sum_node, sum_in_fp32, h = v.args[0], False, v.args[0]
        chain.append(v)
        if set(v.users) != set(readers):
            raise _Refusal("the fp32 copy of the sum has another use")
    elif _is_call(v, aten.add.Tensor):
        sum_node, sum_in_fp32 = v, True
        x, residual = v.args[:2]
        if _is_dtype_cast(x) and _is_dtype_cast(residual):
            # DeepSeek: x.float() + residual.float(); the residual stream is the sum cast back.
            downcasts = [u for u in v.users if u not in readers]
            if any(not _is_dtype_cast(u) for u in downcasts) or len(downcasts) > 1:
                raise _Refusal("the fp32 sum has a use the fused op cannot serve")
            h = downcasts[0] if downcasts else None
        else:
            h = v  # an fp32 model: the sum itself is the residual stream
    else:
        raise _Refusal("no residual add feeds this norm")
    if sum_node.kwargs.get("alpha", 1) != 1 or len(sum_node.args) > 2:
        raise _Refusal("the residual add has alpha != 1")
    x, residual = sum_node.args[:2]
    if sum_in_fp32 and h is not sum_node:
        x, residual = x.args[0], residual.args[0]
    if not all(isinstance(n, torch.fx.Node) and _val(n) is not None for n in (x, residual)):
        raise _Refusal("an operand of the residual add is not a tensor")
    x_val, residual_val = _val(x), _val(residual)
    if x_val.shape != residual_val.shape or x_val.shape != v_val.shape:
        raise _Refusal("the residual add broadcasts")
    for value in (x_val, residual_val, *(_val(p) for p in parameters), _val(y)):
        if value.dtype not in _FLOAT_DTYPES:
            raise _Refusal(f"unsupported dtype {value.dtype}")
    sum_dtype = _val(h).dtype if h is not None else x_val.dtype
    for node in chain:
        if node is not y and node is not h and any(u not in chain and u is not y for u in node.users):
            raise _Refusal(f"intermediate {node.name} of the norm has another use")
    order = {n: i for i, n in enumerate(sum_node.graph.nodes)}
    if any(order[p] > order[sum_node] for p in parameters):
        raise _Refusal("the weight is computed after the residual add")
    return x, residual, sum_node, sum_in_fp32, h, sum_dtype


def _affine_parameter(node, operand, hidden):
    """For mul/add(operand, p) with a 1-D p of the hidden size: p (None if node is not such an op)."""
    other = _other_operand(node, operand)
    other_val = _val(other)
    if other_val is None or tuple(other_val.shape) != (hidden,):
        return None
    return other


def _match_layer_norm(rsqrt: torch.fx.Node) -> _Match | None:
    """Match a LayerNorm around an rsqrt (torch.nn.LayerNorm as capture decomposes it: var_mean, rsqrt, sub, mul,
    then the weight multiply and bias add in fp32); None if it is not one; _Refusal if it cannot fuse."""
    add_eps = rsqrt.args[0]
    if not _is_call(add_eps, aten.add.Tensor, aten.add.Scalar):
        return None
    var, eps = add_eps.args[:2]
    if not isinstance(eps, (int, float)) or not _is_call(var, operator.getitem) or var.args[1] != 0:
        return None
    var_mean = var.args[0]
    if not _is_call(var_mean, aten.var_mean.correction) or var_mean.kwargs.get("correction", 1) != 0 \
            or not var_mean.kwargs.get("keepdim", False):
        return None
    v = var_mean.args[0]
    v_val = _val(v)
    dims = var_mean.args[1] if len(var_mean.args) > 1 else var_mean.kwargs.get("dim")
    if v_val is None or v_val.dtype != torch.float32 or list(dims or []) not in ([-1], [v_val.dim() - 1]):
        return None
    means = [u for u in var_mean.users if _is_call(u, operator.getitem) and u.args[1] == 1]
    centred = [u for m in means for u in m.users if _is_call(u, aten.sub.Tensor) and u.args[:2] == (v, m)]
    if len(means) != 1 or len(centred) != 1:
        return None
    normed = next((u for u in rsqrt.users if _is_call(u, aten.mul.Tensor) and _other_operand(u, rsqrt)
                   is centred[0]), None)
    if normed is None:
        return None
    chain = [var_mean, var, means[0], add_eps, rsqrt, centred[0], normed]
    hidden = v_val.shape[-1]
    if not isinstance(hidden, int):
        raise _Refusal("the hidden size is symbolic")
    y, weight, bias = normed, None, None
    after = _single_user(y)
    if _is_call(after, aten.mul.Tensor) and (weight := _affine_parameter(after, y, hidden)) is not None:
        chain.append(after)
        y = after
        after = _single_user(y)
    if _is_call(after, aten.add.Tensor) and (bias := _affine_parameter(after, y, hidden)) is not None:
        chain.append(after)
        y = after
        after = _single_user(y)
    if _is_dtype_cast(after):
        y = after
    else:
        chain.remove(y)  # y is the norm's result: it may have any users
    parameters = [p for p in (weight, bias) if p is not None]
    x, residual, sum_node, sum_in_fp32, h, sum_dtype = _residual_sum(v, {var_mean, centred[0]}, chain, y,
                                                                     parameters)
    return _Match(x, residual, weight, float(eps), sum_in_fp32, False, y, h, sum_node, sum_dtype, chain,
                  kind="layer", bias=bias)


def _rewrite(graph: torch.fx.Graph, match: _Match) -> None:
    y_val = _val(match.y)
    h_val = _val(match.h) if match.h is not None else y_val.new_empty(y_val.shape, dtype=match.sum_dtype)
    with graph.inserting_before(match.sum_node):
        if match.kind == "layer":
            fused = graph.call_function(dzc.add_layer_norm.default, (
                match.x, match.residual, match.weight, match.bias, match.eps, match.sum_in_fp32, y_val.dtype,
                match.sum_dtype))
        else:
            fused = graph.call_function(dzc.add_rms_norm.default, (
                match.x, match.residual, match.weight, match.eps, match.sum_in_fp32, match.cast_before_weight,
                y_val.dtype, match.sum_dtype))
        fused.meta["val"] = (y_val, h_val)
        fused.meta["stack_trace"] = match.y.meta.get("stack_trace")
        y = graph.call_function(operator.getitem, (fused, 0))
        y.meta["val"] = y_val
        h = graph.call_function(operator.getitem, (fused, 1))
        h.meta["val"] = h_val
    match.y.replace_all_uses_with(y)
    if match.h is not None:
        match.h.replace_all_uses_with(h)
    # The old chain is now dead; remove it bottom-up (only these nodes, never unrelated dead code), and the
    # fp32 upcasts of the DeepSeek spelling's operands.
    upcasts = [a for a in match.sum_node.args[:2] if _is_dtype_cast(a)] if match.sum_in_fp32 else []
    order = {node: i for i, node in enumerate(graph.nodes)}
    candidates = {n for n in (match.y, *match.chain, match.h, match.sum_node, *upcasts) if n is not None}
    for node in sorted(candidates, key=order.__getitem__, reverse=True):  # users before what they use
        if not node.users:
            graph.erase_node(node)


def fuse_residual_norm(graph: torch.fx.Graph) -> PassResult:
    """Rewrite every residual add + RMSNorm pair into dzc.add_rms_norm; returns a new graph and a report."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    for node in list(graph.nodes):
        if node.graph is not graph or not _is_call(node, aten.rsqrt.default):
            continue
        try:
            match = _match_norm(node) or _match_layer_norm(node)
        except _Refusal as refusal:
            result.refused(location_of(node), str(refusal))
            continue
        if match is None:
            continue
        where = location_of(match.y)
        _rewrite(graph, match)
        result.rewrote(where)
    return result
