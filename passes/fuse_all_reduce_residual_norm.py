"""fuse_all_reduce_residual_norm: all-reduce (sum) -> residual add -> RMSNorm  =>  dzc.all_reduce_add_rms_norm

Under tensor parallelism a row-parallel projection (attention's output, the MLP's down projection) ends with an
all-reduce of each rank's partial sum; the residual add and the next RMSNorm follow it. fuse_residual_norm has
already made the add + norm one dzc.add_rms_norm node, so this pass reads that node.

Before (functional collectives, as Dynamo traces DTensor's RowwiseParallel or torch.distributed's
_functional_collectives.all_reduce; fuse_residual_norm has run):

    %r = _c10d_functional.all_reduce.default(%partial, 'sum', %group)
    %s = _c10d_functional.wait_tensor.default(%r)
    %f = dzc.add_rms_norm.default(%residual, %s, %weight, eps, ...)      # the reduced value as either operand

After:

    %f = dzc.all_reduce_add_rms_norm.default(%partial, %residual, %weight, eps, ..., %group)

The add is commutative to the bit (IEEE addition is, in whichever dtype the op sums), so the reduced operand
becomes the op's x wherever it was.

Conditions (each refusal is reported with its reason): the reduction is "sum" (the op reduces by sum); the reduced
value has no use other than the add (the fused op does not return it). The add's shapes fuse_residual_norm has
checked (no broadcast). An all-reduce that no add_rms_norm reads (the last layer's, before a final norm without
residual) is not this meaning and is left alone silently.

Ordering: after fuse_residual_norm (it consumes the dzc.add_rms_norm nodes that pass makes), before lowering,
which turns the op into the backend's all-reduce + dzc's add_rms_norm kernel (or, later, a one-shot kernel).
"""

from __future__ import annotations

import torch
import torch.fx

from dzc.passes.graph_pass import PassResult, calls_any, copy_graph, is_call, location_of

NAME = "fuse_all_reduce_residual_norm"
_c10d = torch.ops._c10d_functional
_ADD_RMS_NORM = torch.ops.dzc.add_rms_norm.default
_FUSED = torch.ops.dzc.all_reduce_add_rms_norm.default


def _reduced(value) -> torch.fx.Node | None:
    """The all_reduce node when `value` is wait_tensor(all_reduce(...)), else None."""
    if is_call(value, _c10d.wait_tensor.default) and is_call(value.args[0], _c10d.all_reduce.default):
        return value.args[0]
    return None


def _why_not(wait: torch.fx.Node, reduce: torch.fx.Node) -> str:
    """Why the all-reduce `reduce` (waited on by `wait`) cannot join the norm it feeds, or "" when it can."""
    reduce_op = reduce.args[1]
    if reduce_op != "sum":
        return f"the all-reduce reduces by {reduce_op!r}; the fused op sums"
    if len(wait.users) != 1 or len(reduce.users) != 1:
        return "the all-reduced value has another use besides the residual add (the fused op does not return it)"
    return ""


def fuse_all_reduce_residual_norm(graph: torch.fx.Graph) -> PassResult:
    """Fold the all-reduce feeding each dzc.add_rms_norm into it; returns a new graph and a report."""
    if not calls_any(graph, _c10d.all_reduce.default):  # every site starts at an all_reduce
        return PassResult(NAME, graph)
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    for norm in list(graph.nodes):
        if not is_call(norm, _ADD_RMS_NORM):
            continue
        x, residual, *rest = norm.args
        if _reduced(x) is None and _reduced(residual) is not None:
            x, residual = residual, x  # the reduced operand first: the sum does not depend on the order
        reduce = _reduced(x)
        if reduce is None:
            continue
        why = _why_not(x, reduce)
        if why:
            result.refused(location_of(norm), why)
            continue
        # add_rms_norm's two trailing arguments are left out where they have their defaults.
        compute_dtype = rest[6] if len(rest) > 6 else torch.float32
        divide_by_rms = rest[7] if len(rest) > 7 else False
        args = (reduce.args[0], residual, *rest[:6], compute_dtype, divide_by_rms, reduce.args[2])
        with graph.inserting_before(norm):
            fused = graph.call_function(_FUSED, args)
        fused.meta.update({key: norm.meta[key] for key in ("val", "stack_trace") if key in norm.meta})
        norm.replace_all_uses_with(fused)
        graph.erase_node(norm)
        graph.erase_node(x)
        graph.erase_node(reduce)
        result.rewrote(location_of(fused))
    return result
