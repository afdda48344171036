"""canonicalize_graph: equivalent spellings of one value => one spelling, exactly (no number changes).

Model code says the same thing many ways; the fusion rules after this pass match one. Each rule here replaces
a node by a node that holds the same bits, so the graph computes exactly what it computed before:

    convert(x: bf16, bf16)                        =>  x                  (fold_noop_cast)
    convert(convert(x: bf16, f32), bf16)          =>  x                  (fold_round_trip_cast)
    convert(x, f32) ... convert(x, f32)           =>  the first one      (dedupe_cast)
    mul(h: bf16, r: f32), convert(h, f32) exists  =>  mul(convert(h, f32), r)   (reuse_upcast)

Not yet here: stripping views that change nothing (`view(x: [s0, 64], [-1, 64])`): fuse_mxfp4_experts' walker
still reads such a view to find the routing-weight multiply, and refuses without it.

What is not here, on purpose: `x / sqrt(y)` => `x * rsqrt(y)` and `sum(x) / n` => `mean(x)` round differently
(rsqrt then multiply rounds twice where sqrt then divide rounds twice elsewhere; CUDA's mean multiplies by 1/n and
bf16 `sum / n` rounds the sum first), so they stay as written and the fusion rules match each spelling as the
same meaning, with the op's parameters saying where it rounds. A parameter-only expression (Gemma's `1 + w`) is
not moved here either: a fusion that takes it as its weight hoists it (patterns.hoist), so that other passes see
the graph's order unchanged.

No rule touches a value the graph returns or one an in-place op writes: replacing it by its input would make an
output alias an input or another output where it did not.

Ordering: first in the pipeline, on the graph as captured; every fusion pass matches the canonical form.
"""

from __future__ import annotations

import torch
import torch.fx

from dzc.passes.graph_pass import PassResult, copy_graph
from dzc.passes.patterns import Cast, Match, Op, Rule, Var, apply_rules, cast_dtype, dtype_of, remove_dead, \
    widens_exactly

aten = torch.ops.aten

NAME = "canonicalize_graph"


def _replaceable(node: torch.fx.Node) -> bool:
    """Whether every use of node may read another node holding the same bits instead (no output, no writer)."""
    for user in node.users:
        if user.op == "output":
            return False
        schema = getattr(user.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return False
    return True


def _replace(node: torch.fx.Node, value: torch.fx.Node, *inputs: torch.fx.Node) -> bool:
    """Make node's uses read value; erase node, and those of `inputs` (the match's own nodes) left unused."""
    node.replace_all_uses_with(value)
    remove_dead([node, *inputs])
    return True


def fold_noop_cast(match: Match):
    """convert(x, dtype) where x already has dtype  =>  x. The cast copies the same bits."""
    cast, x = match["cast"], match["x"]
    if not isinstance(x, torch.fx.Node) or dtype_of(x) != cast_dtype(cast) or not _replaceable(cast):
        return None
    return _replace(cast, x)


def fold_round_trip_cast(match: Match):
    """convert(convert(x, wide), dtype(x))  =>  x, where `wide` holds every value of x's dtype exactly (bf16/fp16 ->
    fp32 -> bf16/fp16): the widening is exact, so narrowing back returns each value unchanged."""
    down, up, x = match["down"], match["up"], match["x"]
    source = dtype_of(x)
    if source is None or cast_dtype(down) != source or not widens_exactly(source, cast_dtype(up)) \
            or not _replaceable(down):
        return None
    return _replace(down, x, up)


def dedupe_cast(match: Match):
    """A second cast of x to the same dtype  =>  the first (`h.float()` written twice: one for the variance, one
    for the normalised value). Both hold the same bits."""
    cast, x = match["cast"], match["x"]
    if not isinstance(x, torch.fx.Node):
        return None
    alike = [u for u in x.users if u is not cast and cast_dtype(u) == cast_dtype(cast) and u.target is cast.target
             and u.kwargs == cast.kwargs]
    if not alike:  # the common case: no other cast of x, and no need to number the graph's nodes
        return None
    order = _positions(cast.graph)
    earlier = [u for u in alike if order[u] < order[cast]]
    if not earlier or not _replaceable(cast):
        return None
    return _replace(cast, min(earlier, key=order.__getitem__))


def _positions(graph: torch.fx.Graph) -> dict:
    """Each node's position in the graph (which of two nodes comes first)."""
    return {n: i for i, n in enumerate(graph.nodes)}


_PROMOTING_OPS = (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor)


def reuse_upcast(match: Match):
    """op(a: bf16, b: f32) where the graph already has convert(a, f32)  =>  op(convert(a, f32), b). Type promotion
    converts a exactly as the cast does (bf16/fp16 -> fp32 is exact), so the op reads the same values; the
    norm then reads one upcast copy of its input instead of a bf16 and an fp32 spelling of it (`h * rsqrt(var)`
    with var over `h.float()`)."""
    node = match.root
    result = dtype_of(node)
    order = None  # numbered only where an operand has an upcast to choose among
    new_args = list(node.args)
    for i, operand in enumerate(node.args[:2]):
        source = dtype_of(operand)
        if source is None or source == result or not widens_exactly(source, result):
            continue
        upcasts = [u for u in operand.users if cast_dtype(u) == result]
        if not upcasts:
            continue
        order = order or _positions(node.graph)
        upcasts = [u for u in upcasts if order[u] < order[node]]
        if upcasts:
            new_args[i] = min(upcasts, key=order.__getitem__)
    if new_args == list(node.args):
        return None
    node.args = tuple(new_args)
    return True


RULES = [
    Rule(Cast(Var("x"), name="cast"), fold_noop_cast),
    Rule(Cast(Cast(Var("x"), name="up"), name="down"), fold_round_trip_cast),
    Rule(Cast(Var("x"), name="cast"), dedupe_cast),
    Rule(Op(_PROMOTING_OPS, Var("a"), Var("b")), reuse_upcast),
]


def canonicalize_graph(graph: torch.fx.Graph) -> PassResult:
    """Put equivalent spellings into one form (see the module docstring); returns a new graph and a report."""
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    # Inputs first, to a fixed point: folding a round trip can leave a cast that another rule then removes.
    apply_rules(graph, RULES, result, users_first=False, name_sites=True, until_fixpoint=True)
    return result
