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

A 0-d tensor constant (fold_scalar_constant): `lift_fresh_copy(_tensor_constant0)` => `full([], value)` of its
dtype and device, so a mask's fill reads alike on every device (Dynamo lifts CUDA scalars, bakes CPU ones).

Index arithmetic on aranges (fold_known_index, fold_and_true): integer and bool tensors whose every value the graph
alone determines, computed from iota / full / scalar_tensor, never from an input. HF's mask without a cache
recomputes what is known (positions = arange(S) when no position_ids are passed):

    ids  = cumsum(diff(pos, prepend=pos[:, :1] - 1) != 1)        # packed-sequence ids: all 0, one sequence a row
    keep = True & (pos[b, kv] <= pos[b, q]) & (ids[b, q] == ids[b, kv])
      =>  keep = arange(S)[kv] <= arange(S)[q]                    # the causal mask, as with a cache

A value is proved by a walk over its inputs that gives it a _Ramp (element [i] = start + step * i[dim]); an index
is followed only where every index is provably in bounds (a negative one would wrap, an overrun would fail). A
computed value (index, cat, cumsum, comparison, arithmetic of two tensors) read by an op the walk cannot prove
(a comparison of two aranges along different dims) is replaced by iota -> unsqueeze -> expand (or full) of its
exact shape and dtype, unless a user reads its strides (a view); `True & m` becomes m. Position ids given as an
input (which may pack several sequences into a row) have no ramp: their masks stay as written.

Ordering: first in the pipeline, on the graph as captured; every fusion pass matches the canonical form.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dzc.passes.graph_pass import (CONSTANT, PassResult, copy_graph, fake_value, is_call, location_of,
                                  note_scalar_constants)
from dzc.passes.patterns import Cast, Match, Op, Rule, Var, apply_rules, cast_dtype, dtype_of, remove_dead, \
    same_sizes, widens_exactly

aten = torch.ops.aten
prims = torch.ops.prims

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
    if graph.owning_module is not None:  # where the graph's tensor constants live (none for a copy)
        note_scalar_constants(graph, graph.owning_module)
    graph = copy_graph(graph)
    result = PassResult(NAME, graph)
    _fold_scalar_constants(graph, result)
    # Inputs first, to a fixed point: folding a round trip can leave a cast that another rule then removes.
    apply_rules(graph, RULES, result, users_first=False, name_sites=True, until_fixpoint=True)
    _fold_known_values(graph, result)
    return result


def _fold_scalar_constants(graph: torch.fx.Graph, result: PassResult) -> None:
    """fold_scalar_constant: lift_fresh_copy(a 0-d tensor constant c)  =>  full([], c.item()) of c's dtype and
    device: a fresh tensor holding the same bits. Dynamo lifts a model's `torch.tensor(0.0, device=d)` on CUDA
    (HF's mask fill) where it bakes the same value into full() on the CPU; the fusions read fills from full(). The
    values are the get_attr nodes' notes (graph_pass.CONSTANT, taken from the module before any copy)."""
    for node in list(graph.nodes):
        if not (is_call(node, aten.lift_fresh_copy.default) and node.args[0].op == "get_attr"
                and CONSTANT in node.args[0].meta and _replaceable(node)):
            continue
        constant = node.meta["val"]
        with graph.inserting_before(node):
            full = _build(aten.full.default, ([], node.args[0].meta[CONSTANT]), dict(
                dtype=constant.dtype, layout=torch.strided, device=constant.device, pin_memory=False), node)
        result.rewrote(f"fold_scalar_constant: {location_of(node)}")
        attribute = node.args[0]
        _replace(node, full)
        if not attribute.users:
            graph.erase_node(attribute)


# ----------------------------------------------------------------------------------------------------------------
# Index arithmetic on aranges: integer and bool values the graph alone determines.

# Positions and masks: exact, and the walk's Python ints stay far inside int64 (sizes times a graph's constants).
_KNOWN_DTYPES = (torch.int64, torch.bool)


@dataclass(frozen=True)
class _Ramp:
    """A tensor whose element [i] is start + step * i[dim] (dim < 0, from the last) whatever its other coordinates:
    an arange along one dim, broadcast along the others. step 0 (then dim 0): the constant start."""

    start: int
    step: int = 0
    dim: int = 0


def _is_int(value) -> bool:
    return type(value) is int  # not a SymInt, not a bool


def _last_dims(dim: int, rank: int) -> int:
    return dim % rank - rank


class _KnownValues:
    """node -> its _Ramp, or None where a value is not proved (any graph input, float, op not listed)."""

    def __init__(self):
        self.memo: dict[torch.fx.Node, _Ramp | None] = {}

    def __call__(self, arg) -> _Ramp | None:
        if isinstance(arg, (bool, int)):  # a Python scalar operand (a SymInt is not an int)
            return _Ramp(int(arg))
        if not isinstance(arg, torch.fx.Node):
            return None
        if arg not in self.memo:
            self.memo[arg] = self._prove(arg)
        return self.memo[arg]

    def _prove(self, node) -> _Ramp | None:
        value = fake_value(node)
        if node.op != "call_function" or not isinstance(value, torch.Tensor) or value.dtype not in _KNOWN_DTYPES:
            return None
        rule = _RAMP_RULES.get(node.target)
        ramp = rule(self, node, value) if rule is not None else None
        if ramp is None or ramp.step == 0:
            return ramp
        if not (_is_int(ramp.start) and _is_int(ramp.step) and -value.dim() <= ramp.dim < 0):
            return None
        if statically_known_true(value.shape[ramp.dim] == 1):  # one element along the ramp: a constant
            return _Ramp(ramp.start)
        return ramp


def _iota(known, node, value):
    start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
    return _Ramp(start, step, -1) if _is_int(start) and _is_int(step) else None


def _filled(known, node, value):
    fill = node.args[1] if node.target is aten.full.default else node.args[0]
    return _Ramp(int(fill)) if isinstance(fill, (bool, int)) else None


def _same_values(known, node, value):
    """expand, clone, alias: the element at [i] reads the input's at the same last coordinates."""
    return known(node.args[0])


def _unsqueeze(known, node, value):
    ramp = known(node.args[0])
    if ramp is None or ramp.step == 0:
        return ramp
    # A new dim right of the ramp's moves it one further from the last.
    inserted, ramp_at = node.args[1] % value.dim(), ramp.dim + value.dim() - 1
    return _Ramp(ramp.start, ramp.step, ramp.dim - 1 if inserted > ramp_at else ramp.dim)


def _slice(known, node, value):
    ramp = known(node.args[0])
    if ramp is None or node.kwargs:
        return None
    dim, start, _, step = (*node.args[1:], *(0, None, None, 1)[len(node.args) - 1:])
    if ramp.step == 0 or _last_dims(dim, value.dim()) != ramp.dim:
        return ramp
    start = 0 if start is None else start
    if not (_is_int(start) and start >= 0 and _is_int(step) and step >= 1):  # a negative start counts from the end
        return None
    return _Ramp(ramp.start + ramp.step * start, ramp.step * step, ramp.dim)


def _add_or_sub(known, node, value):
    a, b = known(node.args[0]), known(node.args[1])
    if a is None or b is None or node.kwargs or value.dtype == torch.bool:  # bool + bool is a logical or
        return None
    if a.step and b.step and a.dim != b.dim:
        return None
    sign = 1 if node.target is aten.add.Tensor else -1
    return _Ramp(a.start + sign * b.start, a.step + sign * b.step, a.dim if a.step else b.dim)


def _cat(known, node, value):
    pieces = node.args[0]
    dim = _last_dims(node.args[1] if len(node.args) > 1 else 0, value.dim())
    ramps = [known(piece) for piece in pieces]
    if any(ramp is None for ramp in ramps):
        return None
    if all(ramp == ramps[0] and ramp.step == 0 for ramp in ramps):
        return ramps[0]
    steps = {ramp.step for ramp in ramps if ramp.step}
    if len(steps) != 1 or any(ramp.step and ramp.dim != dim for ramp in ramps):
        return None
    # One ramp if each piece goes on where the one before ends (a constant piece: one element).
    step, following = steps.pop(), ramps[0].start
    for piece, ramp in zip(pieces, ramps):
        size = fake_value(piece).shape[dim]
        if (ramp.step == 0 and not statically_known_true(size == 1)) \
                or not statically_known_true(following == ramp.start):
            return None
        following = ramp.start + step * size
    return _Ramp(ramps[0].start, step, dim)


_COMPARISONS = {aten.eq: operator.eq, aten.ne: operator.ne, aten.lt: operator.lt, aten.le: operator.le,
                aten.gt: operator.gt, aten.ge: operator.ge}


def _compare(known, node, value):
    a, b = known(node.args[0]), known(node.args[1])
    if a is None or b is None or a.step or b.step:
        return None
    return _Ramp(int(_COMPARISONS[node.target.overloadpacket](a.start, b.start)))


def _cumsum(known, node, value):
    """The running sum of a constant c: c * (i + 1)."""
    ramp = known(node.args[0])
    if ramp is None or ramp.step or node.kwargs:
        return None
    return _Ramp(ramp.start, ramp.start, _last_dims(node.args[1], value.dim()))


def _in_bounds(ramp: _Ramp, index, size) -> bool:
    """Every value of `index` (with this ramp) is in [0, size): indexing reads without wrapping or failing."""
    last = ramp.start + ramp.step * (fake_value(index).shape[ramp.dim] - 1) if ramp.step else ramp.start
    low, high = min(ramp.start, last), max(ramp.start, last)
    return statically_known_true(low >= 0) and statically_known_true(high < size)


def _index(known, node, value):
    """x[i_0, ..., i_n-1] over every dim of x: x's ramp along dim d reads i_d (whose own dims are the result's,
    right-aligned: the indices broadcast into the result's shape)."""
    x, indices = node.args
    shape = fake_value(x).shape
    if len(indices) != len(shape) or not all(isinstance(i, torch.fx.Node) for i in indices):
        return None
    ramp, ramps = known(x), [known(i) for i in indices]
    if ramp is None or any(r is None for r in ramps):
        return None
    if not all(fake_value(i).dtype == torch.int64 and _in_bounds(r, i, size)
               for i, r, size in zip(indices, ramps, shape)):
        return None
    if ramp.step == 0:
        return ramp
    read = ramps[ramp.dim + len(shape)]
    return _Ramp(ramp.start + ramp.step * read.start, ramp.step * read.step, read.dim)


_RAMP_RULES = {
    prims.iota.default: _iota, aten.full.default: _filled, aten.scalar_tensor.default: _filled,
    aten.expand.default: _same_values, aten.clone.default: _same_values, aten.alias.default: _same_values,
    aten.unsqueeze.default: _unsqueeze, aten.slice.Tensor: _slice, aten.add.Tensor: _add_or_sub,
    aten.sub.Tensor: _add_or_sub, aten.cat.default: _cat, aten.cumsum.default: _cumsum, aten.index.Tensor: _index,
    **{getattr(op, overload): _compare for op in _COMPARISONS for overload in ("Tensor", "Scalar")},
}
# Ops that spell an arange itself (iota, shape plumbing, a constant offset): folding them would change nothing.
_PLAIN = {prims.iota.default, aten.full.default, aten.scalar_tensor.default, aten.expand.default, aten.clone.default,
          aten.alias.default, aten.unsqueeze.default, aten.slice.Tensor}
# Users that read strides (a view of an expand fails): a folded value, an expand, must not reach them.
_READS_STRIDES = {aten.view.default, aten._unsafe_view.default, aten.as_strided.default}


def _derived(node, known, memo) -> bool:
    """Whether node's proved value is computed (index, cat, cumsum, comparisons, arithmetic of two tensors) rather
    than spelled as an arange."""
    if node not in memo:
        plain = node.target in _PLAIN or (node.target in (aten.add.Tensor, aten.sub.Tensor)
                                          and not isinstance(node.args[1], torch.fx.Node))
        memo[node] = not plain or any(known(i) is not None and _derived(i, known, memo)
                                      for i in node.all_input_nodes)
    return memo[node]


def _cone(node, known) -> list[torch.fx.Node]:
    """node and the proved values it is computed from: what a fold of node may leave unused."""
    cone, pending = [], [node]
    while pending:
        current = pending.pop()
        if current not in cone:
            cone.append(current)
            pending.extend(i for i in current.all_input_nodes if known(i) is not None)
    return cone


def _foldable(node) -> bool:
    return _replaceable(node) and not any(user.target in _READS_STRIDES for user in node.users)


def _build(target, args, kwargs, like):
    """A call inserted at the graph's insert point, with its fake value (computed without adding guards)."""
    node = like.graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), fake_value)
    mode = fake_value(like).fake_mode
    with mode, (mode.shape_env.suppress_guards() if mode.shape_env else contextlib.nullcontext()):
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    node.meta["stack_trace"] = like.meta.get("stack_trace")
    return node


def _size(node, dim):
    """node's size along dim as an argument: an int, an existing node holding the symbol, or (input, dim) for a
    sym_size of one of node's inputs with that size at the same place from the last dim; None if there is none."""
    size = fake_value(node).shape[dim]
    if isinstance(size, int):
        return size
    for candidate in node.graph.nodes:
        if candidate is node:
            break
        value = fake_value(candidate)
        if isinstance(value, torch.SymInt) and str(value.node.expr) == str(size.node.expr):
            return candidate
    back = dim - fake_value(node).dim()
    for source in node.all_input_nodes:
        value = fake_value(source)
        if isinstance(value, torch.Tensor) and value.dim() >= -back \
                and statically_known_true(value.shape[back] == size):
            return source, back % value.dim()
    return None


def _size_arguments(node: torch.fx.Node) -> list | None:
    """node's sizes as arguments of new nodes before it: ints, or sym_size nodes (built before node) for the
    symbolic ones; None where a size has no argument to spell it (_size)."""
    sizes = [_size(node, d) for d in range(fake_value(node).dim())]
    if any(size is None for size in sizes):
        return None
    with node.graph.inserting_before(node):
        return [_build(aten.sym_size.int, size, {}, node) if isinstance(size, tuple) else size for size in sizes]


def _expanded(value: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node | None:
    """expand(value, like's sizes), before like; None where a size has no argument to spell it (_size)."""
    sizes = _size_arguments(like)
    if sizes is None:
        return None
    with like.graph.inserting_before(like):
        return _build(aten.expand.default, (value, sizes), {}, like)


def _materialize(node, ramp: _Ramp) -> torch.fx.Node | None:
    """iota -> unsqueeze -> expand (or full) of node's shape and dtype holding the ramp's values, before node."""
    value = fake_value(node)
    if ramp.step and value.dtype == torch.bool:
        return None
    sizes = _size_arguments(node)
    if sizes is None:
        return None
    with node.graph.inserting_before(node):
        if ramp.step == 0:
            fill = bool(ramp.start) if value.dtype == torch.bool else ramp.start
            return _build(aten.full.default, (sizes, fill), dict(dtype=value.dtype, layout=torch.strided,
                                                                 device=value.device, pin_memory=False), node)
        folded = _build(prims.iota.default, (sizes[ramp.dim],), dict(
            start=ramp.start, step=ramp.step, dtype=value.dtype, device=value.device, requires_grad=False), node)
        for _ in range(-ramp.dim - 1):
            folded = _build(aten.unsqueeze.default, (folded, -1), {}, node)
        if not same_sizes(fake_value(folded).shape, value.shape):
            folded = _build(aten.expand.default, (folded, sizes), {}, node)
        return folded


def _fold_known_values(graph: torch.fx.Graph, result: PassResult) -> None:
    """fold_and_true, then fold_known_index (see the module docstring)."""
    known = _KnownValues()
    # fold_and_true: a & b where a is proved all True  =>  b (bool: the same values), expanded to the result's
    # shape where a broadcast b (a view with the same values; _foldable: no user reads the strides).
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) \
                or not is_call(node, aten.bitwise_and.Tensor, aten.logical_and.default):
            continue
        operands = node.args[:2]
        if fake_value(node).dtype != torch.bool or any(dtype_of(x) != torch.bool for x in operands):
            continue
        for true, other in (operands, operands[::-1]):
            if known(true) != _Ramp(1) or not _foldable(node):
                continue
            value = other
            if not same_sizes(fake_value(other).shape, fake_value(node).shape):
                value = _expanded(other, node)
                if value is None:
                    continue
            result.rewrote(f"fold_and_true: {location_of(node)}")
            _replace(node, value, *_cone(true, known))
            break
    # fold_known_index: a computed value proved to be an arange (or a constant), read by a user it cannot be
    # proved for  =>  the arange, spelled iota -> unsqueeze -> expand (full for a constant).
    derived: dict = {}
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or node.op != "call_function":
            continue
        ramp = known(node)
        if ramp is None or not _derived(node, known, derived) or all(known(u) is not None for u in node.users) \
                or not _foldable(node):
            continue
        folded = _materialize(node, ramp)
        if folded is not None:
            result.rewrote(f"fold_known_index: {location_of(node)}")
            _replace(node, folded, *_cone(node, known))
