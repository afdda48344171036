"""fuse_residual_norm: h = x + residual; y = norm(h) * weight  =>  y, h = dzc.add_rms_norm | dzc.add_layer_norm(...)

Before (HF transformers RMSNorm, after canonicalize_graph):

    %h = aten.add.Tensor(%x, %residual)                      # bf16: the residual stream of the next layer
    %v = prims.convert_element_type.default(%h, f32)
    %p = aten.pow.Tensor_Scalar(%v, 2)
    %m = aten.mean.dim(%p, [-1], True)
    %r = aten.rsqrt.default(aten.add(%m, eps))
    %n = aten.mul.Tensor(%v, %r)
    %y = aten.mul.Tensor(%weight, prims.convert_element_type(%n, bf16))

After:

    %f = dzc.add_rms_norm.default(%x, %residual, %weight, eps, sum_in_fp32, cast_before_weight, y_dtype, h_dtype)
    %y = %f[0]
    %h = %f[1]                                               # serves every other use of the sum

One rule per meaning; each pattern's alternatives are the spellings of that meaning that released models use:

- RMS-normalised v: `v * rsqrt(mean(v²) + eps)` or `v / sqrt(mean(v²) + eps)` (divide_by_rms), with v² as
  `pow(v, 2)` or `v * v` and the mean as `mean(-1)`, `sum(-1) / H` or `sum(-1) * (1 / H)` (the op's kernels
  compute sum / H; the mean's own rounding is the reduction order's, which no kernel pins); also
  `rsqrt(mean(v² + eps))` (the same sum, eps added once instead of H times over H) and `rsqrt(mean(v², -1) +
  eps).unsqueeze(-1)` (the mean without keepdim, the dim put back: the same values). The arithmetic in
  fp32 after an upcast (HF, Gemma, T5's `h * rsqrt(var)` over a separate upcast, which canonicalize_graph turns
  into one upcast copy), or in bf16/fp16 without one (compute_dtype: the op rounds every step where the model
  does).
- weighted: `w * n`, `n * w`, with the normalised value cast to the input dtype first (HF: cast_before_weight)
  or not (torch.nn.RMSNorm, DeepSeek, Gemma); the weight is any 1-D tensor of the hidden size the graph computes
  without the sum (Gemma's `1 + w.float()`, hoisted before the add), or absent (a norm without weight).
- the residual sum: `cast(x + residual, f32)` (HF), `x.float() + residual.float()` (DeepSeek: sum_in_fp32, h is
  the sum cast back), or `x + residual` read as is (fp32 models, bf16 math); read through a copy (`clone`:
  capture's LayerNorm makes a transposed sum contiguous, SigLIP) or not, and through a view that keeps the last
  dim (`h.reshape(-1, H)`, before or after the upcast: the same rows, so the fused op runs on the sum's shape and
  its y takes the view: `norm(view(h)) = view(norm(h))`).
- LayerNorm (vision encoders), as capture decomposes torch.nn.LayerNorm: var_mean, `(v - mean) * rsqrt(var +
  eps)`, then optional weight multiply and bias add in fp32 and one cast => dzc.add_layer_norm.

Refused, with the reason in the report: an intermediate of the norm (or the fp32 sum of the DeepSeek spelling)
with a use the fused op cannot serve, a broadcasting add, a symbolic hidden size, a weight computed from the sum,
float64 tensors (the kernels take fp32/fp16/bf16: a float64 model keeps its precision, unfused), a normalised
value cast to a dtype other than the norm input's.

Ordering: after canonicalize_graph (it matches the canonical spellings), before lowering (which picks the kernel
for the new op).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from dzc.passes.graph_pass import PassResult, Refusal, copy_graph, fake_value, is_call
from dzc.passes.patterns import Cast, Match, Op, Rule, Scalar, Var, apply_rules, cast_dtype, dtype_of, hoist, \
    is_last_dim, maybe, outside_users, remove_dead, same_sizes, widens_exactly

aten = torch.ops.aten
dzc = torch.ops.dzc

NAME = "fuse_residual_norm"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------------------------------------
# The meanings, as patterns

_V = Var("v")
_SQUARE = Op(aten.pow.Tensor_Scalar, _V, 2) | Op(aten.mul.Tensor, _V, _V)
_SUM_OF_SQUARES = Op(aten.sum.dim_IntList, _SQUARE, Var("dims"), True)
MEAN_SQUARE = (Op(aten.mean.dim, _SQUARE, Var("dims"), True)
               | Op(aten.div.Tensor, _SUM_OF_SQUARES, Scalar("count"))
               | Op(aten.mul.Tensor, _SUM_OF_SQUARES, Scalar("inverse_count")))
_ADD = (aten.add.Tensor, aten.add.Scalar)
_PLUS_EPS = Op(_ADD, MEAN_SQUARE, Scalar("eps"))
# mean(v² + eps) = mean(v²) + eps; the mean without keepdim, its dim put back after the rsqrt (fuse_rms_norm checks
# that the unsqueeze's dim is the last): the same values.
_EPS_IN_MEAN = Op(aten.mean.dim, Op(_ADD, _SQUARE, Scalar("eps")), Var("dims"), True)
_FLAT_PLUS_EPS = Op(_ADD, Op(aten.mean.dim, _SQUARE, Var("dims")) | Op(aten.mean.dim, _SQUARE, Var("dims"), False),
                    Scalar("eps"))
_RSQRT = (Op(aten.rsqrt.default, _PLUS_EPS | _EPS_IN_MEAN)
          | Op(aten.unsqueeze.default, Op(aten.rsqrt.default, _FLAT_PLUS_EPS), Scalar("unsqueezed")))
RMS_NORMALISED = (Op(aten.mul.Tensor, _V, _RSQRT, commutative=True, name="normed")
                  | Op(aten.div.Tensor, _V, Op(aten.sqrt.default, _PLUS_EPS), name="normed"))


def _out_cast(pattern):
    return Cast(pattern, name="out_cast")


WEIGHTED_RMS_NORM = maybe(_out_cast, Op(aten.mul.Tensor, maybe(lambda p: Cast(p, name="normed_cast"), RMS_NORMALISED),
                                         Var("weight"), commutative=True, name="weighted"))
RMS_NORM_WITHOUT_WEIGHT = maybe(_out_cast, RMS_NORMALISED)

_STATS = Op(aten.var_mean.correction, _V, Var("dims"), kwargs={"correction": 0, "keepdim": True}, name="stats")
LAYER_NORMALISED = Op(aten.mul.Tensor, Op(aten.sub.Tensor, _V, Op(operator.getitem, _STATS, 1)),
                      Op(aten.rsqrt.default, Op((aten.add.Tensor, aten.add.Scalar), Op(operator.getitem, _STATS, 0),
                                                Scalar("eps"))), commutative=True, name="normed")
_WEIGHTED_LAYER_NORM = maybe(lambda p: Op(aten.mul.Tensor, p, Var("weight"), commutative=True, name="weighted"),
                             LAYER_NORMALISED)
LAYER_NORM = maybe(_out_cast, maybe(lambda p: Op(aten.add.Tensor, p, Var("bias"), commutative=True, name="biased"),
                                    _WEIGHTED_LAYER_NORM))


# ---------------------------------------------------------------------------------------------------------
# Conditions shared by the rules


def _per_column(parameter, hidden) -> bool:
    """Whether `parameter` is a 1-D tensor of the hidden size (a weight or bias the fused ops can take)."""
    value = fake_value(parameter)
    return isinstance(value, torch.Tensor) and same_sizes(tuple(value.shape), (hidden,))


def _check_dtypes(*nodes) -> None:
    for node in nodes:
        dtype = dtype_of(node)
        if dtype == torch.float64:
            raise Refusal("float64 tensors: dzc's residual-norm kernels take fp32/fp16/bf16 and compute in fp32 at "
                          "most, so a float64 model stays unfused (and keeps its precision)")
        if dtype not in _FLOAT_DTYPES:
            raise Refusal(f"unsupported dtype {dtype}")


class _ResidualSum:
    """Where the norm's input v comes from: the residual add, what the fused op reads (x, residual), the value that
    is the residual stream after it (h, None when the model never rounds the fp32 sum), the nodes between the add
    and the norm (which must serve the norm only) and the operands' upcasts (erased where nothing else reads them)."""

    def __init__(self, v: torch.fx.Node, norm_nodes: list[torch.fx.Node]):
        # A view of the sum that only regroups its rows (leading dims flattened or split, the last dim kept): the
        # norm of each row is the same, so the fused op runs on the sum's shape and its y is viewed the same way
        # (self.view; `norm(view(h)) = view(norm(h))`). Before or after the upcast.
        self.view = None
        if _is_row_view(v):
            self.view, v = v, v.args[0]
        # A copy of the sum between the add and the norm (capture's LayerNorm over a permuted sum makes it
        # contiguous) holds the same values: the fused op reads the add's operands and writes contiguous outputs.
        copies = []
        inner = v.args[0] if cast_dtype(v) is not None else v
        if self.view is None and _is_row_view(inner):
            self.view, inner = inner, inner.args[0]
        views = [self.view] if self.view is not None else []
        if views and outside_users(views, [*norm_nodes, v]):
            raise Refusal("the view of the sum the norm reads has another use")
        if _is_copy(inner) and is_call(inner.args[0], aten.add.Tensor):
            copies, inner = [inner], inner.args[0]
            if outside_users(copies, [*norm_nodes, v]):
                raise Refusal("the copy of the sum has another use")
        if cast_dtype(v) is not None and is_call(inner, aten.add.Tensor):
            # HF: the norm upcasts the sum the residual stream carries.
            self.add, self.sum_in_fp32, self.h = inner, False, inner
            self.nodes, self.upcasts = [*views, v, *copies], []
            if outside_users([v], [*norm_nodes, *views]):
                raise Refusal("the fp32 copy of the sum has another use")
        elif is_call(inner, aten.add.Tensor):
            v = inner
            self.add, self.nodes, self.upcasts = v, [*views, v, *copies], []
            x, residual = v.args[:2]
            if cast_dtype(x) is not None and cast_dtype(residual) is not None and dtype_of(v) == torch.float32:
                # DeepSeek: x.float() + residual.float(); the residual stream is the sum cast back.
                self.sum_in_fp32 = True
                downcasts = outside_users([v], [*norm_nodes, *views])
                if len(downcasts) > 1 or any(cast_dtype(u) is None for u in downcasts):
                    raise Refusal("the fp32 sum has a use the fused op cannot serve")
                self.h = downcasts[0] if downcasts else None
                self.upcasts = [x, residual]
            else:
                # The sum itself is the residual stream, read as it is rounded (fp32 models, bf16 math).
                self.sum_in_fp32, self.h = dtype_of(v) == torch.float32, v
        else:
            raise Refusal("no residual add feeds this norm")
        if self.add.kwargs.get("alpha", 1) != 1 or len(self.add.args) > 2:
            raise Refusal("the residual add has alpha != 1")
        self.x, self.residual = self.add.args[:2]
        if self.sum_in_fp32 and self.h is not self.add:
            self.x, self.residual = self.x.args[0], self.residual.args[0]
        if not all(isinstance(fake_value(n), torch.Tensor) for n in (self.x, self.residual)):
            raise Refusal("an operand of the residual add is not a tensor")
        sum_value = fake_value(self.add)
        if not (same_sizes(fake_value(self.x).shape, sum_value.shape)
                and same_sizes(fake_value(self.residual).shape, sum_value.shape)):
            raise Refusal("the residual add broadcasts")
        self.dtype = dtype_of(self.h) if self.h is not None else dtype_of(self.x)


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _is_row_view(node) -> bool:
    """A view that keeps the last dim (of a tensor with more than one element per row): its rows are its input's
    rows, in order."""
    if not is_call(node, *_VIEWS) or not isinstance(node.args[0], torch.fx.Node):
        return False
    value, source = fake_value(node), fake_value(node.args[0])
    return (isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor) and value.dim() >= 1
            and source.dim() >= 1 and same_sizes((value.shape[-1],), (source.shape[-1],)))


def _is_copy(node) -> bool:
    """clone(x), contiguous or keeping x's layout: the same values in a new tensor."""
    return is_call(node, aten.clone.default) and node.kwargs.get("memory_format") in (
        None, torch.contiguous_format, torch.preserve_format)


def _check_uses(chain, y, h) -> None:
    """Every intermediate of the match, except y and h (which the fused op returns), is used only inside it."""
    for node in chain:
        if node is not y and node is not h and outside_users([node], [*chain, y, h]):
            raise Refusal(f"intermediate {node.name} of the norm has another use")


def _replace_with_fused(op, args: tuple, y: torch.fx.Node, total: _ResidualSum, chain) -> None:
    """Insert `op(*args)` where the residual add is, make its outputs replace y and h, and erase what is dead."""
    graph = y.graph
    # The ops' outputs are dense (their fake implementations and kernels): a sum that was a transposed view (read
    # through a copy) is now a dense tensor of the same values. Under a view, y has the sum's shape until viewed.
    y_value = fake_value(y)
    y_value = y_value.new_empty(fake_value(total.add).shape if total.view is not None else y_value.shape)
    h_value = fake_value(total.h) if total.h is not None else y_value
    h_value = h_value.new_empty(h_value.shape, dtype=total.dtype if total.h is None else h_value.dtype)
    with graph.inserting_before(total.add):
        fused = graph.call_function(op, args)
        fused.meta["val"] = (y_value, h_value)
        fused.meta["stack_trace"] = y.meta.get("stack_trace")
        y_out = graph.call_function(operator.getitem, (fused, 0))
        y_out.meta["val"] = y_value
        h_out = graph.call_function(operator.getitem, (fused, 1))
        h_out.meta["val"] = h_value
    if total.view is not None:  # y as the model viewed the sum: the view's own arguments, after it
        with graph.inserting_after(total.view):
            y_view = graph.call_function(total.view.target, (y_out, *total.view.args[1:]), dict(total.view.kwargs))
            y_view.meta["val"] = fake_value(y).new_empty(fake_value(y).shape)
        y_out = y_view
    y.replace_all_uses_with(y_out)
    if total.h is not None:
        total.h.replace_all_uses_with(h_out)
    remove_dead([y, *chain, total.h, *total.nodes, total.add, *total.upcasts])


# ---------------------------------------------------------------------------------------------------------
# Rules


def fuse_rms_norm(match: Match):
    """x + residual, then RMS-normalised (times a weight, if any)  =>  dzc.add_rms_norm(x, residual, weight, ...).

    The op's arguments say where the spelling rounds: sum_in_fp32 (the norm reads the unrounded sum),
    cast_before_weight (the normalised value is rounded to the input dtype before the weight multiply),
    compute_dtype (the norm's own steps round to bf16/fp16), divide_by_rms (`/ sqrt` instead of `* rsqrt`)."""
    v, normed, y, weight = match["v"], match["normed"], match.root, match.get("weight")
    v_value = fake_value(v)
    if not isinstance(v_value, torch.Tensor) or not is_last_dim(match["dims"], v_value.dim()):
        return None
    hidden = v_value.shape[-1]
    if "unsqueezed" in match.bindings and match["unsqueezed"] % v_value.dim() != v_value.dim() - 1:
        return None
    if "count" in match.bindings and match["count"] != hidden:
        return None
    if "inverse_count" in match.bindings and not math.isclose(match["inverse_count"] * hidden, 1.0, rel_tol=1e-6):
        return None
    if weight is not None and not _per_column(weight, hidden):
        return None  # not a per-column weight (a gate, say): the weightless rule takes the norm, the multiply stays
    compute_dtype = dtype_of(v)
    if dtype_of(normed) != compute_dtype:
        return None  # a promoting multiply canonicalize_graph could not give one upcast copy
    weighted, out_cast = match.get("weighted"), match.get("out_cast")
    if weighted is not None and out_cast is not None and dtype_of(weighted) != torch.float32:
        return None  # the product is rounded before the cast: the op rounds it once (the rule matches without the cast)
    if not isinstance(hidden, int):
        raise Refusal("the hidden size is symbolic")
    chain = [n for n in match.nodes if n is not y]
    total = _ResidualSum(v, match.nodes)
    _check_dtypes(total.x, total.residual, y, v, *([weight] if weight is not None else []),
                  *([total.h] if total.h is not None else []))
    cast_before_weight = False
    normed_cast = match.get("normed_cast")
    if normed_cast is not None and not widens_exactly(compute_dtype, cast_dtype(normed_cast)):
        if cast_dtype(normed_cast) != total.dtype:
            raise Refusal("the normalised value is cast to a dtype other than the norm input's")
        cast_before_weight = True
    _check_uses(chain + total.nodes, y, total.h)
    hoist(weight, total.add)
    args = (total.x, total.residual, weight, float(match["eps"]), total.sum_in_fp32, cast_before_weight,
            dtype_of(y), total.dtype)
    divide_by_rms = normed.target is aten.div.Tensor
    # The two trailing arguments only where they differ from their defaults: graphs print as they always did.
    if compute_dtype != torch.float32 or divide_by_rms:
        args += (compute_dtype, divide_by_rms)
    _replace_with_fused(dzc.add_rms_norm.default, args, y, total, chain)
    return True


def fuse_layer_norm(match: Match):
    """x + residual, then LayerNorm in fp32 (weight and bias optional)  =>  dzc.add_layer_norm(x, residual, ...)."""
    v, y = match["v"], match.root
    weight, bias = match.get("weight"), match.get("bias")
    v_value = fake_value(v)
    if not isinstance(v_value, torch.Tensor) or not is_last_dim(match["dims"], v_value.dim()):
        return None
    hidden = v_value.shape[-1]
    if any(p is not None and not _per_column(p, hidden) for p in (weight, bias)):
        return None  # not an affine parameter: the rule matches the norm without that step
    if dtype_of(v) == torch.float64:
        _check_dtypes(v)
    if dtype_of(v) != torch.float32:
        return None  # captured LayerNorms compute their statistics in fp32
    if not isinstance(hidden, int):
        raise Refusal("the hidden size is symbolic")
    chain = [n for n in match.nodes if n is not y]
    parameters = [p for p in (weight, bias) if p is not None]
    total = _ResidualSum(v, match.nodes)
    _check_dtypes(total.x, total.residual, y, *parameters)
    _check_uses(chain + total.nodes, y, total.h)
    for parameter in parameters:
        hoist(parameter, total.add)
    _replace_with_fused(dzc.add_layer_norm.default, (total.x, total.residual, weight, bias, float(match["eps"]),
                                                     total.sum_in_fp32, dtype_of(y), total.dtype), y, total, chain)
    return True


RULES = [
    Rule(WEIGHTED_RMS_NORM, fuse_rms_norm),
    Rule(RMS_NORM_WITHOUT_WEIGHT, fuse_rms_norm),
    Rule(LAYER_NORM, fuse_layer_norm),
]


def fuse_residual_norm(graph: torch.fx.Graph) -> PassResult:
    """Rewrite every residual add + RMSNorm / LayerNorm pair into the fused op; returns a new graph and a report."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    apply_rules(graph, RULES, result)
    return result
