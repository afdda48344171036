"""patterns: dzc's shared matcher, declarative patterns over the ATen fx graph (tinygrad's UPat/PatternMatcher,
on torch.fx nodes).

A pattern says how a value is computed; matching it against a node walks from that node towards its inputs:

    SQUARE = Op(aten.pow.Tensor_Scalar, Var("v"), 2) | Op(aten.mul.Tensor, Var("v"), Var("v"))

- `Op(targets, *args, kwargs=..., name=..., commutative=...)` matches a call of one of `targets` whose positional
  arguments match `args` (patterns or literal values), no more and no fewer, and whose keyword arguments are
  exactly `kwargs` (a keyword the pattern does not name refuses the match: an unknown `alpha=2` must not pass for
  a plain add). `name` binds the node; `commutative` also tries the two first arguments swapped.
- `Var(name)` matches anything (a node, a number, a list) and binds it; a name bound twice must be the same
  object, which is how a pattern says "the same value" (`mul(v, v)`).
- A list holding patterns (`Op(aten.cat.default, [Var("a"), Var("b")], -1)`) fits a list of as many values.
- `Scalar(name)` binds a Python number; `Cast(inner, name)` is a plain dtype cast (`prims.convert_element_type`, or
  `aten._to_copy` with only a dtype); `a | b` tries `a`, then `b`; `maybe(wrap, inner)` is `wrap(inner) | inner`.

Matching backtracks: `Pattern.matches(node)` yields every way the pattern fits, each as a `Match` (the bindings,
and the nodes the pattern's Ops matched). A `Rule` pairs a pattern with a rewrite function whose docstring is its
before -> after; `apply_rules` runs a list of rules over a graph. A rewrite function receives the Match and returns
None (not this rule after all: its conditions fail, try the next match), or True / a location once it rewrote;
it raises `Refusal(why)` for a site that is the rule's meaning but cannot be rewritten (recorded in the report).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from dzc.passes.graph_pass import PassResult, Refusal, fake_value, location_of

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass
class Match:
    """One way a pattern fits at `root`: bound names, and the nodes its Ops matched (root first)."""

    root: torch.fx.Node
    bindings: dict[str, Any]
    nodes: list[torch.fx.Node] = field(default_factory=list)

    def __getitem__(self, name: str):
        return self.bindings[name]

    def get(self, name: str, default=None):
        return self.bindings.get(name, default)


class Pattern:
    def fits(self, value, bindings: dict, nodes: list) -> Iterator[tuple[dict, list]]:
        """Every (bindings, matched nodes) extending the given ones with which this pattern fits `value`."""
        raise NotImplementedError

    def matches(self, node: torch.fx.Node) -> Iterator[Match]:
        for bindings, nodes in self.fits(node, {}, []):
            yield Match(node, bindings, nodes)

    def match(self, node) -> Match | None:
        """The first way the pattern fits `node`, or None."""
        return next(self.matches(node), None)

    def __or__(self, other: Pattern) -> Pattern:
        return AnyOf(self, other)


def _fits(pattern, value, bindings, nodes):
    """A pattern, or a literal that must equal the value (a number, a dtype, a list of them)."""
    if isinstance(pattern, Pattern):
        yield from pattern.fits(value, bindings, nodes)
    elif isinstance(pattern, list) and any(isinstance(p, Pattern) for p in pattern):
        # A list of patterns (cat's tensors) fits a list of as many values, element by element.
        if isinstance(value, (list, tuple)) and len(value) == len(pattern):
            yield from _fits_all(pattern, value, bindings, nodes)
    elif not isinstance(value, torch.fx.Node) and type(value) is not bool and type(pattern) is not bool \
            and value == pattern:
        yield bindings, nodes
    elif type(value) is bool and type(pattern) is bool and value == pattern:  # True must not pass for 1
        yield bindings, nodes


def _fits_all(patterns, values, bindings, nodes):
    if not patterns:
        yield bindings, nodes
        return
    for b, n in _fits(patterns[0], values[0], bindings, nodes):
        yield from _fits_all(patterns[1:], values[1:], b, n)


def _bind(name, value, bindings):
    """bindings with name -> value, or None if name is bound to something else."""
    if name is None:
        return bindings
    if name in bindings:
        return bindings if bindings[name] is value else None
    return {**bindings, name: value}


class Op(Pattern):
    def __init__(self, targets, *args, kwargs: dict | None = None, name: str | None = None,
                 commutative: bool = False):
        self.targets = targets if isinstance(targets, tuple) else (targets,)
        self.args, self.kwargs, self.name, self.commutative = args, kwargs or {}, name, commutative

    def fits(self, value, bindings, nodes):
        if not (isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target in self.targets):
            return
        if len(value.args) != len(self.args) or set(value.kwargs) != set(self.kwargs):
            return
        bound = _bind(self.name, value, bindings)
        if bound is None:
            return
        patterns = (*self.args, *self.kwargs.values())
        values = (*value.args, *(value.kwargs[k] for k in self.kwargs))
        orders = [values]
        if self.commutative and len(self.args) >= 2:
            orders.append((values[1], values[0], *values[2:]))
        for ordered in orders:
            yield from _fits_all(patterns, ordered, bound, [*nodes, value])


class Var(Pattern):
    def __init__(self, name: str):
        self.name = name

    def fits(self, value, bindings, nodes):
        bound = _bind(self.name, value, bindings)
        if bound is not None:
            yield bound, nodes


class Scalar(Pattern):
    """A Python number (not a bool, not a node), bound to `name`."""

    def __init__(self, name: str):
        self.name = name

    def fits(self, value, bindings, nodes):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            bound = _bind(self.name, value, bindings)
            if bound is not None:
                yield bound, nodes


class AnyOf(Pattern):
    def __init__(self, *alternatives: Pattern):
        self.alternatives = alternatives

    def fits(self, value, bindings, nodes):
        for alternative in self.alternatives:
            yield from alternative.fits(value, bindings, nodes)


def cast_dtype(node) -> torch.dtype | None:
    """The target dtype if node is a plain dtype cast (`.to(dtype)`, `.float()`: same device and layout), else
    None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is not aten._to_copy.default or "dtype" not in node.kwargs or len(node.args) != 1:
        return None
    source = fake_value(node.args[0])
    for key, value in node.kwargs.items():
        if key == "layout" and value not in (None, torch.strided):
            return None
        if key == "device" and value is not None and source is not None and torch.device(value) != source.device:
            return None
        if key not in ("dtype", "layout", "device"):
            return None
    return node.kwargs["dtype"]


class Cast(Pattern):
    """A plain dtype cast of `inner` (to any dtype; the rule reads it from the bound node)."""

    def __init__(self, inner, name: str | None = None):
        self.inner, self.name = inner, name

    def fits(self, value, bindings, nodes):
        if cast_dtype(value) is None:
            return
        bound = _bind(self.name, value, bindings)
        if bound is not None:
            yield from _fits(self.inner, value.args[0], bound, [*nodes, value])


def maybe(wrap: Callable[[Pattern], Pattern], inner: Pattern) -> Pattern:
    """`wrap(inner)` or `inner` alone: an optional step (a cast, a weight multiply), the longer match first."""
    return wrap(inner) | inner


# ---------------------------------------------------------------------------------------------------------
# Facts rules check in their conditions


_EXACT_WIDENINGS = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def widens_exactly(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of `source` converts to `target` exactly (bf16/fp16 -> fp32/fp64, fp32 -> fp64)."""
    return target in _EXACT_WIDENINGS.get(source, ())


def dtype_of(node) -> torch.dtype | None:
    value = fake_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def same_sizes(a, b) -> bool:
    """Whether two size (or stride) tuples are equal, provably: symbolic sizes compared without adding guards."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def is_last_dim(dims, rank: int) -> bool:
    """Whether a reduction's `dims` argument names only the last of `rank` dimensions."""
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def outside_users(nodes, allowed) -> list[torch.fx.Node]:
    """Users of `nodes` that are neither among them nor in `allowed`: uses a rewrite of `nodes` would lose."""
    inside = set(nodes) | set(allowed)
    return [user for node in nodes for user in node.users if user not in inside]


def hoist(value, anchor: torch.fx.Node) -> None:
    """Make `value` available before `anchor` by moving the nodes that compute it there, if they come after it.

    Moving a pure node earlier changes no number. Only nodes computed from graph inputs and constants move
    (Gemma's `1 + w.float()` weight, traced after the norm it scales); Refusal where `value` depends on `anchor`
    or on an impure node after it."""
    if not isinstance(value, torch.fx.Node):
        return
    order = {node: i for i, node in enumerate(anchor.graph.nodes)}
    late, stack = [], [value]
    while stack:
        node = stack.pop()
        if order[node] < order[anchor] or node in late:
            continue
        if node is anchor or node.op != "call_function" or node.is_impure():
            raise Refusal("the weight is computed after the residual add, not from parameters alone")
        late.append(node)
        stack.extend(node.all_input_nodes)
    for node in sorted(late, key=order.__getitem__):
        anchor.prepend(node)


# ---------------------------------------------------------------------------------------------------------
# Rules


@dataclass(frozen=True)
class Rule:
    """A pattern and what to do where it matches: `rewrite(match)`, whose docstring says before -> after."""

    pattern: Pattern
    rewrite: Callable[[Match], Any]

    @property
    def name(self) -> str:
        return self.rewrite.__name__


def _erased(node: torch.fx.Node) -> bool:
    return getattr(node, "_erased", False)


def apply_rules(graph: torch.fx.Graph, rules: list[Rule], result: PassResult, users_first: bool = True,
                name_sites: bool = False, until_fixpoint: bool = False) -> int:
    """Try `rules` in order at every node of `graph` and let the first that accepts a match rewrite there.

    users_first: visit the graph from its outputs back, so that the largest match (a norm with its final cast)
    is found before a part of it. A site a rule refused is recorded once, and its nodes are not matched again
    by a later rule in this sweep. name_sites: record each rewrite as '<rule>: <location>'. until_fixpoint:
    sweep again while a sweep rewrote something (canonical forms that enable each other). Returns the number
    of rewrites."""
    total = 0
    while True:
        claimed: set[torch.fx.Node] = set()
        rewrites = 0
        nodes = list(graph.nodes)
        for node in reversed(nodes) if users_first else nodes:
            if _erased(node) or node in claimed or node.op != "call_function":
                continue
            for rule in rules:
                outcome = _apply_rule(rule, node, claimed, result)
                if outcome is None:
                    continue
                if outcome is not False:
                    where = outcome if isinstance(outcome, str) else location_of(node)
                    result.rewrote(f"{rule.name}: {where}" if name_sites else where)
                    rewrites += 1
                break
        total += rewrites
        if not (until_fixpoint and rewrites):
            return total


def _apply_rule(rule: Rule, node, claimed, result):
    """The rule's outcome at node: None (no match it accepts), False (refused), else what its rewrite returned."""
    for match in rule.pattern.matches(node):
        try:
            outcome = rule.rewrite(match)
        except Refusal as refusal:
            result.refused(location_of(node), str(refusal))
            claimed.update(match.nodes)
            return False
        if outcome:
            return outcome
    return None


def remove_dead(nodes) -> None:
    """Erase those of `nodes` that are now unused, users before what they use (only these: never unrelated dead
    code, which other passes may still read)."""
    pending = [n for n in dict.fromkeys(nodes) if isinstance(n, torch.fx.Node) and not _erased(n)]
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users and node.op == "call_function":
                node.graph.erase_node(node)
                pending.remove(node)
                changed = True
